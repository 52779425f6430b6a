"""Forward/backward schedules over the micro-batches of one step.

The contract (Megatron-LM's): ``forward_step(micro_batch, model) -> (output, loss_fn)`` and
``loss_fn(output) -> (loss_sum, token_count)``, the masked sum of token losses and the
number of tokens it covers. Schedules never look inside the model.

Token-exact normalisation: every micro-batch's backward uses ``loss_sum / num_tokens``
where ``num_tokens`` counts the loss tokens of the whole global batch, so the gradient is
that of (sum of all token losses) / (all tokens), however the batch is cut into
micro-batches and ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch

ForwardStep = Callable[[Any, torch.nn.Module], tuple[torch.Tensor, Callable]]


def forward_backward_no_pipelining(forward_step: ForwardStep, micro_batches: Sequence[Any],
                                   model: torch.nn.Module, num_tokens: float, loss_scale: float = 1.0,
                                   forward_only: bool = False) -> torch.Tensor:
    """Run every micro-batch through forward and (unless ``forward_only``) backward,
    accumulating gradients; return the detached sum of token losses of all micro-batches.

    A data-parallel model (one with ``no_sync()``) synchronises gradients only during the last
    micro-batch's backward."""
    total = None
    no_sync = getattr(model, "no_sync", nullcontext)
    for i, micro_batch in enumerate(micro_batches):
        with no_sync() if i < len(micro_batches) - 1 else nullcontext():
            output, loss_fn = forward_step(micro_batch, model)
            loss_sum, _ = loss_fn(output)
            if not forward_only:
                (loss_sum * (loss_scale / num_tokens)).backward()
        loss_sum = loss_sum.detach().float()
        total = loss_sum if total is None else total + loss_sum
    return total
