"""No silent hang, no orphan: a stopped rank ends the whole torchrun job with a stack dump, and killing
torchrun kills its workers. Each test bounds how long any process of the job may live."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from pathlib import Path

import pytest

from tests.functional.processes import (
    ENDLESS,
    alive,
    kill_everything,
    stop_one_rank,
    torchrun,
    wait_for_step,
    wait_until,
    workers,
)

pytestmark = [pytest.mark.slow,  # runs training processes end to end, as every functional module
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds workers through /proc")]

WATCHDOG_MINUTES = 0.05  # 3 s without a beat
# torchrun's grace between its SIGTERM and SIGKILL when a worker has failed: 30 s, fixed (torch 2.13's
# _stop_workers does not pass --shutdown-timeout on); a stopped rank cannot act on the SIGTERM
SHUTDOWN_S = 30
LAUNCHER_DEATH_S = 5.0


BOUND_S = 60 * WATCHDOG_MINUTES + SHUTDOWN_S + 15  # watchdog + torchrun's shutdown + slack
_EARLY: dict = {}


def start_early(folder: Path) -> None:
    """The stopped-rank job, started by tests/conftest.py when the session begins (the ``starts_early`` mark):
    most of its ~40 s is torchrun's fixed grace, in which the suite's other tests run."""
    def job() -> None:
        try:
            _EARLY["result"] = stop_one_rank(folder / "out", ["--watchdog-timeout-minutes", str(WATCHDOG_MINUTES)],
                                             BOUND_S)
        except BaseException as err:  # noqa: B036 - re-raised by the test
            _EARLY["error"] = err

    _EARLY["thread"] = threading.Thread(target=job, name="stopped-rank-job", daemon=True)
    _EARLY["thread"].start()


@pytest.mark.starts_early
def test_a_stopped_rank_makes_its_peer_dump_its_stacks_and_the_job_end(tmp_path):
    """Rank 1 is SIGSTOPped mid-training. Rank 0 waits in a collective; its watchdog writes the stacks
    and exits 4; torchrun SIGTERMs the stopped rank (which cannot act on it), SIGKILLs it after its
    shutdown timeout and exits non-zero: everything is gone within watchdog + shutdown + slack."""
    if "thread" not in _EARLY:  # run on its own (the mark's hook did not see it)
        start_early(tmp_path)
    _EARLY["thread"].join(timeout=600)
    if "error" in _EARLY:
        raise _EARLY["error"]
    result, bound = _EARLY["result"], BOUND_S
    assert result.all_gone_s is not None, f"processes alive {bound} s after SIGSTOP (the test killed them)\n" \
                                          + result.log[-3000:]
    assert result.returncode not in (0, None), result.log[-3000:]
    header = result.dump.splitlines()[0]
    assert re.match(r"rank 0: no training progress for \d+\.\d s since the last beat, 'training step \d+' "
                    r"\(watchdog_timeout_minutes 0\.05\); ", header), header
    # the collective (or p2p) it waits in, and where in the repository it was called
    assert re.search(r"torch\.distributed[ .](all_reduce|all_gather|reduce_scatter|broadcast|barrier|send|recv)\b.*"
                     r" (called from|at) megatron/\S+\.py:\d+ \w+", header), header
    assert "most recent call first" in result.dump and "in _train" in result.dump
    assert header in result.log and "exiting with status 4." in result.log  # on the rank's stderr too
    assert re.search(r"exitcode\s*: 4 ", result.log)  # torchrun's summary: the root cause is the watchdog's exit
    assert re.search(r"exitcode\s*: -9 ", result.log)  # and torchrun, not the test, SIGKILLed the stopped rank
    assert result.dump_s < 60 * WATCHDOG_MINUTES + 5  # timed from the last beat, which came before the stop


def test_killing_torchrun_kills_its_workers(tmp_path):
    """Workers run in sessions of their own: only the parent-death signal can reach them."""
    out = tmp_path / "out"
    out.mkdir()
    job = torchrun([*ENDLESS, "--save", str(out)], tmp_path / "log")
    pids = {}
    try:
        pids = workers(job, 2)
        wait_for_step(out, 3, job)
        os.kill(job.pid, signal.SIGKILL)
        job.wait()
        gone = wait_until(lambda: not any(alive(p) for p in pids.values()), LAUNCHER_DEATH_S)
    finally:
        orphans = kill_everything(job, list(pids.values()))
    assert job.returncode == -signal.SIGKILL
    assert gone is not None and not orphans, f"workers {orphans} outlived torchrun by {LAUNCHER_DEATH_S} s"
