"""The rank grid and its process groups: the one piece of global state.

world = pp x dp x sharding x cp x tp, tp varying fastest, then cp, and pp slowest (Megatron-LM's
order: tp, cp, dp, pp, with the ZeRO shards part of dp), so a tensor-parallel group is a block of
neighbouring ranks (one node), context-parallel rings are next to it, and pipeline stages span
nodes. For rank r::

    tp_rank       = r % tp
    cp_rank       = (r // tp) % cp
    sharding_rank = (r // (tp * cp)) % sharding
    dp_rank       = (r // (tp * cp * sharding)) % dp
    pp_rank       = r // (tp * cp * sharding * dp)

``rank_grid()`` builds every group's rank lists from the sizes alone (a pure function,
testable without torch.distributed); ``initialize()`` creates the groups once and stores
them in one frozen ``ParallelState``; ``get()`` returns it; ``destroy()`` destroys the groups
``initialize()`` created (each gloo group holds three threads and its sockets until destroyed, so a
process that re-initializes, such as a test pool's rank or a long-lived server, would otherwise leak
them). Calling ``initialize()`` again destroys the previous groups first. Groups:

- tp: same (pp, dp, sharding, cp) coordinates; pp: same (dp, sharding, cp, tp);
- cp: same (pp, dp, sharding, tp): the ranks that share each sample, each holding 2 of its 2 x cp chunks;
- sharding: same (pp, dp, cp, tp); dp: same (pp, sharding, tp): the replicas of a shard (dp x cp: the
  context-parallel ranks hold the same parameters and sum their gradients like replicas). With
  ``shard_over_cp`` (``Config.shards_over_context_parallel``: a sharded optimizer under cp, as Megatron-LM's
  distributed optimizer spans dp x cp) the ZeRO shards span the cp ranks too: sharding: same (pp, dp, tp),
  dp: same (pp, sharding, cp, tp);
- data_parallel: same (pp, tp): every rank whose gradients and token counts are summed (dp x sharding x cp);
  the batch is cut over dp x sharding only (``data_parallel_rank``): the cp ranks of a sample read the same one;
- model_parallel: same (dp, sharding, cp): tp x pp, the ranks that together hold one model;
- embedding: the first and last pipeline stage of each pipeline (tied word embeddings);
- tp_cp: same (pp, dp, sharding): the ranks that hold parts of the same samples (a MoE router's balancing losses
  count their tokens together);
- cp_inner, cp_outer (hierarchical context parallelism, ``cp_inner`` = I given: ``--cp-comm-type a2a+p2p``): the cp
  group's two levels (Megatron-LM's ``create_hierarchical_groups``), by cp_inner_rank = cp_rank % I and
  cp_outer_rank = cp_rank // I: cp_inner: same (pp, dp, sharding, tp, cp_outer_rank), I neighbouring cp ranks (the
  all-to-all's); cp_outer: same (pp, dp, sharding, tp, cp_inner_rank), cp / I ranks I apart (the ring's). cp 4, I 2:
  cp ranks {0, 1} {2, 3} inner, {0, 2} {1, 3} outer.

**Experts** (mixture of experts, ``megatron.moe``) re-cut the same ranks: within a pipeline stage the
S = tp x cp x sharding x dp ranks, numbered L = r mod S, are etp x ep x edp, etp fastest (Megatron-LM's
"MoE parallel folding")::

    etp_rank = L % etp;  ep_rank = (L // etp) % ep;  edp_rank = L // (etp * ep)

- etp: same (pp, ep, edp): an expert's tensor-parallel shards; ep: same (pp, etp, edp): the ranks the experts
  are split over (rank e holds experts [e E/ep, (e+1) E/ep)); ep_etp: same (pp, edp): the all-gather
  dispatcher's group; edp: same (pp, etp, ep): the ranks holding the same experts, whose expert gradients are
  summed (and over which a sharded optimizer shards the expert states).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch.distributed as dist

GROUP_NAMES = ("tp", "cp", "pp", "dp", "sharding", "data_parallel", "model_parallel", "embedding", "tp_cp",
               "etp", "ep", "ep_etp", "edp", "cp_inner", "cp_outer")


def coordinates(rank: int, tp: int, pp: int, dp: int, sharding: int = 1, cp: int = 1) -> dict[str, int]:
    return {"tp": rank % tp, "cp": (rank // tp) % cp, "sharding": (rank // (tp * cp)) % sharding,
            "dp": (rank // (tp * cp * sharding)) % dp, "pp": rank // (tp * cp * sharding * dp)}


def expert_coordinates(rank: int, stage_size: int, ep: int = 1, etp: int = 1) -> dict[str, int]:
    """The rank's place among the experts of its pipeline stage (``stage_size`` = tp x cp x sharding x dp ranks)."""
    local = rank % stage_size
    return {"etp": local % etp, "ep": (local // etp) % ep, "edp": local // (etp * ep), "pp": rank // stage_size}


def rank_grid(world_size: int, tp: int = 1, pp: int = 1, dp: int = 1, sharding: int = 1,
              cp: int = 1, shard_over_cp: bool = False, ep: int = 1, etp: int | None = None,
              cp_inner: int | None = None) -> dict[str, list[list[int]]]:
    """Every group's rank lists, each list sorted, the lists in order of their smallest rank (``cp_inner`` given:
    the hierarchical cp levels too)."""
    if tp * pp * dp * sharding * cp != world_size:
        raise ValueError(f"tp x cp x pp x dp x sharding = {tp * cp * pp * dp * sharding} != world size {world_size}")
    if cp_inner is not None and (cp_inner < 1 or cp % cp_inner):
        raise ValueError(f"the inner level of hierarchical context parallelism ({cp_inner}) must divide cp ({cp})")
    etp = tp if etp is None else etp
    stage_size = world_size // pp
    if stage_size % (ep * etp):
        raise ValueError(f"expert parallel x expert tensor parallel = {ep * etp} does not divide the {stage_size} "
                         f"ranks of a pipeline stage (tp x cp x dp x sharding)")
    keys = {
        "tp": ("pp", "dp", "sharding", "cp"), "cp": ("pp", "dp", "sharding", "tp"),
        "pp": ("dp", "sharding", "cp", "tp"), "sharding": ("pp", "dp", "cp", "tp"),
        "dp": ("pp", "sharding", "tp"), "data_parallel": ("pp", "tp"), "model_parallel": ("dp", "sharding", "cp"),
        "tp_cp": ("pp", "dp", "sharding"),
    }
    if shard_over_cp:
        keys["sharding"], keys["dp"] = ("pp", "dp", "tp"), ("pp", "sharding", "cp", "tp")
    if cp_inner is not None:
        keys["cp_inner"], keys["cp_outer"] = ("pp", "dp", "sharding", "tp", "cp_outer"), \
            ("pp", "dp", "sharding", "tp", "cp_inner")
    grid: dict[str, list[list[int]]] = {}
    for name, shared in keys.items():
        buckets: dict[tuple, list[int]] = {}
        for r in range(world_size):
            c = coordinates(r, tp, pp, dp, sharding, cp)
            c["cp_inner"], c["cp_outer"] = c["cp"] % (cp_inner or 1), c["cp"] // (cp_inner or 1)
            buckets.setdefault(tuple(c[k] for k in shared), []).append(r)
        grid[name] = sorted(buckets.values())
    expert_keys = {"etp": ("pp", "ep", "edp"), "ep": ("pp", "etp", "edp"), "ep_etp": ("pp", "edp"),
                   "edp": ("pp", "etp", "ep")}
    for name, shared in expert_keys.items():
        buckets = {}
        for r in range(world_size):
            c = expert_coordinates(r, stage_size, ep, etp)
            buckets.setdefault(tuple(c[k] for k in shared), []).append(r)
        grid[name] = sorted(buckets.values())
    grid["embedding"] = sorted(sorted({g[0], g[-1]}) for g in grid["pp"])
    return grid


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the grid and the groups it belongs to (None when not distributed)."""

    world_size: int
    rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    sharding_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    sharding_rank: int
    groups: dict = field(default_factory=dict, repr=False)  # name -> ProcessGroup or None
    ranks: dict = field(default_factory=dict, repr=False)  # name -> this rank's group's rank list
    cp_size: int = 1
    cp_rank: int = 0
    shard_over_cp: bool = False  # the ZeRO shards span the cp ranks (see the module docstring)
    ep_size: int = 1  # experts (see the module docstring)
    ep_rank: int = 0
    etp_size: int = 1
    etp_rank: int = 0
    edp_size: int = 1
    edp_rank: int = 0
    cp_inner_size: int | None = None  # hierarchical cp (a2a+p2p): the inner level's size (see the module docstring)

    @property
    def data_parallel_size(self) -> int:
        """The ranks the batch is cut over (dp x sharding; the cp ranks of a sample read the same samples)."""
        return self.dp_size * self.sharding_size

    @property
    def gradient_sum_size(self) -> int:
        """The ranks whose gradients and token counts are summed: the ``data_parallel`` group (dp x sharding x cp)."""
        return self.dp_size * self.sharding_size * self.cp_size

    @property
    def shard_group_size(self) -> int:
        """The ranks one ZeRO shard group spans: the ``sharding`` group (sharding, x cp with ``shard_over_cp``)."""
        return self.sharding_size * (self.cp_size if self.shard_over_cp else 1)

    @property
    def replica_size(self) -> int:
        """The ranks holding the same shard: the ``dp`` group (dp x cp, or dp with ``shard_over_cp``)."""
        return self.dp_size * (1 if self.shard_over_cp else self.cp_size)

    @property
    def writes_shard(self) -> bool:
        """Whether this rank writes its shard to a checkpoint: the first of the shard's replicas."""
        return self.dp_rank == 0 and (self.shard_over_cp or self.cp_rank == 0)

    @property
    def data_parallel_rank(self) -> int:
        return self.dp_rank * self.sharding_size + self.sharding_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def group(self, name: str) -> dist.ProcessGroup | None:
        return self.groups.get(name)


_STATE: ParallelState | None = None
_OWNED: list = []  # the groups initialize() created that this rank belongs to, for destroy()


def single_process_state() -> ParallelState:
    return ParallelState(1, 0, 1, 1, 1, 1, 0, 0, 0, 0, {name: None for name in GROUP_NAMES},
                         {name: [0] for name in GROUP_NAMES})


def initialize(tp: int = 1, pp: int = 1, dp: int | None = None, sharding: int = 1,
               timeout_minutes: float = 10.0, cp: int = 1, shard_over_cp: bool = False, ep: int = 1,
               etp: int | None = None, cp_inner: int | None = None) -> ParallelState:
    """Create every group once (all ranks call this with the same sizes) and store the state; the groups of an
    earlier call are destroyed first, so a process that re-initializes (a server, an evaluation) holds one set.
    ``cp_inner``: the inner level of hierarchical context parallelism (None: no cp_inner / cp_outer groups)."""
    global _STATE
    destroy()
    if not dist.is_initialized():
        _STATE = single_process_state()
        return _STATE
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = dp if dp is not None else world // (tp * pp * sharding * cp)
    etp = tp if etp is None else etp
    grid = rank_grid(world, tp, pp, dp, sharding, cp, shard_over_cp, ep, etp, cp_inner)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    groups, ranks = {}, {}
    if any(len(lists[0]) == 1 for lists in grid.values()):
        # one group of itself per rank, shared by every name whose group is this rank alone: nothing crosses
        # ranks in it, so nothing can be mismatched, and each gloo group costs threads, sockets and milliseconds
        alone = [_new_group([r], rank, timeout) for r in range(world)][rank]
    for name, lists in grid.items():
        for members in lists:  # every rank creates every group, in the same order
            if len(members) == 1:
                group = alone
            else:
                group = _new_group(members, rank, timeout)
            if rank in members:
                groups[name], ranks[name] = group, members
    if dist.get_backend() == "gloo":  # NCCL connects lazily, at a group's first collective
        # new_group returns once this rank's side of each gloo connection is up, maybe before a peer's side: wait
        # for every rank, so that no group is destroyed (its sockets closed) while a peer still connects to it
        dist.barrier()
    c = coordinates(rank, tp, pp, dp, sharding, cp)
    e = expert_coordinates(rank, world // pp, ep, etp)
    _STATE = ParallelState(world, rank, tp, pp, dp, sharding, c["tp"], c["pp"], c["dp"], c["sharding"], groups, ranks,
                           cp, c["cp"], shard_over_cp, ep, e["ep"], etp, e["etp"], world // pp // (ep * etp), e["edp"],
                           cp_inner)
    return _STATE


def _new_group(members: list[int], rank: int, timeout: datetime.timedelta):
    """``dist.new_group``, called by every rank; a group this rank belongs to is destroyed by ``destroy()``
    (elsewhere new_group returns a placeholder, GroupMember.NON_GROUP_MEMBER, with nothing to destroy)."""
    group = dist.new_group(members, timeout=timeout)
    if rank in members:
        _OWNED.append(group)
    return group


def get() -> ParallelState:
    """The current state (single-process when ``initialize`` was not called)."""
    return _STATE if _STATE is not None else single_process_state()


def destroy() -> None:
    """Forget the state and destroy the groups ``initialize()`` created (their threads and sockets go with them).
    Each rank calls it after its last use of the groups (what it sent still reaches its peers: gloo closes its
    sockets gracefully); a no-op when nothing was created or once the default group is gone
    (``dist.destroy_process_group()`` destroys every group)."""
    global _STATE
    _STATE = None
    owned = list(_OWNED)
    _OWNED.clear()
    if not dist.is_initialized():
        return
    for group in reversed(owned):
        try:
            dist.destroy_process_group(group)
        except ValueError:  # already destroyed (the default group was destroyed and created again)
            pass
