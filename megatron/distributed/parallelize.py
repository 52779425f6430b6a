"""The one place that decides which ranks reduce which gradients, and applies it.

``plan_sharding(config, ps)`` reads the configuration and the rank grid once and returns a
``ShardingPlan``: the sharding stage in effect, the process groups, and every consequence of the
stage (meta-device initialisation, the bucket cut, per-micro-batch reduction, ...). Everything
else (``build_model``, ``parallelize``, the optimizer, the memory accounting) reads the plan.

| stage | gradients | parameters |
| --- | --- | --- |
| 1 (also: no sharding) | all-reduced over every data-parallel rank (dp x sharding) | full on every rank |
| 2 | reduce-scattered over the sharding group, shards all-reduced over the dp replicas | full |
| 3 | as stage 2, after every micro-batch (without pipelining) | ``FullyShardedParameters`` |

**Experts** (parameters marked ``expert_parallel``, ``megatron.moe``) are held by the expert-parallel ranks,
so their gradients are summed over the expert-data-parallel group (``edp``: the ranks holding the same experts)
instead, in buckets of their own: all-reduced over edp unsharded; with a sharded optimizer (any stage), sharded
over all of edp (as Megatron-LM's distributed optimizer shards the expert states over the expert data-parallel
ranks), their gradients reduce-scattered from stage 2 and their parameters sharded at stage 3 likewise. Each
bucket carries its groups (``BucketGroups``); everything downstream reads them from the bucket.

``parallelize(model, plan)`` lays out and builds the ``ParamAndGradBuffer`` and installs the
hooks: the data-parallel (or fully-sharded) wrapper the model is trained through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from megatron import parallel_state
from megatron.config.schema import Config
from megatron.config.schema_model import shared_embedding_names
from megatron.distributed.bucket import BucketGroups
from megatron.distributed.buffer_layout import lay_out, layer_buckets, split_into_buckets
from megatron.distributed.data_parallel import DataParallel
from megatron.distributed.fully_sharded import FullyShardedParameters
from megatron.distributed.param_and_grad_buffer import ParamAndGradBuffer
from megatron.distributed.sharding_rule import sharding_stage, shards_grads, shards_params
from megatron.parallel_state import ParallelState

DEFAULT_BUCKET_SIZE = 40_000_000  # elements


@dataclass(frozen=True)
class ShardingPlan:
    """How this rank's model is data-parallel and sharded. The defaults: one rank, nothing sharded.

    ``stage``: the stage in effect (``sharding_stage``); ``sharding_group``: ZeRO over these ranks (None:
    no sharding); ``replica_group``: the data-parallel replicas of the sharding group whose gradient
    shards are all-reduced (HSDP, stages 2 and 3; with context parallelism the cp ranks too: dp x cp);
    ``data_parallel_group``: every rank whose gradients are summed (dp x sharding x cp; the token count and
    the stage-1 all-reduce);
    ``model_parallel_group``: tp x pp, over which the gradient norm is summed. ``meta_init``: built on
    the meta device, initialised straight into the shards (stage 3). ``offload``: masters and AdamW
    states on the CPU. ``overlap``: reduce buckets during the backward. ``every_micro_batch``: reduce
    after every micro-batch (stage 3 without pipelining). ``keep_gathered``: stage 3 with pipelining,
    parameters gathered once per step. ``own_bucket``: names that get a bucket of their own (the tied
    embedding, whose slices must agree on the first and last stages). ``bucket_size``: elements. ``grad_dtype``: the
    gradient buffers' dtype, in which micro-batches accumulate and every reduction runs (fp32; bf16 with
    ``grad_reduce_in_bf16``)."""

    stage: int = 1
    sharding_group: dist.ProcessGroup | None = None
    replica_group: dist.ProcessGroup | None = None
    data_parallel_group: dist.ProcessGroup | None = None
    model_parallel_group: dist.ProcessGroup | None = None
    meta_init: bool = False
    offload: bool = False
    overlap: bool = False
    every_micro_batch: bool = False
    keep_gathered: bool = False
    own_bucket: tuple[str, ...] = ()
    bucket_size: int = DEFAULT_BUCKET_SIZE
    first_replica: bool = True  # this rank holds the first copy of its dense shard (``ParallelState.writes_shard``)
    expert_group: dist.ProcessGroup | None = None  # edp: the ranks holding the same experts (None: one rank)
    expert_first_replica: bool = True
    shard_experts: bool = False  # a sharded optimizer: the expert states sharded over all of edp
    grad_dtype: torch.dtype = torch.float32
    fp32_accumulation: bool = False  # a bf16 reduce-scatter summed in fp32 (Bucket.fp32_accumulation)

    @property
    def shards_grads(self) -> bool:
        return shards_grads(self.stage)

    @property
    def shards_params(self) -> bool:
        return shards_params(self.stage)

    def bucket_groups(self, expert: bool) -> BucketGroups:
        """The groups of a dense or an expert bucket."""
        if expert:
            return BucketGroups(reduce=self.expert_group, sharding=self.expert_group if self.shard_experts else None,
                                first_replica=self.expert_first_replica)
        return BucketGroups(reduce=self.sharding_group if self.shards_grads else self.data_parallel_group,
                            sharding=self.sharding_group, replica=self.replica_group,
                            first_replica=self.first_replica)


def plan_sharding(config: Config, ps: ParallelState) -> ShardingPlan:
    """The plan for ``config`` on this rank of the grid ``ps`` (no communication: groups are looked up)."""
    d = config.distributed
    stage = sharding_stage(ps.shard_group_size, d.sharding.sharding_stage)
    pipelined = ps.pp_size > 1
    return ShardingPlan(
        stage=stage,
        sharding_group=ps.group("sharding") if ps.shard_group_size > 1 else None,
        replica_group=ps.group("dp") if stage >= 2 and ps.replica_size > 1 else None,
        data_parallel_group=ps.group("data_parallel") if ps.gradient_sum_size > 1 else None,
        model_parallel_group=ps.group("model_parallel") if ps.tp_size * ps.pp_size > 1 else None,
        meta_init=stage == 3,
        offload=d.sharding.sharding_offload,
        overlap=bool(d.overlap_grad_reduce),
        every_micro_batch=stage == 3 and not pipelined,
        keep_gathered=stage == 3 and pipelined,
        own_bucket=shared_embedding_names(config.model) if stage >= 2 and pipelined else (),
        bucket_size=int(d.bucket_size_mb * 2**20 / (2 if config.mix_precision.grad_reduce_in_bf16 else 4)),
        first_replica=ps.writes_shard,
        # experts: the edp group even of one rank when sharded (a reduce-scatter over one rank fills the shard)
        expert_group=ps.group("edp") if ps.edp_size > 1 or (stage >= 2 and ps.world_size > 1) else None,
        expert_first_replica=ps.shard_group_size > 1 or ps.edp_rank == 0,
        shard_experts=ps.shard_group_size > 1,
        grad_dtype=torch.bfloat16 if config.mix_precision.grad_reduce_in_bf16 else torch.float32,
        fp32_accumulation=d.ddp_reduce_scatter_with_fp32_accumulation,
    )


def counts_once(p: nn.Parameter, bucket) -> bool:
    """Whether this rank holds the copy of ``p`` (in ``bucket``) that counts once over all ranks: the first
    replica of the bucket's shard, a tensor-parallel shard or else the first tensor-parallel rank (the first
    expert-tensor-parallel rank for an expert), and never the last pipeline stage's copy of the tied embedding.
    Checkpoints write the same copies."""
    ps = parallel_state.get()
    first = ps.etp_rank == 0 if getattr(p, "expert_parallel", False) else ps.tp_rank == 0
    return (bucket.groups.first_replica and (getattr(p, "tensor_model_parallel", False) or first)
            and not getattr(p, "tied_copy", False))


class Parallelized(NamedTuple):
    model: nn.Module  # to train: the data-parallel wrapper, or the model itself on one replica
    buffer: ParamAndGradBuffer
    fully_sharded: FullyShardedParameters | None  # stage 3's gather/free manager


def build_buffer(model: nn.Module, plan: ShardingPlan) -> ParamAndGradBuffer:
    """The parameter and gradient buffer of ``model``'s trainable parameters, laid out by the plan:
    reverse parameter order (the order the backward produces gradients), cut into buckets of
    ``bucket_size`` (stage 3: one per decoder layer), sharded over the sharding group."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad][::-1]
    position = {name: i for i, (name, _) in enumerate(named)}
    buckets: list[tuple[list, bool]] = []
    for expert in (False, True):  # the experts' buckets apart: other ranks reduce and shard them
        shapes = [(name, tuple(p.shape)) for name, p in named if getattr(p, "expert_parallel", False) == expert]
        if shapes:
            cut = layer_buckets(shapes) if plan.shards_params else split_into_buckets(shapes, plan.bucket_size,
                                                                                       plan.own_bucket)
            buckets += [(members, expert) for members in cut]
    buckets.sort(key=lambda bucket: position[bucket[0][0][0]])  # in the order the backward fills them
    groups = [plan.bucket_groups(expert) for _, expert in buckets]
    shardings = [_size_and_rank(g.sharding) for g in groups]
    buffer = ParamAndGradBuffer(lay_out([members for members, _ in buckets], shardings=shardings), dict(named),
                                grad_dtype=plan.grad_dtype, shard_grads=plan.shards_grads,
                                shard_params=plan.shards_params, groups=groups)
    for bucket in buffer.buckets:
        bucket.fp32_accumulation = plan.fp32_accumulation
    return buffer


def _size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)


def parallelize(model: nn.Module, plan: ShardingPlan) -> Parallelized:
    """Build ``model``'s buffer and install the hooks of the plan: stage 3's gather/free hooks, and the
    gradient reduction (a reduce-scatter over the sharding group from stage 2, an all-reduce over the
    data-parallel group otherwise, nothing on one replica)."""
    buffer = build_buffer(model, plan)
    fully_sharded = None
    if plan.shards_params:
        chunks = list(model) if isinstance(model, nn.ModuleList) else [model]
        fully_sharded = FullyShardedParameters(chunks, buffer, keep_gathered=plan.keep_gathered)
    if plan.shards_grads:
        model = DataParallel(model, buffer, overlap=plan.overlap, reduce_scatter=True,
                             every_micro_batch=plan.every_micro_batch,
                             on_grads_done=fully_sharded.on_grads_done if fully_sharded else None)
    elif any(b.groups.reduce is not None for b in buffer.buckets):
        model = DataParallel(model, buffer, overlap=plan.overlap)
    return Parallelized(model, buffer, fully_sharded)


__all__ = ["DEFAULT_BUCKET_SIZE", "Parallelized", "ShardingPlan", "build_buffer", "counts_once", "parallelize",
           "plan_sharding"]
