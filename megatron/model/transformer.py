"""The GPT-2 decoder layer: pre-LayerNorm causal self-attention and a GELU MLP.

Activation layout everywhere in the model: ``[s, b, h]`` (sequence, batch, hidden), as in
Megatron-LM, so that sequence and pipeline parallelism split and send along dim 0.

Tensor parallelism (Megatron-LM's): QKV and the MLP's first matmul are column-parallel (each
rank holds whole heads / a slice of the MLP width), the attention output projection and the
MLP's second matmul are row-parallel (their outputs are summed across the group). With
sequence parallelism the LayerNorm and dropout regions hold ``s / tp`` positions per rank;
the column-parallel layers all-gather the sequence and the row-parallel ones reduce-scatter it.
Dropout inside tensor-parallel regions (and on sequence shards) draws from the tracker's
per-rank tensor-parallel stream; dropout on replicated activations from the shared default one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron import parallel_state
from megatron import tensor_parallel as tp
from megatron.config.schema import ModelConfig

RECOMPUTE_GRANULARITIES = ("full", "only_attn", "full_attn", "core_attn")


def _maybe_checkpoint(enabled: bool, fn: Callable, *args: torch.Tensor) -> torch.Tensor:
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


class SelfAttention(nn.Module):
    """Causal multi-head self-attention with a fused QKV projection.

    The QKV weight's output rows are ordered ``[heads, (q, k, v), head_dim]``, so any
    contiguous block of rows holds whole heads (what tensor parallelism will slice).
    ``out = dense(softmax(Q K^T / sqrt(d) + causal_mask) V)``.
    """

    def __init__(self, cfg: ModelConfig, recompute_core: bool = False, sequence_parallel: bool = False,
                 layer_number: int = 0):
        super().__init__()
        self.layer_number = layer_number  # the global layer index (the KV cache's key)
        tp_size = parallel_state.get().tp_size
        self.num_heads = cfg.num_attention_heads // tp_size  # heads on this rank
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.query_key_value = tp.ColumnParallelLinear(cfg.hidden_size, 3 * cfg.hidden_size,
                                                       sequence_parallel=sequence_parallel)
        self.dense = tp.RowParallelLinear(cfg.hidden_size, cfg.hidden_size, sequence_parallel=sequence_parallel)
        self.attn_dropout = cfg.attention_probs_dropout_prob
        self.recompute_core = recompute_core

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
        """q [b, nh, sq, hd], k and v [b, nh, sk, hd] -> [b, nh, sq, hd] (nh: this rank's heads).
        ``mask`` (boolean, True = may attend, broadcast to [b, nh, sq, sk]) replaces the causal rule
        when given; ``causal=False`` without a mask lets every query see every key (one new token)."""
        dropout = self.attn_dropout if self.training else 0.0
        causal = causal and mask is None
        if dropout and parallel_state.get().tp_size > 1:
            with tp.get_rng_tracker().fork():
                return F.scaled_dot_product_attention(q, k, v, mask, dropout_p=dropout, is_causal=causal)
        return F.scaled_dot_product_attention(q, k, v, mask, dropout_p=dropout, is_causal=causal)

    def forward(self, x: torch.Tensor, kv_cache=None) -> torch.Tensor:
        """x [s, b, h] -> [s, b, h]. ``kv_cache`` (inference, ``megatron.inference.KVCache``): this
        call's keys and values are written into the cache after those of the earlier calls, and the
        queries attend to all of them under the cache's mask (padding, causality)."""
        qkv = self.query_key_value(x)  # [s, b, 3h/tp] (the sequence gathered under sequence parallel)
        s, b, _ = qkv.shape
        qkv = qkv.view(s, b, self.num_heads, 3, self.head_dim)
        q, k, v = qkv.permute(3, 1, 2, 0, 4).unbind(0)  # each [b, nh, s, hd]
        if kv_cache is None:
            ctx = _maybe_checkpoint(self.recompute_core, self.core_attention, q, k, v)
        else:
            k, v = kv_cache.store(self.layer_number, k, v)
            ctx = self.core_attention(q, k, v, kv_cache.mask, kv_cache.causal)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.head_dim)  # [s, b, h/tp]
        return self.dense(ctx)


class MLP(nn.Module):
    """``fc2(gelu_tanh(fc1(x)))``: h -> ffn_hidden_size -> h."""

    def __init__(self, cfg: ModelConfig, sequence_parallel: bool = False):
        super().__init__()
        self.dense_h_to_4h = tp.ColumnParallelLinear(cfg.hidden_size, cfg.ffn_hidden_size,
                                                     sequence_parallel=sequence_parallel)
        self.dense_4h_to_h = tp.RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size,
                                                  sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))


class TransformerDecoderLayer(nn.Module):
    """``x + drop(attn(ln1(x)))``, then ``+ drop(mlp(ln2(.)))``.

    ``recompute``: None, ``full`` (the whole layer), ``only_attn``/``full_attn`` (LayerNorm +
    attention block) or ``core_attn`` (softmax(QK^T)V only).
    """

    def __init__(self, cfg: ModelConfig, layer_number: int, recompute: str | None = None,
                 sequence_parallel: bool = False):
        super().__init__()
        if recompute is not None and recompute not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"unknown recompute granularity {recompute!r}")
        self.layer_number = layer_number
        self.recompute = recompute
        self.sequence_parallel = sequence_parallel
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.self_attention = SelfAttention(cfg, recompute == "core_attn", sequence_parallel, layer_number)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.mlp = MLP(cfg, sequence_parallel)
        if sequence_parallel:
            tp.mark_sequence_parallel(self.input_layernorm)
            tp.mark_sequence_parallel(self.post_attention_layernorm)
        self.hidden_dropout = cfg.hidden_dropout_prob
        self._desc = (f"d_model={cfg.hidden_size}, nhead={cfg.num_attention_heads}, "
                      f"dim_feedforward={cfg.ffn_hidden_size}, dropout={cfg.hidden_dropout_prob}, "
                      f"activation=gelu, attn_dropout={cfg.attention_probs_dropout_prob}")

    def extra_repr(self) -> str:
        return self._desc

    def _attention_block(self, x: torch.Tensor, kv_cache=None) -> torch.Tensor:
        out = self.self_attention(self.input_layernorm(x), kv_cache)
        return parallel_dropout(out, self.hidden_dropout, self.training, self.sequence_parallel)

    def _layer(self, x: torch.Tensor, kv_cache=None) -> torch.Tensor:
        if kv_cache is None:
            x = x + _maybe_checkpoint(self.recompute in ("only_attn", "full_attn"), self._attention_block, x)
        else:  # inference: no autograd, nothing to recompute
            x = x + self._attention_block(x, kv_cache)
        out = self.mlp(self.post_attention_layernorm(x))
        return x + parallel_dropout(out, self.hidden_dropout, self.training, self.sequence_parallel)

    def forward(self, x: torch.Tensor, kv_cache=None) -> torch.Tensor:
        """x: [s, b, h] -> [s, b, h] ([s/tp, b, h] under sequence parallel). ``kv_cache``: see
        ``SelfAttention.forward`` (inference only)."""
        if kv_cache is not None:
            return self._layer(x, kv_cache)
        return _maybe_checkpoint(self.recompute == "full", self._layer, x)
