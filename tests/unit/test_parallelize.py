"""The pure bucket layout (padding, shards, weight decay first, buckets of their own) and the sharding
plan (what each configuration and rank grid decides), without processes or tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron.config import parse_config
from megatron.config.schema_model import TIED_EMBEDDING
from megatron.distributed.buffer_layout import is_decay, lay_out, layer_buckets, split_into_buckets
from megatron.distributed.parallelize import ShardingPlan, parallelize, plan_sharding
from megatron.distributed.sharding_rule import sharding_stage
from megatron.parallel_state import GROUP_NAMES, ParallelState

# ---------------------------------------------------------------- layout


def test_bucket_is_padded_to_a_multiple_of_n_and_each_rank_owns_one_slice():
    buckets = [[("a.weight", (3, 3)), ("a.bias", (3,))], [("b.weight", (2, 2))]]  # 12 and 4 elements
    layouts = [lay_out(buckets, pad_multiple=5, shard_rank=r) for r in range(5)]
    first, second = layouts[0].buckets
    assert (first.start, first.end, first.numel) == (0, 15, 15)  # 12 padded to 15
    assert (second.start, second.end) == (15, 20)  # 4 padded to 5
    assert layouts[0].numel == 20 and layouts[0].shard_numel == 3 + 1
    for r, layout in enumerate(layouts):
        a, b = layout.buckets
        assert a.shard == (3 * r, 3 * r + 3) and a.shard_offset == 0
        assert b.shard == (15 + r, 16 + r) and b.shard_offset == 3
    covered = sorted(i for layout in layouts for s in layout.buckets for i in range(*s.shard))
    assert covered == list(range(20))  # the slices of all ranks tile the buffer exactly once


def test_weight_decay_parameters_come_first_in_their_bucket():
    bucket = [("norm.weight", (4,)), ("dense.weight", (2, 3)), ("dense.bias", (2,)), ("proj.weight", (1, 5))]
    (span,) = lay_out([bucket]).buckets
    assert [p.name for p in span.params] == ["dense.weight", "proj.weight", "norm.weight", "dense.bias"]
    assert [(p.start, p.end) for p in span.params] == [(0, 6), (6, 11), (11, 15), (15, 17)]
    assert span.decay_end == 11
    assert is_decay((2, 3)) and not is_decay((7,))
    (no_decay,) = lay_out([[("bias", (3,))]]).buckets
    assert no_decay.decay_end == no_decay.start


def test_empty_buckets_are_skipped_and_no_parameters_is_an_error():
    layout = lay_out([[], [("w", (2, 2))], []])
    assert [s.index for s in layout.buckets] == [0]
    with pytest.raises(ValueError, match="no trainable parameters"):
        lay_out([[]])


def test_buckets_fill_up_to_their_size_and_the_tied_embedding_gets_its_own():
    named = [("h.2.w", (10,)), ("h.1.w", (10,)), (TIED_EMBEDDING, (2, 4)), ("h.0.w", (10,)), ("pos", (5,))]
    names = [[n for n, _ in b] for b in split_into_buckets(named, bucket_size=20)]
    assert names == [["h.2.w", "h.1.w"], [TIED_EMBEDDING, "h.0.w", "pos"]]  # a bucket closes once >= 20
    names = [[n for n, _ in b] for b in split_into_buckets(named, bucket_size=20, own_bucket=(TIED_EMBEDDING,))]
    assert names == [["h.2.w", "h.1.w"], [TIED_EMBEDDING], ["h.0.w", "pos"]]


def test_stage3_buckets_are_one_per_layer_plus_the_embedding_and_the_rest():
    named = [("final_layernorm.bias", (4,)), ("layers.1.mlp.weight", (4, 4)), ("layers.1.ln.bias", (4,)),
             ("layers.0.mlp.weight", (4, 4)), ("embedding.position_embeddings.weight", (8, 4)),
             ("embedding.word_embeddings.weight", (16, 4))]
    names = [[n for n, _ in b] for b in layer_buckets(named)]
    assert names == [["final_layernorm.bias", "embedding.position_embeddings.weight"],
                     ["layers.1.mlp.weight", "layers.1.ln.bias"], ["layers.0.mlp.weight"],
                     ["embedding.word_embeddings.weight"]]


def test_parallelize_on_one_rank_puts_the_parameters_in_the_buffer_as_laid_out():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    same, buffer, fully_sharded = parallelize(model, ShardingPlan())
    assert same is model and fully_sharded is None  # one replica: nothing to wrap
    (span,) = buffer.layout.buckets  # reverse order, weight decay first
    assert [p.name for p in span.params] == ["0.weight", "1.bias", "1.weight", "0.bias"]
    params = dict(model.named_parameters())
    for p in span.params:
        view = buffer.param_data[p.start:p.end]
        assert params[p.name].data_ptr() == view.data_ptr() and torch.equal(params[p.name].flatten(), view)


# ---------------------------------------------------------------- plan


def _grid(tp: int = 1, pp: int = 1, dp: int = 1, sharding: int = 1) -> ParallelState:
    """Rank 0 of a grid whose groups are stand-ins named like the groups (the plan only looks them up)."""
    groups = {name: f"<{name}>" for name in GROUP_NAMES}
    return ParallelState(tp * pp * dp * sharding, 0, tp, pp, dp, sharding, 0, 0, 0, 0, groups, {})


def _plan(ps: ParallelState, *flags: str) -> ShardingPlan:
    return plan_sharding(parse_config(["--mock-data", *flags]), ps)


def test_without_a_sharding_group_the_stage_is_1():
    plan = _plan(_grid(dp=2), "--sharding-stage", "3")
    assert plan.stage == 1 and not plan.meta_init and not plan.shards_grads and not plan.shards_params
    assert plan.sharding_group is None and plan.replica_group is None
    assert plan.data_parallel_group == "<data_parallel>" and plan.model_parallel_group is None
    single = _plan(_grid())
    assert single.data_parallel_group is None and single.stage == 1
    assert sharding_stage(1, 3) == 1 and sharding_stage(4, 3) == 3


def test_stage3_builds_on_the_meta_device_and_reduces_every_micro_batch():
    plan = _plan(_grid(sharding=2), "--sharding", "2", "--sharding-stage", "3")
    assert plan.stage == 3 and plan.meta_init and plan.shards_params and plan.shards_grads
    assert plan.every_micro_batch and not plan.keep_gathered and plan.own_bucket == ()
    assert plan.sharding_group == "<sharding>" and plan.replica_group is None


def test_stage3_with_pipelining_keeps_the_stage_gathered_and_the_tied_embedding_apart():
    plan = _plan(_grid(pp=2, sharding=2), "--sharding", "2", "--sharding-stage", "3", "--pp", "2")
    assert plan.keep_gathered and not plan.every_micro_batch
    assert plan.own_bucket == (TIED_EMBEDDING,) and plan.model_parallel_group == "<model_parallel>"
    stage1 = _plan(_grid(pp=2, sharding=2), "--sharding", "2", "--sharding-stage", "1", "--pp", "2")
    assert stage1.own_bucket == ()  # all-reduced gradients: every slice is whole on both stages


def test_stage2_with_replicas_and_offload():
    plan = _plan(_grid(dp=2, sharding=2), "--sharding", "2", "--sharding-stage", "2", "--sharding-offload")
    assert plan.stage == 2 and plan.shards_grads and not plan.shards_params and not plan.meta_init
    assert plan.replica_group == "<dp>" and plan.offload and not plan.every_micro_batch
    stage1 = _plan(_grid(dp=2, sharding=2), "--sharding", "2", "--sharding-stage", "1")
    assert stage1.replica_group is None and stage1.data_parallel_group == "<data_parallel>"


def test_bucket_size_and_overlap_come_from_the_config():
    plan = _plan(_grid(dp=2), "--bucket-size-mb", "1", "--overlap-grad-reduce")
    assert plan.bucket_size == 2**20 // 4 and plan.overlap
