"""Global-norm gradient clipping over flat gradient buffers."""

from __future__ import annotations

import torch


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """sqrt(sum of squares) of every element of ``grads``, accumulated in fp32."""
    squares = [torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in grads]
    return torch.stack(squares).sum().sqrt()


def model_parallel_grad_norm(counted: list[torch.Tensor], groups: list, device: torch.device) -> torch.Tensor:
    """Global norm of a model split over ``groups`` (sharding, model-parallel): each rank passes the
    gradients it counts (every element counted on exactly one rank); squares are summed over the groups."""
    sq = global_grad_norm(counted) ** 2 if counted else torch.zeros((), dtype=torch.float32, device=device)
    for group in groups:
        torch.distributed.all_reduce(sq, group=group)
    return sq.sqrt()


def clip_grads(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale ``grads`` in place by min(1, max_norm / (norm + 1e-6)); ``max_norm`` 0 disables."""
    if max_norm <= 0:
        return
    coef = torch.clamp(max_norm / (norm + 1.0e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
