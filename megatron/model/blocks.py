"""The pieces every decoder layer's modules use (``transformer``, ``mla``): recompute of a sub-block (through the
model's ``Seams``: ``megatron.ops.seams``), dropout on the stream a seam selects, and the model's normalization."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config.schema import ModelConfig
from megatron.ops.seams import Seams


def maybe_checkpoint(enabled: bool, seams: Seams, fn: Callable, *args: Any) -> torch.Tensor:
    """Run ``fn`` and, when enabled, recompute it in the backward instead of storing its activations
    (``seams.checkpoint``: the RNG streams are saved and restored, so dropout masks are identical)."""
    if enabled and torch.is_grad_enabled():
        return seams.checkpoint(fn, *args)
    return fn(*args)


def dropout(x: torch.Tensor, p: float, training: bool, rng: Callable = nullcontext) -> torch.Tensor:
    """Dropout drawing from the stream ``rng()`` selects (``Seams.region_rng`` / ``sequence_rng``)."""
    if not training or p == 0.0:
        return x
    with rng():
        return F.dropout(x, p, True)


def make_norm(cfg: ModelConfig, size: int | None = None) -> nn.Module:
    """``LayerNorm`` (weight and bias) or ``RMSNorm`` (weight only: ``x rsqrt(mean(x^2) + eps) w``,
    ``torch.nn.RMSNorm``: computed in fp32 for bf16/fp16 inputs too and rounded once at the end, where
    Hugging Face's LlamaRMSNorm rounds before multiplying by the weight; the same in fp32) over the
    hidden size (or ``size``). (Replicated over the tensor-parallel group; under sequence parallelism it sees a
    sequence shard, so ``tensor_parallel.parallelize`` marks its gradients to be summed over the group.)"""
    size = cfg.hidden_size if size is None else size
    if cfg.normalization == "RMSNorm":
        norm = nn.RMSNorm(size, eps=cfg.layernorm_epsilon)
    elif cfg.normalization == "LayerNorm":
        norm = nn.LayerNorm(size, eps=cfg.layernorm_epsilon)
    else:
        raise ValueError(f"unknown normalization {cfg.normalization!r}")
    return norm
