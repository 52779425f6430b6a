"""Global-norm gradient clipping over flat gradient buffers."""

from __future__ import annotations

import torch


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """sqrt(sum of squares) of every element of ``grads``, accumulated in fp32."""
    squares = [torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in grads]
    return torch.stack(squares).sum().sqrt()


def model_parallel_grad_norm(sharded: list[torch.Tensor], replicated: list[torch.Tensor], group) -> torch.Tensor:
    """Global norm when the model is split over ``group``: every element counted once.

    ``sharded``: gradients of tensor-parallel shards (distinct on each rank), whose squares are
    summed over the group; ``replicated``: gradients equal on every rank, counted once."""
    device = (sharded or replicated)[0].device
    zero = torch.zeros((), dtype=torch.float32, device=device)
    sq_sharded = global_grad_norm(sharded) ** 2 if sharded else zero
    torch.distributed.all_reduce(sq_sharded, group=group)
    sq_replicated = global_grad_norm(replicated) ** 2 if replicated else zero
    return (sq_sharded + sq_replicated).sqrt()


def clip_grads(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale ``grads`` in place by min(1, max_norm / (norm + 1e-6)); ``max_norm`` 0 disables."""
    if max_norm <= 0:
        return
    coef = torch.clamp(max_norm / (norm + 1.0e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
