"""Each dataset's token-id range, checked once against the model's vocabulary before training.

An id at or above the (unpadded) vocabulary size is never a valid token: in a padding row of the
embedding it gives an infinite loss, under tensor parallelism the vocab-parallel lookup silently
masks it to a zero embedding, and at tp 1 torch raises an IndexError mid-run. So the ``.bin`` is
scanned once (``np.max`` over memory-mapped chunks of ``SCAN_CHUNK_BYTES``; ``np.min`` too for signed
token types) and the result cached beside the indices, so a second run does not rescan. The entry is
keyed by the dataset's content key, the ``.bin``'s modification time *and* a probe of the ``.bin``'s bytes
(``bin_probe``): the content key hashes the ``.idx`` but only the size of the ``.bin``, so a ``.bin``
rewritten in place with the same size is told apart by its mtime, and one rewritten with its size and mtime
kept (``cp -p``, ``rsync -t``, ``touch -r``) by the probe: the CRC-32 of every byte of a ``.bin`` up to
``FULL_PROBE_BYTES`` (64 MiB: ~20 ms), else ``fingerprint.sample_digest``'s 64 blocks spread over it (a change
of a large file that touches no sampled block and keeps the mtime is not seen here; ``check_batch`` stops
training at the first batch holding such an id). A copy elsewhere is rescanned too. The scan follows
``index_cache.load_or_build`` (global rank 0, then each node's local rank 0, then every rank reads it),
and the verdict is agreed, so a bad dataset stops every rank with one ``DatasetError``. Given a ``report``
(a logging function), the rank that scans says so before and after (a scan of 10^10 tokens takes about
10 s from disk). The same pass computes the ``.bin``'s CRC-32, kept in the entry (``bin_crc32``: the data's
fingerprint, ``megatron.data.fingerprint``; about 1.5 s more per 10^9 two-byte tokens on one core).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zlib
from collections.abc import Callable

import numpy as np

from megatron.data import index_cache, summary
from megatron.data.fingerprint import sample_digest
from megatron.data.indexed_dataset import DatasetError, IndexedDataset, data_file

SCAN_CHUNK_BYTES = 256 << 20
FULL_PROBE_BYTES = 64 << 20  # a .bin up to this size is probed whole for the token-range entry's key


class Crc32:
    """CRC-32 of a stream of bytes (zlib's): the .bin's checksum, five times as fast as BLAKE2b here and enough to
    tell a copy or a rewrite apart (no one is assumed to forge one)."""

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def scan_token_range(indexed: IndexedDataset, chunk_bytes: int = SCAN_CHUNK_BYTES,
                     digest: Crc32 | None = None) -> tuple[int | None, int]:
    """(smallest id or None for an unsigned token type, largest id; -1 for no tokens), chunk by chunk; each
    chunk's bytes also go into ``digest`` when one is given (the ``.bin``'s hash, in the same pass)."""
    tokens = indexed.bin
    step = max(chunk_bytes // tokens.dtype.itemsize, 1)
    signed = tokens.dtype.kind != "u"
    low, high = None, -1
    for start in range(0, len(tokens), step):
        chunk = tokens[start:start + step]
        if digest is not None:
            digest.update(memoryview(np.ascontiguousarray(chunk)).cast("B"))
        high = max(high, int(chunk.max()))
        if signed:
            low = int(chunk.min()) if low is None else min(low, int(chunk.min()))
    return low, high


def bin_probe(path: str) -> str:
    """What of the ``.bin``'s bytes keys its token-range entry: all of them (CRC-32) up to ``FULL_PROBE_BYTES``,
    else ``sample_digest``'s blocks."""
    if os.path.getsize(path) > FULL_PROBE_BYTES:
        return "sample:" + sample_digest(path)
    digest = Crc32()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return "crc32:" + digest.hexdigest()


def _entry_path(indexed: IndexedDataset, folder: str) -> tuple[str, dict]:
    """The entry is keyed by the content key, the ``.bin``'s mtime and its probe: a ``.bin`` rewritten in place with
    the same size (which the content key cannot tell) is rescanned, also when its mtime was kept, and so is a copy
    elsewhere (~1 s per 10^9 tokens)."""
    bin_path = data_file(indexed.prefix)
    content = {**indexed.content_key(), "bin_mtime_ns": os.stat(bin_path).st_mtime_ns,
               "bin_probe": bin_probe(bin_path), "format": index_cache.CACHE_FORMAT}
    key = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:24]
    return os.path.join(folder, f"{key}-token_range.json"), content


def token_range(indexed: IndexedDataset, folder: str, vocab_size: int | None = None,
                report: Callable[[str], None] | None = None) -> tuple[int | None, int]:
    """The cached (smallest, largest) token id of ``indexed`` (scanned on the builder ranks if not cached in
    ``folder``). With ``vocab_size``, raise ``DatasetError`` on every rank if an id is outside
    ``[0, vocab_size)``. With ``report``, the scanning rank says when it starts and ends."""
    entry = scanned(indexed, folder, vocab_size, report)
    return entry["min_token_id"], entry["max_token_id"]


def scanned(indexed: IndexedDataset, folder: str, vocab_size: int | None = None,
            report: Callable[[str], None] | None = None) -> dict:
    """``token_range``'s cache entry: the content key, the .bin's mtime, ``min_token_id``, ``max_token_id`` and
    ``bin_crc32`` (the checksum of every byte of the .bin, computed by the same scan: ``megatron.data.fingerprint``)."""
    path, content = _entry_path(indexed, folder)

    def build() -> None:
        bin_path = data_file(indexed.prefix)
        if report is not None:
            where = summary.on_this_rank()
            report(f"{summary.PREFIX} scanning the token ids of {bin_path} ({summary.tokens(indexed.num_tokens)} "
                   f"tokens){where}...")
            start = time.perf_counter()
        digest = Crc32()
        low, high = scan_token_range(indexed, SCAN_CHUNK_BYTES, digest)
        if report is not None:
            ids = f"largest token id {high}" if low is None else f"token ids {low}..{high}"
            report(f"{summary.PREFIX} scanned {bin_path} in {summary.seconds(time.perf_counter() - start)}: {ids}, "
                   f"cached in {path}{where}")
        entry = {**content, "min_token_id": low, "max_token_id": high, "bin_crc32": digest.hexdigest()}
        text = json.dumps(entry, indent=2, sort_keys=True)
        with index_cache.writable(folder):
            os.makedirs(folder, exist_ok=True)
            index_cache.write_atomic(path, text.encode())

    def verify(entry: dict) -> None:
        if vocab_size is not None:
            check_range(data_file(indexed.prefix), entry["min_token_id"], entry["max_token_id"], vocab_size)

    return index_cache.load_or_build(f"the token-id scan of {data_file(indexed.prefix)}",
                                     lambda: index_cache.load_json(path, content), build, verify)


def check_range(bin_path: str, low: int | None, high: int, vocab_size: int) -> None:
    """Raise ``DatasetError`` if an id of ``bin_path`` is negative or at least ``vocab_size``."""
    if high >= vocab_size:
        raise DatasetError(f"{bin_path} holds token id {high} but the model's vocabulary has {vocab_size} ids "
                           f"(0..{vocab_size - 1}); re-preprocess the data with the model's tokenizer or raise "
                           f"vocab_size.")
    if low is not None and low < 0:
        raise DatasetError(f"{bin_path} holds token id {low}, a negative id; the file is corrupt or not token "
                           f"data: re-preprocess it with tools/preprocess_data.py.")


def check_batch(batch: dict, vocab_size: int) -> None:
    """Raise ``DatasetError`` when a batch (CPU tensors, before they reach the device: no synchronisation) holds a
    token id outside ``[0, vocab_size)``: data changed after its scan where no probe saw it would otherwise be an
    ``IndexError`` traceback (a device-side assert on a GPU) or, under tensor parallelism, a silent zero embedding."""
    ids = [batch[k] for k in ("tokens", "labels") if k in batch]
    high = max(int(t.max()) for t in ids) if ids and all(t.numel() for t in ids) else 0
    low = min(int(t.min()) for t in ids) if ids and all(t.numel() for t in ids) else 0
    if high >= vocab_size or low < 0:
        bad = high if high >= vocab_size else low
        raise DatasetError(f"a batch holds token id {bad}, outside the model's vocabulary of {vocab_size} ids "
                           f"(0..{vocab_size - 1}): the data changed after its token ids were checked (a .bin "
                           f"rewritten with its size and modification time kept?); re-preprocess it with the model's "
                           f"tokenizer, then train again.")
