"""Batches for training: global-batch sampling from consumed samples, collation, loaders.

Step ``k`` of a run consumes global samples ``[c, c + global_batch)`` where ``c`` is the
number of samples consumed before it; data-parallel rank ``r`` reads the ``r``-th
contiguous ``local_batch`` slice of that range. Resuming only needs ``c``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial

import numpy as np
import torch
from torch.utils.data import DataLoader


class GlobalBatchSampler:
    """Yields this data-parallel rank's sample indices for each global batch, in order."""

    def __init__(self, num_samples: int, consumed_samples: int, global_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1):
        if global_batch_size % dp_size:
            raise ValueError(f"global batch {global_batch_size} not divisible by data-parallel size {dp_size}")
        self.num_samples, self.consumed = num_samples, consumed_samples
        self.global_batch, self.local_batch = global_batch_size, global_batch_size // dp_size
        self.dp_rank = dp_rank

    def __len__(self) -> int:
        return max(0, (self.num_samples - self.consumed) // self.global_batch)

    def __iter__(self) -> Iterator[list[int]]:
        start = self.consumed
        while start + self.global_batch <= self.num_samples:
            first = start + self.dp_rank * self.local_batch
            yield list(range(first, first + self.local_batch))
            start += self.global_batch


def build_batch(samples: Sequence[np.ndarray], eod_id: int, eod_mask_loss: bool = True) -> dict[str, torch.Tensor]:
    """Samples of ``seq_len + 1`` tokens -> tokens, labels, loss_mask, position_ids, all [b, s]."""
    data = torch.from_numpy(np.stack(samples).astype(np.int64))
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod_id] = 0.0
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}


def build_loader(dataset, consumed_samples: int, global_batch_size: int, eod_id: int, eod_mask_loss: bool,
                 dp_rank: int = 0, dp_size: int = 1, num_workers: int = 0) -> DataLoader:
    sampler = GlobalBatchSampler(len(dataset), consumed_samples, global_batch_size, dp_rank, dp_size)
    collate = partial(build_batch, eod_id=eod_id, eod_mask_loss=eod_mask_loss)
    # Its own generator: starting an iteration must not draw from the global RNG, which dropout uses
    # (a resumed run would otherwise be one draw off the uninterrupted one).
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=num_workers,
                      persistent_workers=num_workers > 0, generator=torch.Generator())


def split_micro_batches(batch: dict[str, torch.Tensor], micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Cut a local batch along dim 0 into micro-batches of ``micro_batch_size``."""
    size = next(iter(batch.values())).shape[0]
    return [{k: v[i:i + micro_batch_size] for k, v in batch.items()} for i in range(0, size, micro_batch_size)]
