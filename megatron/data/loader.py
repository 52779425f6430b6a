"""Batches for training: global-batch sampling from consumed samples, collation, loaders.

Step ``k`` of a run consumes global samples ``[c, c + B(c))`` where ``c`` is the number of samples
consumed before it and ``B`` the global batch (constant, or a function of ``c``: a batch-size ramp-up,
``megatron.config.batch_schedule``); data-parallel rank ``r`` reads the ``r``-th contiguous
``B(c) / dp`` slice of that range. Resuming only needs ``c``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial

import numpy as np
import torch
from torch.utils.data import DataLoader

from megatron.context_parallel.layout import split_batch
from megatron.data.future_tokens import future_fields
from megatron.data.packing import document_ids, reset_positions
from megatron.data.worker_signals import blocked, ignore_in_worker


class GlobalBatchSampler:
    """Yields this data-parallel rank's sample indices for each global batch, in order, while the whole
    global batch lies within the dataset. ``global_batch_size``: a number, or ``consumed -> batch``."""

    def __init__(self, num_samples: int, consumed_samples: int, global_batch_size: int | Callable[[int], int],
                 dp_rank: int = 0, dp_size: int = 1):
        self.constant = None if callable(global_batch_size) else global_batch_size
        self.batch_at = global_batch_size if callable(global_batch_size) else lambda consumed: global_batch_size
        self.num_samples, self.consumed = num_samples, consumed_samples
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._local(self.batch_at(consumed_samples))

    def _local(self, global_batch: int) -> int:
        if global_batch % self.dp_size:
            raise ValueError(f"global batch {global_batch} not divisible by data-parallel size {self.dp_size}")
        return global_batch // self.dp_size

    def _batches(self) -> Iterator[tuple[int, int]]:
        """(first sample, global batch) of every step that fits."""
        start = self.consumed
        while start + (batch := self.batch_at(start)) <= self.num_samples:
            yield start, batch
            start += batch

    def __len__(self) -> int:
        if self.constant is not None:
            return max(0, (self.num_samples - self.consumed) // self.constant)
        return sum(1 for _ in self._batches())

    def __iter__(self) -> Iterator[list[int]]:
        for start, batch in self._batches():
            local = self._local(batch)
            first = start + self.dp_rank * local
            yield list(range(first, first + local))


def build_batch(samples: Sequence[np.ndarray], eod_id: int, eod_mask_loss: bool = True,
                reset_position_ids: bool = False, reset_attention_mask: bool = False, cp_rank: int = 0,
                cp_size: int = 1, mtp_depth: int = 0) -> dict[str, torch.Tensor]:
    """Samples of ``seq_len + 1`` tokens -> tokens, labels, loss_mask, position_ids, all [b, s] (Megatron-LM's
    ``get_batch``): the loss masked where the input token is end-of-document (``eod_mask_loss``); positions
    restarting at each document (``reset_position_ids``) and ``document_ids`` [b, s] for attention within
    documents (``reset_attention_mask``), both from ``megatron.data.packing``. Under context parallelism
    (``cp_size`` > 1) the per-token fields are this rank's two chunks (``context_parallel.split_batch``);
    ``document_ids`` stays whole. ``mtp_depth`` (multi-token prediction): the fields shifted by 1..depth positions,
    [b, s, depth] each (``future_tokens.future_fields``), computed before the split."""
    data = torch.from_numpy(np.stack(samples).astype(np.int64))
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod_id] = 0.0
    if reset_position_ids:
        position_ids = reset_positions(tokens, eod_id)
    else:
        position_ids = torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()
    batch = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
    if reset_attention_mask:
        batch["document_ids"] = document_ids(tokens, eod_id)
    if mtp_depth:
        batch.update(future_fields(batch, mtp_depth, batch.get("document_ids")))
    return split_batch(batch, cp_rank, cp_size)


class _Loader(DataLoader):
    """A DataLoader whose workers leave ``stop_signals`` to the trainer (``megatron.data.worker_signals``)."""

    def __init__(self, *args, stop_signals: Sequence[int] = (), **kwargs):
        self.stop_signals = tuple(stop_signals) if kwargs.get("num_workers") else ()
        init = partial(ignore_in_worker, self.stop_signals) if self.stop_signals else None
        super().__init__(*args, worker_init_fn=init, **kwargs)

    def __iter__(self):
        with blocked(self.stop_signals):  # the workers start here: none can be hit before it ignores them
            return super().__iter__()


def build_loader(dataset, consumed_samples: int, global_batch_size: int | Callable[[int], int], eod_id: int,
                 eod_mask_loss: bool, dp_rank: int = 0, dp_size: int = 1, num_workers: int = 0,
                 stop_signals: Sequence[int] = (), **batch_options) -> DataLoader:
    """``stop_signals``: the signals the caller handles, which its workers (if any) then ignore;
    ``batch_options``: ``build_batch``'s packed-document and context-parallel arguments."""
    sampler = GlobalBatchSampler(len(dataset), consumed_samples, global_batch_size, dp_rank, dp_size)
    collate = partial(build_batch, eod_id=eod_id, eod_mask_loss=eod_mask_loss, **batch_options)
    # Its own generator: starting an iteration must not draw from the global RNG, which dropout uses
    # (a resumed run would otherwise be one draw off the uninterrupted one).
    return _Loader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=num_workers,
                   persistent_workers=num_workers > 0, generator=torch.Generator(), stop_signals=stop_signals)


def split_micro_batches(batch: dict[str, torch.Tensor], micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Cut a local batch along dim 0 into micro-batches of ``micro_batch_size``."""
    size = next(iter(batch.values())).shape[0]
    return [{k: v[i:i + micro_batch_size] for k, v in batch.items()} for i in range(0, size, micro_batch_size)]
