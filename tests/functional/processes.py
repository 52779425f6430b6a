"""Launch torchrun jobs in the background, find their workers, stop one, and time when all are gone.

Shared by the hang and launcher-death tests and by benchmarks/watchdog.py. Linux only: workers are
found through /proc (a worker is a child of torchrun carrying RANK in its environment).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

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
    """``torchrun --standalone --nproc-per-node nproc <launcher> pretrain_gpt.py <args>`` in a session of
    its own (so a test can always clean up), output to ``log``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               *launcher, str(ROOT / "pretrain_gpt.py"), *args]
    with open(log, "w") as f:
        return subprocess.Popen(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


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
