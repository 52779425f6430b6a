"""Hugging Face Qwen3-Next (``Qwen3NextForCausalLM``, transformers 5) to and from our GPT with Gated DeltaNet layers
(``--experimental-attention-variant gated_delta_net``, docs/hybrid.md).

Qwen3-Next is Qwen2-MoE's mixture (``hf_qwen_moe``: a router, experts, a shared expert with its gate; the dense
layers ``mlp_only_layers`` keep Llama's MLP) under two kinds of token mixer, chosen per layer by ``layer_types``:
Gated DeltaNet (``linear_attention``, ours where ``linear_attention_freq`` says) and gated full attention
(``full_attention``: a query-shaped gate per head, our ``--attention-output-gate``; QK-norm; rotary embeddings on
``partial_rotary_factor`` of each head, our ``rotary_percent``). Its RMSNorms scale by ``1 + w`` (our
``--apply-layernorm-1p``: the same numbers), but the Gated DeltaNet's output norm, which scales by ``w`` (ours by
``1 + w``: exported plus one).

===================================================  ==============================================================
ours (``layers.{i}.self_attention.``)                Hugging Face (``model.layers.{i}.``)
===================================================  ==============================================================
``query_key_value.weight``: per group of query       ``self_attn.q_proj.weight`` (per head its query, then its gate),
heads: their queries, their gates, key, value        ``self_attn.k_proj.weight``, ``self_attn.v_proj.weight``
``dense.weight``                                     ``self_attn.o_proj.weight``
``q_layernorm.weight``, ``k_layernorm.weight``       ``self_attn.q_norm.weight``, ``self_attn.k_norm.weight``
``in_proj.weight``: per key head ``(q, k, v, z, b,   ``linear_attn.in_proj_qkvz.weight`` (per key head q, k, v, z)
a)``                                                 and ``linear_attn.in_proj_ba.weight`` (per key head b, a)
``conv1d_weight [C, K]``: channels per key head      ``linear_attn.conv1d.weight [C, 1, K]``: all queries, all keys,
``(q, k, v)``                                        all values
``dt_bias``, ``A_log``, ``out_proj.weight``          ``linear_attn.dt_bias``, ``linear_attn.A_log``,
                                                     ``linear_attn.out_proj.weight``
``out_norm.weight`` (scales by 1 + w)                ``linear_attn.norm.weight`` (scales by w)
===================================================  ==============================================================

A model of ours exports here when it has the linear-attention layers or the attention gate, and everything else
Qwen3-Next has: rope (partial or not), RMSNorm with ``--apply-layernorm-1p``, SwiGLU, QK-norm, the attention gate,
no linear biases, and either no experts or Qwen's router with a shared expert (as ``hf_qwen_moe`` checks it; without
the shared expert's gate, the same zero gate and doubled down projection as there). Anything else is one line.
"""

from __future__ import annotations

import torch

from megatron.checkpoint.hf import llama as hf_llama
from megatron.checkpoint.hf import qwen2_moe as hf_qwen_moe
from megatron.checkpoint.hf.common import ConversionError, layer_pattern, to_flags
from megatron.checkpoint.hf.mapping import BLOCK, Family, Transform, config_out, layers_where, renames, rule
from megatron.checkpoint.hf.transforms import scaled
from megatron.config.schema import ModelConfig
from megatron.config.validate_hybrid import linear_attention_pattern
from megatron.config.validate_moe import first_coefficient

ARCHITECTURE = "Qwen3NextForCausalLM"
_ARCH = f"Hugging Face Qwen3-Next ({ARCHITECTURE})"
_HINT = "check num_hidden_layers, layer_types, num_experts, mlp_only_layers and tie_word_embeddings"
LAYER, HF_LAYER = hf_llama.LAYER + "self_attention.", hf_llama.HF_LAYER


def linear_pattern(m) -> list[bool]:
    """Which layers are Gated DeltaNet (every one attention without the variant)."""
    if m.experimental_attention_variant != "gated_delta_net":
        return [False] * m.num_layers
    try:
        return linear_attention_pattern(str(m.linear_attention_freq), m.num_layers)
    except ValueError as err:
        raise ConversionError(f"{err}.") from None


linear_layers = layers_where(linear_pattern)
full_layers = layers_where(lambda m: [not linear for linear in linear_pattern(m)])
moe_layers = layers_where(lambda m: hf_qwen_moe._pattern(m) if m.num_experts else [False] * m.num_layers)
dense_layers = layers_where(lambda m: [not moe for moe in hf_qwen_moe._pattern(m)] if m.num_experts
                            else [True] * m.num_layers)


def check_model(model_cfg: ModelConfig) -> None:
    """ConversionError, naming the setting, unless our ``ModelConfig`` is a Qwen3-Next."""
    m = model_cfg
    for differs, setting, theirs in (
            (m.position_embedding_type != "rope", f"position_embedding_type {m.position_embedding_type}",
             "rotary embeddings"),
            (m.rotary_interleaved, "rotary_interleaved", "rotary embeddings on the halves of each head's channels"),
            (m.normalization != "RMSNorm", f"normalization {m.normalization}", "RMSNorm"),
            (not m.apply_layernorm_1p, "norms that scale by w (apply_layernorm_1p off)", "norms scaling by 1 + w"),
            (not m.swiglu, "a GELU MLP (swiglu off)", "a SwiGLU MLP"),
            (not m.qk_layernorm, "attention without QK-norm (qk_layernorm off)", "QK-norm"),
            (not m.attention_output_gate, "attention without an output gate", "a gate on each attention head"),
            (m.multi_latent_attention, "multi-latent attention", "query/key/value projections per head"),
            (not m.disable_bias_linear or m.add_qkv_bias, "linear biases", "none"),
            (m.num_experts and not m.moe_shared_expert_intermediate_size, "experts without a shared expert",
             "a shared expert in every MoE layer")):
        if differs:
            raise ConversionError(f"{setting} has no {_ARCH} equivalent (it has {theirs}), so this checkpoint cannot "
                                  f"be exported.")
    linear_pattern(m)
    if m.num_experts:
        hf_qwen_moe.check_router(m, _ARCH, "Qwen3-Next")


def _dims(m) -> tuple[int, int, int]:
    return hf_llama.dims(m)


def _gated_qkv_to_hf(t: torch.Tensor, ctx, ours: str) -> list[torch.Tensor]:
    """Rows ``[ng, (r queries, r gates, key, value), hd]`` -> q_proj ``[nq, (query, gate), hd]``, k_proj and v_proj
    ``[ng, hd]``."""
    nq, ng, hd = _dims(ctx.m)
    r, rest = nq // ng, t.shape[1:]
    groups = t.reshape(ng, 2 * r + 2, hd, *rest)
    q_gate = torch.stack([groups[:, :r], groups[:, r:2 * r]], dim=2)  # [ng, r, 2, hd, ...]
    return [q_gate.reshape(-1, *rest), groups[:, 2 * r].reshape(-1, *rest), groups[:, 2 * r + 1].reshape(-1, *rest)]


def _gated_qkv_from_hf(parts: list[torch.Tensor], ctx) -> torch.Tensor:
    nq, ng, hd = _dims(ctx.m)
    q_gate, k, v = parts
    r, rest = nq // ng, q_gate.shape[1:]
    q_gate = q_gate.reshape(ng, r, 2, hd, *rest)
    pieces = (q_gate[:, :, 0], q_gate[:, :, 1], k.reshape(ng, 1, hd, *rest), v.reshape(ng, 1, hd, *rest))
    return torch.cat(pieces, dim=1).reshape(-1, *rest)


def _linear_dims(m) -> tuple[int, int, int, int]:
    return m.linear_num_key_heads, m.linear_num_value_heads // m.linear_num_key_heads, m.linear_key_head_dim, \
        m.linear_value_head_dim


def _in_proj_to_hf(t: torch.Tensor, ctx, ours: str) -> list[torch.Tensor]:
    """Rows per key head ``(q, k, v, z, b, a)`` -> in_proj_qkvz (per key head q, k, v, z) and in_proj_ba."""
    nk, r, dk, dv = _linear_dims(ctx.m)
    heads = t.reshape(nk, 2 * dk + 2 * r * dv + 2 * r, t.shape[-1])
    return [heads[:, :2 * dk + 2 * r * dv].reshape(-1, t.shape[-1]),
            heads[:, 2 * dk + 2 * r * dv:].reshape(-1, t.shape[-1])]


def _in_proj_from_hf(parts: list[torch.Tensor], ctx) -> torch.Tensor:
    nk, r, dk, dv = _linear_dims(ctx.m)
    qkvz, ba = parts
    h = qkvz.shape[-1]
    return torch.cat([qkvz.reshape(nk, -1, h), ba.reshape(nk, 2 * r, h)], dim=1).reshape(-1, h)


def _conv_to_hf(t: torch.Tensor, ctx) -> torch.Tensor:
    """Channels per key head ``(q, k, v)`` ``[C, K]`` -> all queries, all keys, all values ``[C, 1, K]``."""
    nk, r, dk, dv = _linear_dims(ctx.m)
    heads = t.reshape(nk, 2 * dk + r * dv, t.shape[-1])
    parts = (heads[:, :dk], heads[:, dk:2 * dk], heads[:, 2 * dk:])
    return torch.cat([p.reshape(-1, t.shape[-1]) for p in parts])[:, None]


def _conv_from_hf(t: torch.Tensor, ctx) -> torch.Tensor:
    nk, r, dk, dv = _linear_dims(ctx.m)
    if t.dim() != 3 or t.shape[1] != 1:
        raise ConversionError(f"linear_attn.conv1d.weight has shape {list(t.shape)}, expected [channels, 1, kernel].")
    t = t[:, 0]
    q, k, v = t.split([nk * dk, nk * dk, nk * r * dv])
    return torch.cat([q.reshape(nk, dk, -1), k.reshape(nk, dk, -1), v.reshape(nk, r * dv, -1)], dim=1) \
        .reshape(-1, t.shape[-1])


GATED_QKV = Transform("gated qkv by group", _gated_qkv_to_hf, _gated_qkv_from_hf)
IN_PROJ = Transform("in_proj per key head", _in_proj_to_hf, _in_proj_from_hf)
CONV = Transform("conv channels per key head", lambda t, ctx, ours: [_conv_to_hf(t, ctx)],
                 lambda parts, ctx: _conv_from_hf(parts[0], ctx))

FULL_ATTENTION = [
    rule(f"{LAYER}dense.weight", f"{HF_LAYER}self_attn.o_proj.weight", layers=full_layers),
    rule(f"{LAYER}query_key_value.weight", tuple(f"{HF_LAYER}self_attn.{p}_proj.weight" for p in "qkv"), GATED_QKV,
         layers=full_layers),
    *renames({"q_layernorm.weight": "self_attn.q_norm.weight", "k_layernorm.weight": "self_attn.k_norm.weight"},
             layers=full_layers, ours=LAYER, theirs=HF_LAYER)]
LINEAR_ATTENTION = [
    rule(f"{LAYER}in_proj.weight", (f"{HF_LAYER}linear_attn.in_proj_qkvz.weight",
                                   f"{HF_LAYER}linear_attn.in_proj_ba.weight"), IN_PROJ, layers=linear_layers),
    rule(f"{LAYER}conv1d_weight", f"{HF_LAYER}linear_attn.conv1d.weight", CONV, layers=linear_layers),
    *renames({"dt_bias": "linear_attn.dt_bias", "A_log": "linear_attn.A_log",
              "out_norm.weight": "linear_attn.norm.weight", "out_proj.weight": "linear_attn.out_proj.weight"},
             layers=linear_layers, ours=LAYER, theirs=HF_LAYER)]
_down, _gate_up = hf_llama.mlp("weight", dense_layers)
RULES = (hf_llama.WORD_EMBEDDING, *hf_llama.NORMS, *FULL_ATTENTION, *LINEAR_ATTENTION, *_down, *_gate_up,
         *hf_llama.FINAL, BLOCK, *hf_qwen_moe.moe_mlp(layers=moe_layers, shared_down=scaled(2.0)))
EXTRAS = tuple(type(e)(e.theirs, e.make, e.check, layers=moe_layers, when=e.when) for e in hf_qwen_moe.EXTRAS)


def hf_config(model_cfg: ModelConfig, dtype: str = "float32") -> dict:
    """``config.json`` of the equivalent ``Qwen3NextForCausalLM``."""
    check_model(model_cfg)
    m = model_cfg
    nq, ng, hd = _dims(m)
    cfg = {k: v for k, v in config_out(hf_llama.KEYS, m).items() if k not in ("mlp_bias", "pretraining_tp",
                                                                            "rope_scaling", "rope_theta")}
    cfg["torch_dtype"] = dtype
    moe = bool(m.num_experts)
    cfg.update({
        "architectures": [ARCHITECTURE], "model_type": "qwen3_next", "attention_bias": False, "head_dim": hd,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(m.rotary_base),
                            "partial_rotary_factor": float(m.rotary_percent)},
        "layer_types": ["linear_attention" if linear else "full_attention" for linear in linear_pattern(m)],
        "linear_conv_kernel_dim": m.linear_conv_kernel_dim, "linear_key_head_dim": m.linear_key_head_dim,
        "linear_value_head_dim": m.linear_value_head_dim, "linear_num_key_heads": m.linear_num_key_heads,
        "linear_num_value_heads": m.linear_num_value_heads,
        "intermediate_size": m.ffn_hidden_size, "decoder_sparse_step": 1,
        "num_experts": m.num_experts or 0, "num_experts_per_tok": m.moe_router_topk if moe else 1,
        "moe_intermediate_size": (m.moe_ffn_hidden_size or m.ffn_hidden_size) if moe else m.ffn_hidden_size,
        "shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size or 0,
        "norm_topk_prob": not m.moe_router_pre_softmax,
        "mlp_only_layers": [n for n, is_moe in enumerate(hf_qwen_moe._pattern(m)) if not is_moe] if moe else [],
        "router_aux_loss_coef": first_coefficient(m.moe_aux_loss_coeff) if moe else 0.0,
        "output_router_logits": False,
    })
    return cfg


def model_flags(config: dict) -> list[str]:
    """Our command-line flags for the model of a Hugging Face Qwen3-Next ``config.json``."""
    if config.get("model_type", "qwen3_next") != "qwen3_next":
        raise ConversionError(f"config.json describes a {config.get('model_type')!r} model, not qwen3_next.")
    if config.get("attention_bias"):
        raise ConversionError("config.json sets attention_bias, but Qwen3-Next's other projections have no bias and "
                              "this GPT has biases on every linear layer or none; the model cannot be imported.")
    rope = dict(config.get("rope_parameters") or {})
    partial = float(rope.pop("partial_rotary_factor", None) or 0.25)  # transformers' default for Qwen3-Next
    values = hf_llama.model_values({**config, "rope_parameters": rope, "attention_bias": False, "mlp_bias": False})
    layers = values["num_layers"]
    kinds = config.get("layer_types") or ["full_attention"] * layers
    unknown = set(kinds) - {"linear_attention", "full_attention"}
    if unknown:
        raise ConversionError(f"config.json's layer_types holds {sorted(unknown)}; Qwen3-Next's are linear_attention "
                              f"and full_attention.")
    values.update({"qk_layernorm": True, "apply_layernorm_1p": True, "attention_output_gate": True,
                   "rotary_percent": partial})
    if "linear_attention" in kinds:
        values.update({"experimental_attention_variant": "gated_delta_net",
                       "linear_attention_freq": str([int(k == "linear_attention") for k in kinds]).replace(" ", "")})
        for key in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                    "linear_num_value_heads"):
            if config.get(key) is None:
                raise ConversionError(f"config.json lacks {key}, which its linear-attention layers need.")
            values[key] = int(config[key])
    experts = int(config.get("num_experts") or 0)
    if experts:
        values.update(_moe_values(config, experts, layers))
    return to_flags(values)


def _moe_values(config: dict, experts: int, layers: int) -> dict:
    topk, width, shared = (config.get(k) for k in ("num_experts_per_tok", "moe_intermediate_size",
                                                   "shared_expert_intermediate_size"))
    if not topk or not width or not shared:
        raise ConversionError("config.json lacks num_experts_per_tok, moe_intermediate_size or "
                              "shared_expert_intermediate_size (each at least 1 in a Qwen3-Next with experts).")
    if not 1 <= int(topk) <= experts:
        raise ConversionError(f"num_experts_per_tok ({topk}) must be from 1 to num_experts ({experts}).")
    step, dense = int(config.get("decoder_sparse_step") or 1), set(config.get("mlp_only_layers") or ())
    pattern = layer_pattern(layers, lambda n: int(n not in dense and (n + 1) % step == 0))
    return {"num_experts": experts, "moe_router_topk": int(topk), "moe_ffn_hidden_size": int(width),
            "moe_shared_expert_intermediate_size": int(shared), "moe_shared_expert_gate": True,
            "moe_layer_freq": "1" if all(pattern) else str(pattern).replace(" ", ""),
            "moe_router_pre_softmax": not config.get("norm_topk_prob", True),
            "moe_aux_loss_coeff": float(config.get("router_aux_loss_coef", 0.0))}


FAMILY = Family("qwen3_next", RULES, hf_llama.KEYS, check_model, hf_qwen_moe.strip_hf_prefix, hf_llama.HF_WTE,
                hf_llama.HF_HEAD, hf_llama.tied_head, extras=EXTRAS, hint=_HINT, one_plus_norms=(".out_norm.weight",))
name_map, to_hf_state_dict, from_hf_state_dict = FAMILY.name_map, FAMILY.to_hf_state_dict, FAMILY.from_hf_state_dict
