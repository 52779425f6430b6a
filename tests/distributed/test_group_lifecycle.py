"""Process groups live as long as the rank grid that created them: ``parallel_state.destroy()`` (which the
harness calls after every call) and a second ``initialize()`` destroy them, so a pooled rank, or a long-lived
server that re-initializes, does not gather gloo's threads (three per group) and sockets."""

from __future__ import annotations

import os
import sys

import pytest

from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads through /proc")

CALLS = 50
THREAD_BOUND = 64  # a rank holds ~7 threads between calls, ~25 with a grid's groups (3 a gloo group), ~85 by a leak
LAYOUTS = ({"tp": 2}, {"pp": 2})  # 13 groups each, 6 and 4 of them distinct


def _threads() -> int:
    """This process's threads, as the kernel counts them (gloo's and OpenMP's included)."""
    return len(os.listdir("/proc/self/task"))


def _groups() -> int:
    from torch.distributed.distributed_c10d import _world

    return len(_world.pg_map)


def _data_parallel_model(ps) -> None:
    """A data-parallel model (its gradient hooks hold it, and its plan's groups, beyond the call: the harness
    releases them)."""
    from megatron.config import parse_config, validate
    from megatron.distributed.parallelize import parallelize, plan_sharding
    from megatron.parallelize_gpt import build_model

    config = parse_config(["--mock-data", "--device", "cpu", "--num-layers", "1", "--hidden-size", "16",
                           "--num-attention-heads", "2", "--vocab-size", "32", "--max-seq-len", "8"])
    validate(config, world_size=2)
    parallelize(build_model(config), plan_sharding(config, ps))


def _initialize(rank: int, world_size: int, call: int) -> tuple[int, int, int, int, int]:
    """(threads before, threads, open files, process groups, of them this state's) around this call's initialize;
    the harness destroys its groups after the call. Every tenth call builds a data-parallel model instead."""
    import torch
    import torch.distributed as dist

    from megatron import parallel_state

    before, with_model = _threads(), call % 10 == 9
    ps = parallel_state.initialize(**({} if with_model else LAYOUTS[call % len(LAYOUTS)]))  # {}: dp 2
    for name in ("tp", "pp", "cp"):  # use some of them, as a test does
        value = torch.ones(1)
        dist.all_reduce(value, group=ps.group(name))
        assert value.item() == len(ps.ranks[name])
    if with_model:
        _data_parallel_model(ps)
    return before, _threads(), len(os.listdir("/proc/self/fd")), _groups(), len({id(g) for g in ps.groups.values()})


def _initialize_twice(rank: int, world_size: int) -> list[tuple[int, int]]:
    """A second initialize (a server loading another model) replaces the first one's groups: [(process groups,
    of them the state's)] after each initialize, and the process groups after destroy."""
    from megatron import parallel_state

    counts = []
    for layout in LAYOUTS[:2]:
        ps = parallel_state.initialize(**layout)
        counts.append((_groups(), len({id(g) for g in ps.groups.values()})))
    parallel_state.destroy()
    return counts, _groups()


def test_initialize_again_destroys_the_earlier_groups():
    for counts, after in run_distributed(_initialize_twice, 2):
        assert [groups for groups, _ in counts] == [1 + own for _, own in counts]  # the default group and the state's
        assert after == 1


def test_a_pooled_rank_s_threads_stay_bounded_over_many_calls():
    before = run_distributed(_initialize, 2, 0)
    seen = [run_distributed(_initialize, 2, call) for call in range(1, CALLS)]
    for call, per_rank in enumerate([before, *seen]):
        for rank, (_, count, _, groups, own) in enumerate(per_rank):
            assert count < THREAD_BOUND, f"call {call}: rank {rank} has {count} threads"
            assert groups == 1 + own, f"call {call}: rank {rank} holds {groups} process groups"  # default + its own
    for rank in range(2):  # and nothing grows: the last call starts and holds what the first did
        assert [seen[-1][rank][i] <= before[rank][i] + 2 for i in range(3)] == [True] * 3, (before, seen[-1])
