"""No process outlives the test session that started it: ``--collect-only`` starts no job (the ``starts_early``
hook waits for tests that will run), and whatever a test left running, its descendants in sessions of their own
included, is killed when the session ends, also when it is interrupted (tests/conftest.py's
``pytest_unconfigure``, tests/functional/processes.py's ``kill_leftovers``). Each test runs pytest in a
subprocess whose environment carries a probe, so that every process it starts can be found afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import pytest

from tests.functional.processes import ROOT, alive, marked, popen

pytestmark = [pytest.mark.slow,  # runs pytest in a subprocess
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds processes through /proc")]

PROBE = "PROCESS_CLEANUP_PROBE"


def _pytest(args: list[str], tmp_path, **env: str) -> tuple[subprocess.CompletedProcess, list[int]]:
    """``python -m pytest args`` (its temporary folders in tmp_path/tmp) to its end; (its outcome, the pids of
    every process it started that is still alive), the latter then killed."""
    (tmp_path / "tmp").mkdir()
    probe = uuid.uuid4().hex
    env = {**os.environ, PROBE: probe, "TMPDIR": str(tmp_path / "tmp"), **env}
    process = popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT, env=env,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=120)
    finally:
        process.kill()
        left = marked(PROBE, probe)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    return subprocess.CompletedProcess(process.args, process.returncode, output), left


def test_collect_only_starts_no_job_and_leaves_no_process(tmp_path):
    """tests/functional/test_hang.py's stopped-rank job (a 2-rank torchrun training 100000 steps) starts early,
    when the tests are about to run: never for --collect-only (or --co, the same option)."""
    result, left = _pytest([str(ROOT / "tests" / "functional" / "test_hang.py"), "--collect-only"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "test_hang.py::test_a_stopped_rank_makes_its_peer_dump_its_stacks_and_the_job_end" in result.stdout
    assert not list((tmp_path / "tmp").glob("test_hang-*")), "start_early was called: its job folder exists"
    assert left == [], f"processes left running after --collect-only: {left}"


# A process that starts a grandchild in a session of its own (as torchrun starts its workers), prints both pids
# and waits; a test that starts it and leaves it running, and one that is then interrupted (Ctrl-C).
_CHILD = ("import subprocess, sys, time; grandchild = subprocess.Popen([sys.executable, '-c', 'import time; "
          "time.sleep(600)'], start_new_session=True); print(grandchild.pid, flush=True); time.sleep(600)")
_TESTS = f'''
import os, signal, sys, time
from tests.functional.processes import popen

def _leave_running(name):
    child = popen([sys.executable, "-c", {_CHILD!r}], stdout=-1, text=True)
    grandchild = child.stdout.readline().strip()
    with open(os.path.join(os.environ["TMPDIR"], name), "w") as f:
        f.write(f"{{child.pid}} {{grandchild}}")

def test_leaves_a_process_running():
    _leave_running("left")

def test_is_interrupted():
    _leave_running("interrupted")
    if os.environ["STOP"] == "sigterm":  # as a CI timeout or a kill: pytest is told to stop
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
    raise KeyboardInterrupt  # as a Ctrl-C at the terminal: pytest stops here and ends the session
'''


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_processes_left_running_die_with_the_session_also_on_ctrl_c_or_sigterm(tmp_path, stop):
    tests = tmp_path / "test_leftovers.py"
    tests.write_text(_TESTS)
    # tests/conftest.py as a plugin: the module lies outside tests/, whose conftest would not apply
    result, left = _pytest([str(tests), "-p", "tests.conftest", "--rootdir", str(tmp_path)], tmp_path, STOP=stop)
    assert result.returncode == pytest.ExitCode.INTERRUPTED, result.stdout[-3000:]
    started = [int(pid) for name in ("left", "interrupted") for pid in (tmp_path / "tmp" / name).read_text().split()]
    assert len(started) == 4, started
    assert left == [] and not any(alive(pid) for pid in started), f"left running: {left}"
    assert "killed 4 processes the tests left running" in result.stdout, result.stdout[-3000:]
