"""Activation memory on gloo ranks: the formula (megatron/memory/activations.py) against
saved_tensors_hooks (megatron/memory/measure.py), byte for byte.

- tensor parallel 2, with and without sequence parallelism (under sp the column-parallel layers save
  only their ``[s/t, b, h]`` input shard), one micro-batch's forward;
- pipeline parallel 2: the saved bytes alive on each stage at the schedule's peak (1F1B, GPipe,
  interleaved), measured across the whole schedule by the hooks' live count.

Each group of cases runs in one spawn (module-level cache), so the cases cost one start-up each.
"""

from __future__ import annotations

import functools

import pytest
import torch

from megatron import parallel_state
from megatron.config import parse_config, validate
from megatron.data.loader import build_batch, split_micro_batches
from megatron.data.mock_dataset import MockGPTDataset
from megatron.memory.activations import activation_bytes_per_microbatch, activation_terms, peak_activation_bytes
from megatron.memory.measure import SavedActivations, measure_microbatch
from megatron.model import build_model
from megatron.pipeline_parallel import schedule_tables as tables
from megatron.pipeline_parallel.schedules import run_pipeline_table
from megatron.tensor_parallel import tensor_parallel_seed
from pretrain_gpt import forward_step
from tests.distributed.harness import run_distributed

TINY = ["--mock-data", "--device", "cpu", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "200",
        "--max-seq-len", "16", "--max-position-embeddings", "32", "--micro-batch-size", "2"]
NO_DROPOUT = ["--hidden-dropout-prob", "0", "--attention-probs-dropout-prob", "0"]
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
         "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--bf16"]
SP = ["--sequence-parallel"]
TP_CASES = {
    "tp2-gpt2-dropout": [],
    "tp2-llama-flash": LLAMA + NO_DROPOUT,
    "tp2-sp-gpt2-dropout": SP,
    "tp2-sp-gpt2-flash": SP + NO_DROPOUT,  # the embedding's shard is a view of the whole output: kept whole
    "tp2-sp-llama-selective": SP + LLAMA + ["--use-recompute", "--recompute-granularity", "selective"],
    "tp2-sp-full-recompute": SP + ["--use-recompute", "--recompute-granularity", "full"],
}


def _batch(config, count: int, seed: int = 1) -> dict:
    data = MockGPTDataset(8, config.dataset.max_seq_len, config.model.vocab_size, seed=seed)
    return {k: v.clone() for k, v in build_batch([data[i] for i in range(count)], data.eod_id).items()}


def _tp_run(rank, world):
    ps = parallel_state.initialize(tp=world)
    results = {}
    for name, flags in TP_CASES.items():
        config = parse_config([*TINY, "--num-layers", "2", "--tp", str(world), *flags])
        validate(config, world_size=world)
        tensor_parallel_seed(config.seed, ps.tp_rank, torch.device("cpu"))
        model = build_model(config).train()
        batch = _batch(config, config.batch_size.micro_batch_size)
        results[name] = (measure_microbatch(model, forward_step, batch), activation_bytes_per_microbatch(config),
                         activation_terms(config))
    return results


@functools.cache
def tp_results() -> list[dict]:
    return run_distributed(_tp_run, 2)


@pytest.mark.parametrize("case", list(TP_CASES))
def test_tensor_parallel_prediction_equals_measurement(case):
    for rank_results in tp_results():
        measured, predicted, terms = rank_results[case]
        assert measured == pytest.approx(predicted, rel=0.05)
        assert measured == predicted, terms


SCHEDULES = {"1f1b": (1, tables.one_f_one_b), "gpipe": (1, tables.gpipe),
             "interleaved": (2, lambda pp, r, m: tables.interleaved_one_f_one_b(pp, r, m, 2))}
M = 4  # micro-batches


def _pp_run(rank, world):
    ps = parallel_state.initialize(pp=world)
    results = {}
    for name, (vpp, make) in SCHEDULES.items():
        config = parse_config([*TINY, "--num-layers", "4", "--pp", str(world), "--vpp", str(vpp),
                               "--pipeline-schedule", "gpipe" if name == "gpipe" else "1f1b",
                               "--global-batch-size", str(2 * M)])
        validate(config, world_size=world)
        torch.manual_seed(0)
        model = build_model(config).train()
        chunks = list(model) if isinstance(model, torch.nn.ModuleList) else [model]
        micro = split_micro_batches(_batch(config, 2 * M), 2)
        micro = [{k: v.clone() for k, v in mb.items()} for mb in micro]
        with SavedActivations(exclude=model.parameters()) as meter:
            run_pipeline_table(make(world, rank, M), forward_step, micro, chunks, 1.0, 1.0, ps, (16, 2, 64),
                               torch.float32, torch.device("cpu"))
        results[name] = (meter.peak, meter.live, peak_activation_bytes(config, rank),
                         activation_bytes_per_microbatch(config, rank))
    return results


@functools.cache
def pp_results() -> list[dict]:
    return run_distributed(_pp_run, 2)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_pipeline_peak_equals_in_flight_times_per_micro_batch(schedule):
    for rank, rank_results in enumerate(pp_results()):
        measured_peak, live_after, predicted_peak, per_micro_batch = rank_results[schedule]
        assert live_after == 0  # every backward released its micro-batch's activations
        assert measured_peak == predicted_peak
        if schedule == "gpipe":
            assert predicted_peak == M * per_micro_batch
        if schedule == "1f1b":
            assert predicted_peak == (2 - rank) * per_micro_batch
