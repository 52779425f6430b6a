"""The MLP's activations, shared by the dense MLP (``megatron.model``) and the experts (``megatron.moe``): GELU
(Megatron-LM's choice of its tanh approximation), squared ReLU, SwiGLU and gpt-oss's quick GeGLU over interleaved
rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.config.schema import ModelConfig


def gelu_approximation(cfg: ModelConfig) -> str:
    """``F.gelu``'s ``approximate`` for a GELU MLP (the MLP's and the experts'): Megatron-LM's rule, the tanh
    approximation only where its fused bias-GELU kernel runs (``bias_gelu_fusion`` with linear biases), else exact."""
    return "tanh" if cfg.bias_gelu_fusion and not cfg.disable_bias_linear else "none"


def mlp_activation(cfg: ModelConfig) -> tuple:
    """The MLP's (and experts') activation settings, for ``activate``: (kind: a gated kind, squared_relu, or None for
    GELU; the GELU approximation,
    glu_linear_offset, activation_func_clamp_value)."""
    kind = "swiglu" if cfg.swiglu else "quick_geglu" if cfg.quick_geglu else "squared_relu" if cfg.squared_relu \
        else None
    return kind, gelu_approximation(cfg), cfg.glu_linear_offset, cfg.activation_func_clamp_value


def is_gated(settings: tuple) -> bool:
    """Whether ``fc1`` gives two interleaved halves (gate, linear): 2 x ffn rows."""
    return settings[0] in ("swiglu", "quick_geglu")


def activate(y: torch.Tensor, settings: tuple) -> torch.Tensor:
    """The MLP's activation of ``fc1``'s output: GELU, or a gated unit over interleaved (gate, linear) rows (row 2j
    gate_j, 2j+1 linear_j): ``act(gate) * (linear + offset)``, the two halves clamped first when a clamp is set
    (gate at most c, linear within [-c, c]: gpt-oss), act SiLU (SwiGLU) or quick GELU ``g sigmoid(1.702 g)``."""
    kind, gelu, offset, clamp = settings
    if kind is None:
        return F.gelu(y, approximate=gelu)
    if kind == "squared_relu":  # not gated
        return F.relu(y).square()
    gate, linear = y.unflatten(-1, (-1, 2)).unbind(-1)
    if clamp is not None:
        gate, linear = gate.clamp(max=clamp), linear.clamp(-clamp, clamp)
    act = F.silu(gate) if kind == "swiglu" else gate * torch.sigmoid(1.702 * gate)
    return act * (linear + offset) if offset else act * linear
