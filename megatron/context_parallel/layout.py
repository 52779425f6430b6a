"""The load-balanced split of a sample over the context-parallel ranks (pure functions).

A sample of ``s`` tokens is cut into ``2 cp`` chunks of ``c = s / (2 cp)``; rank ``r`` keeps chunks
``r`` and ``2 cp - 1 - r``, in that order (Megatron-LM's scheme). Under a causal mask a late chunk
attends to more keys than an early one; pairing chunk ``r`` with its mirror gives every rank the same
work. With ``cp = 2`` and ``s = 8``::

    tokens   t0 t1 | t2 t3 | t4 t5 | t6 t7       chunks 0 1 2 3 of c = 2
    rank 0   t0 t1          t6 t7              chunks 0 and 3
    rank 1          t2 t3 t4 t5                chunks 1 and 2

A rank's local order is increasing in global position, so causality between its own tokens is the
ordinary lower triangle. Position ids, labels and the loss mask travel with their tokens
(``split_batch``); the document ids of packed data stay whole (every rank derives the attention of any
pair of chunks from them).
"""

from __future__ import annotations

import torch

from megatron.attention.plan import chunk_ids  # noqa: F401 (the split's rule, beside the blocks it plans)

WHOLE_KEYS = ("document_ids",)  # [b, s] fields every rank keeps whole; the others ([b, s, ...]) are cut with the tokens


def local_positions(seq_len: int, cp_rank: int, cp_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The global positions of a rank's ``seq_len / cp`` local tokens, in local order."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"a sequence of {seq_len} tokens cannot be cut into 2 x {cp_size} equal chunks")
    c = seq_len // (2 * cp_size)
    first, second = chunk_ids(cp_rank, cp_size)
    return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                      torch.arange(second * c, (second + 1) * c, device=device)])


def split_batch(batch: dict[str, torch.Tensor], cp_rank: int, cp_size: int) -> dict[str, torch.Tensor]:
    """This rank's share of a batch of [b, s, ...] fields: the per-token fields (tokens, labels, loss mask, position
    ids, multi-token prediction's shifted ones) cut to its two chunks along dim 1; ``WHOLE_KEYS`` whole."""
    if cp_size == 1:
        return batch
    index = local_positions(batch["tokens"].shape[1], cp_rank, cp_size, batch["tokens"].device)
    return {k: v.index_select(1, index).contiguous() if k not in WHOLE_KEYS else v for k, v in batch.items()}


def merge_chunks(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every rank's local part (``parts[j]``: rank j's, along ``dim``), in global order."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for j, part in enumerate(parts):
        first, second = chunk_ids(j, cp)
        chunks[first], chunks[second] = part.chunk(2, dim)
    return torch.cat(chunks, dim)


def scatter_chunks(whole: torch.Tensor, cp: int, dim: int) -> list[torch.Tensor]:
    """``merge_chunks`` inverted: the whole sequence cut into every rank's local part."""
    chunks = whole.chunk(2 * cp, dim)
    return [torch.cat([chunks[a], chunks[b]], dim) for a, b in (chunk_ids(j, cp) for j in range(cp))]
