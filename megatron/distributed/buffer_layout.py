"""Where every parameter lives in the flat buffer: a pure function of names and shapes.

The buffer is a sequence of **buckets** in the order their gradients become ready (reverse
parameter order: the backward produces the last layers' gradients first). Within a bucket the
weight-decay parameters (matrices, ``ndim >= 2``) come first, then the others (biases, norms);
each bucket is padded to a multiple of the sharding degree N, and rank r of the sharding group
owns the r-th contiguous slice of every bucket. Nothing here touches a tensor: the layout of a
model is computed from ``(name, shape)`` pairs, so it can be tested (and reasoned about) alone.

Which parameters share a bucket: ``split_into_buckets`` (consecutive parameters up to a size,
stages 1 and 2) or ``layer_buckets`` (one per decoder layer, stage 3).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

Shape = Sequence[int]
Named = tuple[str, Shape]


def is_decay(shape: Shape) -> bool:
    """Weight decay applies to matrices only: biases and norm weights (1-D) get none."""
    return len(shape) >= 2


@dataclass(frozen=True)
class ParamSpan:
    """One parameter's ``[start, end)`` in the buffer."""

    name: str
    start: int
    end: int


@dataclass(frozen=True)
class BucketSpan:
    """``[start, end)`` in the buffer (``end`` padded); ``[start, decay_end)`` holds the weight-decay
    parameters; ``shard``: this rank's ``[a, b)``; ``shard_offset``: where it starts in the shard tensors."""

    index: int
    start: int
    end: int
    decay_end: int
    shard: tuple[int, int]
    shard_offset: int
    params: tuple[ParamSpan, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class BufferLayout:
    """The buckets, the buffer's padded size and the size of this rank's shard of it."""

    buckets: tuple[BucketSpan, ...]
    numel: int
    shard_numel: int


def lay_out(buckets: Sequence[Sequence[Named]], pad_multiple: int = 1, shard_rank: int = 0,
            shardings: Sequence[tuple[int, int]] | None = None) -> BufferLayout:
    """The layout of ``buckets`` (lists of (name, shape), empty ones skipped), each padded to a multiple of
    ``pad_multiple`` (the sharding degree N), with ``shard_rank``'s slice of each; ``shardings``: instead, each
    bucket's own (N, rank) (the experts' buckets are sharded over other ranks than the dense ones)."""
    spans: list[BucketSpan] = []
    offset = shard_offset = 0
    cuts = [(pad_multiple, shard_rank)] * len(buckets) if shardings is None else list(shardings)
    for members, (n, rank) in ((b, cut) for b, cut in zip(buckets, cuts) if b):
        span = _lay_out_bucket(len(spans), members, offset, shard_offset, n, rank)
        spans.append(span)
        offset, shard_offset = span.end, shard_offset + span.numel // n
    if not spans:
        raise ValueError("no trainable parameters")
    return BufferLayout(tuple(spans), offset, shard_offset)


def _lay_out_bucket(index: int, members: Sequence[Named], start: int, shard_offset: int, pad_multiple: int,
                    shard_rank: int) -> BucketSpan:
    ordered = [m for m in members if is_decay(m[1])] + [m for m in members if not is_decay(m[1])]
    params, offset, decay_end = [], start, start
    for name, shape in ordered:
        params.append(ParamSpan(name, offset, offset + math.prod(shape)))
        offset += math.prod(shape)
        decay_end = offset if is_decay(shape) else decay_end
    end = start + -(-(offset - start) // pad_multiple) * pad_multiple
    size = (end - start) // pad_multiple
    shard = (start + shard_rank * size, start + (shard_rank + 1) * size)
    return BucketSpan(index, start, end, decay_end, shard, shard_offset, tuple(params))


def split_into_buckets(named: Sequence[Named], bucket_size: int, own_bucket: tuple[str, ...] = ()) -> list[list[Named]]:
    """Consecutive parameters (already in gradient-ready order) grouped into buckets of at least
    ``bucket_size`` elements (a parameter is never split); a name ending in one of ``own_bucket``
    gets a bucket to itself."""
    buckets, current, size = [], [], 0
    for name, shape in named:
        if name.endswith(own_bucket):
            buckets += [current, [(name, shape)]] if current else [[(name, shape)]]
            current, size = [], 0
            continue
        current.append((name, shape))
        size += math.prod(shape)
        if size >= bucket_size:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


_LAYER = re.compile(r"^(.*?layers\.\d+)\.")


def layer_buckets(named: Sequence[Named],
                  own_bucket: tuple[str, ...] = ("word_embeddings.weight",)) -> list[list[Named]]:
    """ZeRO stage 3: one bucket per decoder layer (``...layers.<i>.``), one per name ending in
    ``own_bucket`` (the word embedding), and one for each model chunk's other parameters (position
    embedding, final norm), in the order of ``named``. (A MoE layer's experts, sharded over other ranks, are
    laid out by the caller as buckets of their own.)"""
    buckets: dict[str, list] = {}
    for name, shape in named:
        match = _LAYER.match(name)
        if match:
            key = match.group(1)
        elif name.endswith(own_bucket):
            key = name
        else:
            key = name.split("embedding.")[0].split("final_layernorm.")[0] + "<other>"
        buckets.setdefault(key, []).append((name, shape))
    return list(buckets.values())
