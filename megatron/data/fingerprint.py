"""What the run's data is, by content: agreed by every rank at start, recorded for a resume, re-checked later.

A dataset's **fingerprint** is its content, never its path: the ``.idx`` size and BLAKE2b hash and the
``.bin`` size (``IndexedDataset.content_key``), the CRC-32 of every byte of the ``.bin`` (``bin_crc32``,
computed by the token-id scan in the same pass and cached with it: ``token_check.scanned``, keyed by the
``.bin``'s mtime), and ``bin_sample``, a hash of 64 blocks spread over the ``.bin`` read afresh at every
open (``sample_digest``: a change that kept the size and the mtime, as ``cp -p`` or ``rsync -t`` of other
bytes would, is still seen where it touches a block).

What is detected, and when:

- **A node-local copy that differs from the others** (multi-node, per-node data paths): at start, while the
  datasets are built, every rank's fingerprints are gathered (``agree``) and any difference is one
  ``DatasetError`` on every rank naming the dataset, two ranks, their hosts, paths and what differs.
- **A ``.bin`` or ``.idx`` changed under a running job**: each open records the files' identity (size,
  mtime, inode) and ``bin_sample``; a data-loader worker that re-opens the files (``IndexedDataset``'s
  unpickling: at each worker start) refuses a changed file with a ``DatasetError``, and ``verify_unchanged``
  (a collective: every rank re-stats and re-samples its files, the verdict agreed) is the check to run before
  each checkpoint is written: a change is then one line on every rank, before the checkpoint records data
  the run did not train on.
- **At resume**: ``of_datasets`` is the run's data fingerprint (JSON), to be saved with a checkpoint and
  compared at resume with ``compare(saved, now)`` (a message naming the dataset and what differs, or None).
"""

from __future__ import annotations

import hashlib
import os
import socket

from megatron.data.indexed_dataset import DatasetError, IndexedDataset, data_file, file_identity

SAMPLE_BLOCKS = 64
SAMPLE_BLOCK_BYTES = 4096
CONTENT = ("idx_size", "idx_blake2b", "bin_size", "bin_crc32", "bin_sample")  # what must agree


def sample_digest(path: str, blocks: int = SAMPLE_BLOCKS, block: int = SAMPLE_BLOCK_BYTES) -> str:
    """BLAKE2b of the file's size and of ``blocks`` blocks of ``block`` bytes spread evenly over it (the first
    and the last included; all of a small file): cheap at any size."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(str(size).encode())
        if size <= blocks * block:
            digest.update(f.read())
        else:
            for i in range(blocks):
                f.seek((size - block) * i // (blocks - 1))
                digest.update(f.read(block))
    return digest.hexdigest()


def record(indexed: IndexedDataset, scan_entry: dict) -> dict:
    """Set and return ``indexed.fingerprint`` from its token-scan entry (``token_check.scanned``; without one,
    as the builders' callers without a vocabulary, ``bin_crc32`` is None) and a fresh ``bin_sample``;
    ``indexed.identity`` is what ``verify_unchanged`` compares with later."""
    indexed.identity = file_identity(indexed.prefix)
    indexed.fingerprint = {**indexed.content_key(), "bin_crc32": scan_entry.get("bin_crc32"),
                           "bin_sample": sample_digest(data_file(indexed.prefix))}
    return indexed.fingerprint


def _differences(a: dict, b: dict) -> list[str]:
    return [name for name in CONTENT if a.get(name) != b.get(name)]


def agree(indexed: list[IndexedDataset], what: str) -> None:
    """Collective (every rank, datasets ``record``ed, in the same order): raise the same ``DatasetError`` on
    every rank when a dataset's fingerprint differs between ranks (a node's copy is not the others'). ``what``:
    the setting and its value ("input_dir '...'"); the message names the setting."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mine = (socket.gethostname(), [(ds.prefix, ds.fingerprint) for ds in indexed])
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    host0, first = everyone[0]
    for rank, (host, datasets) in enumerate(everyone[1:], 1):
        for d, ((path0, print0), (path, fingerprint)) in enumerate(zip(first, datasets)):
            differs = _differences(print0, fingerprint)
            if differs:
                setting = what.split(" ")[0]  # the same words on every rank: the setting, not this rank's paths
                raise DatasetError(
                    f"dataset {d} of {setting} differs between ranks: rank 0 (host {host0}) reads {path0}, rank {rank} "
                    f"(host {host}) reads {path}, and their {', '.join(differs)} differ; every node must hold the "
                    f"same files: copy them again (or give every rank the same path)")


def verify_unchanged(datasets) -> None:
    """Collective (every rank): re-stat and re-sample every ``.bin``/``.idx`` of ``datasets`` (a split, a blend,
    a tuple of them); when any rank finds a file changed since the run opened it, raise the same
    ``DatasetError`` on every rank. Cost: two stats and 64 small reads per dataset."""
    from megatron.agreement import first_failure

    error = None
    for ds in indexed_of(datasets):
        error = error or changed(ds)
    message = first_failure(error)
    if message is not None:
        raise DatasetError(message)


def changed(ds: IndexedDataset) -> str | None:
    """Why ``ds``'s files are not the ones it opened (None when they are)."""
    identity = getattr(ds, "identity", None)
    try:
        now = file_identity(ds.prefix)
        sample = sample_digest(data_file(ds.prefix)) if identity is not None else None
    except OSError as err:
        return f"{ds.prefix}: {err.strerror or err} since the run opened it; restore the dataset"
    if identity is None:
        return None
    fingerprint = getattr(ds, "fingerprint", {})
    if now != identity or sample != fingerprint.get("bin_sample"):
        return (f"{data_file(ds.prefix)} (or its .idx) changed since the run opened it (on {socket.gethostname()}): a "
                f"dataset must not be rewritten under a running job; restore it, or start a new run on the new data")
    return None


def indexed_of(datasets) -> list[IndexedDataset]:
    """The distinct indexed datasets under ``datasets`` (a split, a blend, a capped split, or a tuple of them)."""
    found: dict[int, IndexedDataset] = {}
    stack = list(datasets) if isinstance(datasets, (tuple, list)) else [datasets]
    while stack:
        ds = stack.pop()
        if ds is None:
            continue
        if isinstance(ds, IndexedDataset):
            found.setdefault(id(ds), ds)
        stack += [getattr(ds, "indexed", None), getattr(ds, "dataset", None), *getattr(ds, "datasets", [])]
    return sorted(found.values(), key=lambda ds: ds.prefix)


def of_datasets(datasets) -> dict:
    """The run's data fingerprint (JSON): each dataset's content fingerprint, with its path (informative only:
    a copy elsewhere is the same data). Compare two with ``compare``."""
    return {"datasets": [{"path": ds.prefix, **getattr(ds, "fingerprint", ds.content_key())}
                         for ds in indexed_of(datasets)]}


def compare(saved: dict | None, now: dict) -> str | None:
    """None when the data is the saved run's (same datasets, same content, in any path), else one sentence."""
    if not saved:
        return None
    before = {tuple(d.get(k) for k in CONTENT): d["path"] for d in saved.get("datasets", [])}
    after = {tuple(d.get(k) for k in CONTENT): d["path"] for d in now.get("datasets", [])}
    gone = [path for key, path in before.items() if key not in after]
    new = [path for key, path in after.items() if key not in before]
    if not gone and not new:
        return None
    return (f"the data differs from the checkpoint's run: {', '.join(gone) or 'nothing'} as it was then, "
            f"{', '.join(new) or 'nothing'} as it is now (its content changed, or other datasets are given); "
            f"restore the run's data, or start a new run from its weights (--finetune)")
