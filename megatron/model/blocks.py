"""The pieces every decoder layer's modules use (``transformer``, ``mla``): recompute of a sub-block, dropout on
the right RNG stream, and the model's normalization."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron import parallel_state
from megatron import tensor_parallel as tp
from megatron.config.schema import ModelConfig


def maybe_checkpoint(enabled: bool, fn: Callable, *args: Any) -> torch.Tensor:
    """Run ``fn`` and, when enabled, recompute it in the backward instead of storing its
    activations. The RNG state is saved and restored, so dropout masks are identical."""
    if enabled and torch.is_grad_enabled():
        return tp.checkpoint(fn, *args)  # restores the tracker's streams too
    return fn(*args)


def parallel_dropout(x: torch.Tensor, p: float, training: bool, per_rank: bool) -> torch.Tensor:
    """Dropout drawing from the per-rank tensor-parallel stream when ``per_rank`` (tensor-parallel
    regions, sequence shards) and from the default stream (replicated activations) otherwise."""
    if not training or p == 0.0:
        return x
    if per_rank and parallel_state.get().tp_size > 1:
        with tp.get_rng_tracker().fork():
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


def make_norm(cfg: ModelConfig, sequence_parallel: bool = False, size: int | None = None) -> nn.Module:
    """``LayerNorm`` (weight and bias) or ``RMSNorm`` (weight only: ``x rsqrt(mean(x^2) + eps) w``,
    ``torch.nn.RMSNorm``: computed in fp32 for bf16/fp16 inputs too and rounded once at the end, where
    Hugging Face's LlamaRMSNorm rounds before multiplying by the weight; the same in fp32) over the
    hidden size (or ``size``). Replicated over the tensor-parallel group; under sequence parallelism it sees a
    sequence shard, so its gradients are summed over the group (``mark_sequence_parallel``)."""
    size = cfg.hidden_size if size is None else size
    if cfg.normalization == "RMSNorm":
        norm = nn.RMSNorm(size, eps=cfg.layernorm_epsilon)
    elif cfg.normalization == "LayerNorm":
        norm = nn.LayerNorm(size, eps=cfg.layernorm_epsilon)
    else:
        raise ValueError(f"unknown normalization {cfg.normalization!r}")
    return tp.mark_sequence_parallel(norm) if sequence_parallel else norm


def gelu_approximation(cfg: ModelConfig) -> str:
    """``F.gelu``'s ``approximate`` for a GELU MLP (the MLP's and the experts'): Megatron-LM's rule, the tanh
    approximation only where its fused bias-GELU kernel runs (``bias_gelu_fusion`` with linear biases), else exact."""
    return "tanh" if cfg.bias_gelu_fusion and not cfg.disable_bias_linear else "none"
