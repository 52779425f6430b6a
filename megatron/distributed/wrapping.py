"""Wrap a model for data parallelism and ZeRO, from the configuration: the one place that decides
which ranks reduce which gradients.

| sharding stage | gradients | parameters |
| --- | --- | --- |
| none, 1 | all-reduced over every data-parallel rank (dp x sharding) | full on every rank |
| 2 | reduce-scattered over the sharding group, shards all-reduced over the dp replicas | full |
| 3 | as stage 2, after every micro-batch (without pipelining) | ``FullyShardedParameters`` |
"""

from __future__ import annotations

from torch import nn

from megatron.config.schema import Config
from megatron.distributed.data_parallel import DataParallel
from megatron.distributed.fully_sharded import FullyShardedParameters
from megatron.optimizer import MixedPrecisionOptimizer, build_optimizer
from megatron.parallel_state import ParallelState


def setup_optimizer(model: nn.Module, config: Config,
                    ps: ParallelState) -> tuple[nn.Module, MixedPrecisionOptimizer, FullyShardedParameters | None]:
    """The optimizer over ``model`` (its norm reduced over the model-parallel group, its states sharded
    over the sharding group) and the model wrapped for the gradient sync: (model to train, optimizer,
    the stage-3 parameter manager or None)."""
    model_parallel = ps.group("model_parallel") if ps.tp_size * ps.pp_size > 1 else None
    sharding = ps.group("sharding") if ps.sharding_size > 1 else None
    optimizer = build_optimizer(model, config, model_parallel, sharding)
    model, fully_sharded = wrap_data_parallel(model, optimizer, config, ps)
    return model, optimizer, fully_sharded


def wrap_data_parallel(model: nn.Module, optimizer: MixedPrecisionOptimizer, config: Config,
                       ps: ParallelState) -> tuple[nn.Module, FullyShardedParameters | None]:
    """(the model to train, the stage-3 parameter manager or None)."""
    d = config.distributed
    stage = optimizer.stage if optimizer.sharding_group is not None else 1
    fully_sharded = None
    if stage == 3:
        chunks = list(model) if isinstance(model, nn.ModuleList) else [model]
        fully_sharded = FullyShardedParameters(chunks, optimizer.buffer, optimizer.sharding_group,
                                               keep_gathered=ps.pp_size > 1)
    if stage >= 2:
        model = DataParallel(model, optimizer.buffer, optimizer.sharding_group, overlap=d.overlap_grad_reduce,
                             reduce_scatter=True, replica_group=ps.group("dp") if ps.dp_size > 1 else None,
                             every_micro_batch=stage == 3 and ps.pp_size == 1,
                             on_grads_done=fully_sharded.on_grads_done if fully_sharded else None)
    elif ps.data_parallel_size > 1:
        model = DataParallel(model, optimizer.buffer, ps.group("data_parallel"), overlap=d.overlap_grad_reduce)
    return model, fully_sharded


__all__ = ["setup_optimizer", "wrap_data_parallel"]
