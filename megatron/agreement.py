"""Agreement between ranks on a failure.

A rank that raises while the others go on to a collective leaves them waiting until the
process-group timeout, and its error lands on one rank's stderr among many. ``first_failure`` is the
one mechanism (data caches and checkpoints use it): every rank passes its own error message (or
None), a failure flag is all-reduced, and only if some rank failed are the messages gathered, so that
every rank can raise the same line. It costs one small all-reduce when all went well.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.device import collective_device


def first_failure(error: str | None, device: torch.device | None = None) -> str | None:
    """Collective (call on every rank): None when no rank failed, else the message of the first
    failing rank, on every rank. ``device``: where the flag lives (default: the backend's)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return error
    device = device or collective_device(dist.get_backend())
    failed = torch.tensor([0.0 if error is None else 1.0], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if not failed.item():
        return None
    messages: list = [None] * dist.get_world_size()
    dist.all_gather_object(messages, error)
    return next(m for m in messages if m is not None)
