"""The ZeRO stage rule, in the standard library only (the memory estimate and the layout planner read it without
importing torch): which stage is in effect, and which states that stage shards.

| stage in effect | optimizer states + fp32 masters | gradients | parameters |
| --- | --- | --- | --- |
| 1 (also: a sharding group of one rank) | sharded | full | full |
| 2 | sharded | sharded | full |
| 3 | sharded | sharded | sharded |

``parallelize.ShardingPlan`` applies it to a run; ``memory.model_states`` counts its bytes.
"""

from __future__ import annotations


def sharding_stage(sharding_degree: int, stage: int) -> int:
    """The stage in effect: ``stage`` over a sharding group of more than one rank; otherwise 1 (the
    whole optimizer state on every rank, gradients all-reduced)."""
    return stage if sharding_degree > 1 else 1


def shards_grads(stage: int) -> bool:
    return stage >= 2


def shards_params(stage: int) -> bool:
    return stage == 3
