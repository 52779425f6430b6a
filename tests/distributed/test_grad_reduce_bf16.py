"""--grad-reduce-in-bf16 over two gloo ranks: every gradient reduction of ``megatron.distributed`` runs on bf16
tensors, under plain data parallelism (all-reduce), ZeRO stages 2 and 3 (reduce-scatter), offload, a MoE model's
expert buckets (over the expert-data-parallel ranks) and the pipeline's tied-embedding sum; the reduced values are
the bf16 rounding of the two ranks' sum; the optimizer steps fp32 copies."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from megatron import parallel_state
from megatron.config import parse_config, validate
from megatron.data.loader import build_batch
from megatron.data.mock_dataset import MockGPTDataset
from megatron.distributed import bucket as bucket_module
from megatron.distributed.finalize_grads import finalize_model_grads
from megatron.distributed.parallelize import parallelize, plan_sharding
from megatron.optimizer import build_optimizer
from megatron.parallelize_gpt import build_model
from megatron.training import train_step
from pretrain_gpt import forward_step
from tests.distributed.harness import run_distributed

GPT = ["--mock-data", "--device", "cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--vocab-size", "128", "--max-seq-len", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
       "--global-batch-size", "8", "--hidden-dropout-prob", "0", "--attention-probs-dropout-prob", "0", "--bf16",
       "--grad-reduce-in-bf16"]
MOE = ["--num-experts", "2", "--moe-router-topk", "1", "--moe-ffn-hidden-size", "16"]


class Recorded:
    """Every all-reduce and reduce-scatter called from ``megatron.distributed`` while active: (caller, op, dtype)."""

    def __init__(self):
        self.calls: list[tuple[str, str, torch.dtype]] = []

    def __enter__(self):
        self._saved = dist.all_reduce, bucket_module._reduce_scatter_flat
        all_reduce, reduce_scatter = self._saved

        def recorded_all_reduce(tensor, *args, **kwargs):
            self._note("all_reduce", tensor)
            return all_reduce(tensor, *args, **kwargs)

        def recorded_reduce_scatter(out, tensor, *args, **kwargs):
            self._note("reduce_scatter", tensor)
            return reduce_scatter(out, tensor, *args, **kwargs)

        dist.all_reduce, bucket_module._reduce_scatter_flat = recorded_all_reduce, recorded_reduce_scatter
        return self

    def _note(self, op: str, tensor: torch.Tensor) -> None:
        caller = sys._getframe(2).f_globals["__name__"]
        if caller.startswith("megatron.distributed"):
            self.calls.append((caller.rsplit(".", 1)[-1], op, tensor.dtype))

    def __exit__(self, *exc):
        dist.all_reduce, bucket_module._reduce_scatter_flat = self._saved


def _train(rank, world, flags):
    ps = parallel_state.initialize(sharding=2 if "--sharding" in flags else 1)
    config = parse_config([*GPT, *flags])
    validate(config, world_size=world)
    plan = plan_sharding(config, ps)
    model, buffer, _ = parallelize(build_model(config, meta_init=plan.meta_init), plan)
    optimizer = build_optimizer(buffer, plan, config)
    data = MockGPTDataset(64, 16, 128, seed=rank)
    batch = build_batch([data[i] for i in range(4)], data.eod_id)
    with Recorded() as recorded:
        train_step(forward_step, batch, model, buffer, optimizer, 1e-3, 2, dp_group=ps.group("data_parallel"))
    reduced = buffer.grad_shard if buffer.shard_grads else buffer.grad_data
    return {"calls": recorded.calls, "grad_dtypes": {str(b.grad_dtype) for b in buffer.buckets},
            "reduced_dtype": str(reduced.dtype), "experts": sum(1 for b in buffer.buckets
                                                               if getattr(b.params[0][0], "expert_parallel", False)),
            "buckets": len(buffer.buckets), "masters": str(optimizer.masters[0].dtype),
            "cpu_grad": str(optimizer.cpu_grad.dtype)}


CASES = {"dp2": ["--dp", "2"], "stage2": ["--sharding", "2", "--sharding-stage", "2"],
         "stage3": ["--sharding", "2", "--sharding-stage", "3"],
         "stage2-offload": ["--sharding", "2", "--sharding-stage", "2", "--sharding-offload"],
         "moe-dp2": ["--dp", "2", *MOE]}


@pytest.mark.parametrize("case", list(CASES))
def test_every_gradient_reduction_runs_in_bf16(case):
    op = "all_reduce" if case.endswith("dp2") else "reduce_scatter"
    for result in run_distributed(_train, 2, CASES[case]):
        assert result["grad_dtypes"] == {"torch.bfloat16"} and result["reduced_dtype"] == "torch.bfloat16"
        bucket_calls = [(o, d) for caller, o, d in result["calls"] if caller == "bucket"]
        assert len(bucket_calls) >= result["buckets"] and {o for o, _ in bucket_calls} == {op}
        assert {d for _, _, d in result["calls"]} == {torch.bfloat16}, result["calls"]
        assert result["masters"] == result["cpu_grad"] == "torch.float32"
        if case == "moe-dp2":
            assert result["experts"] > 0  # the experts' buckets, reduced over edp, are among them


def _reduced_values(rank, world):
    """dp2: the all-reduced gradients against the bf16 rounding of the (exact) fp32 sum of the two ranks' bf16 ones."""
    ps = parallel_state.initialize()
    config = parse_config([*GPT, "--dp", "2"])
    validate(config, world_size=world)
    model, buffer, _ = parallelize(build_model(config), plan_sharding(config, ps))
    data = MockGPTDataset(64, 16, 128, seed=rank)
    batch = build_batch([data[i] for i in range(2)], data.eod_id)  # one micro-batch: nothing accumulated
    buffer.zero_grad()
    with model.no_sync():  # the reduction waits for finish_grad_sync
        output, loss_fn = forward_step(batch, model)
        loss_fn(output)[0].backward()
    local = buffer.grad_data.float()  # a copy
    both = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(both, local)
    model.finish_grad_sync()
    want = (both[0] + both[1]).to(torch.bfloat16)
    return bool(torch.equal(buffer.grad_data, want)), float((buffer.grad_data.float() - want.float()).abs().max())


def test_the_all_reduce_is_the_bf16_rounding_of_the_sum():
    for equal, diff in run_distributed(_reduced_values, 2):
        assert equal, diff


def _tied_embedding(rank, world):
    ps = parallel_state.initialize(pp=2)
    config = parse_config([*GPT, "--pp", "2"])
    validate(config, world_size=world)
    plan = plan_sharding(config, ps)
    model, buffer, _ = parallelize(build_model(config), plan)
    tied = [p for p in model.parameters() if getattr(p, "shared_embedding", False)]
    g = torch.Generator().manual_seed(rank)
    for p in tied:
        p.main_grad.copy_(torch.randn(p.shape, generator=g))
    mine = [p.main_grad.float().clone() for p in tied]
    theirs = [torch.empty_like(m) for m in mine]
    for m, t in zip(mine, theirs):
        dist.all_reduce(t.copy_(m))
    with Recorded() as recorded:
        finalize_model_grads(model, ps, buffer)
    return (recorded.calls, [str(p.main_grad.dtype) for p in tied],
            all(torch.equal(p.main_grad, t.to(torch.bfloat16)) for p, t in zip(tied, theirs)))


def test_the_tied_embedding_sum_runs_in_bf16():
    """Pipeline stages 0 and 1 hold the word embedding and its copy at the head: their bf16 gradients are summed in
    bf16 over the embedding group, both stages ending with the bf16 rounding of the sum."""
    for calls, dtypes, equal in run_distributed(_tied_embedding, 2):
        assert calls == [("finalize_grads", "all_reduce", torch.bfloat16)]
        assert dtypes == ["torch.bfloat16"] and equal


def _scattered_values(rank, world, fp32_accumulation):
    """ZeRO-2 over ``world`` ranks: this rank's reduce-scattered gradient shard, and the bf16 rounding of the exact
    (fp64) sum of every rank's bf16 gradients there."""
    ps = parallel_state.initialize(sharding=world)
    flags = ["--sharding", str(world), "--sharding-stage", "2"]
    config = parse_config([*GPT, *flags, *(["--ddp-reduce-scatter-with-fp32-accumulation"] if fp32_accumulation
                                          else [])])
    validate(config, world_size=world)
    model, buffer, _ = parallelize(build_model(config), plan_sharding(config, ps))
    data = MockGPTDataset(64, 16, 128, seed=rank)
    batch = build_batch([data[i] for i in range(2)], data.eod_id)
    buffer.zero_grad()
    with model.no_sync():
        output, loss_fn = forward_step(batch, model)
        (loss_fn(output)[0] * 100.0).backward()  # gradients of magnitude ~1: many bits of bf16 in play
    pieces = []
    for bucket in buffer.buckets:
        local = bucket.grad_data.double()
        everyone = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(everyone, local)
        lo, hi = bucket.shard
        pieces.append(torch.stack(everyone).sum(0)[lo - bucket.start:hi - bucket.start])
    model.finish_grad_sync()
    exact = torch.cat(pieces).to(torch.bfloat16)
    got = torch.cat([bucket.grad_shard for bucket in buffer.buckets])
    return int((got != exact).sum()), got.numel()


def test_the_fp32_accumulating_reduce_scatter_rounds_once():
    """--ddp-reduce-scatter-with-fp32-accumulation at ZeRO-2 over 4 ranks: every element of a rank's shard is the
    bf16 rounding of the exact sum (fp32 accumulation of four bf16 values is exact at these magnitudes), where the
    plain bf16 reduce-scatter rounds after each addition and differs on some."""
    accumulated = run_distributed(_scattered_values, 4, True)
    plain = run_distributed(_scattered_values, 4, False)
    assert all(wrong == 0 for wrong, _ in accumulated), accumulated
    assert sum(wrong for wrong, _ in plain) > 0, plain
