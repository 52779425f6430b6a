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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron import parallel_state
from megatron import tensor_parallel as tp
from megatron.config.schema import ModelConfig
from megatron.model.blocks import make_norm, maybe_checkpoint
from megatron.model.rotary import Yarn, apply_rotary, yarn_mscale


def yarn_settings(cfg: ModelConfig) -> Yarn | None:
    """YaRN's settings for multi-latent attention's rotary channels (None: plain rope)."""
    if mla_rope_type(cfg) != "yarn":
        return None
    return Yarn(cfg.rotary_scaling_factor, cfg.original_max_position_embeddings, cfg.mscale, cfg.mscale_all_dim)


def mla_rope_type(cfg: ModelConfig) -> str:
    return cfg.rope_type or "yarn"  # Megatron-LM: multi-latent attention takes yarn by default


def softmax_scale(cfg: ModelConfig) -> float:
    """``mscale(f, mscale_all_dim)^2 / sqrt(dn + dr)`` (Megatron Core's, with rope or yarn)."""
    return yarn_mscale(cfg.rotary_scaling_factor, cfg.mscale_all_dim) ** 2 / (cfg.qk_head_dim +
                                                                              cfg.qk_pos_emb_head_dim) ** 0.5


class MultiLatentAttention(nn.Module):
    """See the module docstring. Inference's KV cache and context parallelism are not built for it yet (refused
    at validation)."""

    def __init__(self, cfg: ModelConfig, recompute_core: bool = False, sequence_parallel: bool = False,
                 layer_number: int = 0):
        super().__init__()
        self.layer_number = layer_number
        tp_size = parallel_state.get().tp_size
        heads = cfg.num_attention_heads
        if heads % tp_size:
            raise ValueError(f"num_attention_heads ({heads}) must be divisible by the tensor-parallel size "
                             f"({tp_size})")
        self.num_heads = heads // tp_size
        self.dn, self.dr, self.dv = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.sequence_parallel = sequence_parallel and tp_size > 1
        q_dim = heads * (self.dn + self.dr)
        if cfg.q_lora_rank is None:
            self.linear_q_proj = tp.ColumnParallelLinear(cfg.hidden_size, q_dim, bias=False)
        else:
            self.linear_q_down_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
            self.q_layernorm = make_norm(cfg, size=cfg.q_lora_rank) if cfg.qk_layernorm else None
            self.linear_q_up_proj = tp.ColumnParallelLinear(cfg.q_lora_rank, q_dim, bias=False)
        self.linear_kv_down_proj = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + self.dr, bias=False)
        self.kv_layernorm = make_norm(cfg, size=cfg.kv_lora_rank) if cfg.qk_layernorm else None
        self.linear_kv_up_proj = tp.ColumnParallelLinear(cfg.kv_lora_rank, heads * (self.dn + self.dv), bias=False)
        self.dense = tp.RowParallelLinear(heads * self.dv, cfg.hidden_size, bias=not cfg.disable_bias_linear,
                                          sequence_parallel=sequence_parallel)
        self.scale = softmax_scale(cfg)
        self.attn_dropout = cfg.attention_probs_dropout_prob
        self.recompute_core = recompute_core
        self.q_lora = cfg.q_lora_rank is not None

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads} (per rank), qk_head_dim={self.dn}, qk_pos_emb_head_dim={self.dr}, "
                f"v_head_dim={self.dv}, kv_lora_rank={self.kv_lora_rank}, softmax_scale={self.scale:.6g}")

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k [b, a, s, dn + dr], v [b, a, s, dv] -> [b, a, s, dv], causal."""
        dropout = self.attn_dropout if self.training else 0.0
        if dropout and parallel_state.get().tp_size > 1:
            with tp.get_rng_tracker().fork():
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=self.scale)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=self.scale)

    def forward(self, x: torch.Tensor, kv_cache=None, rotary=None, plan=None) -> torch.Tensor:
        if kv_cache is not None or plan is not None:
            raise NotImplementedError("multi-latent attention has no KV cache, context parallelism or packed "
                                      "documents yet")
        if self.sequence_parallel:  # every rank computes the latents of the whole sequence; the gradient sliced
            x = tp.gather_from_sequence_region(x, tensor_parallel_output_grad=False)
        s, b, _ = x.shape
        if self.q_lora:
            q_latent = self.linear_q_down_proj(x)
            q = self.linear_q_up_proj(self.q_layernorm(q_latent) if self.q_layernorm is not None else q_latent)
        else:
            q = self.linear_q_proj(x)
        kv_latent, k_rot = self.linear_kv_down_proj(x).split([self.kv_lora_rank, self.dr], dim=-1)
        kv = self.linear_kv_up_proj(self.kv_layernorm(kv_latent) if self.kv_layernorm is not None else kv_latent)
        q = q.view(s, b, self.num_heads, self.dn + self.dr).permute(1, 2, 0, 3)  # [b, a, s, dn + dr]
        kv = kv.view(s, b, self.num_heads, self.dn + self.dv).permute(1, 2, 0, 3)
        k_rot = tp.copy_to_tp_region(k_rot).permute(1, 0, 2).unsqueeze(1)  # [b, 1, s, dr]: the heads' gradients
        q_nope, q_rot = q.split([self.dn, self.dr], dim=-1)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)
        if rotary is not None:
            q_rot = apply_rotary(q_rot, *rotary, interleaved=True)
            k_rot = apply_rotary(k_rot, *rotary, interleaved=True)
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, self.num_heads, -1, -1)), dim=-1)
        ctx = maybe_checkpoint(self.recompute_core, self.core_attention, q, k, v.contiguous())
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.dv)
        return self.dense(ctx)
