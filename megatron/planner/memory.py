"""The memory side of the planner: per device, the worst pipeline stage's model states, saved activations and
largest temporary (what ``megatron.memory.estimate(config, stage)`` adds up), and per rank on the host what
ZeRO offload keeps there.

Device memory: the model states of ``megatron/optimizer/memory.py`` during a step (by the sharding plan's stage
rule), the saved activations of the micro-batches the schedule keeps in flight on that stage
(``activations.peak_activation_bytes``) and the largest temporary. Stages alike (same layer counts, neither
first nor last) are evaluated at the first of them, which holds the most micro-batches. The estimate is a lower
bound of the device's peak (no CUDA context, activation gradients or allocator slack).

Host memory (offload): the fp32 master weights, AdamW's two moments and the CPU copy of the gradient shard,
16 bytes per parameter of the rank's offloaded shard (its dense shard over the ZeRO group and its experts' over
the expert-data-parallel ranks), ``ModelStateBytes.cpu_total`` at the worst stage.

A planning run evaluates tens of thousands of layouts; every figure is cached in a dict the run passes
(``cache``) under the settings it depends on: the model states under the layout without its micro-batch size,
recompute or cp communication type (each of which multiplies the candidates), one micro-batch's activations
without dp, sharding or offload, the schedule's walk by (pp, vpp, micro-batches, stage, per-chunk bytes)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config import Config
from megatron.memory import activations as act
from megatron.optimizer.memory import rank_model_state_bytes, step_transient_bytes
from megatron.planner.layout import copy_config
from megatron.planner.stages import representative_stages


@dataclass(frozen=True)
class MemoryTerms:
    """Bytes per device at the worst stage. Activations and temporaries are None where a lower bound
    already exceeded the limit (the schedule was not walked); ``total`` is then that bound. ``host``: bytes
    one rank keeps on the host (offload), at the stage keeping most."""

    stage: int
    model_states: int
    activations: int | None
    temporaries: int | None
    total: int
    host: int = 0

    @property
    def estimated(self) -> bool:
        return self.activations is not None


def _states_key(config: Config, stage: int) -> tuple:
    """What a stage's model states depend on in one planning run (the model is fixed): the layout without its
    micro-batch size, recompute, sequence parallelism or cp communication type."""
    d = config.distributed
    s = d.sharding
    return ("states", d.mp_degree, d.pp_degree, d.virtual_pp_degree, d.pipeline_partition, d.context_parallel_size,
            d.dp_degree, s.sharding_degree, s.sharding_stage, s.sharding_offload, d.use_distributed_optimizer,
            d.expert_model_parallel_size, d.expert_tensor_parallel_size, stage)


def model_states(config: Config, stage: int, cache: dict) -> tuple[int, int, int]:
    """(between steps, during a step) device bytes of a stage's model states, memory.py's as ``estimate``
    counts them, and the host bytes of a rank (offload); cached."""
    key = _states_key(config, stage)
    if key not in cache:
        states = rank_model_state_bytes(config, stage)
        held = states.device_total
        cache[key] = (held, held + step_transient_bytes(config, stage), states.cpu_total)
    return cache[key]


def _chunk_key(config: Config, stage: int, kernel: str | None) -> tuple:
    """What one micro-batch's saved activations and the temporaries of a stage depend on in one planning
    run (the model is fixed): not dp, sharding, offload or the number of micro-batches."""
    d = config.distributed
    return ("chunks", d.mp_degree, d.context_parallel_size, d.cp_comm_type, d.pp_degree, d.virtual_pp_degree,
            d.sequence_parallel, d.pipeline_partition, d.expert_model_parallel_size, d.expert_tensor_parallel_size,
            config.batch_size.micro_batch_size, config.use_recompute, config.recompute_granularity,
            config.recompute_method, config.recompute_num_layers, stage, kernel)


def _stage_activations(config: Config, stage: int, kernel: str | None, cache: dict) -> tuple[tuple[int, ...], int]:
    """(bytes one micro-batch saves on each model chunk of ``stage``, the largest temporary), cached."""
    key = _chunk_key(config, stage, kernel)
    if key not in cache:
        chunks = range(len(act.chunk_specs(config, stage)))
        cache[key] = (tuple(act.activation_bytes_per_microbatch(config, stage, c, kernel) for c in chunks),
                      act.largest_temporary_bytes(config, stage, kernel))
    return cache[key]


def walked_micro_batches(config: Config) -> int:
    """The micro-batches whose interleaved schedule has the same peak as the step's: the warm-up only
    adds and the cool-down only removes activations, and the steady state repeats every pp x vpp
    forwards, so a steady state of two periods after the longest warm-up shows every held set. The
    tables of a 1536-micro-batch step take seconds to build; this keeps them small."""
    d, m = config.distributed, config.num_micro_batches
    pp, vpp = d.pp_degree, d.virtual_pp_degree
    if vpp == 1:
        return m
    warm_up = 2 * (pp - 1) + (vpp - 1) * pp
    enough = -(-(warm_up + 2 * pp * vpp) // (vpp * pp)) * pp  # a multiple of pp, as the schedule needs
    return min(m, enough)


def _peak_activations(config: Config, stage: int, per_chunk: tuple[int, ...], cache: dict) -> int:
    """``activations.peak_activation_bytes``: per-chunk bytes times the micro-batches of each chunk in
    flight at the schedule's peak; the schedule walk cached by what it depends on."""
    d, m = config.distributed, walked_micro_batches(config)
    key = ("peak", d.pp_degree, d.virtual_pp_degree, d.pipeline_schedule, m, stage, per_chunk)
    if key not in cache:
        walked = config
        if m != config.num_micro_batches:
            walked = copy_config(config)
            walked.batch_size.local_batch_size = m * config.batch_size.micro_batch_size
        cache[key] = act.in_flight_at_peak(walked, stage, list(per_chunk))
    return sum(k * w for k, w in zip(cache[key], per_chunk))


def layout_memory(config: Config, limit_bytes: float, kernel: str | None = None,
                  cache: dict | None = None) -> MemoryTerms:
    """Model states + peak saved activations + the largest temporary (``megatron.memory.estimate``'s
    sum) at the worst stage, and the host bytes of a rank. Where a stage's lower bound (its model states, one
    micro-batch's largest chunk and its temporary) already exceeds ``limit_bytes`` the schedule is not walked
    and that bound is returned (``activations`` None). ``cache``: figures already computed in this planning
    run."""
    cache = {} if cache is None else cache
    stages = representative_stages(config)
    states = {s: model_states(config, s, cache) for s in stages}
    host = max(states[s][2] for s in stages)
    heaviest = max(stages, key=lambda s: states[s][1])
    if states[heaviest][0] > limit_bytes:
        return MemoryTerms(heaviest, states[heaviest][1], None, None, states[heaviest][1], host)
    chunks = {s: _stage_activations(config, s, kernel, cache) for s in stages}
    bounds = {s: states[s][1] + max(chunks[s][0]) + chunks[s][1] for s in stages}
    over = max(stages, key=lambda s: bounds[s])
    if bounds[over] > limit_bytes:
        return MemoryTerms(over, states[over][1], None, None, bounds[over], host)
    worst = None
    for s in stages:
        activations = _peak_activations(config, s, chunks[s][0], cache)
        terms = MemoryTerms(s, states[s][1], activations, chunks[s][1], states[s][1] + activations + chunks[s][1],
                            host)
        worst = terms if worst is None or terms.total > worst.total else worst
    return worst
