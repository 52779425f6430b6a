"""The layout planner: every valid parallel layout of a model on N devices, whether it fits in their
memory, and an estimated step time (a model, not a measurement), every term kept.

A layout is (tp, cp and its communication type, pp, vpp, dp, sharding degree and stage, offload,
recompute, micro-batch size; for a MoE model the expert-parallel size ep and the experts' tensor-parallel size
etp, the model's tp or 1); the global batch is the configuration's. Within a pipeline stage the tp x cp x dp x
sharding ranks are re-cut for the experts as etp x ep x edp: ep divides the experts and ep x etp the stage's
ranks. Sequence parallelism is on
whenever tp > 1 and divides each rank's share of the sequence: it moves the same bytes as tp alone (an
all-reduce is a reduce-scatter plus an all-gather) and keeps less activation memory, so it is never
worse here. Context parallelism (cp > 1, p2p / all_gather / a2a) cuts every sample over cp ranks: the
activations of a rank are those of ``s / cp`` tokens (``megatron.memory.activations``), the attention
exchanges keys and values (``time_model``); its sizes divide the devices and the sequence must divide
into 2 x cp chunks (x tp under sp); a2a needs heads and query groups divisible by tp x cp. Each candidate
is applied to a copy of the configuration and checked by ``megatron.config.validate``; a ``ConfigError``
drops it.

Memory (per device, the worst pipeline stage): what ``megatron.memory.estimate(config, stage)`` adds up,
i.e. the model states of ``megatron/optimizer/memory.py`` during a step (by the sharding plan's stage
rule), the saved activations of the micro-batches the schedule keeps in flight on that stage
(``activations.peak_activation_bytes``) and the largest temporary. Stages alike (same layer counts,
neither first nor last) are evaluated at the first of them, which holds the most micro-batches. The
estimate is a lower bound of the device's peak (no CUDA context, activation gradients or allocator
slack): a layout fits when it is within the device memory less ``headroom`` (10%).

Time: an estimate, see ``megatron.planner.time_model``.

Ranking: by step time, then the larger micro-batch (GPU kernels are more efficient on larger matmuls;
not in the model), then the smaller memory. ``non_dominated`` drops the layouts another one beats or
equals on all three.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from itertools import product

from megatron.config import Config, ConfigError, validate
from megatron.distributed.parallelize import sharding_stage
from megatron.memory import activations as act
from megatron.optimizer.memory import rank_model_state_bytes, step_transient_bytes
from megatron.planner.stages import representative_stages
from megatron.planner.time_model import GIB, Hardware, TimeTerms, layout_time

MIN_CP_TOKENS = 1024  # context parallelism tried while each rank keeps at least this many tokens of a sample


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    vpp: int
    dp: int
    sharding_degree: int
    sharding_stage: int
    offload: bool
    recompute: str  # off, core_attn, only_attn, full, or block: full on block_layers of each model chunk
    micro_batch_size: int
    sequence_parallel: bool = False
    block_layers: int = 0
    cp: int = 1  # context-parallel size
    cp_comm: str = "p2p"  # its communication type (p2p with cp 1)
    ep: int = 1  # expert-parallel size (a MoE model)
    etp: int = 0  # the experts' tensor-parallel size; 0: tp's
    moe: bool = False  # a MoE model: its flags name ep and etp

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    def describe(self) -> str:
        """``tp2 cp2:p2p pp4 vpp2 dp1 ep4 etp1 zero2x4 offload mb1 rc:full``: what is not the default is named
        (``zero2x4``: stage 2 over 4 ranks, the sharding degree x cp when the shards span the cp ranks)."""
        parts = [f"tp{self.tp}"] + ([f"cp{self.cp}:{self.cp_comm}"] if self.cp > 1 else []) + [f"pp{self.pp}"]
        parts += ([f"vpp{self.vpp}"] if self.vpp > 1 else []) + [f"dp{self.dp}"]
        parts += ([f"ep{self.ep}"] if self.ep > 1 else []) + ([f"etp{self.etp}"] if self.etp else [])
        if self.sharding_degree > 1:
            parts.append(f"zero{self.sharding_stage}x{self.sharding_degree * self.cp}")
        if self.offload:
            parts.append("offload")
        parts.append(f"mb{self.micro_batch_size}")
        if self.recompute != "off":
            parts.append("rc:" + (f"block{self.block_layers}" if self.recompute == "block" else self.recompute))
        return " ".join(parts)

    def flags(self) -> str:
        """The command-line flags of pretrain_gpt.py that run this layout, given after the configuration's own
        (``-c config.yaml FLAGS``): every setting of the layout is explicit, the ones it turns off too (a
        configuration's ``use_recompute: True`` or ``sharding_degree: 8`` would otherwise stay)."""
        out = [f"--tp {self.tp}", f"--context-parallel-size {self.cp}"]
        out += [f"--cp-comm-type {self.cp_comm}"] if self.cp > 1 else []
        out += [f"--pp {self.pp}", f"--vpp {self.vpp}", f"--dp {self.dp}"]
        if self.moe:
            out.append(f"--expert-model-parallel-size {self.ep} --expert-tensor-parallel-size {self.expert_tp}")
        out.append(f"--sharding {self.sharding_degree}"
                   + (f" --sharding-stage {self.sharding_stage}" if self.sharding_degree > 1 else ""))
        out += ["--sharding-offload" if self.offload else "--no-sharding-offload"]
        out += ["--sequence-parallel" if self.sequence_parallel else "--no-sequence-parallel"]
        out.append(f"--micro-batch-size {self.micro_batch_size}")
        if self.recompute == "block":
            out.append(f"--use-recompute --recompute-granularity full --recompute-method block "
                       f"--recompute-num-layers {self.block_layers}")
        elif self.recompute != "off":
            out.append(f"--use-recompute --recompute-granularity {self.recompute}")
        else:
            out.append("--no-use-recompute")
        return " ".join(out)

    def apply(self, base: Config) -> Config:
        """A copy of ``base`` (not validated) with this layout; the global batch and the rest kept."""
        c = _copy_config(base)
        d, b = c.distributed, c.batch_size
        d.mp_degree, d.pp_degree, d.virtual_pp_degree, d.dp_degree = self.tp, self.pp, self.vpp, self.dp
        d.sharding.sharding_degree, d.sharding.sharding_stage = self.sharding_degree, self.sharding_stage
        d.sharding.sharding_offload, d.use_distributed_optimizer = self.offload, False
        d.sequence_parallel = self.sequence_parallel
        d.context_parallel_size, d.cp_comm_type = self.cp, self.cp_comm
        d.expert_model_parallel_size, d.expert_tensor_parallel_size = self.ep, self.etp or None
        b.local_batch_size, b.micro_batch_size = None, self.micro_batch_size
        c.use_recompute = self.recompute != "off"
        c.recompute_granularity = None if self.recompute == "off" else "full" if self.recompute == "block" \
            else self.recompute
        c.recompute_method = "block" if self.recompute == "block" else None
        c.recompute_num_layers = self.block_layers if self.recompute == "block" else None
        c.no_recompute_layers = None
        c.device = "gpu"
        return c


def _copy_config(config):
    """A copy of a Config whose sections and lists are new objects (the leaves are immutable): a
    deepcopy's result at a fraction of its cost, which dominates a planning run."""
    new = copy.copy(config)
    sections, lists = _nested_fields(type(config))
    for name in sections:
        setattr(new, name, _copy_config(getattr(config, name)))
    for name in lists:
        value = getattr(config, name)
        if value is not None:
            setattr(new, name, list(value))
    return new


@functools.cache
def _nested_fields(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The section fields and the list-valued fields of a schema dataclass."""
    return (tuple(f.name for f in fields(cls) if "section" in f.metadata),
            tuple(f.name for f in fields(cls) if str(f.type).startswith("list")))


@dataclass(frozen=True)
class MemoryTerms:
    """Bytes per device at the worst stage. Activations and temporaries are None where a lower bound
    already exceeded the limit (the schedule was not walked); ``total`` is then that bound."""

    stage: int
    model_states: int
    activations: int | None
    temporaries: int | None
    total: int

    @property
    def estimated(self) -> bool:
        return self.activations is not None


@dataclass(frozen=True)
class Plan:
    layout: Layout
    memory: MemoryTerms
    time: TimeTerms | None  # None when it does not fit (not ranked)
    fits: bool

    def to_dict(self) -> dict:
        time = None if self.time is None else {**asdict(self.time), "step": self.time.step}
        return {"layout": {**asdict(self.layout), "name": self.layout.describe(), "flags": self.layout.flags()},
                "memory": asdict(self.memory), "time": time, "fits": self.fits}


@dataclass
class PlanResult:
    plans: list[Plan]  # the layouts that fit, best first
    considered: int = 0
    valid: int = 0
    smallest: Plan | None = None  # the valid layout needing least memory (what to report when none fits)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def recompute_options(num_layers: int, pp: int, vpp: int) -> list[tuple[str, int]]:
    """(granularity, block layers): off, core_attn, only_attn, full, and block with half of each model
    chunk's layers (when a chunk has at least two)."""
    chunk = -(-num_layers // (pp * vpp))
    options = [("off", 0), ("core_attn", 0), ("only_attn", 0), ("full", 0)]
    return options + ([("block", chunk // 2)] if chunk >= 2 else [])


def context_options(config: Config, tp: int, devices: int) -> list[tuple[int, str, bool]]:
    """(cp, communication type, sequence parallel) for a tensor-parallel size: cp 1, and each cp > 1
    dividing ``devices`` whose 2 x cp chunks (x tp under sp) divide the sequence, with p2p and all_gather
    (not with attention dropout, which they do not draw) and a2a where tp x cp divides the heads and query
    groups. What ``validate`` would refuse anyway, left out early: a search on many devices is mostly these.
    Only while each rank keeps at least ``MIN_CP_TOKENS`` tokens of a sample: the time model has no
    latency, which shorter exchanges would be dominated by (and a search on many devices would be mostly
    these too)."""
    seq, m = config.dataset.max_seq_len, config.model
    nq = m.num_attention_heads
    ng = m.num_query_groups if m.group_query_attention and m.num_query_groups else nq
    options = [(1, "p2p", tp > 1 and seq % tp == 0)]
    blockwise = [] if m.attention_probs_dropout_prob > 0 else ["p2p", "all_gather"]
    for cp in _divisors(devices)[1:]:
        if seq % (2 * cp) or seq // cp < MIN_CP_TOKENS:
            continue
        sp = tp > 1 and seq % (2 * cp * tp) == 0
        a2a = ["a2a"] if not nq % (tp * cp) and not ng % (tp * cp) else []
        options += [(cp, comm, sp) for comm in [*blockwise, *a2a]]
    return options


def expert_options(config: Config, tp: int, stage_ranks: int) -> list[tuple[int, int]]:
    """(ep, etp) of a MoE model whose pipeline stage has ``stage_ranks`` = tp x cp x dp x sharding ranks: etp the
    model's tp (0) or, under tp, 1; ep dividing the experts with ep x etp dividing the stage's ranks. (1, 0) for
    a dense model."""
    experts = config.model.num_experts
    if not experts:
        return [(1, 0)]
    return [(ep, etp) for etp in ((0, 1) if tp > 1 else (0,)) for ep in _divisors(experts)
            if not stage_ranks % (ep * (etp or tp))]


def candidate_layouts(config: Config, hw: Hardware, max_micro_batch: int = 8, max_vpp: int = 8) -> Iterator[Layout]:
    """Every (tp, cp, pp, vpp, dp, ep, etp, sharding, offload, recompute, micro-batch) with tp x cp x pp x dp x
    sharding = devices, tp within a node, cp as ``context_options``, ep and etp as ``expert_options``, vpp
    dividing each stage's layers up to ``max_vpp``, micro-batches the powers of two up to ``max_micro_batch``.
    Not yet validated. Layouts with the same pipeline schedule (pp, vpp, number of micro-batches) come one after
    the other: its tables are cached."""
    layers, moe = config.model.num_layers, bool(config.model.num_experts)
    micro_batches = [2**k for k in range(max_micro_batch.bit_length()) if 2**k <= max_micro_batch]
    for tp in _divisors(hw.devices):
        for cp, comm, sp in context_options(config, tp, hw.devices // tp) if tp <= hw.devices_per_node else []:
            for pp in _divisors(hw.devices // (tp * cp)):
                group = hw.devices // (tp * cp * pp)  # dp x sharding
                shardings = [(n, stage) for n in _divisors(group) for stage in ((1, 2, 3) if n > 1 else (1,))]
                vpps = [1] + [v for v in _divisors(layers // pp) if 1 < v <= max_vpp and pp > 1 and not layers % pp]
                experts = expert_options(config, tp, hw.devices // pp)
                for vpp, mb in product(vpps if pp <= layers else [], micro_batches):
                    for (n, stage), offload, (recompute, block), (ep, etp) in product(
                            shardings, (False, True), recompute_options(layers, pp, vpp), experts):
                        yield Layout(tp, pp, vpp, group // n, n, stage, offload, recompute, mb, sp, block, cp, comm,
                                     ep, etp, moe)


def layout_config(base: Config, layout: Layout, devices: int, tokenizer_vocab_size: int | None = None) -> Config:
    """``layout`` applied to ``base`` and validated for ``devices`` GPUs; ConfigError if it is not a valid run."""
    config = layout.apply(base)
    validate(config, world_size=devices, cuda_available=True, tokenizer_vocab_size=tokenizer_vocab_size,
             training_data=False)
    return config


def _model_states(config: Config, stage: int) -> tuple[int, int]:
    """(between steps, during a step) device bytes of model states: memory.py's, as ``estimate``."""
    held = rank_model_state_bytes(config, stage).device_total
    return held, held + step_transient_bytes(config, stage)


def _chunk_key(config: Config, stage: int, kernel: str | None) -> tuple:
    """What one micro-batch's saved activations and the temporaries of a stage depend on in one planning
    run (the model is fixed): not dp, sharding, offload or the number of micro-batches."""
    d = config.distributed
    return (d.mp_degree, d.context_parallel_size, d.cp_comm_type, d.pp_degree, d.virtual_pp_degree,
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
    key = (d.pp_degree, d.virtual_pp_degree, d.pipeline_schedule, m, stage, per_chunk)
    if key not in cache:
        walked = config
        if m != config.num_micro_batches:
            walked = _copy_config(config)
            walked.batch_size.local_batch_size = m * config.batch_size.micro_batch_size
        cache[key] = act.in_flight_at_peak(walked, stage, list(per_chunk))
    return sum(k * w for k, w in zip(cache[key], per_chunk))


def layout_memory(config: Config, limit_bytes: float, kernel: str | None = None,
                  cache: dict | None = None) -> MemoryTerms:
    """Model states + peak saved activations + the largest temporary (``megatron.memory.estimate``'s
    sum) at the worst stage. Where a stage's lower bound (its model states, one micro-batch's largest
    chunk and its temporary) already exceeds ``limit_bytes`` the schedule is not walked and that bound
    is returned (``activations`` None). ``cache``: figures already computed in this planning run."""
    cache = {} if cache is None else cache
    stages = representative_stages(config)
    states = {s: _model_states(config, s) for s in stages}
    heaviest = max(stages, key=lambda s: states[s][1])
    if states[heaviest][0] > limit_bytes:
        return MemoryTerms(heaviest, states[heaviest][1], None, None, states[heaviest][1])
    chunks = {s: _stage_activations(config, s, kernel, cache) for s in stages}
    bounds = {s: states[s][1] + max(chunks[s][0]) + chunks[s][1] for s in stages}
    over = max(stages, key=lambda s: bounds[s])
    if bounds[over] > limit_bytes:
        return MemoryTerms(over, states[over][1], None, None, bounds[over])
    worst = None
    for s in stages:
        activations = _peak_activations(config, s, chunks[s][0], cache)
        terms = MemoryTerms(s, states[s][1], activations, chunks[s][1], states[s][1] + activations + chunks[s][1])
        worst = terms if worst is None or terms.total > worst.total else worst
    return worst


def configured_layout(config: Config) -> Layout:
    """The layout a validated configuration runs (recompute in the planner's terms; a uniform recompute
    of several layers per unit is counted as ``full``)."""
    d, g = config.distributed, config.recompute_granularity if config.use_recompute else None
    block = config.recompute_num_layers if g == "full" and config.recompute_method == "block" else 0
    recompute = "off" if g is None else "block" if block else "only_attn" if g == "full_attn" else g
    n, cp = d.sharding.sharding_degree, d.context_parallel_size
    etp = d.expert_tensor_parallel_size
    return Layout(d.mp_degree, d.pp_degree, d.virtual_pp_degree, d.dp_degree, n,
                  sharding_stage(n, d.sharding.sharding_stage), d.sharding.sharding_offload, recompute,
                  config.batch_size.micro_batch_size, d.sequence_parallel and d.mp_degree > 1, block, cp,
                  d.cp_comm_type if cp > 1 else "p2p", d.expert_model_parallel_size,
                  0 if etp in (None, d.mp_degree) else etp, bool(config.model.num_experts))


def evaluate_layout(base: Config, layout: Layout, hw: Hardware, tokenizer_vocab_size: int | None = None,
                    kernel: str | None = None, cache: dict | None = None, complete: bool = False) -> Plan:
    """One layout's memory and, when it fits, step time; ``complete``: the whole memory estimate and the
    step time even when it does not fit. ConfigError if the layout is no valid run."""
    config = layout_config(base, layout, hw.devices, tokenizer_vocab_size)
    memory = layout_memory(config, float("inf") if complete else hw.memory_bytes, kernel, cache)
    fits = memory.estimated and memory.total <= hw.memory_bytes
    return Plan(layout, memory, layout_time(config, hw) if fits or complete else None, fits)


def plan_layouts(base: Config, hw: Hardware, tokenizer_vocab_size: int | None = None, max_micro_batch: int = 8,
                 max_vpp: int = 8, kernel: str | None = None) -> PlanResult:
    """Every valid layout of ``base``'s model and global batch on ``hw``: those that fit, ranked by the
    estimated step time; when none fits, ``smallest`` is the valid layout needing least memory.
    ``kernel``: the attention kernel of the activation estimate (``megatron.memory.activations.dims``)."""
    result, cache = PlanResult(plans=[]), {}
    for layout in candidate_layouts(base, hw, max_micro_batch, max_vpp):
        result.considered += 1
        try:
            plan = evaluate_layout(base, layout, hw, tokenizer_vocab_size, kernel, cache)
        except ConfigError:
            continue
        result.valid += 1
        if plan.fits:
            result.plans.append(plan)
        if result.smallest is None or plan.memory.total < result.smallest.memory.total:
            result.smallest = plan
    result.plans.sort(key=rank_key)
    return result


def rank_key(plan: Plan) -> tuple:
    """Step time, then the larger micro-batch, then the smaller memory."""
    return plan.time.step, -plan.layout.micro_batch_size, plan.memory.total


def non_dominated(plans: list[Plan]) -> list[Plan]:
    """The ranked ``plans`` without those another layout beats or equals on all of step time, memory (to
    0.1 GiB, as the table shows it) and micro-batch size: e.g. a recompute that saves no memory, or
    ZeRO-3 where it holds what ZeRO-2 holds. Of exact ties the first is kept."""
    kept, least_memory = [], {}  # micro-batch size -> least memory among the faster layouts kept so far
    for plan in plans:
        mb, total = plan.layout.micro_batch_size, round(plan.memory.total / GIB, 1)
        if any(other >= mb and memory <= total for other, memory in least_memory.items()):
            continue
        kept.append(plan)
        least_memory[mb] = min(total, least_memory.get(mb, total))
    return kept
