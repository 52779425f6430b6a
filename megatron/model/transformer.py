"""The GPT-2 decoder layer: pre-LayerNorm causal self-attention and a GELU MLP.

Activation layout everywhere in the model: ``[s, b, h]`` (sequence, batch, hidden), as in
Megatron-LM, so that later sequence and pipeline parallelism split and send along dim 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron.config.schema import ModelConfig

RECOMPUTE_GRANULARITIES = ("full", "only_attn", "full_attn", "core_attn")


def _maybe_checkpoint(enabled: bool, fn: Callable, *args: torch.Tensor) -> torch.Tensor:
    """Run ``fn`` and, when enabled, recompute it in the backward instead of storing its
    activations. The RNG state is saved and restored, so dropout masks are identical."""
    if enabled and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


class SelfAttention(nn.Module):
    """Causal multi-head self-attention with a fused QKV projection.

    The QKV weight's output rows are ordered ``[heads, (q, k, v), head_dim]``, so any
    contiguous block of rows holds whole heads (what tensor parallelism will slice).
    ``out = dense(softmax(Q K^T / sqrt(d) + causal_mask) V)``.
    """

    def __init__(self, cfg: ModelConfig, recompute_core: bool = False):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.query_key_value = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.attn_dropout = cfg.attention_probs_dropout_prob
        self.recompute_core = recompute_core

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k, v: [b, nh, s, hd] -> [b, nh, s, hd]
        dropout = self.attn_dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        qkv = self.query_key_value(x).view(s, b, self.num_heads, 3, self.head_dim)
        q, k, v = qkv.permute(3, 1, 2, 0, 4).unbind(0)  # each [b, nh, s, hd]
        ctx = _maybe_checkpoint(self.recompute_core, self.core_attention, q, k, v)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, h)  # [s, b, h]
        return self.dense(ctx)


class MLP(nn.Module):
    """``fc2(gelu_tanh(fc1(x)))``: h -> ffn_hidden_size -> h."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size)
        self.dense_4h_to_h = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))


class TransformerDecoderLayer(nn.Module):
    """``x + drop(attn(ln1(x)))``, then ``+ drop(mlp(ln2(.)))``.

    ``recompute``: None, ``full`` (the whole layer), ``only_attn``/``full_attn`` (LayerNorm +
    attention block) or ``core_attn`` (softmax(QK^T)V only).
    """

    def __init__(self, cfg: ModelConfig, layer_number: int, recompute: str | None = None):
        super().__init__()
        if recompute is not None and recompute not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"unknown recompute granularity {recompute!r}")
        self.layer_number = layer_number
        self.recompute = recompute
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.self_attention = SelfAttention(cfg, recompute_core=recompute == "core_attn")
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.mlp = MLP(cfg)
        self.hidden_dropout = cfg.hidden_dropout_prob
        self._desc = (f"d_model={cfg.hidden_size}, nhead={cfg.num_attention_heads}, "
                      f"dim_feedforward={cfg.ffn_hidden_size}, dropout={cfg.hidden_dropout_prob}, "
                      f"activation=gelu, attn_dropout={cfg.attention_probs_dropout_prob}")

    def extra_repr(self) -> str:
        return self._desc

    def _attention_block(self, x: torch.Tensor) -> torch.Tensor:
        out = self.self_attention(self.input_layernorm(x))
        return F.dropout(out, self.hidden_dropout, self.training)

    def _layer(self, x: torch.Tensor) -> torch.Tensor:
        x = x + _maybe_checkpoint(self.recompute in ("only_attn", "full_attn"), self._attention_block, x)
        out = self.mlp(self.post_attention_layernorm(x))
        return x + F.dropout(out, self.hidden_dropout, self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [s, b, h] -> [s, b, h]."""
        return _maybe_checkpoint(self.recompute == "full", self._layer, x)
