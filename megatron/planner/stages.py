"""Decoder layers per model chunk of each pipeline stage, and the stages worth evaluating."""

from __future__ import annotations

import functools

from megatron.config import Config
from megatron.config.layer_split import rank_chunks


def stage_chunks(config: Config, stage: int) -> tuple[int, ...]:
    """Decoder layers of each model chunk of a pipeline stage."""
    d = config.distributed
    return _chunks(config.model.num_layers, d.pp_degree, d.virtual_pp_degree, d.pipeline_partition, stage)


@functools.lru_cache(maxsize=4096)
def _chunks(layers: int, pp: int, vpp: int, partition: str, stage: int) -> tuple[int, ...]:
    return tuple(len(chunk) for chunk, _, _ in rank_chunks(layers, pp, vpp, partition, stage))


def representative_stages(config: Config) -> list[int]:
    """The first stage of each distinct chunk signature, and the last stage (the LM head)."""
    d = config.distributed
    return list(_representatives(config.model.num_layers, d.pp_degree, d.virtual_pp_degree, d.pipeline_partition))


@functools.lru_cache(maxsize=4096)
def _representatives(layers: int, pp: int, vpp: int, partition: str) -> tuple[int, ...]:
    seen, stages = set(), []
    for stage in range(pp):
        key = _chunks(layers, pp, vpp, partition, stage)
        if stage == 0 or stage == pp - 1 or key not in seen:
            stages.append(stage)
        seen.add(key)
    return tuple(stages)
