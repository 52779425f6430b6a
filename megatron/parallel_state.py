"""The rank grid and its process groups: the one piece of global state.

world = pp x dp x sharding x tp, tp varying fastest and pp slowest, so a tensor-parallel
group is a block of neighbouring ranks (one node) and pipeline stages span nodes. For
rank r::

    tp_rank       = r % tp
    sharding_rank = (r // tp) % sharding
    dp_rank       = (r // (tp * sharding)) % dp
    pp_rank       = r // (tp * sharding * dp)

``rank_grid()`` builds every group's rank lists from the sizes alone (a pure function,
testable without torch.distributed); ``initialize()`` creates the groups once and stores
them in one frozen ``ParallelState``; ``get()`` returns it. Groups:

- tp: same (pp, dp, sharding) coordinates; pp: same (dp, sharding, tp);
- sharding: same (pp, dp, tp); dp: same (pp, sharding, tp) (the replicas of a shard);
- data_parallel: same (pp, tp): every rank holding a distinct slice of the batch (dp x sharding);
- model_parallel: same (dp, sharding): tp x pp, the ranks that together hold one model;
- embedding: the first and last pipeline stage of each pipeline (tied word embeddings).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch.distributed as dist

GROUP_NAMES = ("tp", "pp", "dp", "sharding", "data_parallel", "model_parallel", "embedding")


def coordinates(rank: int, tp: int, pp: int, dp: int, sharding: int = 1) -> dict[str, int]:
    return {"tp": rank % tp, "sharding": (rank // tp) % sharding, "dp": (rank // (tp * sharding)) % dp,
            "pp": rank // (tp * sharding * dp)}


def rank_grid(world_size: int, tp: int = 1, pp: int = 1, dp: int = 1, sharding: int = 1) -> dict[str, list[list[int]]]:
    """Every group's rank lists, each list sorted, the lists in order of their smallest rank."""
    if tp * pp * dp * sharding != world_size:
        raise ValueError(f"tp x pp x dp x sharding = {tp * pp * dp * sharding} != world size {world_size}")
    keys = {
        "tp": ("pp", "dp", "sharding"), "pp": ("dp", "sharding", "tp"), "sharding": ("pp", "dp", "tp"),
        "dp": ("pp", "sharding", "tp"), "data_parallel": ("pp", "tp"), "model_parallel": ("dp", "sharding"),
    }
    grid: dict[str, list[list[int]]] = {}
    for name, shared in keys.items():
        buckets: dict[tuple, list[int]] = {}
        for r in range(world_size):
            c = coordinates(r, tp, pp, dp, sharding)
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

    @property
    def data_parallel_size(self) -> int:
        return self.dp_size * self.sharding_size

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


def single_process_state() -> ParallelState:
    return ParallelState(1, 0, 1, 1, 1, 1, 0, 0, 0, 0, {name: None for name in GROUP_NAMES},
                         {name: [0] for name in GROUP_NAMES})


def initialize(tp: int = 1, pp: int = 1, dp: int | None = None, sharding: int = 1,
               timeout_minutes: float = 10.0) -> ParallelState:
    """Create every group once (all ranks call this with the same sizes) and store the state."""
    global _STATE
    if not dist.is_initialized():
        _STATE = single_process_state()
        return _STATE
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = dp if dp is not None else world // (tp * pp * sharding)
    grid = rank_grid(world, tp, pp, dp, sharding)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    groups, ranks = {}, {}
    for name, lists in grid.items():
        for members in lists:  # every rank creates every group, in the same order
            group = dist.new_group(members, timeout=timeout)
            if rank in members:
                groups[name], ranks[name] = group, members
    c = coordinates(rank, tp, pp, dp, sharding)
    _STATE = ParallelState(world, rank, tp, pp, dp, sharding, c["tp"], c["pp"], c["dp"], c["sharding"], groups, ranks)
    return _STATE


def get() -> ParallelState:
    """The current state (single-process when ``initialize`` was not called)."""
    return _STATE if _STATE is not None else single_process_state()


def destroy() -> None:
    global _STATE
    _STATE = None
