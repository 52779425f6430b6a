"""megatron/cpu_threads.py: which thread count a CPU run computes with, and why."""

from __future__ import annotations

import pytest

from megatron import cpu_threads
from megatron.config import ConfigError
from megatron.cpu_threads import ENV, busy_cores, choose, decide

STAT = """cpu  300 0 100 600 0 0 0 0 0 0
cpu0 {u0} 0 0 {i0} 0 0 0 {s0} 0 0
cpu1 {u1} 0 0 {i1} 0 0 0 0 0 0
cpu2 500 0 0 500 0 0 0 0 0 0
intr 1 2 3
"""


def _stat(u0=0, i0=0, s0=0, u1=0, i1=0):
    return STAT.format(u0=u0, i0=i0, s0=s0, u1=u1, i1=i1)


def test_busy_cores_counts_the_usable_cores_only_with_stolen_time_as_busy():
    reads = iter([_stat(), _stat(u0=60, s0=40, i1=100)])  # core 0 fully taken (40% stolen), core 1 idle
    slept = []
    busy = busy_cores([0, 1], read_stat=lambda: next(reads), sleep=slept.append, sample_s=0.5)
    assert busy == pytest.approx(1.0) and slept == [0.5]  # cpu2 (not usable here) is not counted


def test_busy_cores_unknown_without_proc_stat():
    assert busy_cores([0], read_stat=lambda: None, sleep=lambda s: None) is None


@pytest.mark.parametrize("cores, busy, ranks, threads", [
    (2, 0.05, 1, 2),    # idle: every usable core
    (2, 1.0, 1, 1),     # one busy process beside it: one thread (2.5x faster than two there)
    (2, 0.6, 1, 1),
    (2, 0.4, 1, 2),
    (2, 3.5, 1, 1),     # never below one
    (16, 0.0, 4, 4),    # four ranks share the node
    (16, 8.0, 4, 2),
    (4, None, 1, 4),    # no /proc/stat: the usable cores
    (2, 0.0, 4, 1),     # more ranks than cores
])
def test_decide(cores, busy, ranks, threads):
    choice = decide(cores, busy, ranks)
    assert choice.threads == threads
    assert f"{cores} cores usable" in choice.reason and "--cpu-threads N" in choice.reason
    assert ("busy with other work" in choice.reason) == (busy is not None)


def test_precedence_flag_then_omp_then_environment(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_automatic", lambda ranks: pytest.fail("measured though a count was given"))
    env = {"OMP_NUM_THREADS": "3", ENV: "5"}
    assert choose(2, environ=env) == cpu_threads.ThreadChoice(2, "--cpu-threads")
    assert choose(None, local_ranks=4, environ=env).threads == 3
    assert "torchrun" in choose(None, local_ranks=4, environ=env).reason
    assert choose(None, environ={ENV: "5"}) == cpu_threads.ThreadChoice(5, ENV)


def test_automatic_when_nothing_is_set(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_automatic", lambda ranks: decide(8, 0.0, ranks))
    assert choose(None, local_ranks=2, environ={}).threads == 4


@pytest.mark.parametrize("env", [{"OMP_NUM_THREADS": "0"}, {ENV: "two"}])
def test_a_bad_count_is_one_sentence_naming_the_variable(env):
    with pytest.raises(ConfigError, match=f"{next(iter(env))}=.* is not a positive whole number"):  # one line, exit 2
        choose(None, environ=env)


def test_describe():
    assert cpu_threads.ThreadChoice(1, "x").describe() == "1 compute thread (x)"
    assert cpu_threads.ThreadChoice(2, "x").describe() == "2 compute threads (x)"
