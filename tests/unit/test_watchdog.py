"""The hang watchdog (megatron/watchdog.py) and workers dying with their launcher (megatron/initialize.py)."""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron import watchdog
from megatron.watchdog import Watchdog, describe_wait

ROOT = Path(__file__).resolve().parents[2]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and prctl")


class RecordingWatchdog(Watchdog):
    """Records a firing instead of exiting the test process."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fired: list[tuple[str, float, float]] = []

    def _fire(self, label: str, silent: float) -> None:
        self.fired.append((label, silent, time.monotonic()))
        self._stopped.set()


def test_beats_keep_it_quiet_then_silence_fires_once_after_the_timeout(tmp_path):
    dog = RecordingWatchdog(0.3, str(tmp_path), rank=0)
    dog.start("step 1")
    for step in range(2, 12):  # 0.5 s of beats, each well inside the timeout
        time.sleep(0.05)
        dog.beat(f"step {step}")
    assert dog.fired == []
    silent_from = time.monotonic()
    time.sleep(0.3 + 0.5)
    dog.stop()
    assert len(dog.fired) == 1
    label, silent, when = dog.fired[0]
    assert label == "step 11" and silent >= 0.3
    assert when - silent_from < 0.3 + 0.1  # at the deadline, not a polling interval later


def test_stop_disarms_and_module_level_beat_is_a_no_op_without_a_watchdog(tmp_path):
    watchdog.beat("nothing armed")  # no error
    assert watchdog.start(0, str(tmp_path), rank=0) is None  # 0 disables
    assert watchdog.start(None, str(tmp_path), rank=0) is None
    dog = watchdog.start(10, str(tmp_path), rank=0)
    watchdog.beat("step 3")
    assert dog._last[1] == "step 3"
    watchdog.stop()
    assert watchdog._active is None and not dog._thread.is_alive()


def _blocked_here(event: threading.Event) -> None:
    event.wait()


def test_describe_wait_names_the_repository_frame_and_its_source_line():
    event = threading.Event()
    thread = threading.Thread(target=_blocked_here, args=(event,))
    thread.start()
    try:
        time.sleep(0.1)
        text = describe_wait(sys._current_frames()[thread.ident])
    finally:
        event.set()
        thread.join()
    assert re.fullmatch(r"the training thread is at tests/unit/test_watchdog\.py:\d+ _blocked_here: event\.wait\(\)",
                        text), text


# ---------------------------------------------------------------- a real hang in gloo, in subprocesses

def _hang(rank: int, port: int, how: str, out: str) -> None:
    """Rank 0 arms a 0.5 s watchdog and waits in ``how`` for rank 1, which never takes part."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=0.5))  # as short as the watchdog's
    if rank == 1:
        time.sleep(120)
    Watchdog(0.5, out, rank=0).start("step 7")
    if how == "all_reduce":
        dist.all_reduce(torch.ones(4), group=group)  # started right after the beat: its timeout comes later
    else:
        work = dist.irecv(torch.empty(4), src=1)
        work.wait()


def _run_two_ranks(function: str, *args) -> tuple[int, str, str]:
    """``function(rank, port, *args)`` of this module in two fresh interpreters; rank 0's (exit code,
    stdout, stderr) once it ends (rank 1 is killed then)."""
    from tests.functional.processes import free_port, popen

    port = free_port()
    call = ", ".join(repr(a) for a in args)
    procs = [popen([sys.executable, "-c", f"from tests.unit.test_watchdog import {function}; "
                                          f"{function}({rank}, {port}, {call})"],
                   cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    try:
        stdout, stderr = procs[0].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return procs[0].returncode, stdout, stderr


@pytest.mark.slow  # starts processes
@linux_only
@pytest.mark.parametrize("how, clause", [
    ("all_reduce", r"waiting in torch\.distributed\.all_reduce called from tests/unit/test_watchdog\.py:\d+ _hang"),
    ("irecv", r"waiting for an asynchronous torch\.distributed recv at tests/unit/test_watchdog\.py:\d+ _hang"),
], ids=["all_reduce", "irecv"])
def test_a_rank_waiting_in_a_collective_dumps_its_stacks_and_exits_4(tmp_path, how, clause):
    returncode, _, stderr = _run_two_ranks("_hang", how, str(tmp_path))
    assert returncode == watchdog.HANG_EXIT_CODE, stderr[-3000:]
    dump = (tmp_path / "hang" / "rank0.txt").read_text()
    header = dump.splitlines()[0]
    assert re.fullmatch(r"rank 0: no training progress for 0\.\d s since the last beat, 'step 7' "
                        rf"\(watchdog_timeout_minutes 0\.00833333\); {clause}", header), header
    assert "most recent call first" in dump and " in _hang" in dump  # faulthandler's stacks, every thread
    assert header in stderr and f"is in {tmp_path}/hang/rank0.txt; exiting with status 4." in stderr
    assert "most recent call first" in stderr.split(header, 1)[1]


# ---------------------------------------------------------------- the configured collective timeout

def _collective_timeout(rank: int, port: int, folder: str) -> None:
    """Both ranks join through ``initialize_distributed`` (timeout from the config); rank 0 then
    all-reduces on the default and the data-parallel group while rank 1 stays away."""
    import torch
    import torch.distributed as dist

    from megatron.config import parse_config, validate
    from megatron.initialize import initialize_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank))
    config = parse_config(["--mock-data", "--device", "cpu", "--num-layers", "1", "--hidden-size", "32",
                           "--num-attention-heads", "2", "--vocab-size", "64", "--max-seq-len", "8",
                           "--global-batch-size", "2", "--distributed-timeout-minutes", "0.02"])
    validate(config, world_size=2)
    Path(folder, f"ready{rank}").touch()  # start the rendezvous together: its own timeout is 1.2 s too
    while not Path(folder, f"ready{1 - rank}").exists():
        time.sleep(0.01)
    ps = initialize_distributed(config)
    if rank == 1:
        time.sleep(120)
    for name, group in (("default", None), ("data_parallel", ps.group("data_parallel"))):
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=group)
        except RuntimeError:
            print(f"{name} {time.monotonic() - start:.2f}", flush=True)


@pytest.mark.slow  # starts processes
@linux_only
def test_the_configured_timeout_bounds_collectives_on_every_group(tmp_path):
    _, stdout, stderr = _run_two_ranks("_collective_timeout", str(tmp_path))
    times = dict(line.split() for line in stdout.splitlines())
    assert set(times) == {"default", "data_parallel"}, stderr[-3000:]
    assert all(1.1 < float(t) < 4.0 for t in times.values()), times  # 0.02 minutes, not the former fixed 10


# ---------------------------------------------------------------- dying with the launcher

_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
time.sleep(120)
"""

_CHILD = """
import time
from megatron import initialize
if {poll}:
    initialize._set_parent_death_signal = lambda sig: False
    initialize.PARENT_POLL_SECONDS = 0.1
print(initialize.die_with_launcher(), flush=True)
time.sleep(120)
"""


@pytest.mark.slow  # starts processes
@linux_only
@pytest.mark.parametrize("mechanism", ["prctl", "poll"])
def test_a_worker_dies_with_its_launcher(mechanism):
    """The launcher (a stand-in for torchrun's agent) is SIGKILLed; its worker must be gone at once."""
    from tests.functional.processes import alive, popen, wait_until

    parent = popen([sys.executable, "-c", _PARENT, _CHILD.format(poll=mechanism == "poll")], cwd=ROOT,
                   stdout=subprocess.PIPE, text=True)  # in a session of its own: the worker's launcher
    child = int(parent.stdout.readline())
    try:
        assert parent.stdout.readline().strip() == mechanism  # the worker has installed it
        assert alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        gone = wait_until(lambda: not alive(child), 5.0)
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)
    assert gone is not None, "the worker outlived its launcher"
    assert gone < (0.5 if mechanism == "prctl" else 1.0)
