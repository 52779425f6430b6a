"""The pieces every decoder layer's modules use (``transformer``, ``mla``): dropout on the stream a seam selects
(``megatron.ops.seams``, which also holds ``maybe_checkpoint``, the recompute of a sub-block) and the model's
normalization."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config.schema import ModelConfig


def dropout(x: torch.Tensor, p: float, training: bool, rng: Callable = nullcontext) -> torch.Tensor:
    """Dropout drawing from the stream ``rng()`` selects (``Seams.region_rng`` / ``sequence_rng``)."""
    if not training or p == 0.0:
        return x
    with rng():
        return F.dropout(x, p, True)


class ZeroCentredLayerNorm(nn.LayerNorm):
    """LayerNorm scaling by ``1 + weight`` (Megatron-LM's --apply-layernorm-1p): the weight starts at 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ZeroCentredRMSNorm(nn.RMSNorm):
    """RMSNorm scaling by ``1 + weight`` (Megatron-LM's --apply-layernorm-1p with RMSNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


def make_norm(cfg: ModelConfig, size: int | None = None) -> nn.Module:
    """``LayerNorm`` (weight and bias) or ``RMSNorm`` (weight only: ``x rsqrt(mean(x^2) + eps) w``,
    ``torch.nn.RMSNorm``: computed in fp32 for bf16/fp16 inputs too and rounded once at the end, where
    Hugging Face's LlamaRMSNorm rounds before multiplying by the weight; the same in fp32) over the
    hidden size (or ``size``); with ``apply_layernorm_1p`` they scale by ``1 + w`` (zero-centred weights).
    (Replicated over the tensor-parallel group; under sequence parallelism it sees a
    sequence shard, so ``tensor_parallel.parallelize`` marks its gradients to be summed over the group.)"""
    size, one_plus = cfg.hidden_size if size is None else size, cfg.apply_layernorm_1p
    if cfg.normalization == "RMSNorm":
        norm = (ZeroCentredRMSNorm if one_plus else nn.RMSNorm)(size, eps=cfg.layernorm_epsilon)
    elif cfg.normalization == "LayerNorm":
        norm = (ZeroCentredLayerNorm if one_plus else nn.LayerNorm)(size, eps=cfg.layernorm_epsilon)
    else:
        raise ValueError(f"unknown normalization {cfg.normalization!r}")
    return norm
