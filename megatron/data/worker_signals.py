"""Data-loader workers leave the stop signals to the trainer.

A preemption signals a whole process group (``kill -- -PGID``, ``scancel``, systemd, and torchrun, which
sends its SIGTERM to each rank's group): the data-loader workers get it too. PyTorch's worker dies of a
SIGTERM that its parent did not send, and the trainer, saving at the end of the step, then fails on the
dead worker: the run is lost. So a worker ignores every signal the trainer handles (SIGTERM, SIGUSR1,
SIGINT), with one exception kept from PyTorch: a SIGTERM from its own parent (the DataLoader ending a
worker that does not stop at shutdown, or multiprocessing's exit handler) still ends it.

The signals are blocked in the thread that starts the workers for as long as it starts them, so that a
worker created then cannot be hit before it has set this up: a signal sent meanwhile to the trainer waits
and is handled when the block ends, one sent to the worker is discarded or, for SIGTERM, judged by its
sender like any later one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator, Sequence

_CAN = hasattr(signal, "pthread_sigmask") and hasattr(signal, "sigwaitinfo")  # POSIX (Linux, macOS has no sigwaitinfo)


@contextlib.contextmanager
def blocked(signals: Sequence[int]) -> Iterator[None]:
    """``signals`` blocked in the calling thread (and in the processes and threads it starts) for the block."""
    if not (_CAN and signals):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_in_worker(signals: Sequence[int], worker_id: int = 0) -> None:
    """A worker's ``worker_init_fn``: ignore ``signals``; a SIGTERM among them stays blocked and a thread takes
    each one, ending the worker only when its parent sent it (as PyTorch's own worker handler does)."""
    if not _CAN or not signals:
        return
    for sig in signals:
        if sig != signal.SIGTERM:
            signal.signal(sig, signal.SIG_IGN)  # discards one pending since the worker started
    if signal.SIGTERM in signals:
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
        threading.Thread(target=_sigterm_from_parent_only, args=(os.getppid(),), daemon=True,
                         name="sigterm-from-parent").start()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [s for s in signals if s != signal.SIGTERM])


def _sigterm_from_parent_only(parent: int) -> None:
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == parent:
            os._exit(0)
