"""The pipeline executor: every schedule gives the same gradients; 1F1B holds ~pp/m of GPipe's activations."""

from __future__ import annotations

import torch

from megatron import parallel_state
from megatron.config import parse_config, validate
from megatron.data.loader import build_batch, split_micro_batches
from megatron.data.mock_dataset import MockGPTDataset
from megatron.distributed.parallelize import parallelize, plan_sharding
from megatron.parallelize_gpt import build_model
from megatron.pipeline_parallel import schedule_tables as tables
from megatron.pipeline_parallel.schedules import run_pipeline_table
from pretrain_gpt import forward_step
from tests.distributed.harness import run_distributed

M = 8  # micro-batches


def _run(rank, world, vpp):
    ps = parallel_state.initialize(pp=world)
    config = parse_config(["--mock-data", "--device", "cpu", "--num-layers", "4", "--hidden-size", "32",
                           "--num-attention-heads", "4", "--vocab-size", "128", "--max-seq-len", "16",
                           "--max-position-embeddings", "16", "--hidden-dropout-prob", "0",
                           "--attention-probs-dropout-prob", "0", "--micro-batch-size", "1",
                           "--global-batch-size", str(M), "--pp", str(world), "--vpp", str(vpp)])
    validate(config, world_size=world)
    data = MockGPTDataset(64, 16, 128, seed=5)
    micro = split_micro_batches(build_batch([data[i] for i in range(M)], data.eod_id), 1)
    num_tokens = float(sum(mb["loss_mask"].sum() for mb in micro))
    results = {}
    schedules = {"1f1b": tables.one_f_one_b, "gpipe": tables.gpipe} if vpp == 1 else \
        {"interleaved": lambda pp, r, m: tables.interleaved_one_f_one_b(pp, r, m, vpp)}
    for name, make in schedules.items():
        model, buffer, _ = parallelize(build_model(config), plan_sharding(config, ps))  # no data parallelism
        chunks = list(model) if isinstance(model, torch.nn.ModuleList) else [model]
        stats = {}
        loss = run_pipeline_table(make(world, ps.pp_rank, M), forward_step, micro, chunks, num_tokens, 1.0, ps,
                                  (16, 1, 32), torch.float32, torch.device("cpu"), stats)
        results[name] = (float(loss), buffer.grad_data.clone(), stats["peak_in_flight"])
    return {k: (loss, grads.tolist(), peak) for k, (loss, grads, peak) in results.items()}


def test_1f1b_and_gpipe_same_gradients_and_activation_bound():
    per_rank = run_distributed(_run, 2, 1)
    for rank, res in enumerate(per_rank):
        loss_1f1b, grads_1f1b, peak_1f1b = res["1f1b"]
        loss_gpipe, grads_gpipe, peak_gpipe = res["gpipe"]
        assert grads_1f1b == grads_gpipe  # the same operations, only reordered: bitwise equal
        assert loss_1f1b == loss_gpipe
        assert peak_gpipe == M
        assert peak_1f1b == 2 - rank  # pp - rank: pp/m of GPipe's on rank 0
    assert per_rank[1]["1f1b"][0] > 0 and per_rank[0]["1f1b"][0] == 0  # the loss lives on the last stage


def test_interleaved_holds_what_the_simulator_predicts():
    """The executor keeps exactly as many chunk activations alive as the schedule table's
    simulation says (the table is checked deadlock-free and bounded in test_schedule_tables)."""
    per_rank = run_distributed(_run, 2, 2)
    predicted = tables.simulate([tables.interleaved_one_f_one_b(2, r, M, 2) for r in range(2)], 2, 2)
    assert [res["interleaved"][2] for res in per_rank] == list(predicted["peak_in_flight"])
    assert per_rank[1]["interleaved"][0] > 0  # the loss is computed on the last virtual stage
