"""How many query rows the plain block kernel (``blocks``) takes at a time, in the standard library only: the
kernel tiles by it and the memory estimate (``megatron.memory.attention``) counts by it, without torch.

A tile's fp32 scores ``[b, heads, rows, keys]`` (and its probabilities) stay under ``MATH_TILE_BYTES["limit"]``
whatever the block's length; a single row may exceed it. Tests lower the limit to make many tiles.
"""

from __future__ import annotations

MATH_TILE_BYTES = {"limit": 256 << 20}


def tile_rows(row_bytes: int) -> int:
    """Query rows per tile when one row's fp32 scores take ``row_bytes``: at least one."""
    return max(1, MATH_TILE_BYTES["limit"] // max(1, row_bytes))
