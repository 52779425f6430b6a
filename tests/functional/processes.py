"""Start the test suite's background processes, launch torchrun jobs, find their workers, stop one, and time
when all are gone.

Shared by the hang and launcher-death tests, every test that starts a process it does not wait for, and by
benchmarks/watchdog.py. Linux only: workers are found through /proc (a worker is a child of torchrun carrying
RANK in its environment).

**Every process a test starts dies with the test session.** ``popen`` starts a process in a session of its own
(a Ctrl-C at the terminal reaches pytest alone, which then ends it), with ``PR_SET_PDEATHSIG`` = SIGKILL (it
dies when the thread that started it exits, pytest killed included), carrying this session's token in
``OWNER`` (its descendants inherit it: torchrun's workers run in sessions of their own, torch 2.13's
``SubprocessHandler`` starts them with ``start_new_session``, and a worker that is still importing when
torchrun dies is not reached by its own death signal), and registered. ``kill_leftovers()`` SIGKILLs every
process still in a registered session or carrying the token; tests/conftest.py calls it when the session ends
(normally, after ``--collect-only`` or on Ctrl-C), and so does this module at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWNER = "MEGATRON_TEST_OWNER"  # the environment variable: which test session started the process
_TOKEN = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"  # this process's; its own children get it
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_STARTED: list[subprocess.Popen] = []
_LOCK = threading.Lock()  # popen and kill_leftovers: no process started while the leftovers are killed
_CLOSED = False


def error_lines(text: str) -> list[str]:
    """The lines of a run's output that say "error" as a word (any case): the start-up config dump's
    ``error_injection_rate`` / ``transient_error`` keys are not errors."""
    return [line for line in text.splitlines() if re.search(r"\berror\b", line, re.IGNORECASE)]


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _libc() if sys.platform.startswith("linux") else None


def _die_with(parent: int, background: bool = False, address_space: int | None = None):
    """The child's preexec_fn: SIGKILL when the thread that started it exits; gone now if that already happened;
    ``background``: scheduled only on an idle core; ``address_space``: its virtual memory capped at that many bytes
    (``RLIMIT_AS``: an allocation beyond it fails, as on a machine that small)."""
    def preexec() -> None:
        if address_space is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
        if background:
            if hasattr(os, "SCHED_IDLE"):
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            else:
                os.nice(19)
            # with autogroups (Linux's default on desktops and these VMs) a new session is a scheduling group of its
            # own, which competes with the tests' group as an equal whatever its tasks' policy: lower the group
            with contextlib.suppress(OSError):
                Path("/proc/self/autogroup").write_text("19")
        if _LIBC is not None:
            _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)
    return preexec


def popen(command: list, *, env: dict | None = None, background: bool = False, address_space: int | None = None,
          **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(command, ...)`` for a test (see the module docstring): own session, dies with the thread
    that calls this (so call it from the thread that outlives the process: the test's), marked and registered;
    ``background``: it (and its descendants) computes only when a core is otherwise idle (``SCHED_IDLE``, and
    its session's scheduling group at nice 19; the lowest priority where those are missing). RuntimeError once
    the session's leftovers were killed."""
    environment = dict(os.environ if env is None else env)
    environment[OWNER] = _TOKEN
    with _LOCK:
        if _CLOSED:
            raise RuntimeError("the test session has ended: no new process")
        process = subprocess.Popen(command, env=environment, start_new_session=True,
                                   preexec_fn=_die_with(os.getpid(), background, address_space), **kwargs)
        _STARTED.append(process)
    return process


# The interpreter of run_tools_in_bounded_memory: each call a tool's main(argv) in turn, what it printed and its
# status (an exception that escapes it, a MemoryError say, is status 1 with its traceback), as JSON on stdout.
_TOOLS_DRIVER = """
import json, sys, traceback
sys.path.insert(0, sys.argv[1])
from tests.functional.launch import run_tool_here
results = []
for path, *argv in json.loads(sys.argv[2]):
    try:
        done = run_tool_here(path, *argv)
        results.append([done.returncode, done.stdout, done.stderr])
    except SystemExit as stop:
        results.append([stop.code, "", ""])
    except BaseException:
        results.append([1, "", traceback.format_exc()])
print(json.dumps(results))
"""


def run_tools_in_bounded_memory(calls: list[list[str]], address_space: int = 3 << 30, timeout: float = 120,
                                **kwargs) -> list[subprocess.CompletedProcess]:
    """Each of ``calls`` (a script of the repository, ``tools/x.py`` or ``pretrain_gpt.py``, then its arguments) run
    by its ``main(argv)``, one after the other, in one interpreter whose virtual memory is capped at
    ``address_space`` bytes (default 3 GiB: torch and the tools need about 1.5): an input that makes a tool grow
    without bound fails there, fast, rather than filling the machine; one interpreter for them all imports torch
    once. What each printed and its exit status."""
    command = [sys.executable, "-c", _TOOLS_DRIVER, str(ROOT), json.dumps([[str(a) for a in c] for c in calls])]
    process = popen(command, address_space=address_space, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    **kwargs)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
    if process.returncode != 0:
        raise AssertionError(f"the bounded interpreter ended with status {process.returncode}: {err[-2000:]}")
    return [subprocess.CompletedProcess(call, code, stdout, stderr)
            for call, (code, stdout, stderr) in zip(calls, json.loads(out.splitlines()[-1]))]


def _stat(pid: str) -> tuple[str, int] | None:
    """(state, session id) of a process, None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0], int(fields[3])


def _owned(pid: str, sessions: set[int], marker: bytes) -> bool:
    """Alive, and in one of ``sessions`` or carrying ``marker`` (``NAME=value``) in its environment."""
    stat = _stat(pid)
    if stat is None or stat[0] in "ZX":
        return False
    if stat[1] in sessions:
        return True
    try:
        return marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def marked(name: str = OWNER, value: str = _TOKEN, sessions: set[int] = frozenset()) -> list[int]:
    """The live processes whose environment has ``name=value`` (default: those this process started with
    ``popen``, and their descendants) or that are in ``sessions``; this process aside."""
    marker, me = f"{name}={value}".encode(), str(os.getpid())
    return [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and pid != me and _owned(pid, sessions, marker)]


def kill_leftovers(final: bool = True) -> list[int]:
    """SIGKILL every process ``popen`` started, and their descendants, still alive; the pids killed. A session
    counts while its leader is not reaped (its id cannot have been reused); the token finds the rest. ``final``:
    no ``popen`` after this."""
    global _CLOSED
    killed: set[int] = set()
    with _LOCK:
        _CLOSED = _CLOSED or final
        if not sys.platform.startswith("linux"):
            return []
        sessions = {p.pid for p in _STARTED if p.returncode is None}
        deadline = time.monotonic() + 10
        while (left := marked(OWNER, _TOKEN, sessions)) and time.monotonic() < deadline:  # until none forks any more
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            killed.update(left)
            time.sleep(0.01)  # SIGKILL is delivered asynchronously
        for process in _STARTED:  # reap them
            if process.returncode is None and process.pid in killed:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(10)
    return sorted(killed)


atexit.register(kill_leftovers)

# fp32 tiny GPT on synthetic data, many steps: a job that trains until it is stopped.
ENDLESS = ["--mock-data", "--device", "cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
           "--vocab-size", "128", "--max-seq-len", "32", "--max-position-embeddings", "32", "--global-batch-size", "16",
           "--eval-iters", "2", "--max-steps", "100000", "--eval-freq", "100000", "--logging-freq", "1",
           "--num-workers", "0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args: list[str], log: Path, nproc: int = 2, launcher: tuple[str, ...] = ()) -> subprocess.Popen:
    """``torchrun --standalone --nproc-per-node nproc <launcher> pretrain_gpt.py <args>`` started by ``popen``
    (in a session of its own, so a test can always clean up), output to ``log``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               *launcher, str(ROOT / "pretrain_gpt.py"), *args]
    with open(log, "w") as f:
        return popen(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)


def children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def alive(pid: int) -> bool:
    """Running, sleeping or stopped; False once it has exited (gone, or a zombie nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def workers(launcher: subprocess.Popen, count: int, timeout: float = 120) -> dict[int, int]:
    """{rank: pid} of the launcher's ``count`` workers, once they all exist."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and launcher.poll() is None:
        found = {rank_of(pid): pid for pid in children(launcher.pid)}
        found.pop(None, None)
        if len(found) == count:
            return found
        time.sleep(0.1)
    raise AssertionError(f"torchrun did not start {count} workers within {timeout} s (exit code {launcher.poll()}).")


def wait_for_step(out: Path, step: int, launcher: subprocess.Popen, timeout: float = 120) -> None:
    """Until ``out/metrics.jsonl`` records training step ``step`` (with --logging-freq 1)."""
    path, deadline = out / "metrics.jsonl", time.monotonic() + timeout
    while time.monotonic() < deadline and launcher.poll() is None:
        if path.exists():
            steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.endswith("}")]
            if steps and max(steps) >= step:
                return
        time.sleep(0.1)
    raise AssertionError(f"training did not reach step {step} within {timeout} s (exit code {launcher.poll()}).")


def wait_until(condition, timeout: float, interval: float = 0.02) -> float | None:
    """Seconds until ``condition()`` held, or None if it did not within ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if condition():
            return time.monotonic() - start
        time.sleep(interval)
    return None


def kill_everything(launcher: subprocess.Popen, pids: list[int]) -> list[int]:
    """SIGKILL the launcher's session and ``pids`` (continued first if stopped); the pids that were still alive."""
    left = [pid for pid in pids if alive(pid)]
    for pid in left:
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
    try:
        os.killpg(launcher.pid, signal.SIGKILL)
    except OSError:
        pass
    launcher.wait(timeout=30)
    return left


@dataclass
class HangResult:
    dump_s: float | None  # from SIGSTOP to the hang dump of the surviving rank existing
    all_gone_s: float | None  # from SIGSTOP to every process (torchrun and both workers) having exited
    returncode: int | None  # torchrun's
    dump: str  # the surviving rank's hang/rank{r}.txt
    log: str  # torchrun's and the workers' output


def stop_one_rank(out: Path, flags: list[str], bound: float, at_step: int = 5) -> HangResult:
    """A 2-rank job (ENDLESS + ``flags``): SIGSTOP rank 1 at ``at_step``, time rank 0's hang dump and
    everyone's exit (waiting at most ``bound`` seconds), then clean up whatever is left."""
    out.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}.log"
    job = torchrun([*ENDLESS, *flags, "--save", str(out)], log)
    pids = {}
    try:
        pids = workers(job, 2)
        wait_for_step(out, at_step, job)
        os.kill(pids[1], signal.SIGSTOP)
        start = time.monotonic()
        dump = out / "hang" / "rank0.txt"
        dump_s = wait_until(lambda: dump.exists() and dump.stat().st_size > 0, bound)
        left = bound - (time.monotonic() - start)
        gone = wait_until(lambda: job.poll() is not None and not any(alive(p) for p in pids.values()), left)
        all_gone_s = None if gone is None else time.monotonic() - start
    finally:
        kill_everything(job, list(pids.values()))
    text = dump.read_text() if dump.exists() else ""
    return HangResult(dump_s, all_gone_s, job.returncode if gone is not None else None, text, log.read_text())
