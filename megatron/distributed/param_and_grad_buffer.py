"""Contiguous parameter and gradient buffers.

All trainable parameters are re-pointed into one flat tensor in the model's dtype, and their
fp32 gradients ("main grads") live in one flat fp32 tensor with the same layout. Parameters
are laid out in groups (e.g. weight-decay / no-decay) so that each group is one contiguous
range: the optimizer then steps a handful of flat tensors instead of hundreds of small ones,
and gradient reductions and sharding (later) operate on ranges of one buffer.

Gradient flow: for fp32 parameters ``param.grad`` *is* the main-grad view, and autograd
accumulates into it in place (a hook repairs the link if ``param.grad`` was reset). For
bf16/fp16 parameters a post-accumulate hook adds ``param.grad`` into the fp32
``param.main_grad`` and frees it, so accumulation over micro-batches happens in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ParamRange:
    name: str
    start: int
    end: int
    shape: torch.Size


class ParamAndGradBuffer:
    """``groups``: lists of (name, parameter); each group becomes one contiguous range, padded with
    zeros to a multiple of ``pad_multiple`` (the sharding degree, so every shard has one size)."""

    def __init__(self, groups: list[list[tuple[str, nn.Parameter]]], grad_dtype: torch.dtype = torch.float32,
                 pad_multiple: int = 1):
        params = [p for group in groups for _, p in group]
        if not params:
            raise ValueError("no trainable parameters")
        dtype, device = params[0].dtype, params[0].device
        sizes = [sum(p.numel() for _, p in group) for group in groups]
        numel = sum(-(-n // pad_multiple) * pad_multiple for n in sizes)
        self.param_data = torch.zeros(numel, dtype=dtype, device=device)
        self.grad_data = torch.zeros(numel, dtype=grad_dtype, device=device)
        self.ranges: list[ParamRange] = []
        self.group_bounds: list[tuple[int, int]] = []
        self._hooks = []
        self._params: list[tuple[nn.Parameter, int, int]] = []
        offset = 0
        for group in groups:
            group_start = offset
            for name, p in group:
                end = offset + p.numel()
                self.param_data[offset:end].copy_(p.detach().reshape(-1))
                p.data = self.param_data[offset:end].view_as(p)
                p.main_grad = self.grad_data[offset:end].view_as(p)
                if p.dtype == grad_dtype:
                    p.grad = p.main_grad  # autograd accumulates in place
                self._hooks.append(p.register_post_accumulate_grad_hook(_accumulate_main_grad))
                self.ranges.append(ParamRange(name, offset, end, p.shape))
                self._params.append((p, offset, end))
                offset = end
            offset = group_start + -(-(offset - group_start) // pad_multiple) * pad_multiple
            self.group_bounds.append((group_start, offset))

    def zero_grad(self) -> None:
        if self.grad_data.numel() == 0:
            self.allocate_grads()
        else:
            self.grad_data.zero_()

    def release_grads(self) -> None:
        """Free the full gradient buffer (ZeRO stage 2, once its shards have been reduced out)."""
        for p, _, _ in self._params:
            p.main_grad = None
            p.grad = None
        self.grad_data = torch.zeros(0, dtype=self.grad_data.dtype, device=self.grad_data.device)

    def allocate_grads(self) -> None:
        """A fresh zeroed gradient buffer, the parameters' main grads pointed back into it."""
        numel = self.param_data.numel()
        self.grad_data = torch.zeros(numel, dtype=self.grad_data.dtype, device=self.grad_data.device)
        for p, start, end in self._params:
            p.main_grad = self.grad_data[start:end].view_as(p)
            if p.dtype == self.grad_data.dtype:
                p.grad = p.main_grad


def _accumulate_main_grad(param: torch.Tensor) -> None:
    """Move a freshly accumulated ``param.grad`` into the fp32 main grad.

    For fp32 parameters ``param.grad`` normally already is the main grad (nothing to do);
    if something reset it to None (``model.zero_grad()``), autograd stored a new tensor,
    which is folded back here so that no gradient is lost.
    """
    grad = param.grad
    if grad is param.main_grad:
        return
    param.main_grad.add_(grad)
    param.grad = param.main_grad if grad.dtype == param.main_grad.dtype else None
