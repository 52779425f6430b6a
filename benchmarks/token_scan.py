"""Cost of the token-id check on a large dataset: the .idx hash, the first .bin scan, the cached second check.

    python benchmarks/token_scan.py            # 10^9 uint16 tokens (a 2 GB .bin), about a minute on 2 cores
    python benchmarks/token_scan.py --write    # also update the token_scan section of docs/benchmarks.md

A --tokens-token pair is written into a temporary folder with NumPy (random uint16 ids below --vocab-size in
documents of random length, uniform 1 .. 2 x --mean-doc-tokens - 1) and opened with IndexedDataset, which
checks it. Then, best of --repeats each:

- .idx hash: ``IndexedDataset.content_key()`` on a fresh instance (BLAKE2b of the .idx bytes, page cache warm);
- first check, cold: ``token_check.token_range`` on a fresh IndexedDataset (its own memory map; the .idx
  hash excluded, timed above) with an empty cache folder after evicting the .bin from the
  page cache (``posix_fadvise(DONTNEED)`` on that file only): the scan reads the disk (on a virtual machine
  the host may still cache it);
- first check, warm: the same with the .bin in the page cache (no disk reads: the memory map's page faults
  and np.max);
- cached second check: a fresh IndexedDataset and ``token_range`` against the cache entry the first check
  wrote, as a second run does (the .idx hash plus reading a small JSON file).

The scan reads the .bin in chunks of ``token_check.SCAN_CHUNK_BYTES`` (np.max over mmap slices). The folder is
removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.report import write_section  # noqa: E402
from megatron.data import token_check  # noqa: E402
from megatron.data.indexed_dataset import _HEADER, CODES, MAGIC, VERSION, IndexedDataset  # noqa: E402

MB = 2**20
INTRO = """`benchmarks/token_scan.py` measures what the token-id check before training costs on a dataset of
10^9 tokens: hashing the `.idx` (the cache key), the first scan of the `.bin` for its largest id (from disk
and from the page cache), and a second run's check, which reads the cached result. The script's docstring
says how each figure is taken."""


def write_pair(prefix: str, tokens: int, mean_doc: int, vocab: int, seed: int, chunk: int = 1 << 27) -> int:
    """A uint16 .bin/.idx pair of exactly ``tokens`` tokens; returns the number of documents."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 2 * mean_doc, size=tokens // mean_doc + 1, dtype=np.int64)
    ends = np.cumsum(sizes)
    n = int(np.searchsorted(ends, tokens)) + 1
    sizes = sizes[:n]
    sizes[-1] -= int(ends[n - 1]) - tokens
    with open(prefix + ".bin", "wb") as f:
        for start in range(0, tokens, chunk):
            f.write(rng.integers(0, vocab, size=min(chunk, tokens - start), dtype=np.uint16).tobytes())
    pointers = np.zeros(n, np.int64)
    np.cumsum(sizes[:-1] * 2, out=pointers[1:])
    with open(prefix + ".idx", "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, CODES[np.uint16], n, n + 1))
        f.write(sizes.astype("<i4").tobytes() + pointers.astype("<i8").tobytes())
        f.write(np.arange(n + 1, dtype="<i8").tobytes())
    return n


def evict(path: str) -> None:
    """Drop ``path``'s pages from the page cache (this file only)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def best(fn, repeats: int, before=None) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def measure(args, tmp: str) -> dict:
    prefix = os.path.join(tmp, "big")
    start = time.perf_counter()
    docs = write_pair(prefix, args.tokens, args.mean_doc_tokens, args.vocab_size, args.seed)
    write_s = time.perf_counter() - start
    indexed = IndexedDataset(prefix)
    assert indexed.num_tokens == args.tokens
    folder = os.path.join(tmp, "cache")
    hash_s, _ = best(lambda: IndexedDataset(prefix).content_key(), args.repeats)

    key = indexed.content_key()

    def first_check() -> tuple:
        """As a first run: a fresh instance (its own memory map) and no cache; the hash is timed above."""
        shutil.rmtree(folder, ignore_errors=True)
        fresh = IndexedDataset(prefix)
        fresh._content_key = key
        return token_check.token_range(fresh, folder, args.vocab_size)

    cold_s, _ = best(first_check, args.repeats, before=lambda: evict(prefix + ".bin"))
    warm_s, (_, high) = best(first_check, args.repeats)
    scans = []
    real = token_check.scan_token_range
    token_check.scan_token_range = lambda *a: scans.append(1) or real(*a)
    cached_s, _ = best(lambda: token_check.token_range(IndexedDataset(prefix), folder, args.vocab_size),
                       args.repeats)
    token_check.scan_token_range = real
    if scans or not 0 <= high < args.vocab_size:
        sys.exit("benchmarks/token_scan.py: the second check rescanned, or the scan found a wrong largest id")
    return {"docs": docs, "bin_mb": os.path.getsize(prefix + ".bin") / MB, "write_s": write_s,
            "idx_mb": os.path.getsize(prefix + ".idx") / MB, "hash_s": hash_s, "cold_s": cold_s,
            "warm_s": warm_s, "cached_s": cached_s, "high": high}


def render(args, r: dict) -> str:
    gbs = r["bin_mb"] / 1024
    return "\n".join([
        f"{os.cpu_count()} CPU cores, Python {sys.version.split()[0]}, NumPy {np.__version__}; MB = 2^20 bytes.", "",
        f"Dataset: {args.tokens:,} uint16 tokens (ids below {args.vocab_size:,}; largest {r['high']:,}) in "
        f"{r['docs']:,} documents: a {r['bin_mb']:,.0f} MB .bin and a {r['idx_mb']:.1f} MB .idx, written in "
        f"{r['write_s']:.1f} s. Scan chunks of {token_check.SCAN_CHUNK_BYTES // MB} MB; best of {args.repeats}.", "",
        "| step | time s | throughput |", "| --- | ---: | ---: |",
        f"| .idx hash (BLAKE2b, the cache key) | {r['hash_s']:.3f} | {r['idx_mb'] / r['hash_s']:,.0f} MB/s |",
        f"| first check, .bin from disk (scan + cache write) | {r['cold_s']:.3f} | {gbs / r['cold_s']:.2f} GB/s |",
        f"| first check, .bin in the page cache | {r['warm_s']:.3f} | {gbs / r['warm_s']:.2f} GB/s |",
        f"| cached second check (.idx hash + cached result) | {r['cached_s']:.3f} | - |",
        "", "The check runs once per dataset before training, on global rank 0 and then on each node's local "
        "rank 0 where the node's cache lacks it; a second run pays only the cached check."])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1_000_000_000, help="Tokens in the synthetic .bin.")
    p.add_argument("--mean-doc-tokens", type=int, default=1000, help="Mean document length.")
    p.add_argument("--vocab-size", type=int, default=50257, help="Ids are drawn below this.")
    p.add_argument("--repeats", type=int, default=3, help="Best of this many runs of each step.")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tmp-dir", default=None, help="Where the temporary folder goes (default: the system's).")
    p.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="token_scan_", dir=args.tmp_dir)
    try:
        result = measure(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    body = render(args, result)
    print(body)
    if args.write:
        write_section("token_scan", "Token-id check", "python benchmarks/token_scan.py " + " ".join(sys.argv[1:]),
                      body, INTRO)


if __name__ == "__main__":
    main()
