"""An exclusive lock on a file for as long as a process writes something: ``fcntl.flock`` on ``path``,
taken without waiting.

The kernel drops a ``flock`` when its holder's file is closed, and so when the process dies, however it
dies: a killed writer leaves nothing to clean up, and the next one takes the lock. The holder writes
who it is into the file (``pid P on HOST since T``), which a refused writer quotes. ``release`` removes
the file while still holding it; a writer that locked a file that was removed meanwhile notices (the path
no longer names the file it holds) and tries again, so two writers never both hold "the" lock.

Two open files conflict even in one process (a lock belongs to the open file, not to the process). Over
NFS, Linux turns ``flock`` into an NFS byte-range lock (kernel >= 2.6.12, the lock service running), seen
by every client; a file system mounted without locks (NFS ``nolock``, Lustre without ``-o flock``) either
fails the call (``Unsupported``, raised) or keeps locks local to each node, where writers on different
nodes are not seen.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import time

_BUSY = (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN)


class Busy(Exception):
    """Another open file holds the lock; ``holder`` is what its holder wrote (``pid P on HOST since T``)."""

    def __init__(self, holder: str):
        super().__init__(holder)
        self.holder = holder


class Unsupported(Exception):
    """The file system refuses ``flock`` (the OSError's message)."""


def hold(path: str):
    """The open file holding the lock on ``path`` (created if needed); Busy, Unsupported, or the OSError of
    opening it."""
    for _ in range(10):
        f = _open_regular(path)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            f.seek(0)
            holder = " ".join(f.read().split())
            f.close()
            if err.errno in _BUSY:
                raise Busy(holder or "another process") from None
            raise Unsupported(err.strerror or str(err)) from None
        try:
            same = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # its holder removed it between our open and our lock: lock the new one
            f.close()
            continue
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        return f
    raise Busy("writers that keep replacing the lock file")


def _open_regular(path: str):
    """``path`` opened for appending, created if needed; never through a symbolic link (a lock file linked to
    another file would have its holder line written there) and only a regular file."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", path)
    return os.fdopen(fd, "a+")


def drop(f, path: str) -> None:
    """Remove ``path`` and release the lock ``hold`` returned."""
    try:
        if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
            os.remove(path)
    except OSError:
        pass
    f.close()


def make_writable_folder(folder: str, tag: str = "") -> None:
    """Create ``folder`` (and its parents) and prove it writable by creating and removing a probe file named with
    ``tag`` and the pid; ``OSError`` when it cannot be made or written (read-only, full, not a folder)."""
    os.makedirs(folder, exist_ok=True)
    probe = os.path.join(folder, f".write_test.{tag}{os.getpid()}")
    with open(probe, "w"):
        pass
    os.remove(probe)
