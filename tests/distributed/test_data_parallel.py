"""Bucketed data-parallel gradients equal the single-process gradients of the whole batch."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron import parallel_state
from megatron.config import parse_config, validate
from megatron.data.loader import build_batch, split_micro_batches
from megatron.data.mock_dataset import MockGPTDataset
from megatron.distributed.data_parallel import DataParallel
from megatron.distributed.parallelize import ShardingPlan, parallelize, plan_sharding
from megatron.parallelize_gpt import build_model
from megatron.pipeline_parallel.schedules import forward_backward_no_pipelining
from pretrain_gpt import forward_step
from tests.distributed.harness import run_distributed


def _setup():
    config = parse_config(["--mock-data", "--device", "cpu", "--num-layers", "2", "--hidden-size", "32",
                           "--num-attention-heads", "4", "--vocab-size", "128", "--max-seq-len", "16",
                           "--max-position-embeddings", "16", "--hidden-dropout-prob", "0",
                           "--attention-probs-dropout-prob", "0", "--micro-batch-size", "2"])
    validate(config)
    data = MockGPTDataset(64, 16, 128, seed=3)
    batch = build_batch([data[i] for i in range(8)], data.eod_id)
    return config, batch


def _grads(model, buffer, batch, num_tokens):
    buffer.zero_grad()
    forward_backward_no_pipelining(forward_step, split_micro_batches(batch, 2), model, num_tokens)
    if isinstance(model, DataParallel):
        model.finish_grad_sync()
    module = model.module if isinstance(model, DataParallel) else model
    return torch.cat([p.main_grad.reshape(-1) for p in module.parameters()])  # layout-free: by parameter


def _compare(rank, world_size, bucket_size, overlap):
    ps = parallel_state.initialize()  # one data-parallel group of all ranks
    config, batch = _setup()
    num_tokens = float(batch["loss_mask"].sum())
    reference_model, reference_buffer, _ = parallelize(build_model(config), ShardingPlan())  # one replica
    reference = _grads(reference_model, reference_buffer, batch, num_tokens)

    config.distributed.bucket_size_mb = bucket_size * 4 / 2**20  # fp32 elements
    plan = replace(plan_sharding(config, ps), overlap=overlap)
    assert plan.data_parallel_group is not None
    ddp, buffer, _ = parallelize(build_model(config), plan)
    assert isinstance(ddp, DataParallel)
    share = 8 // world_size
    local = {k: v[rank * share:(rank + 1) * share] for k, v in batch.items()}
    grads = _grads(ddp, buffer, local, num_tokens)
    return len(buffer.buckets), float((grads - reference).abs().max()), float(reference.abs().max())


@pytest.mark.parametrize("bucket_size, overlap", [(1, True), (10**9, True), (5000, True), (5000, False)],
                         ids=["bucket-smaller-than-a-parameter", "one-bucket", "several-buckets", "no-overlap"])
def test_bucketed_gradients_equal_single_process(bucket_size, overlap):
    results = run_distributed(_compare, 2, bucket_size, overlap)
    for _num_buckets, diff, scale in results:
        # fp32 round-off only: the two halves' gradients are summed in another order.
        assert diff <= 1e-6 * scale
    if bucket_size == 1:
        assert results[0][0] > 10  # every parameter its own bucket
    if bucket_size == 10**9:
        assert results[0][0] == 1
