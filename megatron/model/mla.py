"""Multi-latent attention (DeepSeek-V2/V3; Megatron Core's ``MLASelfAttention``), beside ``SelfAttention`` with the
same interface: ``forward(x [s, b, h], kv_cache, rotary, plan) -> [s, b, h]``. ``transformer.make_attention`` is
the one place that chooses between them.

With ``a`` heads, ``dn = qk_head_dim``, ``dr = qk_pos_emb_head_dim``, ``dv = v_head_dim``::

    q        = q_up(q_norm(q_down(x)))  [a, dn + dr]    (or q_proj(x) without q_lora_rank)
    c, k_r   = kv_down(x)               [kv_lora_rank], [dr]      (k_r: one rotary key shared by the heads)
    k_n, v   = kv_up(kv_norm(c))        [a, dn], [a, dv]
    q = [q_n, rope(q_r)],  k = [k_n, rope(k_r)]  (k_r broadcast to every head)
    out = dense(softmax(q k^T x scale + causal) v),  scale = mscale(f, mscale_all_dim)^2 / sqrt(dn + dr)

The norms are RMSNorm/LayerNorm (the model's) with ``qk_layernorm`` (DeepSeek-V3 sets it), else absent, as
Megatron Core's local spec builds them. Rotary embeddings on the ``dr`` channels rotate adjacent channel pairs
(Megatron Core de-interleaves them first, transformers' DeepSeek-V3 permutes its weights the same way: the scores
are the same), with YaRN's frequencies and concentration factor for ``rope_type yarn`` (``rotary.Yarn``).

Tensor parallelism: the heads are split (``q_up`` / ``q_proj`` and ``kv_up`` column-parallel, ``dense``
row-parallel); the down-projections and the latent norms are replicated and computed by every rank on the whole
sequence (under sequence parallelism the layer's input is gathered first, its gradient only sliced back: every
rank's is the whole one). The ranks' partial gradients meet where the heads begin: the column-parallel
up-projections all-reduce their input's gradient, and the shared rotary key is copied into the tensor-parallel
region (``copy_to_tp_region``) for the same sum, so every replicated weight gets the same, whole gradient.

Context parallelism and packed documents: the layer computes its queries, keys and values on this rank's tokens
(its two chunks of the sequence, their positions' rotary embeddings), then attends through the same
``AttentionPlan`` / ``attend`` as ``SelfAttention`` (``planned_attention``: eager under ``--compile``): every
communication type (p2p ring, all_gather, a2a) carries keys of ``dn + dr`` and values of ``dv`` channels, and
the softmax scale above. The keys sent are the expanded ones (``a`` heads: the shared rotary key repeated), not
the latent: the same exchange as standard attention. Under sequence parallelism the input is gathered over the
tensor-parallel ranks first, as without context parallelism: the tokens of this rank's chunks.

KV cache (generation, ``megatron.inference.KVCache``): each layer's cache holds the keys [a, dn + dr] (after
the rotary embedding) and values [a, dv] of every token so far (``cache_shape``), as ``SelfAttention``'s holds
its heads: a new token's queries attend to them under the cache's mask. Holding the latent (``kv_lora_rank + dr``
per token, a fraction of that) would save memory at the cost of up-projecting every cached latent each step (or
absorbing ``kv_up`` into the queries and the output): not built.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from megatron.attention.local import AttentionPlan, attend
from megatron.attention.max_logits import running_max_logits
from megatron.config.schema import ModelConfig
from megatron.model.blocks import make_norm
from megatron.model.rotary import Yarn, apply_rotary, yarn_mscale, yarn_of
from megatron.ops.offload import NO_OFFLOAD
from megatron.ops.seams import LOCAL, maybe_checkpoint


def yarn_settings(cfg: ModelConfig) -> Yarn | None:
    """YaRN's settings for multi-latent attention's rotary channels (None: plain rope)."""
    if mla_rope_type(cfg) != "yarn":
        return None
    return yarn_of(cfg)


def mla_rope_type(cfg: ModelConfig) -> str:
    return cfg.rope_type or "yarn"  # Megatron-LM: multi-latent attention takes yarn by default


def softmax_scale(cfg: ModelConfig) -> float:
    """``mscale(f, mscale_all_dim)^2 / sqrt(dn + dr)`` (Megatron Core's, with rope or yarn)."""
    return yarn_mscale(cfg.rotary_scaling_factor, cfg.mscale_all_dim) ** 2 / (cfg.qk_head_dim +
                                                                              cfg.qk_pos_emb_head_dim) ** 0.5


class MultiLatentAttention(nn.Module):
    """See the module docstring. Built whole; ``tensor_parallel.parallelize`` swaps the up-projections and ``dense``
    for column- / row-parallel ones and sets ``num_heads`` to this rank's."""

    seams = LOCAL
    recompute_core = False  # megatron.recompute (core_attn)
    recompute_up_proj = False  # megatron.recompute (mla_up_proj)
    offload = NO_OFFLOAD  # qkv_linear (down and up projections), core_attn, attn_proj: to host (megatron.offload)
    first_head = 0  # the global index of this rank's first head (tensor parallelism)
    tracks_max_logits = False  # QK-clip, as SelfAttention's
    max_logits: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig, layer_number: int = 0):
        super().__init__()
        self.layer_number = layer_number
        heads = cfg.num_attention_heads
        self.num_heads = heads
        self.dn, self.dr, self.dv = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        q_dim = heads * (self.dn + self.dr)
        if cfg.q_lora_rank is None:
            self.linear_q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=False)
        else:
            self.linear_q_down_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
            self.q_layernorm = make_norm(cfg, size=cfg.q_lora_rank) if cfg.qk_layernorm else None
            self.linear_q_up_proj = nn.Linear(cfg.q_lora_rank, q_dim, bias=False)
        self.linear_kv_down_proj = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + self.dr, bias=False)
        self.kv_layernorm = make_norm(cfg, size=cfg.kv_lora_rank) if cfg.qk_layernorm else None
        self.linear_kv_up_proj = nn.Linear(cfg.kv_lora_rank, heads * (self.dn + self.dv), bias=False)
        self.dense = nn.Linear(heads * self.dv, cfg.hidden_size, bias=not cfg.disable_bias_linear)
        self.scale = softmax_scale(cfg)
        self.attn_dropout = cfg.attention_probs_dropout_prob
        self.q_lora = cfg.q_lora_rank is not None

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads} (per rank), qk_head_dim={self.dn}, qk_pos_emb_head_dim={self.dr}, "
                f"v_head_dim={self.dv}, kv_lora_rank={self.kv_lora_rank}, softmax_scale={self.scale:.6g}")

    @property
    def cache_shape(self) -> tuple[int, int, int]:
        """(heads on this rank, key width, value width) of what the KV cache holds per token."""
        return self.num_heads, self.dn + self.dr, self.dv

    def _dropout(self) -> tuple[float, object]:
        """The attention dropout now, and the RNG stream it draws from (per tensor-parallel rank: its own heads)."""
        dropout = self.attn_dropout if self.training else 0.0
        return dropout, self.seams.region_rng() if dropout else nullcontext()

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
        """q, k [b, a, s(k), dn + dr], v [b, a, sk, dv] -> [b, a, s, dv]: causal, or under ``mask`` (boolean, True =
        may attend: the KV cache's) when given; ``causal=False`` without a mask: every query sees every key."""
        dropout, rng = self._dropout()
        with rng:
            return F.scaled_dot_product_attention(q, k, v, mask, dropout_p=dropout, is_causal=causal and mask is None,
                                                  scale=self.scale)

    def planned_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          plan: AttentionPlan) -> torch.Tensor:
        """``core_attention`` across a context-parallel split and/or within packed documents
        (``megatron.context_parallel``, with this layer's softmax scale); eager under ``--compile``."""
        dropout, rng = self._dropout()
        with rng:
            return attend(q, k, v, plan, dropout, self.scale, layer=self.layer_number, head_offset=self.first_head,
                          max_logits=running_max_logits(self, q))

    def forward(self, x: torch.Tensor, kv_cache=None, rotary=None, plan: AttentionPlan | None = None) -> torch.Tensor:
        """x [s, b, h] -> [s, b, h]; ``kv_cache``, ``rotary`` and ``plan`` as ``SelfAttention.forward``'s."""
        if kv_cache is None:
            q, k, v = maybe_checkpoint(False, self.seams, self.queries_keys_values, x, rotary,
                                       offload=self.offload.get("qkv_linear"))
        else:
            q, k, v = self.queries_keys_values(x, rotary)
        s, b = q.shape[2], q.shape[0]
        if kv_cache is None and plan is None and running_max_logits(self, q) is not None:
            plan = AttentionPlan()  # QK-clip's maxima come from the plan's blocks
        if kv_cache is not None:
            k, v = kv_cache.store(self.layer_number, k, v)
            ctx = self.core_attention(q, k, v, kv_cache.mask, kv_cache.causal)
        elif plan is not None:
            ctx = maybe_checkpoint(self.recompute_core, self.seams, self.planned_attention, q, k, v, plan,
                                   offload=self.offload.get("core_attn"))
        else:
            ctx = maybe_checkpoint(self.recompute_core, self.seams, self.core_attention, q, k, v.contiguous(),
                                   offload=self.offload.get("core_attn"))
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.dv)
        return maybe_checkpoint(False, self.seams, self.dense, ctx, offload=self.offload.get("attn_proj"))

    def queries_keys_values(self, x: torch.Tensor, rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k [b, a, s, dn + dr] (rotated), v [b, a, s, dv] of this rank's heads (see the module docstring)."""
        x = self.seams.gather_sequence_input(x)  # sequence parallelism: the latents of the whole sequence on every rank
        q = self.linear_q_down_proj(x) if self.q_lora else self.linear_q_proj(x)
        kv_latent, k_rot = self.linear_kv_down_proj(x).split([self.kv_lora_rank, self.dr], dim=-1)
        return maybe_checkpoint(self.recompute_up_proj, self.seams, self._up_projections, q, kv_latent, k_rot, rotary)

    def _up_projections(self, q: torch.Tensor, kv_latent: torch.Tensor, k_rot: torch.Tensor, rotary):
        """From the down projections (the query's latent, or its whole projection without q_lora) to q, k, v: the
        latents' norms, the up projections and the rotary channels (Megatron-LM's mla_up_proj recompute)."""
        s, b, _ = kv_latent.shape
        if self.q_lora:
            q = self.linear_q_up_proj(self.q_layernorm(q) if self.q_layernorm is not None else q)
        kv = self.linear_kv_up_proj(self.kv_layernorm(kv_latent) if self.kv_layernorm is not None else kv_latent)
        q = q.view(s, b, self.num_heads, self.dn + self.dr).permute(1, 2, 0, 3)  # [b, a, s, dn + dr]
        kv = kv.view(s, b, self.num_heads, self.dn + self.dv).permute(1, 2, 0, 3)
        k_rot = self.seams.copy_to_heads(k_rot).permute(1, 0, 2).unsqueeze(1)  # [b, 1, s, dr]: the heads' gradients
        q_nope, q_rot = q.split([self.dn, self.dr], dim=-1)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)
        if rotary is not None:
            q_rot = apply_rotary(q_rot, *rotary, interleaved=True)
            k_rot = apply_rotary(k_rot, *rotary, interleaved=True)
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, self.num_heads, -1, -1)), dim=-1)
        return q, k, v
