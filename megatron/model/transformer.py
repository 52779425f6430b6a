"""The decoder layer: pre-norm causal self-attention and an MLP (or a mixture of experts, ``megatron.moe``, in
the layers ``moe_layer_freq`` chooses), in GPT-2's form or Llama's.

Activation layout everywhere in the model: ``[s, b, h]`` (sequence, batch, hidden), as in
Megatron-LM, so that sequence and pipeline parallelism split and send along dim 0.

Variants (``ModelConfig``, Megatron-LM's flags): LayerNorm or RMSNorm; GELU or SwiGLU MLP;
multi-head or grouped-query attention (``num_query_groups`` key/value heads, each shared by
``nq / ng`` query heads); learned absolute positions (added by the embedding), rotary embeddings
on the queries and keys, or none; linear biases or not (``disable_bias_linear``); ``kv_channels``
channels per head.

Tensor parallelism (Megatron-LM's): QKV and the MLP's first matmul are column-parallel (each
rank holds whole key/value groups / a slice of the MLP width), the attention output projection and
the MLP's second matmul are row-parallel (their outputs are summed across the group). With
sequence parallelism the norm and dropout regions hold ``s / tp`` positions per rank; the
column-parallel layers all-gather the sequence and the row-parallel ones reduce-scatter it.
Dropout inside tensor-parallel regions (and on sequence shards) draws from the tracker's
per-rank tensor-parallel stream; dropout on replicated activations from the shared default one.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from megatron.attention.local import AttentionPlan, attend, masked_attention
from megatron.attention.max_logits import running_max_logits
from megatron.config.schema import ModelConfig
from megatron.config.schema_model import attention_shape
from megatron.config.validate_attention import layer_window
from megatron.config.validate_hybrid import hybrid_layer_kind, is_linear_attention_layer
from megatron.config.validate_moe import is_moe_layer
from megatron.config.validate_mup import attention_scale
from megatron.model.blocks import dropout, make_norm
from megatron.model.mla import MultiLatentAttention
from megatron.model.rotary import apply_rotary
from megatron.ops.activations import activate, is_gated, mlp_activation
from megatron.ops.offload import NO_OFFLOAD
from megatron.ops.seams import LOCAL, maybe_checkpoint

Rotary = tuple[torch.Tensor, torch.Tensor] | None  # (cos, sin) [b, 1, s, rot] of this forward's positions


def attention_needs_plan(cfg: ModelConfig) -> bool:
    """Whether the layers attend through ``context_parallel.attend`` whatever the layout: sliding windows or
    attention sinks."""
    return cfg.window_size is not None or cfg.softmax_type != "vanilla"


def attention_needs_plan_of(attention: SelfAttention) -> bool:
    return attention.window is not None or attention.softmax_type != "vanilla"


class SelfAttention(nn.Module):
    """Causal self-attention with a fused QKV projection; grouped-query when ng < nq.

    The QKV weight's output rows are ordered by group, ``[ng, (nq/ng queries, key, value), hd]``
    (with ng = nq: ``[heads, (q, k, v), hd]``), so any contiguous block of rows holds whole groups:
    what a tensor-parallel rank owns (tp must divide ng). With rotary embeddings, queries and keys
    are rotated at their tokens' positions before attending; with ``qk_layernorm`` (Qwen3, Megatron's
    ``--qk-layernorm``), each head's query and key are normalised first (``q_layernorm``, ``k_layernorm``: the
    model's normalization over the head width, shared by the heads). ``out = dense(softmax(Q K^T / sqrt(hd) +
    causal_mask) V)``, each query head reading the key and value of its group (muP: ``softmax_scale`` instead of
    ``1 / sqrt(hd)``, ``validate_mup.attention_scale``). With ``attention_output_gate`` (Qwen3-Next's full
    attention, Megatron Core's layout) each group's rows are ``(queries, their gates, key, value)`` and each head's
    output is multiplied by ``sigmoid(gate)`` before ``dense``.

    The QK norms are replicated over the tensor-parallel ranks, each of which feeds them its own heads: their
    gradients are summed over the group (marked like sequence-parallel norms), with or without sequence
    parallelism.

    gpt-oss's attention (Megatron Core's): a sliding window in the layers ``window_attn_skip_freq`` chooses
    (``window``: each query sees itself and the ``window`` keys before it; ``validate_attention.layer_window``), and
    sinks (``softmax_type``): a logit per head joining every row's softmax as a key of zero value, learnable
    (``softmax_offset`` [nq], cut over tp with the heads) or 0 (off-by-one). Both go through
    ``context_parallel.attend`` (the model always passes a plan), which computes only the blocks the window reaches.

    Built whole; ``tensor_parallel.parallelize`` swaps its projections for column- / row-parallel ones, cuts the
    sink logits with the heads and sets ``num_heads`` / ``num_kv_heads`` to this rank's.
    """

    seams = LOCAL
    recompute_core = False  # recompute softmax(QK^T)V in the backward (megatron.recompute: core_attn)
    offload = NO_OFFLOAD  # qkv_linear, core_attn, attn_proj: their saves to host (megatron.offload)
    first_head = 0  # the global index of this rank's first head (tensor parallelism)
    # QK-clip (megatron.optimizer.qk_clip.track): each head's largest logit in training, [num_heads] fp32 until the
    # step reads it (megatron.attention.max_logits)
    tracks_max_logits = False
    max_logits: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig, layer_number: int = 0):
        super().__init__()
        self.layer_number = layer_number  # the global layer index (the KV cache's key)
        nq, ng, hd = attention_shape(cfg)
        if nq % ng:
            raise ValueError(f"num_query_groups ({ng}) must divide num_attention_heads ({nq})")
        self.num_heads, self.num_kv_heads, self.head_dim = nq, ng, hd  # on this rank
        bias = not cfg.disable_bias_linear
        self.output_gate = cfg.attention_output_gate  # each group's rows: queries, their gates, key, value
        queries = 2 * nq if self.output_gate else nq
        self.query_key_value = nn.Linear(cfg.hidden_size, (queries + 2 * ng) * hd, bias=bias or cfg.add_qkv_bias)
        self.dense = nn.Linear(nq * hd, cfg.hidden_size, bias=bias)
        self.attn_dropout = cfg.attention_probs_dropout_prob
        self.rotary_interleaved = cfg.rotary_interleaved
        self.window = layer_window(cfg, layer_number)
        self.softmax_type = cfg.softmax_type
        self.softmax_scale = attention_scale(cfg)  # muP's sqrt(base) / hd^p; None: 1 / sqrt(hd)
        if cfg.softmax_type == "learnable":  # a sink logit per head
            self.softmax_offset = nn.Parameter(torch.empty(nq))
        else:
            self.softmax_offset = None
        if cfg.qk_layernorm:  # under tp each rank feeds its own heads: the gradients are summed over tp
            self.q_layernorm = make_norm(cfg, size=hd)
            self.k_layernorm = make_norm(cfg, size=hd)
        else:
            self.q_layernorm = self.k_layernorm = None

    def extra_repr(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        sinks = "" if self.softmax_type == "vanilla" else f", softmax={self.softmax_type}"
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads} (per rank), head_dim={self.head_dim}, "
                f"attn_dropout={self.attn_dropout}{window}{sinks}")

    def sinks(self, like: torch.Tensor) -> torch.Tensor | None:
        """This rank's heads' sink logits (None: vanilla softmax)."""
        if self.softmax_type == "vanilla":
            return None
        if self.softmax_offset is not None:
            return self.softmax_offset
        return like.new_zeros(self.num_heads)  # off-by-one: a zero logit

    @property
    def cache_shape(self) -> tuple[int, int, int]:
        """(heads on this rank, key width, value width) of what the KV cache holds per token: the key/value
        groups (shared by their query heads)."""
        return self.num_kv_heads, self.head_dim, self.head_dim

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
        """q [b, nq, sq, hd], k and v [b, ng, sk, hd] -> [b, nq, sq, hd] (this rank's heads; query head
        ``i`` reads group ``i // (nq / ng)``). ``mask`` (boolean, True = may attend, broadcast to
        [b, nq, sq, sk]) replaces the causal rule when given; ``causal=False`` without a mask lets every
        query see every key (one new token)."""
        dropout = self.attn_dropout if self.training else 0.0
        if mask is not None and self.softmax_type != "vanilla":  # the KV cache's mask, with the sinks
            return masked_attention(q, k, v, mask, self.sinks(q), dropout, self.softmax_scale)
        causal = causal and mask is None
        # Grouped keys are read in place by the kernel (no copy of the keys and values per query head).
        extra = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        with self.seams.region_rng() if dropout else nullcontext():
            return F.scaled_dot_product_attention(q, k, v, mask, dropout_p=dropout, is_causal=causal,
                                                  scale=self.softmax_scale, **extra)

    def planned_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          plan: AttentionPlan) -> torch.Tensor:
        """``core_attention`` across a context-parallel split and/or within packed documents (``megatron.attention``,
        the exchanges ``megatron.context_parallel``'s); eager under ``--compile`` (``megatron.compile.compile_model``):
        its collectives and per-document calls stay outside compiled graphs."""
        dropout = self.attn_dropout if self.training else 0.0
        with self.seams.region_rng() if dropout else nullcontext():
            return attend(q, k, v, plan, dropout, self.softmax_scale, window=self.window, sinks=self.sinks(q),
                          layer=self.layer_number, head_offset=self.first_head, max_logits=running_max_logits(self, q))

    def forward(self, x: torch.Tensor, kv_cache=None, rotary: Rotary = None,
                plan: AttentionPlan | None = None) -> torch.Tensor:
        """x [s, b, h] -> [s, b, h]. ``rotary``: (cos, sin) of the tokens' positions (rope), or None.
        ``kv_cache`` (inference, ``megatron.inference.KVCache``): this call's (rotated) keys and values
        are written into the cache after those of the earlier calls, and the queries attend to all of
        them under the cache's mask (padding, causality). ``plan``: the context-parallel split and packed
        documents the attention respects (None: whole sequences, one document each)."""
        qkv = maybe_checkpoint(False, self.seams, self.query_key_value, x, offload=self.offload.get("qkv_linear"))
        # qkv: [s, b, (nq + 2 ng) hd / tp] (the sequence gathered under sequence parallel)
        s, b, _ = qkv.shape
        per_group = self.num_heads // self.num_kv_heads
        gates = per_group if self.output_gate else 0
        qkv = qkv.view(s, b, self.num_kv_heads, per_group + gates + 2, self.head_dim)
        q = qkv[:, :, :, :per_group].reshape(s, b, self.num_heads, self.head_dim).permute(1, 2, 0, 3)  # [b, nq, s, hd]
        gate = qkv[:, :, :, per_group:per_group + gates].reshape(s, b, -1) if gates else None
        k, v = qkv[:, :, :, per_group + gates].permute(1, 2, 0, 3), qkv[:, :, :, -1].permute(1, 2, 0, 3)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary is not None:
            q, k = (apply_rotary(t, *rotary, interleaved=self.rotary_interleaved) for t in (q, k))
        if kv_cache is None and plan is None and (attention_needs_plan_of(self) or
                                                  running_max_logits(self, q) is not None):
            plan = AttentionPlan()  # windows, sinks and QK-clip's maxima attend by the plan's blocks
        if kv_cache is None and plan is not None:
            ctx = maybe_checkpoint(self.recompute_core, self.seams, self.planned_attention, q, k, v, plan,
                                   offload=self.offload.get("core_attn"))
        elif kv_cache is None:
            ctx = maybe_checkpoint(self.recompute_core, self.seams, self.core_attention, q, k, v,
                                   offload=self.offload.get("core_attn"))
        else:
            k, v = kv_cache.store(self.layer_number, k, v)
            mask = kv_cache.mask_for(self.layer_number, self.window, self.softmax_type != "vanilla")
            ctx = self.core_attention(q, k, v, mask, kv_cache.causal)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.head_dim)  # [s, b, nq hd / tp]
        if self.output_gate:  # Qwen3-Next's gated attention (Megatron Core's attention_output_gate)
            ctx = ctx * torch.sigmoid(gate.float()).to(ctx.dtype)
        return maybe_checkpoint(False, self.seams, self.dense, ctx, offload=self.offload.get("attn_proj"))


def make_attention(cfg: ModelConfig, layer_number: int) -> nn.Module:
    """The one place that chooses a layer's attention: multi-latent (``megatron.model.mla``) or ``SelfAttention``;
    both take ``(x, kv_cache, rotary, plan)``, attend through ``planned_attention`` under a plan (context
    parallelism, packed documents) and say what the KV cache holds (``cache_shape``)."""
    if is_linear_attention_layer(cfg, layer_number):  # Qwen3-Next's linear attention (megatron.hybrid)
        from megatron.hybrid.gated_deltanet import GatedDeltaNet

        return GatedDeltaNet(cfg, make_norm, layer_number)
    if cfg.multi_latent_attention:
        return MultiLatentAttention(cfg, layer_number)
    return SelfAttention(cfg, layer_number)


class MLP(nn.Module):
    """GELU: ``fc2(gelu(fc1 x))`` (the tanh approximation or exact: ``ops.activations.gelu_approximation``);
    gated (SwiGLU, ``fc2(silu(x W_gate) * (x W_up))``, or gpt-oss's quick GeGLU with its offset and clamp:
    ``ops.activations.activate``); h -> ffn -> h.

    A gated MLP's ``dense_h_to_4h`` has 2 x ffn output rows, interleaved: row 2j is gate_j, row 2j+1 is
    up_j, so a tensor-parallel rank's contiguous block of rows holds matching pairs."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.activation = mlp_activation(cfg)
        gated = is_gated(self.activation)
        bias, ffn = not cfg.disable_bias_linear, cfg.ffn_hidden_size
        self.dense_h_to_4h = nn.Linear(cfg.hidden_size, 2 * ffn if gated else ffn, bias=bias)
        self.dense_4h_to_h = nn.Linear(ffn, cfg.hidden_size, bias=bias)

    def extra_repr(self) -> str:
        kind, gelu, offset, clamp = self.activation
        extra = (f", offset={offset}" if offset else "") + (f", clamp={clamp}" if clamp is not None else "")
        return f"activation={kind or ('gelu_tanh' if gelu == 'tanh' else 'gelu')}{extra}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(activate(self.dense_h_to_4h(x), self.activation))


class TransformerDecoderLayer(nn.Module):
    """``x + drop(attn(norm1(x)))``, then ``+ drop(mlp(norm2(.)))``.

    ``recompute``: None, ``full`` (the whole layer), ``only_attn``/``full_attn`` (norm +
    attention block) or ``core_attn`` (selective: the parts ``recompute_parts`` names, ``megatron.recompute``).
    """

    seams = LOCAL
    recompute: str | None = None  # megatron.recompute.apply_recompute
    recompute_parts: frozenset[str] = frozenset()  # under core_attn (selective): what it covers
    offload = NO_OFFLOAD  # layer (the whole layer's saves), attn_norm, mlp_norm: to host (megatron.offload)

    def __init__(self, cfg: ModelConfig, layer_number: int):
        super().__init__()
        self.layer_number = layer_number
        kind = hybrid_layer_kind(cfg, layer_number)  # a hybrid model's layer holds one of its parts (or None: both)
        mixes, has_mlp = kind in (None, "M", "*"), kind in (None, "-", "E")
        self.input_layernorm = make_norm(cfg) if mixes else None
        self.self_attention = make_attention(cfg, layer_number) if mixes and kind != "M" else None
        if kind == "M":  # a Mamba-2 mixer (megatron.hybrid), named as Megatron-LM's hybrid models name it
            from megatron.hybrid.mamba import Mamba2Mixer

            self.mixer = Mamba2Mixer(cfg, layer_number)
        self.post_attention_layernorm = make_norm(cfg) if has_mlp else None
        if not has_mlp:
            self.mlp = None
        elif is_moe_layer(cfg, layer_number):  # mixture of experts in place of the MLP (megatron.moe)
            from megatron.moe.layer import MoELayer

            self.mlp = MoELayer(cfg, MLP, layer_number)
        else:
            self.mlp = MLP(cfg)
        self.hidden_dropout = cfg.hidden_dropout_prob
        nq, ng, hd = attention_shape(cfg)
        self._desc = (f"d_model={cfg.hidden_size}, nhead={nq}, dim_feedforward={cfg.ffn_hidden_size}, "
                      f"dropout={cfg.hidden_dropout_prob}, activation={mlp_activation(cfg)[0] or 'gelu'}, "
                      f"attn_dropout={cfg.attention_probs_dropout_prob}")
        if (ng, hd) != (nq, cfg.hidden_size // nq):
            self._desc += f", num_query_groups={ng}, head_dim={hd}"
        if cfg.normalization != "LayerNorm":
            self._desc += f", normalization={cfg.normalization}"
        if is_moe_layer(cfg, layer_number):
            self._desc += f", num_experts={cfg.num_experts}, topk={cfg.moe_router_topk}"

    def extra_repr(self) -> str:
        return self._desc

    def _attention_block(self, x: torch.Tensor, kv_cache=None, rotary: Rotary = None,
                         plan: AttentionPlan | None = None) -> torch.Tensor:
        mixer = self.self_attention if self.self_attention is not None else self.mixer
        out = mixer(self._norm(self.input_layernorm, x, "attn_norm"), kv_cache, rotary, plan)
        return dropout(out, self.hidden_dropout, self.training, self.seams.sequence_rng)

    def _norm(self, norm: nn.Module, x: torch.Tensor, part: str) -> torch.Tensor:
        return maybe_checkpoint("layernorm" in self.recompute_parts, self.seams, norm, x,
                                offload=self.offload.get(part))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP, or the mixture of a MoE layer (recomputed when its part, mlp or moe, is named)."""
        part = "moe" if hasattr(self.mlp, "router") else "mlp"
        return maybe_checkpoint(part in self.recompute_parts, self.seams, self.mlp, x)

    def _layer(self, x: torch.Tensor, kv_cache=None, rotary: Rotary = None,
               plan: AttentionPlan | None = None) -> torch.Tensor:
        if self.input_layernorm is None:  # a hybrid model's MLP or MoE layer
            pass
        elif kv_cache is None:
            x = x + maybe_checkpoint(self.recompute in ("only_attn", "full_attn"), self.seams, self._attention_block,
                                     x, None, rotary, plan)
        else:  # inference: no autograd, nothing to recompute
            x = x + self._attention_block(x, kv_cache, rotary)
        if self.mlp is None:  # a hybrid model's mixer layer
            return x
        out = self._mlp(self._norm(self.post_attention_layernorm, x, "mlp_norm"))
        return x + dropout(out, self.hidden_dropout, self.training, self.seams.sequence_rng)

    def forward(self, x: torch.Tensor, kv_cache=None, rotary: Rotary = None,
                plan: AttentionPlan | None = None) -> torch.Tensor:
        """x: [s, b, h] -> [s, b, h] ([s/tp, b, h] under sequence parallel; s this rank's share of the sequence
        under context parallelism). ``rotary``, ``kv_cache`` and ``plan``: see ``SelfAttention.forward`` (the
        cache in inference only)."""
        if kv_cache is not None:
            return self._layer(x, kv_cache, rotary)
        return maybe_checkpoint(self.recompute == "full", self.seams, self._layer, x, None, rotary, plan,
                                offload=self.offload.get("layer"))
