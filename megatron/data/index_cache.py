"""The on-disk cache of what is computed from a dataset (index arrays, its token-id range), and who builds it.

**Key.** A cache entry is named by a hash of what its contents depend on. For the dataset that is its
content as a copy keeps it (``IndexedDataset.content_key``: the ``.idx`` size and BLAKE2b hash, the
``.bin`` size), never its path or modification time, so a node-local copy of the data hits the same
entry as the original. The token-id range (``token_check``) is the exception: it depends on the ``.bin``'s
bytes, which the content key does not hash, so its entry is keyed by the ``.bin``'s mtime as well.

**Who builds** (``load_or_build``), in three phases that every rank enters:

1. global rank 0 builds the entry if it is missing or unreadable;
2. on every node, local rank 0 (``LOCAL_RANK == "0"``, as torchrun sets it) builds it if it is still
   missing there: a cache folder that is not shared between nodes gets its own copy;
3. every rank loads it (memory-maps the arrays).

Each phase ends with an all-reduce of a failure flag (which is also the barrier), so that when any
rank fails every rank raises (``DatasetError`` naming the failure, or the builder's own error) and
none waits in a collective the others skip. A run without ``torch.distributed`` is global and local
rank 0. Files are written under unique temporary names and renamed into place, the description
last, so concurrent builders on a shared disk are harmless and a killed build leaves no entry that
looks complete. An entry that cannot be read back (a truncated or corrupt ``.npy``, a shape or dtype
that disagrees with its description) is rebuilt with a warning.

**Foreign or stale entries.** The file name is only a hash: the entry itself says what it is. Its
description holds the whole key (every field of what it was built from) and, per array, a digest of its
``.npy`` file (size, first and last MiB: ``file_digest``); on load the key stored inside is compared with
the key asked for, and each array's digest with its file. An entry built for another dataset or
configuration, a file copied in from another entry or cache folder, a stale or half-replaced one: rebuilt,
with a warning that says which field or file differs. Never used.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np

from megatron.agreement import first_failure
from megatron.data.indexed_dataset import DatasetError

T = TypeVar("T")

CACHE_FORMAT = 3  # 1: keyed by path and mtime, split by document; 2: keyed by content, split by sequence;
# 3: the key and each array's digest stored in the entry, checked on load; the token-range entry holds the .bin's hash
DIGEST_SPAN = 1 << 20  # file_digest reads this much at each end of a file
DEFAULT_FOLDER = "index-cache"


def cache_folder(prefix: str, data_cache_path: str | None) -> str:
    """``data_cache_path`` when given, else ``index-cache/`` beside the dataset."""
    return data_cache_path or os.path.join(os.path.dirname(os.path.abspath(prefix)), DEFAULT_FOLDER)


def _log():
    from megatron.metrics import get_logger

    return get_logger()


# ----------------------------------------------------------------------------- ranks and agreement
def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def is_global_builder() -> bool:
    import torch.distributed as dist

    return not _distributed() or dist.get_rank() == 0


def _is_local_builder() -> bool:
    """Local rank 0 of a torchrun launch (or the only process); a launch without LOCAL_RANK has none."""
    return not _distributed() or os.environ.get("LOCAL_RANK") == "0"


def _raise_if_any(error: BaseException | None, what: str) -> None:
    """Every rank enters; every rank raises if any rank has an error: its own, or the first failing
    rank's message as a DatasetError (``megatron.agreement``)."""
    message = first_failure(None if error is None else " ".join(str(error).split()) or type(error).__name__)
    if error is not None:
        raise error
    if message is not None:
        raise DatasetError(message)


def run_agreed(fn: Callable[[], T], what: str) -> T:
    """``fn()`` on every rank; if it raises on any rank, every rank raises (see ``_raise_if_any``)."""
    try:
        value, error = fn(), None
    except Exception as err:  # handed to every rank through the failure flag, then re-raised here
        value, error = None, err
    _raise_if_any(error, what)
    return value


def load_or_build(what: str, load: Callable[[], tuple[T | None, str | None]], build: Callable[[], None],
                  verify: Callable[[T], None] | None = None) -> T:
    """The three phases above. ``load() -> (value, None)`` on a hit, ``(None, None)`` when the entry is
    missing, ``(None, why)`` when it is unreadable; ``build()`` writes it; ``verify(value)`` runs on every
    rank after loading and raises ``DatasetError`` to stop every rank."""
    first = is_global_builder()
    for builds in (first, _is_local_builder() and not first):
        _raise_if_any(_build_if_missing(what, load, build) if builds else None, what)

    def load_and_verify() -> T:
        value, why = load()
        if value is None:
            raise DatasetError(f"{what} is {why or 'missing'} on this rank after the builders ran (global rank 0, "
                               f"then each node's LOCAL_RANK 0): launch with torchrun, which sets LOCAL_RANK, or give "
                               f"--data-cache-path a folder that every rank can read.")
        if verify is not None:
            verify(value)
        return value

    return run_agreed(load_and_verify, what)


def _build_if_missing(what: str, load: Callable, build: Callable[[], None]) -> BaseException | None:
    try:
        value, why = load()
        if value is None:
            if why is not None:
                _log().warning(f"{what}: {why}; rebuilding it")
            build()
    except Exception as err:  # agreed by the caller, then re-raised on this rank
        return err
    return None


# ----------------------------------------------------------------------------- files
@contextlib.contextmanager
def writable(folder: str) -> Iterator[None]:
    """Turn an OSError while writing under ``folder`` into a one-line DatasetError that says what to do."""
    try:
        yield
    except OSError as err:
        reason = err.strerror or str(err)
        hint = " (the folder is read-only)" if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM) else ""
        raise DatasetError(f"cannot write the dataset index cache in {folder}: {reason}{hint}; give "
                           f"--data-cache-path a writable folder (by default the cache is written beside the "
                           f"data).") from None


def _tmp_name(path: str) -> str:
    return f"{path}.tmp.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def write_atomic(path: str, data: bytes | np.ndarray) -> None:
    """Write ``path`` under a unique temporary name, then rename it into place (an array as .npy)."""
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            if isinstance(data, np.ndarray):
                np.save(f, data, allow_pickle=False)
            else:
                f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def file_digest(path: str, span: int = DIGEST_SPAN) -> str:
    """BLAKE2b of a file's size and of its first and last ``span`` bytes (all of a small file): cheap at any
    size, and different for a file copied in from another entry (whose bytes differ at the ends)."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(str(size).encode())
        digest.update(f.read(span))
        if size > span:
            f.seek(max(span, size - span))
            digest.update(f.read(span))
    return digest.hexdigest()


def save_arrays(base: str, arrays: dict[str, np.ndarray], description: dict) -> None:
    """``{base}_{name}.npy`` per array, then ``{base}_description.json`` (the key ``description``, each array's
    shape, dtype and file digest) which marks the set complete."""
    folder = os.path.dirname(base)
    with writable(folder):
        os.makedirs(folder, exist_ok=True)
        for name, arr in arrays.items():
            write_atomic(f"{base}_{name}.npy", arr)
        shapes = {name: {"shape": list(arr.shape), "dtype": arr.dtype.str, "digest": file_digest(f"{base}_{name}.npy")}
                  for name, arr in arrays.items()}
        text = json.dumps({"key": description, "arrays": shapes}, indent=2, sort_keys=True)
        write_atomic(f"{base}_description.json", text.encode())


def _key_difference(stored: object, key: dict) -> str | None:
    """Why the key stored in an entry is not ``key`` (None when it is)."""
    if not isinstance(stored, dict):
        return "holds no key (written by another version)"
    for name in sorted(set(key) | set(stored)):
        if stored.get(name) != key.get(name):
            return (f"was built for another dataset or configuration ({name} {stored.get(name)!r}, here "
                    f"{key.get(name)!r})")
    return None


def load_arrays(base: str, names: tuple[str, ...], key: dict) -> tuple[dict[str, np.ndarray] | None, str | None]:
    """Memory-mapped arrays saved by ``save_arrays`` under ``key``: ``(arrays, None)``, ``(None, None)`` if the
    set is absent, or ``(None, why)`` if a file is unreadable, disagrees with the description, or the key stored
    in the entry is not ``key`` (a foreign or stale entry)."""
    desc_path = f"{base}_description.json"
    if not os.path.exists(desc_path):
        return None, None
    try:
        with open(desc_path) as f:
            description = json.load(f)
        expected = description["arrays"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return None, f"{desc_path} is unreadable ({type(err).__name__})"
    differs = _key_difference(description.get("key"), key)
    if differs:
        return None, f"{desc_path} {differs}"
    arrays = {}
    for name in names:
        path = f"{base}_{name}.npy"
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except Exception as err:  # a truncated or overwritten file fails in many ways (ValueError, EOFError, ...)
            return None, f"{path} is unreadable ({type(err).__name__}: {err})"
        want = expected.get(name, {})
        if list(arr.shape) != want.get("shape") or arr.dtype.str != want.get("dtype"):
            return None, (f"{path} holds {arr.dtype.str}{list(arr.shape)} but its description says "
                          f"{want.get('dtype')}{want.get('shape')}")
        if file_digest(path) != want.get("digest"):
            return None, f"{path} is not the file its description was written with (copied in, or replaced)"
        arrays[name] = arr
    return arrays, None


def load_json(path: str, expected: dict) -> tuple[dict | None, str | None]:
    """A JSON entry whose items include ``expected``: ``(value, None)``, ``(None, None)`` if absent, ``(None, why)``."""
    if not os.path.exists(path):
        return None, None
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError) as err:
        return None, f"{path} is unreadable ({type(err).__name__})"
    if not isinstance(value, dict) or any(value.get(k) != v for k, v in expected.items()):
        return None, f"{path} does not describe this dataset"
    return value, None
