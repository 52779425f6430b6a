"""The layout planner's search: every valid parallel layout of a model on N devices, whether it fits in their
memory (the device's and, under offload, the host's), and an estimated step time (a model, not a measurement),
every term kept.

A layout (``layout.Layout``) is (tp, cp and its communication type, pp, vpp, dp, sharding degree and stage,
offload, recompute, micro-batch size; for a MoE model the expert-parallel size ep and the experts'
tensor-parallel size etp, the model's tp or 1); the global batch is the configuration's. Within a pipeline stage
the tp x cp x dp x sharding ranks are re-cut for the experts as etp x ep x edp: ep divides the experts and ep x
etp the stage's ranks. Sequence parallelism is on whenever tp > 1 and divides each rank's share of the sequence:
it moves the same bytes as tp alone (an all-reduce is a reduce-scatter plus an all-gather) and keeps less
activation memory, so it is never worse here. Context parallelism (cp > 1, p2p / all_gather / a2a) cuts every
sample over cp ranks: the activations of a rank are those of ``s / cp`` tokens (``megatron.memory.activations``),
the attention exchanges keys and values (``time_model``); its sizes divide the devices and the sequence must
divide into 2 x cp chunks (x tp under sp); a2a needs heads and query groups divisible by tp x cp. Candidates
that ``--only`` / ``--exclude`` rule out (``filters``) are dropped first; each other candidate is applied to a
copy of the configuration and checked by ``megatron.config.validate``; a ``ConfigError`` drops it.

Memory: ``planner.memory``. A layout fits when its device estimate is within the device memory less
``headroom`` (10%) and, under offload, its host bytes per node (a rank's times the devices of a node) within
the host memory less the same headroom; one that fits its devices but not the host is rejected with that reason
(``Plan.reason``).

Time: an estimate, see ``megatron.planner.time_model``.

Ranking: by step time, then the larger micro-batch (GPU kernels are more efficient on larger matmuls;
not in the model), then the smaller memory. ``non_dominated`` drops the layouts another one beats or
equals on all three.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from itertools import product

from megatron.config import Config, ConfigError, validate
from megatron.planner.filters import AxisFilter, accepts, allows
from megatron.planner.layout import Layout
from megatron.planner.memory import (
    MemoryTerms,
    layout_memory,
    memory_terms,
    model_states,
    peak_activations,
    stage_chunk_bytes,
    stage_temporary,
    states_too_large,
)
from megatron.planner.stages import representative_stages
from megatron.planner.time_model import (
    GIB,
    Hardware,
    TimeTerms,
    layout_time,
    offloaded_parameters,
    stage_times,
    step_terms,
)
from megatron.planner.workers import map_slices

MIN_CP_TOKENS = 1024  # context parallelism tried while each rank keeps at least this many tokens of a sample


@dataclass(frozen=True)
class Plan:
    layout: Layout
    memory: MemoryTerms
    time: TimeTerms | None  # None when it does not fit (not ranked)
    fits: bool
    host_per_node: int = 0  # bytes of host memory a node's ranks keep (offload)
    reason: str | None = None  # why a layout that fits its devices is rejected (the host's memory)

    def to_dict(self) -> dict:
        time = None if self.time is None else {**asdict(self.time), "step": self.time.step}
        return {"layout": {**asdict(self.layout), "name": self.layout.describe(), "flags": self.layout.flags()},
                "memory": asdict(self.memory), "host_per_node": self.host_per_node, "time": time,
                "fits": self.fits, "reason": self.reason}


@dataclass
class PlanResult:
    plans: list[Plan]  # the layouts that fit, best first
    considered: int = 0  # the candidates the filters let through
    valid: int = 0
    smallest: Plan | None = None  # the valid layout needing least device memory (what to report when none fits)
    host_rejected: int = 0  # layouts that fit their devices but not the host's memory (offload)
    filters: tuple[AxisFilter, ...] = field(default_factory=tuple)


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
    dividing ``devices`` whose 2 x cp chunks (x tp under sp) divide the sequence, with p2p and all_gather, and
    a2a where tp x cp divides the heads and query groups (attention dropout runs under each of them). What
    ``validate`` would refuse anyway, left out early: a search on many devices is mostly these. Only while each
    rank keeps at least ``MIN_CP_TOKENS`` tokens of a sample: the time model has no latency, which shorter
    exchanges would be dominated by (and a search on many devices would be mostly these too)."""
    seq, m = config.dataset.max_seq_len, config.model
    nq = m.num_attention_heads
    ng = m.num_query_groups if m.group_query_attention and m.num_query_groups else nq
    options = [(1, "p2p", tp > 1 and seq % tp == 0)]
    for cp in _divisors(devices)[1:]:
        if seq % (2 * cp) or seq // cp < MIN_CP_TOKENS:
            continue
        sp = tp > 1 and seq % (2 * cp * tp) == 0
        a2a = ["a2a"] if not nq % (tp * cp) and not ng % (tp * cp) else []
        options += [(cp, comm, sp) for comm in ["p2p", "all_gather", *a2a]]
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


def candidate_layouts(config: Config, hw: Hardware, max_micro_batch: int = 8, max_vpp: int = 8,
                      filters: tuple[AxisFilter, ...] = ()) -> Iterator[Layout]:
    """Every (tp, cp, pp, vpp, dp, ep, etp, sharding, offload, recompute, micro-batch) with tp x cp x pp x dp x
    sharding = devices, tp within a node, cp as ``context_options``, ep and etp as ``expert_options``, vpp
    dividing each stage's layers up to ``max_vpp``, micro-batches the powers of two up to ``max_micro_batch``,
    that ``filters`` let through (each loop pruned by the filters on its axes). Not yet validated. Layouts with
    the same pipeline schedule (pp, vpp, number of micro-batches) come one after the other: its tables are
    cached."""
    for block in candidate_blocks(config, hw, max_micro_batch, max_vpp, filters):
        yield from block


def candidate_blocks(config: Config, hw: Hardware, max_micro_batch: int = 8, max_vpp: int = 8,
                     filters: tuple[AxisFilter, ...] = ()) -> Iterator[list[Layout]]:
    """``candidate_layouts`` a block at a time: the (non-empty) run of layouts of one tp, cp and its communication
    type, pp, vpp and micro-batch size (every layout of a ``validation_key`` is within one block)."""
    layers, moe = config.model.num_layers, bool(config.model.num_experts)
    micro_batches = [mb for mb in (2**k for k in range(max_micro_batch.bit_length()))
                     if mb <= max_micro_batch and allows(filters, "mb", mb)]
    offloads = [o for o in (False, True) if allows(filters, "offload", "on" if o else "off")]
    for tp in (t for t in _divisors(hw.devices) if t <= hw.devices_per_node and allows(filters, "tp", t)):
        for cp, comm, sp in context_options(config, tp, hw.devices // tp):
            if not (allows(filters, "cp", cp) and allows(filters, "cp-comm", comm)):
                continue
            for pp in (p for p in _divisors(hw.devices // (tp * cp)) if allows(filters, "pp", p)):
                group = hw.devices // (tp * cp * pp)  # dp x sharding
                shardings = [(n, stage) for n in _divisors(group) for stage in ((1, 2, 3) if n > 1 else (1,))
                             if allows(filters, "sharding", n) and allows(filters, "dp", group // n)
                             and allows(filters, "zero", stage if n > 1 else 0)]
                vpps = [1] + [v for v in _divisors(layers // pp) if 1 < v <= max_vpp and pp > 1 and not layers % pp]
                experts = [(ep, etp) for ep, etp in expert_options(config, tp, hw.devices // pp)
                           if allows(filters, "ep", ep) and allows(filters, "etp", etp or tp)]
                vpps = [v for v in vpps if allows(filters, "vpp", v)] if pp <= layers else []
                for vpp, mb in product(vpps, micro_batches):
                    recomputes = [r for r in recompute_options(layers, pp, vpp) if allows(filters, "recompute", r[0])]
                    block = [_made(Layout, _LAYOUT_FIELDS, (tp, pp, vpp, group // n, n, stage, offload, recompute, mb,
                                                            sp, block_layers, cp, comm, ep, etp, moe))
                             for (n, stage), offload, (recompute, block_layers), (ep, etp)
                             in product(shardings, offloads, recomputes, experts)]
                    if block:
                        yield block


def layout_config(base: Config, layout: Layout, devices: int, tokenizer_vocab_size: int | None = None) -> Config:
    """``layout`` applied to ``base`` and validated for ``devices`` GPUs; ConfigError if it is not a valid run."""
    config = layout.apply(base)
    validate(config, world_size=devices, cuda_available=True, tokenizer_vocab_size=tokenizer_vocab_size,
             training_data=False)
    return config


def validation_key(layout: Layout) -> tuple:
    """The layout without what ``validate`` does not look at: the sharding stage, offload and recompute. Layouts
    with one key are valid or not together, and their validated configurations differ in those fields only
    (``variant_config``)."""
    return (layout.tp, layout.pp, layout.vpp, layout.dp, layout.sharding_degree, layout.micro_batch_size,
            layout.sequence_parallel, layout.cp, layout.cp_comm, layout.ep, layout.etp)


def _shallow_copy(obj):
    """``copy.copy`` of a schema dataclass (a plain ``__dict__``), at a third of its cost."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    return new


def variant_config(validated: Config, layout: Layout) -> Config:
    """``layout_config(base, layout)`` made from the validated configuration of another layout with the same
    ``validation_key``: a copy (of the sections it changes) with the layout's sharding stage, offload and
    recompute. ``validate`` reads neither the stage nor offload, and leaves the planner's recompute settings (a
    granularity, or full with the block method and its layer count) as they are, so this is the configuration
    validating the layout gives, without the validation (a planning run's largest cost): checked layout by
    layout in tests/unit/test_plan_search.py."""
    config = _shallow_copy(validated)
    config.distributed = _shallow_copy(validated.distributed)
    config.distributed.sharding = _shallow_copy(validated.distributed.sharding)
    sharding = config.distributed.sharding
    sharding.sharding_stage, sharding.sharding_offload = layout.sharding_stage, layout.offload
    config.use_recompute = layout.recompute != "off"
    config.recompute_granularity = None if layout.recompute == "off" else "full" if layout.recompute == "block" \
        else layout.recompute
    config.recompute_method = "block" if layout.recompute == "block" else None
    config.recompute_num_layers = layout.block_layers if layout.recompute == "block" else None
    return config


def _fits(layout: Layout, memory: MemoryTerms, hw: Hardware) -> tuple[bool, int, str | None]:
    """(whether it fits, the host bytes of a node, why a layout that fits its devices is refused)."""
    fits = memory.estimated and memory.total <= hw.memory_bytes
    host, reason = memory.host * hw.ranks_per_node, None
    if fits and host > hw.host_memory_bytes:
        fits, reason = False, (f"its offloaded optimizer states need {host / GIB:.1f} GiB of host memory per node "
                               f"({hw.ranks_per_node} ranks x {memory.host / GIB:.1f}), more than the "
                               f"{hw.host_memory_bytes / GIB:.1f} usable of --host-memory-gb {hw.host_memory_gb:g}")
    return fits, host, reason


def evaluate_layout(base: Config, layout: Layout, hw: Hardware, tokenizer_vocab_size: int | None = None,
                    kernel: str | None = None, cache: dict | None = None, complete: bool = False,
                    validated: Config | None = None, exact_below: float = float("inf")) -> Plan:
    """One layout's memory and, when it fits, step time; ``complete``: the whole memory estimate and the
    step time even when it does not fit. ConfigError if the layout is no valid run. ``validated``: the validated
    configuration of a layout with the same ``validation_key`` (this one's is then ``variant_config``'s).
    ``exact_below``: ``memory_terms``'."""
    config = layout_config(base, layout, hw.devices, tokenizer_vocab_size) if validated is None \
        else variant_config(validated, layout)
    memory = layout_memory(config, float("inf") if complete else hw.memory_bytes, kernel, cache, exact_below)
    fits, host, reason = _fits(layout, memory, hw)
    time = layout_time(config, hw, cache) if fits or complete else None
    return Plan(layout, memory, time, fits, host, reason)


class _Family:
    """The layouts of one ``validation_key``, evaluated from its validated configuration: what depends on the
    sharding stage and offload (the model states, the offloaded shard) is computed once per (stage, offload),
    what depends on recompute (the activations per stage and chunk, the temporaries, the schedule's peak, the
    stage times) once per recompute, each on a ``variant_config`` of the first layout asking for it; a layout's
    plan adds them up as ``evaluate_layout`` does (the tests compare the two)."""

    def __init__(self, validated: Config, hw: Hardware, kernel: str | None, cache: dict):
        self.validated, self.hw, self.kernel, self.cache = validated, hw, kernel, cache
        # (stage, offload) -> its config, model states, offloaded shard (once asked for), and the memory terms
        # when the states alone exceed the device (every recompute of it then does not fit)
        self.sharded: dict[tuple, tuple[Config, dict, int | None, MemoryTerms | None]] = {}
        self.recomputed: dict[tuple, _Recompute] = {}  # (recompute, block layers) -> its figures

    def plan(self, layout: Layout, exact_below: float) -> Plan:
        key = (layout.sharding_stage, layout.offload)
        if key not in self.sharded:
            config = variant_config(self.validated, layout)
            states = {s: model_states(config, s, self.cache) for s in representative_stages(config)}
            self.sharded[key] = (config, states, None, states_too_large(states, self.hw.memory_bytes))
        config, states, shard, early = self.sharded[key]
        if early is not None:  # whatever the recompute: what memory_terms returns, and does not fit
            return Plan(layout, early, None, False, early.host * self.hw.ranks_per_node, None)
        recompute = self.recomputed.get((layout.recompute, layout.block_layers))
        if recompute is None:
            recompute = _Recompute(variant_config(self.validated, layout), self)
            self.recomputed[layout.recompute, layout.block_layers] = recompute
        hw = self.hw
        memory = memory_terms(states, recompute.chunks, recompute.temporary, recompute.peak, hw.memory_bytes,
                              exact_below, states_fit=True)
        fits, host, reason = _fits(layout, memory, hw)
        if not fits:
            return Plan(layout, memory, None, fits, host, reason)
        if shard is None:
            shard = offloaded_parameters(config, self.cache)
            self.sharded[key] = (config, states, shard, None)
        time = step_terms(config, hw, recompute.stage_times(), shard, self.cache)
        return Plan(layout, memory, time, fits, host, reason)


class _Recompute:
    """A family's figures under one recompute: per stage the bytes per chunk, the largest temporary and the
    peak activations, and the stage times, each computed when first asked for."""

    def __init__(self, config: Config, family: _Family):
        self.config, self.family = config, family
        self._chunks, self._temporaries, self._peaks, self._times = {}, {}, {}, None

    def chunks(self, stage: int) -> tuple[int, ...]:
        if stage not in self._chunks:
            self._chunks[stage] = stage_chunk_bytes(self.config, stage, self.family.kernel, self.family.cache)
        return self._chunks[stage]

    def temporary(self, stage: int) -> int:
        if stage not in self._temporaries:
            self._temporaries[stage] = stage_temporary(self.config, stage, self.family.kernel, self.family.cache)
        return self._temporaries[stage]

    def peak(self, stage: int, per_chunk: tuple[int, ...]) -> int:
        if stage not in self._peaks:
            self._peaks[stage] = peak_activations(self.config, stage, per_chunk, self.family.cache)
        return self._peaks[stage]

    def stage_times(self) -> tuple:
        if self._times is None:
            self._times = stage_times(self.config, self.family.hw, self.family.cache)
        return self._times


def plan_layouts(base: Config, hw: Hardware, tokenizer_vocab_size: int | None = None, max_micro_batch: int = 8,
                 max_vpp: int = 8, kernel: str | None = None, filters: tuple[AxisFilter, ...] = (),
                 progress=None, share_validation: bool = True, jobs: int = 1) -> PlanResult:
    """Every valid layout of ``base``'s model and global batch on ``hw`` that ``filters`` let through: those
    that fit, ranked by the estimated step time; when none fits, ``smallest`` is the valid layout needing least
    device memory. ``kernel``: the attention kernel of the activation estimate
    (``megatron.memory.activations.dims``). ``progress``: an object with ``set_total(n)`` and ``update(k)``
    (``megatron.progress.Progress``), told the candidates and those done. ``share_validation``: validate one
    layout per ``validation_key`` and evaluate its family from it (``_Family``); False validates and evaluates
    each layout on its own (``evaluate_layout``; the tests compare the two). ``jobs``: processes that share
    the candidates (``megatron.planner.workers``); the result is the same whatever their number."""
    kept, blocks = [], []
    for block in candidate_blocks(base, hw, max_micro_batch, max_vpp, filters):
        block = [layout for layout in block if accepts(layout, filters)] if filters else block
        if block:
            blocks.append((len(kept), len(kept) + len(block)))
            kept += block
    if progress is not None:
        progress.set_total(len(kept))
    search = _Search(kept, blocks, base, hw, tokenizer_vocab_size, kernel, share_validation)
    parts = map_slices(search.run, blocks, jobs, None if progress is None else progress.update,
                       pack=search.pack, unpack=search.unpack)
    result = PlanResult(plans=[], filters=tuple(filters))
    for part in parts:  # in candidate order: the smallest is the first of least memory, as one process finds it
        result.considered += part.considered
        result.valid += part.valid
        result.host_rejected += part.host_rejected
        result.plans += part.plans
        if part.smallest is not None and (result.smallest is None
                                          or part.smallest.memory.total < result.smallest.memory.total):
            result.smallest = part.smallest
    result.plans.sort(key=rank_key)
    return result


_LAYOUT_FIELDS = tuple(f.name for f in fields(Layout))
_MEMORY_FIELDS = tuple(f.name for f in fields(MemoryTerms))
_TIME_FIELDS = tuple(f.name for f in fields(TimeTerms))
_PLAN_FIELDS = tuple(f.name for f in fields(Plan))


def _values(obj, names: tuple[str, ...]) -> tuple:
    """A dataclass's field values in order (``names``), without ``astuple``'s deep copy."""
    return tuple(getattr(obj, name) for name in names)


def _made(cls, names: tuple[str, ...], values: tuple):
    """``cls(*values)`` of a plain frozen dataclass (no ``__post_init__``), at half the cost: a search makes
    10^5 candidates and unpacks as many plans from its worker processes."""
    obj = object.__new__(cls)
    obj.__dict__.update(zip(names, values))
    return obj


class _Search:
    """The evaluation of a slice of the candidates: a ``PlanResult`` of its own (plans not yet sorted). The
    caches (``cache``: memory and time figures of this planning run) live as long as the object, in each
    process that evaluates slices."""

    def __init__(self, kept: list[Layout], blocks: list[tuple[int, int]], base: Config, hw: Hardware,
                 vocab: int | None, kernel: str | None, share_validation: bool):
        self.kept, self.base, self.hw, self.vocab, self.kernel = kept, base, hw, vocab, kernel
        self.block_starts = frozenset(start for start, _ in blocks)  # ``candidate_blocks``' bounds in ``kept``
        self.share_validation, self.cache = share_validation, {}

    def run(self, start: int, stop: int, before: list[PlanResult]) -> PlanResult:
        """The candidates ``start:stop``, one block (``candidate_blocks``) or more; ``before``: results of slices before
        it in candidate order (some or all of them). A layout that does not fit matters only if it needs less than
        every valid layout before it (``memory_terms``' exact_below): the least of ``before``'s bounds that, since
        their layouts came first, leaves each layout that is the smallest so far exact, as one process finds it."""
        least = min((part.smallest.memory.total for part in before if part.smallest is not None),
                    default=float("inf"))
        result, families = PlanResult(plans=[]), {}  # validation_key -> its family (None: invalid)
        starts = self.block_starts
        for i in range(start, stop):
            layout = self.kept[i]
            if i in starts:
                families.clear()  # the candidates of one key come within one block
            result.considered += 1
            plan = self._plan(layout, families, least)
            if plan is None:
                continue
            result.valid += 1
            if plan.fits:
                result.plans.append(plan)
            result.host_rejected += plan.reason is not None
            if result.smallest is None or plan.memory.total < result.smallest.memory.total:
                result.smallest = plan
                least = min(least, plan.memory.total)
        return result

    def pack(self, result: PlanResult, start: int) -> tuple:
        """A slice's result as a forked process sends it: each fitting plan as its candidate's index and its
        figures, plain tuples (pickling a plan's dataclasses cost seconds over a search's 10^5 plans)."""
        plans, j = [], start
        for plan in result.plans:  # in candidate order
            while self.kept[j] is not plan.layout:
                j += 1
            plans.append((j, _values(plan.memory, _MEMORY_FIELDS), _values(plan.time, _TIME_FIELDS),
                          plan.host_per_node, plan.reason))
        return plans, result.considered, result.valid, result.host_rejected, result.smallest

    def unpack(self, packed: tuple) -> PlanResult:
        """``pack``'s tuples as a ``PlanResult`` again (every plan sent fits)."""
        plans, considered, valid, host_rejected, smallest = packed
        kept = self.kept
        return PlanResult([_made(Plan, _PLAN_FIELDS, (kept[j], _made(MemoryTerms, _MEMORY_FIELDS, memory),
                                                      _made(TimeTerms, _TIME_FIELDS, time), True, host, reason))
                           for j, memory, time, host, reason in plans], considered, valid, smallest, host_rejected)

    def _plan(self, layout: Layout, families: dict, smallest: float) -> Plan | None:
        """The layout's plan; None if it is no valid run."""
        try:
            if not self.share_validation:
                return evaluate_layout(self.base, layout, self.hw, self.vocab, self.kernel, self.cache,
                                       exact_below=smallest)
            key = validation_key(layout)
            if key not in families:
                try:
                    config = layout_config(self.base, layout, self.hw.devices, self.vocab)
                    families[key] = _Family(config, self.hw, self.kernel, self.cache)
                except ConfigError:
                    families[key] = None
            return None if families[key] is None else families[key].plan(layout, smallest)
        except ConfigError:
            return None


def rank_key(plan: Plan) -> tuple:
    """Step time, then the larger micro-batch, then the smaller memory."""
    return plan.time.step, -plan.layout.micro_batch_size, plan.memory.total


def non_dominated(plans: list[Plan]) -> list[Plan]:
    """The ranked ``plans`` without those another layout beats or equals on all of step time, memory (to
    0.1 GiB, as the table shows it) and micro-batch size: e.g. a recompute that saves no memory, or
    ZeRO-3 where it holds what ZeRO-2 holds. Of exact ties the first is kept."""
    kept, least_memory = [], {}  # micro-batch size -> least memory among the faster layouts kept so far
    for plan in plans:  # 10^5 of them: a plain loop, no generator per plan
        mb, total = plan.layout.micro_batch_size, round(plan.memory.total / GIB, 1)
        for other, memory in least_memory.items():
            if other >= mb and memory <= total:
                break
        else:
            kept.append(plan)
            least_memory[mb] = min(total, least_memory.get(mb, total))
    return kept
