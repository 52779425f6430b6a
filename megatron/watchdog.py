"""Per-rank hang watchdog: a rank whose training stops making progress says where it is and exits.

Why: when one rank stops (a stopped or swapped-out process, a wedged device, a dead node whose
connections stay open), every other rank blocks inside its next collective and says nothing until
the process-group timeout, and then only that a collective timed out. The watchdog is a daemon
thread; the training loop calls ``beat()`` at least once a step and around evaluation and
checkpoint saves. When no beat has come for the timeout, the rank writes every thread's Python
stack, with a header naming the last beat and the operation the training thread waits in, to
stderr and to ``output_dir/hang/rank{r}.txt``, and exits with ``HANG_EXIT_CODE`` so that torchrun
tears the whole job down instead of leaving it waiting.

The module holds the one active watchdog, so any code (evaluation, checkpoint writing) can call
``beat()`` without being handed an object; with none armed, ``beat()`` does nothing.
"""

from __future__ import annotations

import faulthandler
import linecache
import os
import sys
import threading
import time
from types import FrameType

import torch.distributed as dist

HANG_EXIT_CODE = 4
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Watchdog:
    """Exits the process when ``beat()`` has not been called for ``timeout_s`` seconds once armed."""

    def __init__(self, timeout_s: float, output_dir: str, rank: int, exit_code: int = HANG_EXIT_CODE):
        if timeout_s <= 0:
            raise ValueError(f"watchdog timeout must be positive, got {timeout_s}; use no watchdog to disable it.")
        self.timeout_s, self.output_dir, self.rank, self.exit_code = timeout_s, output_dir, rank, exit_code
        self._last = (time.monotonic(), "start")  # one tuple: read and written atomically under the GIL
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._watched = threading.get_ident()

    @property
    def dump_path(self) -> str:
        return os.path.join(self.output_dir, "hang", f"rank{self.rank}.txt")

    def start(self, label: str = "start") -> None:
        """Arm: the calling thread is the one whose progress is watched; the clock starts now."""
        self._watched = threading.get_ident()
        self.beat(label)
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
        self._thread.start()

    def beat(self, label: str | None = None) -> None:
        """Record progress (cheap: a clock read and a store); ``label`` says what starts now."""
        self._last = (time.monotonic(), self._last[1] if label is None else label)

    def stop(self) -> None:
        """Disarm; returns once the thread has ended."""
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        """Sleep until the last beat's deadline, then look again: no polling, and the firing is within
        milliseconds of the deadline. That matters when the watchdog's timeout equals the collective
        timeout (the default): the beat comes before the collective starts, so the watchdog fires
        first and the rank's stacks are written instead of the collective's bare timeout error."""
        while True:
            beat_time, label = self._last
            remaining = beat_time + self.timeout_s - time.monotonic()
            if remaining > 0:
                if self._stopped.wait(remaining):
                    return
            elif self._stopped.is_set():
                return
            else:
                self._fire(label, time.monotonic() - beat_time)

    def report(self, label: str, silent: float) -> str:
        """The header of a hang dump: rank, last beat and what the watched thread is waiting in."""
        frame = sys._current_frames().get(self._watched)
        return (f"rank {self.rank}: no training progress for {silent:.1f} s since the last beat, '{label}' "
                f"(watchdog_timeout_minutes {self.timeout_s / 60:g}); {describe_wait(frame)}")

    def _fire(self, label: str, silent: float) -> None:
        header = self.report(label, silent)
        try:
            os.makedirs(os.path.dirname(self.dump_path), exist_ok=True)
            with open(self.dump_path, "w") as f:
                f.write(header + "\n\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
            where = f"every thread's stack follows and is in {self.dump_path}"
        except OSError as err:
            where = f"every thread's stack follows ({self.dump_path} could not be written: {err})"
        _write_stderr(f"{header}\n{where}; exiting with status {self.exit_code}.\n")
        try:
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
        except (OSError, ValueError, AttributeError, RuntimeError):  # a stderr without a file descriptor
            pass
        _write_stderr("")
        os._exit(self.exit_code)


def _write_stderr(text: str) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _frames(frame: FrameType | None) -> list[FrameType]:
    """The stack, innermost first."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def _is_torch_distributed(frame: FrameType) -> bool:
    return frame.f_globals.get("__name__", "").startswith("torch.distributed")


def _repo_path(frame: FrameType) -> str | None:
    """The frame's file relative to the repository, or None for a file outside it (libraries)."""
    if frame.f_code.co_filename.startswith("<"):  # "<string>", "<frozen runpy>": no file
        return None
    path = os.path.abspath(frame.f_code.co_filename)
    if not path.startswith(_REPO_ROOT + os.sep) or f"{os.sep}site-packages{os.sep}" in path:
        return None
    return os.path.relpath(path, _REPO_ROOT)


def _where(frame: FrameType, path: str) -> str:
    return f"{path}:{frame.f_lineno} {frame.f_code.co_name}"


def _public_call(frames: list[FrameType]) -> str | None:
    """The public torch.distributed function among ``frames`` (the library frames inside a repository
    frame), outermost first: the call the repository made, not the wrappers and helpers inside it."""
    for f in reversed(frames):
        name = f.f_code.co_name
        if _is_torch_distributed(f) and not name.startswith("_") and hasattr(dist, name):
            return name
    return None


def _op_name(work) -> str:
    """torch.distributed's name of an asynchronous operation's kind ("all_reduce", "send", ...)."""
    from torch._C._distributed_c10d import OpType

    name = OpType(work._get_op_type()).name.lower().strip("_").removesuffix("_base")
    for fused, spaced in (("allreduce", "all_reduce"), ("allgather", "all_gather"), ("alltoall", "all_to_all")):
        name = name.replace(fused, spaced)
    return name


def _pending_ops(frame: FrameType) -> str | None:
    """The kinds of the unfinished asynchronous operations held in ``frame``'s local variables
    (``work.wait()`` is native code, so the kind is on the work object, not on the stack)."""
    try:
        works = []
        for value in list(frame.f_locals.values()):
            items = value if isinstance(value, (list, tuple)) else [value]
            works += [w for w in items if isinstance(w, dist.Work) and not w.is_completed()]
        names = list(dict.fromkeys(_op_name(w) for w in works))
    except Exception:  # a private API (Work._get_op_type) that may change: the clause is optional
        return None
    return "/".join(names) or None


def describe_wait(frame: FrameType | None) -> str:
    """Where the thread of ``frame`` is, in one clause.

    The public ``torch.distributed`` function it is inside and the repository frame that called it
    ("waiting in torch.distributed.all_reduce called from megatron/training/step.py:66 all_reduce_sum");
    for an asynchronous operation's ``wait()`` (native code, no Python frame), the operation's kind
    from the work object; otherwise the innermost repository frame and its source line."""
    frames = _frames(frame)
    repo = [(i, f, path) for i, f in enumerate(frames) if (path := _repo_path(f)) is not None]
    if not repo:
        if not frames:
            return "the training thread's stack is not available"
        f = frames[0]
        return f"the training thread is at {f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}"
    i, f, path = repo[0]
    call = _public_call(frames[:i])
    if call:
        return f"waiting in torch.distributed.{call} called from {_where(f, path)}"
    caller = f", called from {_where(repo[1][1], repo[1][2])}" if len(repo) > 1 else ""
    pending = _pending_ops(f)
    if pending:
        return f"waiting for an asynchronous torch.distributed {pending} at {_where(f, path)}{caller}"
    line = linecache.getline(f.f_code.co_filename, f.f_lineno).strip()
    return f"the training thread is at {_where(f, path)}" + (f": {line}" if line else "") + caller


_active: Watchdog | None = None


def start(timeout_minutes: float | None, output_dir: str, rank: int, label: str = "start") -> Watchdog | None:
    """Arm this rank's watchdog (``timeout_minutes`` 0 or None: none) and make it the one ``beat()`` feeds."""
    global _active
    stop()
    if not timeout_minutes:
        return None
    _active = Watchdog(60.0 * timeout_minutes, output_dir, rank)
    _active.start(label)
    return _active


def beat(label: str | None = None) -> None:
    """Tell the active watchdog (if any) that training makes progress; ``label``: what starts now."""
    if _active is not None:
        _active.beat(label)


def stop() -> None:
    """Disarm the active watchdog, if any."""
    global _active
    if _active is not None:
        _active.stop()
        _active = None
