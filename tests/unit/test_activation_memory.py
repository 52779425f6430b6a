"""Activation memory: the formula (megatron/memory/activations.py) against what saved_tensors_hooks
measure (megatron/memory/measure.py) for tiny models on the CPU, one process; the pipeline's
micro-batches in flight against the schedule simulator; the estimate's parts.

The prediction is exact (to the byte) for every case here; the only difference it allows is the rope
cos/sin tables of a chunk whose every layer recomputes its attention: they are alive but referenced by
the checkpoint, not saved, so the hooks cannot see them (2 b s rot d bytes). Tensor-parallel and
pipeline cases run on gloo ranks: tests/distributed/test_activation_memory.py.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from megatron.attention.tiling import MATH_TILE_BYTES
from megatron.config import Config, parse_config, validate
from megatron.data.loader import build_batch
from megatron.data.mock_dataset import MockGPTDataset
from megatron.memory import estimate
from megatron.memory.activations import (
    activation_bytes_per_microbatch,
    activation_terms,
    chunk_specs,
    context_parallel_terms,
    dims,
    in_flight_at_peak,
    largest_temporary_bytes,
    layer_bytes,
    peak_activation_bytes,
    schedule_table,
    temporary_terms,
)
from megatron.memory.measure import SavedActivations, measure_microbatch
from megatron.memory.model_states import model_state_bytes, parameters_per_rank
from megatron.parallelize_gpt import build_model
from megatron.pipeline_parallel import schedule_tables as tables
from pretrain_gpt import forward_step

TINY = ("--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "200",
        "--max-seq-len", "16", "--max-position-embeddings", "32", "--micro-batch-size", "2")
LLAMA = ("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
         "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--kv-channels", "24")
NO_DROPOUT = ("--hidden-dropout-prob", "0", "--attention-probs-dropout-prob", "0")
# multi-latent attention: q/k 16 + 8 channels, values 12 (unequal: the math kernel on the CPU), latents of 24 (kv)
# and 20 (q LoRA, with --qk-layernorm its norm)
MLA = ("--multi-latent-attention", "--position-embedding-type", "rope", "--kv-lora-rank", "24", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12")
Q_LORA = ("--q-lora-rank", "20", "--qk-layernorm")
# DeepSeek-V3's MoE layer (the second; the multi-token prediction module's as the decoder's last): group-limited
# sigmoid routing with the expert bias, a shared expert
DEEPSEEK_MOE = ("--normalization", "RMSNorm", "--swiglu", "--untie-embeddings-and-output-weights",
                "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "[0,1]",
                "--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "32",
                "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-num-groups",
                "2", "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5",
                "--moe-token-dispatcher-type", "allgather")
RECOMPUTE = {"none": (), "selective": ("--use-recompute", "--recompute-granularity", "selective"),
             "only_attn": ("--use-recompute", "--recompute-granularity", "only_attn"),
             "full": ("--use-recompute", "--recompute-granularity", "full"),
             "uniform2": ("--use-recompute", "--recompute-granularity", "full", "--recompute-method", "uniform",
                          "--recompute-num-layers", "2"),
             "block1": ("--use-recompute", "--recompute-granularity", "full", "--recompute-method", "block",
                        "--recompute-num-layers", "1")}
HIDDEN = "rope tables (in checkpoints)"


def make_config(*argv: str, world_size: int = 1) -> Config:
    config = parse_config(["--mock-data", "--device", "cpu", *TINY, *argv])
    validate(config, world_size=world_size, cuda_available=False)
    return config


def measured_bytes(config: Config, eods: tuple[int, ...] = ()) -> int:
    """``eods``: positions of each sample made end-of-document tokens (packed documents)."""
    torch.manual_seed(0)
    model = build_model(config).train()
    data = MockGPTDataset(8, config.dataset.max_seq_len, config.model.vocab_size, seed=1)
    samples = [data[i] for i in range(config.batch_size.micro_batch_size)]
    for sample in samples:
        sample[list(eods)] = data.eod_id
    d = config.dataset
    # own storages: build_batch's tokens of one sample are a view of the [1, s + 1] sample
    batch = {k: v.clone() for k, v in build_batch(samples, data.eod_id, reset_position_ids=d.reset_position_ids,
                                                  reset_attention_mask=d.reset_attention_mask,
                                                  mtp_depth=config.model.mtp_num_layers or 0).items()}
    return measure_microbatch(model, forward_step, batch)


def assert_prediction_matches(config: Config) -> None:
    terms = activation_terms(config)
    predicted = activation_bytes_per_microbatch(config)
    assert predicted == sum(terms.values())
    visible = predicted - terms.get(HIDDEN, 0)  # what the hooks can see
    measured = measured_bytes(config)
    assert measured == pytest.approx(visible, rel=0.05)
    assert measured == visible, terms  # exact, byte for byte


GRID = list(itertools.product(("gpt2", "llama"), RECOMPUTE, ("dropout", "no-dropout"), ("fp32", "bf16")))


@pytest.mark.parametrize("model, recompute, dropout, dtype", GRID, ids=["-".join(c) for c in GRID])
def test_prediction_equals_measurement(model, recompute, dropout, dtype):
    """Dropout on: the CPU runs the math attention kernel (the [b, a, s, s] probabilities, their mask);
    off: the flash kernel (q, k, v, out, log-sum-exp). Llama: rope, RMSNorm, SwiGLU, GQA (2 groups of 2
    heads), untied head, no biases, kv_channels 24 (nq hd != h)."""
    argv = (*(LLAMA if model == "llama" else ()), *RECOMPUTE[recompute], *(NO_DROPOUT if dropout != "dropout" else ()),
            *(("--bf16",) if dtype == "bf16" else ()))
    assert_prediction_matches(make_config(*argv))


@pytest.mark.parametrize("argv", [
    ("--fp16",),
    ("--micro-batch-size", "1", *NO_DROPOUT),  # b = 1
    ("--micro-batch-size", "3", "--max-seq-len", "24"),
    ("--group-query-attention", "--num-query-groups", "1", *NO_DROPOUT),  # one group: q is a view of the QKV output
    ("--group-query-attention", "--num-query-groups", "2", "--bf16"),
    ("--position-embedding-type", "rope", "--rotary-percent", "0.5", *NO_DROPOUT),  # partial rope: q is contiguous
    ("--position-embedding-type", "rope", "--rotary-percent", "0.5", "--num-attention-heads", "1", *NO_DROPOUT),
    ("--position-embedding-type", "none", "--bf16", *NO_DROPOUT),
    ("--use-recompute", "--recompute-granularity", "core_attn", "--no-recompute-layers", "1"),
    ("--use-recompute", "--recompute-granularity", "full_attn", *LLAMA),
    ("--hidden-dropout-prob", "0"),  # attention dropout only: the math kernel, no hidden masks
    ("--attention-probs-dropout-prob", "0", "--bf16"),  # hidden dropout only: flash and masks
    # QK-norm: the norms' outputs are [b, a, s, hd] (the output a copy of its own), they keep q and k as given
    ("--qk-layernorm", *NO_DROPOUT),
    # gpt-oss: quick GeGLU with its offset and clamp (7 n f d), off-by-one sinks (the zero logits kept); windows in
    # alternate layers with learnable sinks (the planned blocks keep q, k, v, out, lse); a window with dropout (the
    # masked math softmax); the MoE experts' quick GeGLU
    ("--quick-geglu", "--glu-linear-offset", "1", "--activation-func-clamp-value", "7", "--softmax-type", "off-by-one",
     *NO_DROPOUT),
    (*LLAMA, "--window-size", "5,0", "--window-attn-skip-freq", "2", "--softmax-type", "learnable", *NO_DROPOUT),
    ("--window-size", "5,0"),
    ("--quick-geglu", "--glu-linear-offset", "1", "--num-experts", "4", "--bf16", *NO_DROPOUT),
    ("--qk-layernorm", *LLAMA, "--bf16"),  # RMSNorm's fp32 copies; the math kernel: the QKV output kept by the norms
    ("--qk-layernorm", *LLAMA, *RECOMPUTE["selective"]),
    # multi-latent attention, one query projection and the q LoRA, the CPU's math kernel and (equal widths) flash
    (*MLA, *NO_DROPOUT),
    (*MLA, *Q_LORA, "--normalization", "RMSNorm", "--bf16"),
    (*MLA, *Q_LORA, "--v-head-dim", "24", "--num-attention-heads", "1", "--micro-batch-size", "1", *NO_DROPOUT),
    (*MLA, *Q_LORA, *RECOMPUTE["selective"]),
    (*MLA, *RECOMPUTE["full"], "--bf16"),
    # multi-token prediction: D modules after the head, each embedding, a decoder layer and the head again
    ("--mtp-num-layers", "2", "--num-layers", "1"),
    ("--mtp-num-layers", "1", *LLAMA, *RECOMPUTE["uniform2"], "--bf16"),
    ("--mtp-num-layers", "1", "--num-layers", "2", *MLA, *Q_LORA, *DEEPSEEK_MOE, *NO_DROPOUT),
], ids=lambda a: " ".join(a))
def test_prediction_equals_measurement_more_shapes(argv):
    assert_prediction_matches(make_config(*argv))


def test_hidden_rope_tables_are_what_full_recompute_hides():
    config = make_config(*LLAMA, *RECOMPUTE["full"], "--bf16")
    d = dims(config)
    assert activation_terms(config)[HIDDEN] == 2 * d.b * d.s * d.rot * d.d
    assert HIDDEN not in activation_terms(make_config(*LLAMA, *RECOMPUTE["block1"]))  # other layers save them


def test_recompute_orders_the_saved_bytes():
    """full < only_attn < selective < none; uniform units of 2 layers keep less than full."""
    sizes = {name: activation_bytes_per_microbatch(make_config(*argv)) for name, argv in RECOMPUTE.items()}
    assert sizes["uniform2"] < sizes["full"] < sizes["only_attn"] < sizes["selective"] < sizes["none"]
    assert sizes["full"] < sizes["block1"] < sizes["none"]


def test_saved_activations_live_and_peak():
    """The meter's live bytes return to zero once the backward has released the graph."""
    config = make_config(*NO_DROPOUT)
    model = build_model(config).train()
    tokens = torch.randint(0, 200, (2, 16))
    with SavedActivations(exclude=model.parameters()) as meter:
        loss = model(tokens, labels=tokens).sum()
        assert meter.live == meter.total == meter.peak > 0
        loss.backward()
    assert meter.live == 0 and meter.peak == meter.total


# ---------------------------------------------------------------------------- the pipeline


def pipeline_config(pp: int, m: int, vpp: int = 1, schedule: str = "1f1b", *argv: str) -> Config:
    return make_config("--num-layers", str(2 * pp * vpp), "--pp", str(pp), "--vpp", str(vpp),
                       "--pipeline-schedule", schedule, "--global-batch-size", str(2 * m), *argv, world_size=pp)


PIPELINES = [(2, 4, 1, "1f1b"), (4, 8, 1, "1f1b"), (4, 3, 1, "1f1b"), (4, 8, 1, "gpipe"), (3, 5, 1, "gpipe"),
             (2, 4, 2, "1f1b"), (4, 8, 2, "1f1b"), (4, 8, 3, "1f1b"), (2, 2, 3, "1f1b")]


@pytest.mark.parametrize("pp, m, vpp, schedule", PIPELINES, ids=[f"pp{p}-m{m}-vpp{v}-{s}" for p, m, v, s in PIPELINES])
def test_in_flight_count_is_the_simulators(pp, m, vpp, schedule):
    config = pipeline_config(pp, m, vpp, schedule)
    assert config.num_micro_batches == m
    sim = tables.simulate([schedule_table(config, r) for r in range(pp)], pp, vpp)
    assert [sum(in_flight_at_peak(config, r)) for r in range(pp)] == list(sim["peak_in_flight"])
    if vpp == 1:  # 1F1B keeps pp - rank micro-batches (at most m), GPipe all m
        assert [sum(in_flight_at_peak(config, r)) for r in range(pp)] == \
               [m if schedule == "gpipe" else min(pp - r, m) for r in range(pp)]
    # the weighted peak, replayed from the simulator's timeline of each rank
    for r in range(pp):
        weights = [activation_bytes_per_microbatch(config, r, c) for c in range(vpp)]
        held, best = [0] * vpp, 0
        for action, _, _ in sim["timeline"][r]:
            held[action.chunk] += 1 if action.kind == "F" else -1
            best = max(best, sum(h * w for h, w in zip(held, weights)))
        assert peak_activation_bytes(config, r) == best


def test_no_pipelining_holds_one_micro_batch():
    config = make_config("--global-batch-size", "8")  # 4 micro-batches of 2, accumulated one at a time
    assert in_flight_at_peak(config) == (1,)
    assert peak_activation_bytes(config) == activation_bytes_per_microbatch(config)


def test_stage_chunks_follow_build_model():
    config = pipeline_config(2, 4, vpp=2)
    assert chunk_specs(config, 0) == [(range(0, 2), True, False), (range(4, 6), False, False)]
    assert chunk_specs(config, 1) == [(range(2, 4), False, False), (range(6, 8), False, True)]
    first, last = (activation_terms(config, s) for s in (0, 1))
    assert "embedding ids" in first and "loss grad" not in first and "loss grad" in last
    mtp = pipeline_config(2, 4, 2, "1f1b", "--mtp-num-layers", "2")  # the modules on the last stage's last chunk
    terms = [activation_terms(mtp, s, c) for s in (0, 1) for c in (0, 1)]
    assert [any(k.startswith("mtp") for k in t) for t in terms] == [False, False, False, True]
    d = dims(mtp)
    assert terms[3]["mtp head input"] == 2 * d.n * d.h * d.d and terms[3]["mtp loss mask"] == 4 * d.n * 2


def test_attention_kernel_on_the_cpu():
    """Multi-latent attention with unequal q/k and v widths runs the math kernel on the CPU without dropout (the fused
    one takes one width); on GPUs a fused kernel is assumed."""
    assert dims(make_config(*MLA, *NO_DROPOUT)).kernel == "math"
    assert dims(make_config(*MLA, "--v-head-dim", "24", *NO_DROPOUT)).kernel == "flash"
    gpu = make_config(*MLA, *NO_DROPOUT)
    gpu.device = "gpu"
    assert dims(gpu).kernel == "flash"


# ---------------------------------------------------------------------------- temporaries and the estimate


def test_temporaries():
    config = make_config(*RECOMPUTE["full"])
    d, terms = dims(config), temporary_terms(config)
    assert terms["recompute"] == layer_bytes(d, None) - d.n_sp * d.h * d.d  # one layer's saves, but its input
    assert terms["loss"] == d.n * d.vocab * d.d + 2 * d.n * d.vocab * 4  # logits + two fp32 chunks (all rows)
    assert terms["attention scores"] == 2 * 4 * d.b * d.a * d.s**2  # dropout on: the math kernel
    assert largest_temporary_bytes(config) == max(terms.values())
    unit = make_config(*RECOMPUTE["uniform2"])
    assert temporary_terms(unit)["recompute"] == 2 * layer_bytes(d, None) - d.n_sp * d.h * d.d
    mtp = make_config(*RECOMPUTE["uniform2"], "--num-layers", "2", "--mtp-num-layers", "1")  # the module's layer: full
    assert temporary_terms(mtp)["recompute"] == 2 * layer_bytes(d, None) - d.n_sp * d.h * d.d
    assert "attention scores" not in temporary_terms(make_config(*NO_DROPOUT))


@pytest.mark.parametrize("sharding_stage", [1, 2, 3])
def test_estimate_adds_its_parts(sharding_stage):
    config = make_config("--bf16", "--sharding", "2", "--sharding-stage", str(sharding_stage), world_size=2)
    e = estimate(config, 0)
    assert e.total == e.model_states + e.activations + e.temporaries
    assert e.activations == peak_activation_bytes(config) == e.activations_per_microbatch
    assert e.temporaries == largest_temporary_bytes(config)
    n = parameters_per_rank(config)
    between = model_state_bytes(n, "bf16", 2, sharding_stage).device_total
    assert e.model_states_between_steps == between
    extra = {1: 0, 2: 4 * (n - n // 2)}.get(sharding_stage)
    if extra is not None:
        assert e.model_states == between + extra  # stage 2: the full fp32 gradient buffer during the step
    else:
        assert e.model_states > between  # stage 3: the root and two layers gathered


# ---------------------------------------------------------------------------- packed documents, context parallelism
# (the context-parallel measurements run on gloo ranks: tests/distributed/test_activation_memory.py)

DOCS = ("--reset-attention-mask", "--reset-position-ids")


@pytest.mark.parametrize("argv", [(*NO_DROPOUT,), (*LLAMA, *NO_DROPOUT, "--bf16"), ("--num-attention-heads", "1",
                                  "--micro-batch-size", "1", *NO_DROPOUT), (*LLAMA, "--rotary-percent", "0.5",
                                  *NO_DROPOUT),
                                  (*MLA, *Q_LORA, "--v-head-dim", "24", *NO_DROPOUT, "--mtp-num-layers", "1")],
                         ids=["gpt2", "llama", "one-head-b1", "partial-rope", "mla-mtp"])
def test_packed_documents_prediction_equals_measurement(argv):
    """One flash call per document: the same q, k, v and log-sum-exp, each call's output its own storage
    and the dense input a copy of their concatenation (even with a = b = 1)."""
    config = make_config(*argv, *DOCS)
    assert "attention out" in activation_terms(config)
    assert measured_bytes(config, eods=(4, 9, 10)) == activation_bytes_per_microbatch(config)


def test_packed_documents_math_kernel_is_bounded_by_whole_sequences():
    """With attention dropout (the math kernel) each document's probabilities are its length squared: the
    formula's s^2 per sample is exact less the squares the documents leave out (probabilities, mask and
    dropped probabilities, 4 bytes each, per head and layer)."""
    config = make_config(*DOCS)
    d = dims(config)
    lengths = [5, 5, 1, 5]  # eods at 4, 9, 10: documents of tokens 0-4, 5-9, 10, 11-15
    missing = d.b * (d.s**2 - sum(x * x for x in lengths)) * d.a * 12 * config.model.num_layers
    assert measured_bytes(config, eods=(4, 9, 10)) == activation_bytes_per_microbatch(config) - missing


@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_context_parallel_temporaries(comm):
    """The exchange's buffers and the fp32 accumulators of one layer's attention; on GPUs p2p and
    all_gather add the plain block kernel's backward: fp32 expanded keys, values, their gradients and dQ,
    and four fp32 tiles of query rows of the diagonal block's scores (each at most MATH_TILE_BYTES). Multi-latent
    attention's keys and values keep their widths (one packed buffer; a2a the wider of queries and outputs)."""
    config = make_config(*NO_DROPOUT, "--cp", "2", "--cp-comm-type", comm, world_size=2)
    d = dims(config)
    assert (d.cp, d.cp_comm, d.n, d.length) == (2, comm, 16, 8)
    kv, dkv, acc = 2 * d.n * d.g * d.hd * 4, 2 * d.n * d.g * d.hd * 4, 4 * d.n * d.a * d.hd + 4 * d.n * d.a
    expected = {"p2p": {"forward": 2 * kv + 2 * acc, "backward": 2 * kv + 2 * dkv + 2 * 4 * d.n * d.a * d.hd},
                "all_gather": {"forward": 2 * kv + 2 * acc, "backward": 2 * kv + 3 * dkv + 2 * 4 * d.n * d.a * d.hd},
                "a2a": {"forward": 2 * d.n * d.a * d.hd * 4, "backward": 2 * d.n * d.a * d.hd * 4}}[comm]
    assert context_parallel_terms(d) == expected
    assert temporary_terms(config)["context-parallel attention"] == max(expected.values())
    assert "context-parallel attention" not in temporary_terms(make_config(*NO_DROPOUT))
    gpu = dataclasses.replace(d, device="gpu")
    blocks = 0 if comm == "a2a" else 5 * 4 * d.n * d.a * d.hd + 4 * 4 * d.b * d.a * d.length**2  # tiles of every row
    assert context_parallel_terms(gpu)["backward"] == expected["backward"] + blocks
    long = dataclasses.replace(gpu, s=1 << 20)  # 2^19 tokens a rank: a tile of 16 query rows, 256 MiB
    extra = context_parallel_terms(long)["backward"] - context_parallel_terms(dataclasses.replace(long, device="cpu"))[
        "backward"]
    assert extra == (0 if comm == "a2a" else 5 * 4 * long.n * d.a * d.hd + 4 * MATH_TILE_BYTES["limit"])
    dropped = dataclasses.replace(d, attn_dropout=True)  # the plain kernel on the CPU too, and the masks' tiles
    assert context_parallel_terms(dropped)["backward"] == expected["backward"] + (
        0 if comm == "a2a" else 5 * 4 * d.n * d.a * d.hd + 14 * 4 * d.b * d.a * d.length**2)
    mla = dims(make_config(*MLA, *NO_DROPOUT, "--cp", "2", "--cp-comm-type", comm, world_size=2))
    packed, out = mla.n * mla.a * (24 + 12) * 4, 4 * mla.n * mla.a * 12 + 4 * mla.n * mla.a  # keys 16 + 8, values 12
    assert context_parallel_terms(mla)["forward"] == {"p2p": 2 * packed + 2 * out, "all_gather": 3 * packed,
                                                      "a2a": 2 * mla.n * mla.a * 24 * 4}[comm]
    if comm == "all_gather":  # every rank's keys and values, the whole sequence's at any cp
        four = dims(make_config(*NO_DROPOUT, "--cp", "4", "--cp-comm-type", comm, world_size=4))
        assert context_parallel_terms(four)["backward"] == 4 * kv // 2 + 5 * dkv // 2 + 4 * d.n * d.a * d.hd
