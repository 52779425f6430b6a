"""Under pipelining the data-parallel gradient reduction starts during each model chunk's last backward
(not after the schedule), and gives bitwise the gradients of the reduction after it.

4 gloo ranks: pp 2 x (dp 2 | sharding 2), ZeRO stages 1, 2 and 3, 1F1B and interleaved (vpp 2). The
same model is run with ``overlap`` on and off; the start of every bucket's reduction is recorded
against the backwards the executor has run so far.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron import parallel_state
from megatron.config import parse_config, validate
from megatron.data.loader import build_batch, split_micro_batches
from megatron.data.mock_dataset import MockGPTDataset
from megatron.distributed.bucket import Bucket
from megatron.distributed.parallelize import parallelize, plan_sharding
from megatron.parallelize_gpt import build_model
from megatron.pipeline_parallel import schedule_tables as tables
from megatron.pipeline_parallel import schedules
from pretrain_gpt import forward_step
from tests.distributed.harness import run_distributed

M, SEQ, HIDDEN = 4, 16, 32  # micro-batches per data-parallel rank (a multiple of pp for vpp 2)


def _config(stage: int, vpp: int, world: int):
    replicas = ["--sharding", "2", "--sharding-stage", str(stage)] if stage > 1 else ["--dp", "2"]
    config = parse_config(["--mock-data", "--device", "cpu", "--num-layers", "4", "--hidden-size", str(HIDDEN),
                           "--num-attention-heads", "4", "--vocab-size", "128", "--max-seq-len", str(SEQ),
                           "--max-position-embeddings", str(SEQ), "--hidden-dropout-prob", "0",
                           "--attention-probs-dropout-prob", "0", "--micro-batch-size", "1",
                           "--global-batch-size", str(2 * M), "--pp", "2", "--vpp", str(vpp), *replicas,
                           "--bucket-size-mb", str(2000 * 4 / 2**20)])  # small buckets: several per chunk
    validate(config, world_size=world)
    return config


def _last_backwards(ps, vpp: int) -> set[int]:
    """1-based positions, among this rank's backwards, of each chunk's last one."""
    table = tables.interleaved_one_f_one_b(2, ps.pp_rank, M, vpp) if vpp > 1 else tables.one_f_one_b(2, ps.pp_rank, M)
    backwards = [a for a in table if a.kind == "B"]
    return {max(i for i, a in enumerate(backwards, 1) if a.chunk == c) for c in range(vpp)}


def _step(config, ps, plan, micro, num_tokens) -> tuple[torch.Tensor, list[int], int]:
    """(reduced gradients this rank keeps, the backward during which each reduction started, buckets)."""
    model, buffer, _ = parallelize(build_model(config, meta_init=plan.meta_init), plan)
    buffer.zero_grad()
    done, starts = [0], []
    run_backward, start_grad_sync = schedules._backward, Bucket.start_grad_sync

    def counted_backward(*args):
        done[0] += 1
        run_backward(*args)

    def recorded_start(bucket, *args):
        starts.append(done[0])
        start_grad_sync(bucket, *args)

    schedules._backward, Bucket.start_grad_sync = counted_backward, recorded_start
    try:
        schedules.forward_backward_pipelining(forward_step, micro, model, num_tokens, ps=ps, schedule="1f1b",
                                              shape=(SEQ, 1, HIDDEN), dtype=torch.float32,
                                              device=torch.device("cpu"))
        started_in_schedule = list(starts)
        model.finish_grad_sync()
    finally:
        schedules._backward, Bucket.start_grad_sync = run_backward, start_grad_sync
    grads = buffer.grad_shard if plan.shards_grads else buffer.grad_data
    return grads.clone(), started_in_schedule, len(buffer.buckets)


def _run(rank: int, world: int, stage: int) -> list[dict]:
    ps = parallel_state.initialize(pp=2, sharding=2 if stage > 1 else 1)
    data = MockGPTDataset(64, SEQ, 128, seed=7)
    batch = build_batch([data[i] for i in range(2 * M)], data.eod_id)  # the global batch
    num_tokens = float(batch["loss_mask"].sum())
    mine = {k: v[ps.data_parallel_rank * M:(ps.data_parallel_rank + 1) * M] for k, v in batch.items()}
    results = []
    for vpp in (1, 2):
        config = _config(stage, vpp, world)
        plan = plan_sharding(config, ps)
        after, started_after, _ = _step(config, ps, replace(plan, overlap=False), split_micro_batches(mine, 1),
                                        num_tokens)
        during, started_during, buckets = _step(config, ps, replace(plan, overlap=True),
                                                split_micro_batches(mine, 1), num_tokens)
        results.append({"vpp": vpp, "equal": torch.equal(after, during), "nonzero": bool(after.abs().sum() > 0),
                        "started_after": started_after, "started_during": started_during, "buckets": buckets,
                        "last_backwards": _last_backwards(ps, vpp)})
    return results


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_pipelined_grad_sync_starts_in_each_chunks_last_backward(stage):
    for per_rank in run_distributed(_run, 4, stage, timeout=240):
        for r in per_rank:
            assert r["equal"] and r["nonzero"], r["vpp"]  # the same sums, started earlier: bitwise equal
            assert r["started_after"] == []  # overlap off: nothing starts before finish_grad_sync
            # overlap on: every bucket starts during the schedule, in a chunk's last backward, and with
            # vpp 2 some start in the later chunk's, while the earlier chunk's backward is still to run
            assert len(r["started_during"]) == r["buckets"] > r["vpp"]
            assert set(r["started_during"]) == r["last_backwards"], r
