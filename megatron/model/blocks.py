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


def mlp_activation(cfg: ModelConfig) -> tuple:
    """The MLP's (and experts') activation settings, for ``activate``: (gated kind or None, GELU approximation,
    glu_linear_offset, activation_func_clamp_value)."""
    kind = "swiglu" if cfg.swiglu else "quick_geglu" if cfg.quick_geglu else None
    return kind, gelu_approximation(cfg), cfg.glu_linear_offset, cfg.activation_func_clamp_value


def activate(y: torch.Tensor, settings: tuple) -> torch.Tensor:
    """The MLP's activation of ``fc1``'s output: GELU, or a gated unit over interleaved (gate, linear) rows (row 2j
    gate_j, 2j+1 linear_j): ``act(gate) * (linear + offset)``, the two halves clamped first when a clamp is set
    (gate at most c, linear within [-c, c]: gpt-oss), act SiLU (SwiGLU) or quick GELU ``g sigmoid(1.702 g)``."""
    kind, gelu, offset, clamp = settings
    if kind is None:
        return F.gelu(y, approximate=gelu)
    gate, linear = y.unflatten(-1, (-1, 2)).unbind(-1)
    if clamp is not None:
        gate, linear = gate.clamp(max=clamp), linear.clamp(-clamp, clamp)
    act = F.silu(gate) if kind == "swiglu" else gate * torch.sigmoid(1.702 * gate)
    return act * (linear + offset) if offset else act * linear
