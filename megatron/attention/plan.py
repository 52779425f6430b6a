"""Which blocks of queries and keys attention computes: ``AttentionPlan``, built once per micro-batch by the model
and shared by its layers.

The plan holds what attention must respect beyond the lower triangle: the context-parallel group this rank's tokens
are split over (``layout.py``'s chunks) and the documents of packed samples (``document_ids``, [b, s] over the whole
sequence). A layer adds its sliding window (``window``: the keys before each query it sees; None: all).
``blocks(kv_rank, length, window)`` says which ``Block``s this rank's queries compute against rank ``kv_rank``'s
keys (cached per micro-batch):

- each pair of a query chunk and a key chunk (rank r holds chunks r and 2cp-1-r; cp 1: the whole sequence is one
  chunk) whose keys do not all come after its queries: the same chunk is the lower triangle, an earlier one is
  seen whole;
- with a window, the query rows in tiles (``TILE`` rows, at least the window plus one) against the keys a tile can
  see: the pairs and tiles wholly outside the window are never computed, so attention costs O(s x window);
- with documents, each block cut into its documents (per sample; a block sharing no document is skipped);
- every block trimmed to the query rows that see at least one of its keys and the keys some row sees (a row with
  nothing to see would make the kernel's softmax empty).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.attention.blocks import Block
from megatron.attention.dropout import BlockDropout

TILE = {"rows": 256}  # query rows of one windowed block (at least the window + 1)


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp) a context-parallel rank holds, in its local order (the load-balanced split:
    ``context_parallel/layout.py``)."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


@dataclass
class AttentionPlan:
    """What this micro-batch's attention respects: the cp split and the documents of packed samples."""

    cp_size: int = 1
    cp_rank: int = 0
    group: dist.ProcessGroup | None = None
    comm_type: str = "p2p"
    document_ids: torch.Tensor | None = None  # [b, s] over the whole sequence, or None: one document per sample
    positional_dropout: bool = False  # cp 1 and a2a too draw attention dropout by position (``dropout.py``)
    seed: int | None = None  # the attention dropout's seed of this micro-batch (None: drawn at first use)
    # cp > 1: how the ranks' keys and values meet (``context_parallel.attention.exchange``, by ``comm_type``)
    exchange: Callable | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    def dropout(self, p: float, layer: int, heads: int, first_head: int) -> BlockDropout:
        """The positional attention dropout of a layer in this micro-batch (``dropout.py``): its seed drawn once per
        plan from the tracker's ``positional-dropout`` stream (alike on every rank; recompute replays it)."""
        if self.seed is None:
            from megatron.tensor_parallel.random import ATTENTION_DROPOUT_RNG, get_rng_tracker

            tracker = get_rng_tracker()
            with tracker.fork(ATTENTION_DROPOUT_RNG):
                self.seed = int(torch.randint(0, 2 ** 62, (1,), device=tracker.device).item())
        return BlockDropout(p, self.seed, layer, first_head)

    @property
    def ring_ranks(self) -> tuple[int, int]:
        """(next, previous) global ranks of this rank's ring."""
        if "ring" not in self._cache:
            ranks = dist.get_process_group_ranks(self.group)
            self._cache["ring"] = ranks[(self.cp_rank + 1) % self.cp_size], ranks[(self.cp_rank - 1) % self.cp_size]
        return self._cache["ring"]

    def document_ends(self) -> list[list[int]]:
        """Per sample, the end of each of its documents over the whole sequence (cached: read once per
        micro-batch, not per layer)."""
        if "ends" not in self._cache:
            self._cache["ends"] = [_boundaries(ids) for ids in self.document_ids.tolist()]
        return self._cache["ends"]

    def blocks(self, kv_rank: int, length: int, window: int | None = None) -> list[Block]:
        """The blocks of this rank's ``length`` local queries against rank ``kv_rank``'s keys (cached)."""
        key = (kv_rank, length, window)
        if key not in self._cache:
            ends = None if self.document_ids is None else self.document_ends()
            self._cache[key] = plan_blocks(self.cp_rank, kv_rank, self.cp_size, length, window, ends)
        return self._cache[key]


def _boundaries(ids: list[int]) -> list[int]:
    """The end of every run of equal ids."""
    return [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]] + [len(ids)]


def _chunks(rank: int, cp: int, chunk: int) -> list[tuple[int, int]]:
    """(first local row, first global position) of each chunk a rank holds."""
    if cp == 1:
        return [(0, 0)]
    return [(i * chunk, c * chunk) for i, c in enumerate(chunk_ids(rank, cp))]


def _tiles(q0: int, k0: int, chunk: int, window: int | None):
    """(query range, key range) in global positions of a chunk pair's pieces: the whole pair without a window, else
    tiles of query rows against the keys of the pair they can see."""
    if window is None:
        yield q0, q0 + chunk, k0, min(k0 + chunk, q0 + chunk)
        return
    rows = max(window + 1, TILE["rows"])
    for a in range(q0, q0 + chunk, rows):
        b = min(a + rows, q0 + chunk)
        yield a, b, max(k0, a - window), min(k0 + chunk, b)


def _trimmed(qa: int, qb: int, ka: int, kb: int, window: int | None) -> tuple[int, int, int, int] | None:
    """The query rows of [qa, qb) that see a key of [ka, kb), and the keys some of them see; None: none."""
    qa, qb = max(qa, ka), qb if window is None else min(qb, kb + window)
    ka, kb = ka if window is None else max(ka, qa - window), min(kb, qb)
    return (qa, qb, ka, kb) if qa < qb and ka < kb else None


def plan_blocks(q_rank: int, kv_rank: int, cp: int, length: int, window: int | None,
                document_ends: list[list[int]] | None) -> list[Block]:
    """The blocks of rank ``q_rank``'s ``length`` local queries against rank ``kv_rank``'s keys (see the module's
    docstring); ``document_ends``: per sample, where each document ends (None: one document per sample)."""
    chunk = length if cp == 1 else length // 2
    blocks = []
    for q_local, q0 in _chunks(q_rank, cp, chunk):
        for k_local, k0 in _chunks(kv_rank, cp, chunk):
            if k0 > q0:
                continue  # every key after every query
            for qa, qb, ka, kb in _tiles(q0, k0, chunk, window):
                pieces = ([(None, qa, qb, ka, kb)] if document_ends is None else
                          _by_document(document_ends, qa, qb, ka, kb))
                for sample, *ranges in pieces:
                    kept = _trimmed(*ranges, window)
                    if kept is not None:
                        a, b, c, d = kept
                        blocks.append(Block(slice(a - q0 + q_local, b - q0 + q_local),
                                            slice(c - k0 + k_local, d - k0 + k_local), a - c, window, sample,
                                            a))
    return blocks


def _by_document(document_ends: list[list[int]], qa: int, qb: int, ka: int, kb: int):
    """(sample, query range, key range) of each document with tokens in both ranges, per sample."""
    for sample, ends in enumerate(document_ends):
        first = bisect.bisect_right(ends, min(qa, ka))  # the document holding the earliest token of either range
        for d in range(first, len(ends)):
            start = ends[d - 1] if d else 0
            if start >= max(qb, kb):
                break
            q_range, k_range = (max(qa, start), min(qb, ends[d])), (max(ka, start), min(kb, ends[d]))
            if q_range[0] < q_range[1] and k_range[0] < k_range[1]:
                yield sample, *q_range, *k_range
