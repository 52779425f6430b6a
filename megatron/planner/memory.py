"""The memory side of the planner: per device, the worst pipeline stage's model states, saved activations and
largest temporary (what ``megatron.memory.estimate(config, stage)`` adds up), and per rank on the host what
ZeRO offload keeps there.

Device memory: the model states of ``megatron/memory/model_states.py`` during a step (by the sharding plan's stage
rule), the saved activations of the micro-batches the schedule keeps in flight on that stage
(``activations.peak_activation_bytes``) and the largest temporary. Stages alike (same layer counts, neither
first nor last) are evaluated at the first of them, which holds the most micro-batches. The estimate is a lower
bound of the device's peak (no CUDA context, activation gradients or allocator slack).

Host memory (offload): the fp32 master weights, AdamW's two moments and the CPU copy of the gradient shard,
16 bytes per parameter of the rank's offloaded shard (its dense shard over the ZeRO group and its experts' over
the expert-data-parallel ranks), ``ModelStateBytes.cpu_total`` at the worst stage.

A planning run evaluates hundreds of thousands of layouts; every figure is cached in a dict the run passes
(``cache``) under the settings it depends on:

- model states (``model_states``): the layout without its micro-batch size, recompute, sequence parallelism or cp
  communication type (each of which multiplies the candidates), and the stage;
- one micro-batch's activations of a chunk (``stage_chunk_bytes``): ``_dims_key`` (tp, cp and its communication
  type, sp, ep, etp, micro-batch size, recompute) and the chunk's shape (which of its layers are MoE layers,
  whether it holds the embedding or the head), whatever pp and vpp cut it;
- a stage's largest temporary (``stage_temporary``): ``_dims_key`` and the set of its chunks' kinds of layers, of
  recomputed layers, and whether one holds the head;
- the schedule's walk (``peak_activations``): (pp, vpp, schedule, walked micro-batches, stage) and the chunk
  bytes up to a common factor.

``memory_terms`` adds them up and stops at the first lower bound over the limit (``search._Family`` calls it with
a validation family's figures, each computed once)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from megatron.config import Config
from megatron.config.validate_moe import moe_layer_flags
from megatron.memory import activations as act
from megatron.memory.model_states import rank_model_state_bytes, step_transient_bytes
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


def _dims_key(config: Config, kernel: str | None) -> tuple:
    """What a chunk's saved activations and a stage's temporaries depend on besides the chunk's own layers, in one
    planning run (the model is fixed): the layout's tp, cp and its communication type, sequence parallelism, ep,
    etp, micro-batch size and recompute settings; not pp, vpp, dp, sharding, offload or the micro-batches."""
    d = config.distributed
    return (d.mp_degree, d.context_parallel_size, d.cp_comm_type, d.sequence_parallel, d.expert_model_parallel_size,
            d.expert_tensor_parallel_size, config.batch_size.micro_batch_size, config.use_recompute,
            config.recompute_granularity, config.recompute_method, config.recompute_num_layers, kernel)


def _chunk_shape(config: Config, spec: tuple[range, bool, bool], cache: dict) -> tuple:
    """A model chunk as its activations see it: whether each of its layers is a MoE layer, and whether it holds
    the embedding (pre) and the head (post). ``chunk_terms`` reads the layers' indices only through those flags
    and the recompute plan, which counts within the chunk (the planner names no ``no_recompute_layers``), so
    chunks of one shape save the same bytes whatever the pipeline that cut them."""
    if "moe flags" not in cache:
        cache["moe flags"] = moe_layer_flags(config.model)
    flags = cache["moe flags"]
    layers, pre, post = spec
    return tuple(flags[i] for i in layers), pre, post


def stage_chunk_bytes(config: Config, stage: int, kernel: str | None, cache: dict) -> tuple[int, ...]:
    """Bytes one micro-batch saves on each model chunk of ``stage``. Cached by the stage's layout (pp, vpp, stage
    and ``_dims_key``) and, below that, each chunk's by (``_dims_key``, its ``_chunk_shape``): pipelines of
    different pp and vpp cut chunks of the same shapes, computed once."""
    d, dims = config.distributed, _dims_key(config, kernel)
    key = ("chunks", d.pp_degree, d.virtual_pp_degree, d.pipeline_partition, stage, dims)
    if key not in cache:
        per_chunk = []
        for c, spec in enumerate(act.chunk_specs(config, stage)):
            chunk_key = ("chunk bytes", dims, _chunk_shape(config, spec, cache))
            if chunk_key not in cache:
                cache[chunk_key] = act.activation_bytes_per_microbatch(config, stage, c, kernel)
            per_chunk.append(cache[chunk_key])
        cache[key] = tuple(per_chunk)
    return cache[key]


def _temporary_shape(config: Config, spec: tuple[range, bool, bool], cache: dict) -> tuple:
    """A model chunk as its temporaries see it: the kinds of its layers (MoE or not), the kinds of the layers it
    recomputes (all of them, or the first ``recompute_num_layers`` under the block method), and whether it holds
    the head. ``temporary_terms`` keeps the largest of each kind of buffer: the loss on the head's chunk, the
    expert dispatch if a layer is a MoE layer, and the recompute's, the most a recomputed layer saves beyond what
    its forward kept, which depends on the layer's kind and granularity, not on where it is or how many there
    are."""
    if "moe flags" not in cache:
        cache["moe flags"] = moe_layer_flags(config.model)
    flags = cache["moe flags"]
    layers, _, post = spec
    kinds = frozenset(flags[i] for i in layers)
    recomputed = kinds
    if config.use_recompute and config.recompute_method == "block":
        recomputed = frozenset(flags[i] for i in layers[:config.recompute_num_layers])
    return kinds, recomputed, post


def stage_temporary(config: Config, stage: int, kernel: str | None, cache: dict) -> int:
    """The largest temporary of ``stage``; cached by the stage's layout and, below that, by (``_dims_key``, the
    set of its chunks' ``_temporary_shape``): ``temporary_terms`` keeps the largest of each kind of buffer over
    the stage's chunks, which neither their order nor how many share a shape changes."""
    d, dims = config.distributed, _dims_key(config, kernel)
    key = ("temporaries", d.pp_degree, d.virtual_pp_degree, d.pipeline_partition, stage, dims)
    if key not in cache:
        shapes = frozenset(_temporary_shape(config, spec, cache) for spec in act.chunk_specs(config, stage))
        if ("temporary", dims, shapes) not in cache:
            cache["temporary", dims, shapes] = act.largest_temporary_bytes(config, stage, kernel)
        cache[key] = cache["temporary", dims, shapes]
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


def peak_activations(config: Config, stage: int, per_chunk: tuple[int, ...], cache: dict) -> int:
    """``activations.peak_activation_bytes``: per-chunk bytes times the micro-batches of each chunk in
    flight at the schedule's peak; the schedule walk cached by what it depends on: (pp, vpp, schedule, walked
    micro-batches, stage) and the chunks' bytes up to a common factor. The walk keeps the first set of
    micro-batches in flight whose weighted sum is the largest, and dividing every weight by their greatest
    common divisor leaves each comparison of two sums as it was (with one chunk, the weight is 1)."""
    d, m = config.distributed, walked_micro_batches(config)
    common = math.gcd(*per_chunk)
    weights = tuple(w // common for w in per_chunk) if common else per_chunk
    key = ("peak", d.pp_degree, d.virtual_pp_degree, d.pipeline_schedule, m, stage, weights)
    if key not in cache:
        walked = config
        if m != config.num_micro_batches:
            walked = copy_config(config)
            walked.batch_size.local_batch_size = m * config.batch_size.micro_batch_size
        cache[key] = act.in_flight_at_peak(walked, stage, list(weights))
    return sum(k * w for k, w in zip(cache[key], per_chunk))


def layout_memory(config: Config, limit_bytes: float, kernel: str | None = None, cache: dict | None = None,
                  exact_below: float = float("inf")) -> MemoryTerms:
    """Model states + peak saved activations + the largest temporary (``megatron.memory.estimate``'s
    sum) at the worst stage, and the host bytes of a rank (``memory_terms``). ``cache``: figures already computed
    in this planning run."""
    cache = {} if cache is None else cache
    states = {s: model_states(config, s, cache) for s in representative_stages(config)}
    return memory_terms(states, lambda s: stage_chunk_bytes(config, s, kernel, cache),
                        lambda s: stage_temporary(config, s, kernel, cache),
                        lambda s, per_chunk: peak_activations(config, s, per_chunk, cache), limit_bytes, exact_below)


def states_too_large(states: dict[int, tuple[int, int, int]], limit_bytes: float) -> MemoryTerms | None:
    """The lower bound ``memory_terms`` returns where the model states alone, between steps, exceed
    ``limit_bytes`` on a stage (whatever the activations); None where they do not."""
    heaviest = max(states, key=lambda s: states[s][1])
    if states[heaviest][0] <= limit_bytes:
        return None
    host = max(states[s][2] for s in states)
    return MemoryTerms(heaviest, states[heaviest][1], None, None, states[heaviest][1], host)


def memory_terms(states: dict[int, tuple[int, int, int]], chunks: Callable[[int], tuple[int, ...]],
                 temporary: Callable[[int], int], peak: Callable[[int, tuple[int, ...]], int], limit_bytes: float,
                 exact_below: float = float("inf"), states_fit: bool = False) -> MemoryTerms:
    """The worst of the representative stages ``states`` holds (``model_states`` of each), given a stage's bytes
    per micro-batch and chunk (``chunks``), its largest temporary (``temporary``) and its peak saved activations
    (``peak``, of the stage and its chunk bytes), each asked for only when needed.

    Lower bounds, returned (``activations`` None) where they already exceed ``limit_bytes`` and the schedule is
    not walked: the model states between steps; then each stage's states during a step, its largest chunk and
    its temporary. The temporary is computed only where the bound without it does not already exceed the limit,
    or where that bound is below ``exact_below`` (the search's smallest requirement so far: a layout that does
    not fit matters only if it needs less, and its requirement is then the full bound's). ``states_fit``: the
    caller has found ``states_too_large`` None."""
    too_large = None if states_fit else states_too_large(states, limit_bytes)
    if too_large is not None:
        return too_large
    host = max(held[2] for held in states.values())
    per_chunk, floors, low = {}, {}, None  # low: the first stage with the largest floor
    for s, (_, during, _) in states.items():
        per_chunk[s] = stage_chunks = chunks(s)
        floors[s] = floor = during + max(stage_chunks)
        if low is None or floor > floors[low]:
            low = s
    if floors[low] > limit_bytes and floors[low] >= exact_below:
        return MemoryTerms(low, states[low][1], None, None, floors[low], host)
    temporaries, over = {}, None
    for s in states:
        temporaries[s] = temporary(s)
        if over is None or floors[s] + temporaries[s] > floors[over] + temporaries[over]:
            over = s
    if floors[over] + temporaries[over] > limit_bytes:
        return MemoryTerms(over, states[over][1], None, None, floors[over] + temporaries[over], host)
    worst = None
    for s in states:
        activations = peak(s, per_chunk[s])
        terms = MemoryTerms(s, states[s][1], activations, temporaries[s],
                            states[s][1] + activations + temporaries[s], host)
        worst = terms if worst is None or terms.total > worst.total else worst
    return worst
