"""One writer at a time, and what it writes appearing whole or not at all.

**The lock**: an exclusive ``fcntl.flock`` on a file for as long as a process writes something, taken
without waiting. The kernel drops a ``flock`` when its holder's file is closed, and so when the process dies,
however it dies: a killed writer leaves nothing to clean up, and the next one takes the lock. The holder
writes who it is into the file (``pid P on HOST since T, running COMMAND``), which a refused writer quotes.
``drop`` removes the file while still holding it; a writer that locked a file that was removed meanwhile
notices (the path no longer names the file it holds) and tries again, so two writers never both hold "the"
lock.

Two open files conflict even in one process (a lock belongs to the open file, not to the process). Over
NFS, Linux turns ``flock`` into an NFS byte-range lock (kernel >= 2.6.12, the lock service running), seen
by every client; a file system mounted without locks (NFS ``nolock``, Lustre without ``-o flock``) either
fails the call (``Unsupported``, raised) or keeps locks local to each node, where writers on different
nodes are not seen.

**An output folder** (``OutputFolder``): the lock held on a file inside it, the folder (and its missing
parents) created first and removed again when a failed writer leaves them empty; the temporaries of killed
writers (of this host: their process is gone) removed.

**Private temporary names** (``private_name``: ``NAME.tmp.HOST-PID.RANDOM``, beside the final name, so that
renaming is atomic): no two processes ever write the same temporary file or folder, with or without the lock.
``Staged`` writes several files or folders at such names and renames them all at the end: a failure before
that (a full disk) leaves none of them, and the files they would replace unchanged.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import shlex
import shutil
import socket
import stat
import sys
import time
from collections.abc import Callable

_BUSY = (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN)


class Busy(Exception):
    """Another open file holds the lock; ``holder`` is what its holder wrote (``pid P on HOST since T``)."""

    def __init__(self, holder: str):
        super().__init__(holder)
        self.holder = holder


class Unsupported(Exception):
    """The file system refuses ``flock`` (the OSError's message)."""


def command_line() -> str:
    """This process's command as a refused writer quotes it: the script's name and its arguments."""
    argv = sys.argv or [""]
    return shlex.join([os.path.basename(argv[0]) or "python", *argv[1:]])


def hold(path: str, what: str | None = None):
    """The open file holding the lock on ``path`` (created if needed); Busy, Unsupported, or the OSError of
    opening it. ``what``: the command its holder line names (default ``command_line()``; at most 300
    characters)."""
    what = " ".join((what or command_line()).split())
    what = what if len(what) <= 300 else what[:297] + "..."
    for _ in range(10):
        f = _open_regular(path)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            f.seek(0)
            holder = " ".join(f.read(4096).split())  # a holder line, never a whole large file
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
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}, "
                f"running {what}\n")
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


class OutputFolder:
    """One writer of ``folder`` at a time: ``acquire`` creates the folder (and its missing parents), holds the
    lock on ``folder/lock_name`` (``hold``: its holder line names ``what``) and removes the private temporaries
    (``private_name``) that killed writers of this host left in the folder (their process is gone);
    ``release(failed)`` drops the lock and, after a failure, removes the folders ``acquire`` created when they are
    left empty (never a folder that was there before, never one holding anything). Also a context manager:
    ``with OutputFolder(...) as warning:``."""

    def __init__(self, folder: str, lock_name: str, what: str | None = None):
        self.folder, self.path, self.what = folder, os.path.join(folder, lock_name), what
        self.created: list[str] = []  # outermost first
        self._file = None

    def acquire(self) -> str | None:
        """Hold the lock. None, or a warning where the file system refuses ``flock`` (the writer goes on
        unguarded); Busy when another open file holds it; the OSError of creating the folder or the lock file."""
        self.created = _missing(self.folder)
        existed = os.path.lexists(self.path)
        try:
            self._file = self._hold()
        except Unsupported as err:
            if not existed:  # the file our open created
                remove_quietly(self.path)
            return (f"cannot lock {self.path} ({err}): this file system has no locks, so a second writer of "
                    f"{self.folder} at the same time would not be detected.")
        except BaseException:
            self._remove_created()
            raise
        for name in os.listdir(self.folder):
            if _killed_writers(name):
                remove_quietly(os.path.join(self.folder, name))
        return None

    def _hold(self):
        tries = 3
        while True:
            os.makedirs(self.folder, exist_ok=True)
            try:
                return hold(self.path, self.what)
            except FileNotFoundError:  # a failed writer removed the folder it had created: make it again
                tries -= 1
                if not tries:
                    raise

    def release(self, failed: bool) -> None:
        if self._file is not None:
            drop(self._file, self.path)
            self._file = None
        if failed:
            self._remove_created()

    def _remove_created(self) -> None:
        for folder in reversed(self.created):  # innermost first; stop at the first that holds something
            try:
                os.rmdir(folder)
            except OSError:
                break
        self.created = []

    def __enter__(self) -> str | None:
        return self.acquire()

    def __exit__(self, kind, value, traceback) -> None:
        self.release(failed=kind is not None)


def _missing(folder: str) -> list[str]:
    """The folders ``os.makedirs(folder)`` would create, outermost first."""
    missing, path = [], os.path.abspath(folder)
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    return missing[::-1]


_HOST = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64]
_PRIVATE = re.compile(r".+\.tmp\.(?P<host>[A-Za-z0-9._-]*)-(?P<pid>\d+)\.[0-9a-f]{8}")  # what private_name gives


def private_name(path: str) -> str:
    """A name beside ``path`` (in its folder: renaming to ``path`` is atomic) that no other process uses:
    ``NAME.tmp.HOST-PID.RANDOM``. Nothing is created."""
    return f"{path}.tmp.{_HOST}-{os.getpid()}.{secrets.token_hex(4)}"


def _killed_writers(name: str) -> bool:
    """Whether ``name`` is a private temporary of a process of this host that no longer runs. Another host's
    are never taken for dead: where locks are local to each node, their writer may be alive."""
    match = _PRIVATE.fullmatch(name)
    if match is None or match["host"] != _HOST:
        return False
    try:
        os.kill(int(match["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, ValueError):
        return False
    return False


def private_folder(path: str) -> str:
    """A new empty folder at a ``private_name`` of ``path`` (its mode that of any new folder)."""
    tmp = private_name(path)
    os.mkdir(tmp)
    return tmp


def write_private(path: str, write: Callable[[str], None]) -> str:
    """``write(tmp)`` at a ``private_name`` of ``path``, the file's mode that of any new file (0666 less the umask:
    some writers create theirs 0600, safetensors' ``save_file`` does); returns the name, for the caller to rename.
    A failing ``write`` leaves nothing."""
    tmp = private_name(path)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
    except BaseException:
        remove_quietly(tmp)
        raise
    return tmp


def write_synced(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def remove_quietly(path: str) -> None:
    """Remove a file or a folder (with what it holds) if it is there."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)
    except FileNotFoundError:
        pass


class Staged:
    """Files and folders written at private names (``file``, ``data``, ``folder``), then all renamed to their own
    names by ``commit``, in the order they were staged. Until then nothing of theirs is visible: a failure leaves
    none of them (``discard``, also when a ``with`` block ends without ``commit``) and the files they would
    replace unchanged. A staged folder may not replace a folder that holds anything (the rename fails)."""

    def __init__(self):
        self.moves: list[tuple[str, str]] = []

    def file(self, path: str, write: Callable[[str], None]) -> None:
        """``write(tmp)`` now (``write_private``), renamed to ``path`` at the commit."""
        self.moves.append((write_private(path, write), path))

    def data(self, path: str, data: bytes) -> None:
        """``data`` written (and fsynced) now, renamed to ``path`` at the commit."""
        self.file(path, lambda tmp: write_synced(tmp, data))

    def folder(self, path: str) -> str:
        """A new empty private folder to fill, renamed to ``path`` at the commit."""
        tmp = private_folder(path)
        self.moves.append((tmp, path))
        return tmp

    def commit(self) -> None:
        while self.moves:
            tmp, path = self.moves[0]
            os.replace(tmp, path)
            self.moves.pop(0)

    def discard(self) -> None:
        for tmp, _ in self.moves:
            remove_quietly(tmp)
        self.moves = []

    def __enter__(self) -> Staged:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        self.discard()
