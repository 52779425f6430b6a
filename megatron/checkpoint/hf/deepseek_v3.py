"""Our DeepSeek-V3-shaped GPT (multi-latent attention, ``docs/attention.md``) <-> Hugging Face DeepSeek-V3
(``transformers.DeepseekV3ForCausalLM``).

The embedding, the layer norms, the dense MLPs and the head map as Llama's (``hf_llama``: gate/up rows interleaved
on our side, the padding rows of the vocabulary dropped); the experts and the shared expert as Qwen-MoE's
(``hf_qwen_moe``: the Hub's per-expert names, transformers 5's fused in-memory form read too). Per layer N
(``ours: layers.N.``, ``theirs: model.layers.N.``):

==============================================================  =================================================
ours                                                            Hugging Face
==============================================================  =================================================
``self_attention.linear_q_down_proj.weight [q_lora, h]``        ``self_attn.q_a_proj.weight`` (times c, below)
``self_attention.q_layernorm.weight``                           ``self_attn.q_a_layernorm.weight``
``self_attention.linear_q_up_proj.weight [a (dn + dr), q_lora]`` ``self_attn.q_b_proj.weight``
``self_attention.linear_q_proj.weight`` (no query LoRA)         ``self_attn.q_proj.weight``
``self_attention.linear_kv_down_proj.weight [kv_lora + dr, h]`` ``self_attn.kv_a_proj_with_mqa.weight`` (latent
                                                                rows times c)
``self_attention.kv_layernorm.weight``                          ``self_attn.kv_a_layernorm.weight``
``self_attention.linear_kv_up_proj.weight [a (dn + dv), kv]``   ``self_attn.kv_b_proj.weight``
``self_attention.dense.weight``                                 ``self_attn.o_proj.weight``
``mlp.router.weight [E, h]``                                    ``mlp.gate.weight``
(the train state's ``moe_expert_bias[N]``)                      ``mlp.gate.e_score_correction_bias [E]`` (fp32)
``mlp.experts.i.*``, ``mlp.shared_expert.*``                    ``mlp.experts.i.*``, ``mlp.shared_experts.*``
==============================================================  =================================================

- Rotary: we turn adjacent pairs of the ``dr`` channels, as DeepSeek's weights are laid out;
  transformers with ``rope_interleave: true`` (written) turns the same pairs and only lists the results in another
  order, the same for queries and keys: the scores are equal, no row is permuted. A folder with ``rope_interleave:
  false`` (rotate-half pairs ``(j, j + dr/2)``) is read with its rotary rows interleaved.
- The latent norms: transformers builds ``q_a_layernorm`` / ``kv_a_layernorm`` with epsilon 1e-6 whatever
  ``rms_norm_eps`` (ours: ``layernorm_epsilon``). ``rms(c x)`` with epsilon 1e-6 equals ``rms(x)`` with epsilon
  ``e`` for ``c = sqrt(1e-6 / e)``, so the down-projections' latent rows are scaled by c (c = 1, bitwise, at
  DeepSeek-V3's 1e-6; else equal to float32 rounding).
- The router: sigmoid scores, the expert bias added for the choice only, group-limited (``n_group``,
  ``topk_group``; transformers scores a group by its top 2, ours by its top ``topk // group_topk``), the top k
  normalised (``norm_topk_prob``: ours does for k > 1, whatever ``moe_router_pre_softmax``) and multiplied by
  ``routed_scaling_factor``. Without our expert bias the export's is zeros; the import enables it.
- Dense layers are the first ``first_k_dense_replace``. The shared expert is ``n_shared_experts`` x
  ``moe_intermediate_size`` wide: a width of ours that is no multiple is padded with zero units (each adds
  ``silu(0) 0 = 0``: exact), which the import keeps.
- Multi-token prediction (``mtp.layers.k.``) is stored as DeepSeek's checkpoints store it, extra layer
  ``model.layers.{num_hidden_layers + k}.`` (``num_nextn_predict_layers``): the decoder layer's names, ``enorm``,
  ``hnorm``, ``eh_proj [h, 2h]`` (embedding first, as ours), ``shared_head.norm`` (our ``final_layernorm``) and
  copies of the embedding and head (``embed_tokens``, ``shared_head.head``; on import each must equal the model's).
  ``DeepseekV3ForCausalLM`` leaves them unused; transformers' MTP drafter reads them.
"""

from __future__ import annotations

import math

import torch

from megatron.checkpoint.hf import llama as hf_llama
from megatron.checkpoint.hf import qwen2_moe as hf_qwen_moe
from megatron.checkpoint.hf.common import ConversionError, layer_pattern, to_flags
from megatron.checkpoint.hf.config_checks import DEFAULTS
from megatron.checkpoint.hf.deepseek_rope import rope_values as _rope_values
from megatron.checkpoint.hf.mapping import (
    BLOCK,
    Extra,
    Family,
    Key,
    chain,
    config_in,
    config_out,
    every_layer,
    layers_where,
    mtp_layers,
    per_part,
    renames,
    rule,
)
from megatron.checkpoint.hf.transforms import GATE_UP
from megatron.config.schema import ModelConfig
from megatron.config.validate_moe import moe_layer_pattern
from megatron.model.rotary import yarn_mscale

_ARCH = "Hugging Face DeepSeek-V3 (DeepseekV3ForCausalLM)"
_HINT = "check num_hidden_layers, n_routed_experts, first_k_dense_replace, q_lora_rank and num_nextn_predict_layers"
LATENT_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm
BIAS = "mlp.gate.e_score_correction_bias"
_DEFAULTS = DEFAULTS["deepseek_v3"]  # DeepseekV3Config's, for a key a config.json leaves out
def _refuse(setting: str, why: str) -> ConversionError:
    return ConversionError(f"{setting} has no {_ARCH} equivalent ({why}), so this checkpoint cannot be exported.")


def _moe_pattern(m: ModelConfig) -> list[bool]:
    if not m.num_experts:
        return [False] * m.num_layers
    try:
        return moe_layer_pattern(m.moe_layer_freq, m.num_layers)
    except ValueError as err:
        raise ConversionError(f"{err}.") from None


def _groups(m: ModelConfig) -> tuple[int, int]:
    """(n_group, topk_group) of our router: (1, 1) when every group is always chosen."""
    if not m.moe_router_group_topk or m.moe_router_group_topk == m.moe_router_num_groups:
        return 1, 1
    return m.moe_router_num_groups, m.moe_router_group_topk


def check_model(model_cfg: ModelConfig) -> None:
    """ConversionError, naming the setting, unless our ``ModelConfig`` is a model transformers' DeepSeek-V3 is."""
    m = model_cfg
    if not m.multi_latent_attention:
        raise ConversionError("the model has no multi-latent attention: export it as Llama, Mixtral or Qwen-MoE, "
                              "not DeepSeek-V3.")
    pattern = _moe_pattern(m)
    first_dense = pattern.index(True) if any(pattern) else m.num_layers
    kind, f = m.rope_type or "yarn", m.rotary_scaling_factor
    checks = [
        (m.normalization != "RMSNorm", f"normalization {m.normalization}", "its norms are RMSNorms"),
        (not m.swiglu, "a GELU MLP (swiglu off)", "its MLPs are SwiGLU"),
        (not m.disable_bias_linear, "linear biases (disable_bias_linear off)", "its projections have none"),
        (not m.qk_layernorm, "multi-latent attention without qk_layernorm",
         "it always normalises the query and key/value latents"),
        (kind == "rope" and yarn_mscale(f, m.mscale_all_dim) != 1.0,
         f"rope_type rope with rotary_scaling_factor {f} and mscale_all_dim {m.mscale_all_dim}",
         "it scales the softmax by mscale(factor, mscale_all_dim)^2 with YaRN only"),
        (pattern != layer_pattern(m.num_layers, lambda i: i >= first_dense), f"moe_layer_freq {m.moe_layer_freq}",
         "its dense layers are the first first_k_dense_replace")]
    if m.num_experts:
        n_group, topk_group = _groups(m)
        k = m.moe_router_topk
        checks += [
            (m.moe_router_score_function != "sigmoid", f"moe_router_score_function {m.moe_router_score_function}",
             "its router is a sigmoid"),
            (m.moe_expert_capacity_factor is not None, f"moe_expert_capacity_factor {m.moe_expert_capacity_factor}",
             "it drops no tokens"),
            (n_group > 1 and k // topk_group != 2, f"group-limited routing with moe_router_topk {k} and "
             f"moe_router_group_topk {topk_group}", f"it scores a group by its top 2 experts, ours by its top {k} // "
             f"{topk_group}"),
            (m.num_experts // n_group < 2, f"{m.num_experts // n_group} expert(s) per group",
             "it scores a group by its top 2 experts")]
    for differs, setting, why in checks:
        if differs:
            raise _refuse(setting, why)


def _mtp_moe(m: ModelConfig) -> bool:
    """Whether the multi-token prediction layers are MoE layers: as the decoder's last layer."""
    return _moe_pattern(m)[-1]


def moe_layers(model_cfg: ModelConfig) -> list[int]:
    """The global indices of the MoE layers, the MTP layers' (num_layers + k) included."""
    m = model_cfg
    mtp = [b for _, b in mtp_layers(m)] if _mtp_moe(m) else []
    return [n for n, moe in enumerate(_moe_pattern(m)) if moe] + mtp


def _latent_scale(model_cfg: ModelConfig) -> float:
    """c with ``rms(c x, 1e-6) = rms(x, layernorm_epsilon)``: transformers' latent norms take epsilon 1e-6."""
    return math.sqrt(LATENT_EPS / model_cfg.layernorm_epsilon)


def _shared_width(model_cfg: ModelConfig) -> tuple[int, int]:
    """(n_shared_experts, zero units padded) of our shared expert in units of moe_ffn_hidden_size."""
    shared, unit = model_cfg.moe_shared_expert_intermediate_size or 0, model_cfg.moe_ffn_hidden_size
    n = -(-shared // unit)
    return n, n * unit - shared


# the transforms: the latent rows scaled (export by c, import by 1 / c), the rotary rows of a
# ``rope_interleave: false`` folder interleaved (import), the shared expert padded to whole units (export)
def _scale(t: torch.Tensor, m: ModelConfig, factor: float, rows: int | None = None) -> torch.Tensor:
    """``t`` (fp32) with its first ``rows`` rows (all: None) times ``factor``; unchanged for a factor of 1."""
    if factor == 1.0:
        return t
    t = t.to(torch.float32)
    return t * factor if rows is None else torch.cat([t[:rows] * factor, t[rows:]])


def _rope_order(m: ModelConfig) -> torch.Tensor:
    dr = m.qk_pos_emb_head_dim
    return torch.stack([torch.arange(dr // 2), torch.arange(dr // 2) + dr // 2], dim=1).flatten()


def _interleaved(ctx) -> bool:
    return ctx.options.get("rope_interleave", True) is False


def _query_rope(t: torch.Tensor, ctx) -> torch.Tensor:
    """Rotate-half pairs ``(j, j + dr/2)`` -> ours ``(2j, 2j + 1)``: the last dr rows of each query head."""
    if not _interleaved(ctx):
        return t
    m, dn = ctx.m, ctx.m.qk_head_dim
    heads = t.reshape(m.num_attention_heads, dn + m.qk_pos_emb_head_dim, -1)
    return torch.cat([heads[:, :dn], heads[:, dn:][:, _rope_order(m)]], dim=1).reshape(t.shape)


def _kv_down_from_hf(t: torch.Tensor, ctx) -> torch.Tensor:
    m, dr = ctx.m, ctx.m.qk_pos_emb_head_dim
    if _interleaved(ctx):
        t = torch.cat([t[:-dr], t[-dr:][_rope_order(m)]])
    return _scale(t, m, 1.0 / _latent_scale(m), m.kv_lora_rank)


Q_DOWN = per_part("latent scale", lambda t, ctx: _scale(t, ctx.m, _latent_scale(ctx.m)),
                  lambda t, ctx: _scale(t, ctx.m, 1.0 / _latent_scale(ctx.m)))
KV_DOWN = per_part("latent scale, rotary order", lambda t, ctx: _scale(t, ctx.m, _latent_scale(ctx.m),
                                                                       ctx.m.kv_lora_rank), _kv_down_from_hf)
Q_ROPE = per_part("rotary order", lambda t, ctx: t, _query_rope)


def _pad(t: torch.Tensor, ctx, dim: int) -> torch.Tensor:
    pad = _shared_width(ctx.m)[1]
    if not pad or not _shared_width(ctx.m)[0]:
        return t
    return torch.cat([t, t.new_zeros(pad, t.shape[1])] if dim == 0 else [t, t.new_zeros(t.shape[0], pad)], dim=dim)


SHARED_UP = chain(GATE_UP, per_part("units padded", lambda t, ctx: _pad(t, ctx, 0), lambda t, ctx: t))
SHARED_DOWN = per_part("units padded", lambda t, ctx: _pad(t, ctx, 1), lambda t, ctx: t)

# (every, dense, MoE) layers of the decoder and of the MTP layers
DECODER = (every_layer, layers_where(lambda m: [not x for x in _moe_pattern(m)]),
           layers_where(_moe_pattern))
MTP = (mtp_layers, lambda m: [] if _mtp_moe(m) else mtp_layers(m), lambda m: mtp_layers(m) if _mtp_moe(m) else [])


def _swiglu(ours: str, theirs: str, layers) -> list:
    down, gate_up = hf_llama.mlp("weight", layers, ours, theirs)
    return [*gate_up, *down]


def layer_rules(ours: str, theirs: str, layers: tuple) -> list:
    """One decoder layer's rules (our prefix ``ours`` -> Hugging Face's ``theirs``; ``layers``: (every, dense, MoE)
    layers they apply to), in our checkpoints' order."""
    every, dense, moe = layers
    q_lora, no_q_lora = (lambda m: m.q_lora_rank is not None), (lambda m: m.q_lora_rank is None)
    o, h = ours + "self_attention.", theirs + "self_attn."
    return [
        *renames({norm: norm for norm in hf_llama._NORMS}, layers=every, ours=ours, theirs=theirs),
        rule(o + "linear_q_proj.weight", h + "q_proj.weight", Q_ROPE, every, no_q_lora),
        rule(o + "linear_q_down_proj.weight", h + "q_a_proj.weight", Q_DOWN, every, q_lora),
        rule(o + "q_layernorm.weight", h + "q_a_layernorm.weight", layers=every, when=q_lora),
        rule(o + "linear_q_up_proj.weight", h + "q_b_proj.weight", Q_ROPE, every, q_lora),
        rule(o + "linear_kv_down_proj.weight", h + "kv_a_proj_with_mqa.weight", KV_DOWN, every),
        *renames({"kv_layernorm.weight": "kv_a_layernorm.weight", "linear_kv_up_proj.weight": "kv_b_proj.weight",
                  "dense.weight": "o_proj.weight"}, layers=every, ours=o, theirs=h),
        *_swiglu(ours + "mlp.", theirs + "mlp.", dense),
        rule(ours + "mlp.router.weight", theirs + "mlp.gate.weight", layers=moe),
        *_swiglu(ours + "mlp.experts.{}.", theirs + "mlp.experts.{}.", moe),
        rule(ours + "mlp.shared_expert.dense_h_to_4h.weight", (theirs + "mlp.shared_experts.gate_proj.weight",
             theirs + "mlp.shared_experts.up_proj.weight"), SHARED_UP, moe, lambda m: bool(_shared_width(m)[0])),
        rule(ours + "mlp.shared_expert.dense_4h_to_h.weight", theirs + "mlp.shared_experts.down_proj.weight",
             SHARED_DOWN, moe, lambda m: bool(_shared_width(m)[0]))]


_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
            "final_layernorm.weight": "shared_head.norm.weight"}
# the embedding, the final norm and the head; every decoder layer; every MTP layer (DeepSeek's extra layers)
RULES = (hf_llama.WORD_EMBEDDING, *hf_llama.FINAL, *layer_rules("layers.{}.", "model.layers.{}.", DECODER), BLOCK,
         *renames(_MTP_OWN, layers=mtp_layers, ours="mtp.layers.{}.", theirs="model.layers.{}."),
         *layer_rules("mtp.layers.{}.transformer_layer.", "model.layers.{}.", MTP))

# the Hugging Face tensors that hold none of our parameters
def _moe_layers(m: ModelConfig) -> list[tuple[int, int]]:
    return [(n, n) for n in moe_layers(m)]


def _no_shared(m: ModelConfig) -> bool:
    return not m.moe_shared_expert_intermediate_size


def _bias(ctx, out: dict, name: str) -> torch.Tensor:
    """The expert bias of the checkpoint's train state (zeros without our expert bias), fp32."""
    m, saved = ctx.m, (ctx.train_state or {}).get("moe_expert_bias") or {}
    bias = saved.get(name.split(".")[2]) if m.moe_router_enable_expert_bias else None
    return torch.tensor(bias, dtype=torch.float32) if bias is not None else torch.zeros(m.num_experts,
                                                                                         dtype=torch.float32)


def _empty_shared(ctx, out: dict, name: str) -> torch.Tensor:
    """transformers builds a shared expert of width 0 where there is none."""
    h = ctx.m.hidden_size
    return torch.zeros((h, 0) if name.endswith("down_proj.weight") else (0, h))


def _check_empty(weight, ctx, hf: dict, name: str) -> None:
    if weight is not None and weight.numel():
        raise ConversionError(f"{name} is not empty although config.json sets n_shared_experts 0; {_HINT}.")


def _copy_of(main: str) -> tuple:
    """An MTP layer's copy of the embedding or the head: made from ``main``, and on import equal to it."""
    def make(ctx, out: dict, name: str) -> torch.Tensor:
        return out.get(main, out[hf_llama.HF_WTE]).clone()

    def check(weight, ctx, hf: dict, name: str) -> None:
        reference = hf.get(main, hf.get(hf_llama.HF_WTE))
        if weight is not None and reference is not None and not torch.equal(weight, reference):
            raise ConversionError(f"{name} differs from {main if main in hf else hf_llama.HF_WTE}: this GPT's "
                                  f"multi-token prediction shares the model's embedding and head, so the model "
                                  f"cannot be imported.")
    return make, check


EXTRAS = (Extra("model.layers.{}." + BIAS, _bias, lambda *args: None, _moe_layers),
          *(Extra(f"model.layers.{{}}.mlp.shared_experts.{proj}.weight", _empty_shared, _check_empty, _moe_layers,
                  _no_shared) for proj in ("gate_proj", "up_proj", "down_proj")),
          Extra("model.layers.{}.embed_tokens.weight", *_copy_of(hf_llama.HF_WTE), mtp_layers),
          Extra("model.layers.{}.shared_head.head.weight", *_copy_of(hf_llama.HF_HEAD), mtp_layers))


def expert_biases(hf: dict[str, torch.Tensor], model_cfg: ModelConfig) -> dict[str, list[float]]:
    """Every MoE layer's ``e_score_correction_bias``, as a checkpoint's train state keeps our expert biases
    (``{"layer": [E values]}``)."""
    hf = hf_qwen_moe.strip_hf_prefix(hf)
    out = {}
    for n in moe_layers(model_cfg):
        name = f"model.layers.{n}.{BIAS}"
        if name not in hf:
            raise ConversionError(f"the Hugging Face state dict lacks {name!r}; {_HINT}.")
        if tuple(hf[name].shape) != (model_cfg.num_experts,):
            raise ConversionError(f"{name} has shape {list(hf[name].shape)}, expected [{model_cfg.num_experts}] "
                                  f"(n_routed_experts).")
        out[str(n)] = hf[name].to(torch.float32).tolist()
    return out


def mtp_layers_in(hf_keys, config: dict) -> int:
    """The multi-token prediction layers a folder's weights hold: ``num_nextn_predict_layers`` (transformers'
    default 1), or 0 when the weights have no ``model.layers.{num_hidden_layers}.`` (a re-saved folder drops
    them)."""
    n = int(config.get("num_hidden_layers") or 0)
    want = KEY["num_nextn_predict_layers"].value_in(config)
    prefixes = (f"model.layers.{n}.", f"layers.{n}.")
    return want if want and any(key.startswith(prefixes) for key in hf_keys) else 0


# the named transforms of the keys that are more than a line (import: of the whole config.json)
def _layer_freq_in(config: dict) -> str | None:
    """Our ``moe_layer_freq`` for the first ``first_k_dense_replace`` layers dense (None: every layer dense)."""
    layers = hf_llama.KEY["num_hidden_layers"].value_in(config)
    first_dense = min(int(config.get("first_k_dense_replace", 3) or 0), layers)
    if first_dense == layers:
        return None
    return "1" if first_dense == 0 else f"([0]*{first_dense}+[1]*{layers - first_dense})"


def _yarn(m: ModelConfig) -> dict | None:
    """``rope_scaling`` (read back by ``_rope_values``): YaRN's, or None for plain rope."""
    if (m.rope_type or "yarn") != "yarn":
        return None
    f = m.rotary_scaling_factor
    return {"type": "yarn", "rope_type": "yarn", "factor": f,
            "original_max_position_embeddings": m.original_max_position_embeddings, "mscale": m.mscale,
            "mscale_all_dim": m.mscale_all_dim, "beta_fast": 32, "beta_slow": 1,
            "attention_factor": yarn_mscale(f, m.mscale) / yarn_mscale(f, m.mscale_all_dim)}


L = hf_llama.KEY  # Llama's keys, where DeepSeek-V3's are the same
# config.json <-> our ModelConfig, both ways (a key with ``export`` only is constant or derived, written only; the
# rope keys are read back by ``_rope_values``, Llama's by ``hf_llama.model_values``, the router's as they are, then
# checked, by ``_moe_values``)
KEYS = (
    Key("architectures", export=lambda m: ["DeepseekV3ForCausalLM"]),
    Key("model_type", export=lambda m: "deepseek_v3"),
    L["vocab_size"], L["hidden_size"], L["intermediate_size"],
    Key("moe_intermediate_size", "moe_ffn_hidden_size", export=lambda m: m.moe_ffn_hidden_size or m.ffn_hidden_size,
        from_hf=lambda v: int(v or 0), default=_DEFAULTS["moe_intermediate_size"]),
    L["num_hidden_layers"], L["num_attention_heads"],
    Key("num_key_value_heads", export=lambda m: m.num_attention_heads),
    Key("n_shared_experts", "moe_shared_expert_intermediate_size",  # units of moe_intermediate_size
        export=lambda m: _shared_width(m)[0] if m.num_experts else 0,
        read=lambda c: KEY["moe_intermediate_size"].value_in(c) * int(c.get("n_shared_experts", 1) or 0) or None),
    Key("n_routed_experts", "num_experts", export=lambda m: m.num_experts or 1,
        default=_DEFAULTS["n_routed_experts"]),
    Key("routed_scaling_factor", "moe_router_topk_scaling_factor",
        export=lambda m: m.moe_router_topk_scaling_factor or 1.0,
        from_hf=lambda v: float(v) if float(v) != 1.0 else None, default=2.5),
    *(Key(theirs, ours, default=_DEFAULTS[theirs]) for theirs, ours in (
        ("kv_lora_rank", "kv_lora_rank"), ("q_lora_rank", "q_lora_rank"), ("qk_rope_head_dim", "qk_pos_emb_head_dim"),
        ("v_head_dim", "v_head_dim"), ("qk_nope_head_dim", "qk_head_dim"))),
    Key("n_group", "moe_router_num_groups", export=lambda m: _groups(m)[0] if m.num_experts else 1,
        default=_DEFAULTS["n_group"]),
    Key("topk_group", "moe_router_group_topk", export=lambda m: _groups(m)[1] if m.num_experts else 1,
        default=_DEFAULTS["topk_group"]),
    Key("num_experts_per_tok", "moe_router_topk", export=lambda m: m.moe_router_topk if m.num_experts else 1,
        default=_DEFAULTS["num_experts_per_tok"]),
    Key("first_k_dense_replace", "moe_layer_freq", read=_layer_freq_in,
        export=lambda m: _moe_pattern(m).index(True) if any(_moe_pattern(m)) else m.num_layers),
    Key("norm_topk_prob", export=lambda m: bool(m.num_experts) and m.moe_router_topk > 1),  # checked on import
    Key("num_nextn_predict_layers", "mtp_num_layers", to_hf=lambda v: v or 0, from_hf=lambda v: int(v or 0),
        default=1, aliases=("num_mtp_layers",)),
    L["hidden_act"], L["max_position_embeddings"], L["rms_norm_eps"], L["rope_theta"],
    Key("rope_scaling", export=_yarn),
    Key("rope_interleave", export=lambda m: True),  # read back by ``FAMILY.options``
    L["attention_bias"], L["attention_dropout"], L["initializer_range"], L["tie_word_embeddings"],
    L["bos_token_id"], L["eos_token_id"], L["pretraining_tp"],
    Key("output_router_logits", export=lambda m: False),
    L["use_cache"], L["torch_dtype"],
)
KEY = {k.theirs: k for k in KEYS}
_ROUTER = tuple(KEY[name] for name in ("n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"))
_LATENT = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


def hf_config(model_cfg: ModelConfig, dtype: str = "float32") -> dict:
    """``config.json`` of the equivalent ``DeepseekV3ForCausalLM``."""
    check_model(model_cfg)
    return {**config_out(KEYS, model_cfg), "torch_dtype": dtype}


def model_flags(config: dict) -> list[str]:
    """Our command-line flags for the model of a Hugging Face DeepSeek-V3 ``config.json`` (refuses what our GPT
    cannot represent)."""
    if config.get("model_type", "deepseek_v3") != "deepseek_v3":
        raise ConversionError(f"config.json describes a {config.get('model_type')!r} model, not deepseek_v3.")
    if config.get("quantization_config"):
        raise ConversionError("config.json sets quantization_config (DeepSeek's FP8 weights); dequantize the weights "
                              "to bfloat16 or float32 first, then import them.")
    if config.get("attention_bias"):
        raise ConversionError("config.json sets attention_bias, which this GPT's multi-latent attention has not "
                              "(its down-projections' and output's biases).")
    eps = float(config.get("rms_norm_eps", 1e-6))
    values = hf_llama.model_values({**config, "num_key_value_heads": None, "head_dim": None, "rope_scaling": None,
                                    "rope_parameters": None, "rope_theta": 10000, "attention_bias": False,
                                    "mlp_bias": False, "rms_norm_eps": eps})
    values.pop("kv_channels", None)
    values.update(_rope_values(config))
    values.update({"multi_latent_attention": True, "qk_layernorm": True, **config_in(KEYS, config, _LATENT)})
    mtp = KEY["num_nextn_predict_layers"].value_in(config)
    if mtp:
        values["mtp_num_layers"] = mtp
    freq = config_in(KEYS, config, ("moe_layer_freq",))["moe_layer_freq"]
    if freq is None:
        return to_flags(values)  # every layer dense
    values.update(_moe_values(config, freq))
    return to_flags({name: v for name, v in values.items() if v is not None})


def _moe_values(config: dict, freq: str) -> dict:
    """Our MoE settings (the router's checked) of a config.json with MoE layers (``moe_layer_freq`` ``freq``)."""
    router = {key.theirs: key.value_in(config) for key in _ROUTER}
    unset = [key for key, value in router.items() if value is None]
    if unset:  # DeepseekV3TopkRouter divides and chooses by each of them
        raise ConversionError(f"config.json sets {unset[0]} to null, which DeepSeek-V3's router of its MoE layers "
                              f"cannot run with; give it a number (n_group 1 and topk_group 1: no groups).")
    experts, k, n_group, topk_group = (int(value) for value in router.values())
    if experts % n_group or experts // n_group < 2 or not 1 <= topk_group <= n_group:
        raise ConversionError(f"config.json's n_group {n_group} / topk_group {topk_group} do not split "
                              f"n_routed_experts {experts} into groups of at least 2 experts from which topk_group "
                              f"are chosen.")
    if topk_group < n_group and k // topk_group != 2:
        raise ConversionError(f"config.json's group-limited routing scores a group by its top 2 experts, this GPT's "
                              f"by its top num_experts_per_tok // topk_group ({k} // {topk_group}), so the model "
                              f"cannot be imported.")
    norm = config.get("norm_topk_prob", True)
    if bool(norm) != (k > 1):
        raise ConversionError(f"config.json sets norm_topk_prob {norm} with num_experts_per_tok {k}; this GPT's "
                              f"sigmoid router normalises the top k exactly when k > 1.")
    read = config_in(KEYS, config, ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                                    "moe_router_topk_scaling_factor"))
    return {"num_experts": experts, "moe_router_topk": k, "moe_ffn_hidden_size": read["moe_ffn_hidden_size"],
            "moe_shared_expert_intermediate_size": read["moe_shared_expert_intermediate_size"],
            "moe_layer_freq": freq, "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_num_groups": n_group if topk_group < n_group else None,
            "moe_router_group_topk": topk_group if topk_group < n_group else None,
            "moe_router_topk_scaling_factor": read["moe_router_topk_scaling_factor"]}


def _train_state(hf: dict[str, torch.Tensor], model_cfg: ModelConfig) -> dict:
    """An import's train state: the expert biases (``expert_biases``), not parameters."""
    biases = expert_biases(hf, model_cfg)
    return {"consumed_samples": 0, "skipped_steps": 0, **({"moe_expert_bias": biases} if biases else {})}


FAMILY = Family("deepseek_v3", RULES, KEYS, check_model, hf_qwen_moe.strip_hf_prefix, hf_llama.HF_WTE,
                hf_llama.HF_HEAD, hf_llama.tied_head, extras=EXTRAS, hint=_HINT, keeps_fp32=(BIAS,), holds_mtp=True,
                mtp_layers_in=mtp_layers_in, train_state=_train_state,
                options=lambda config: {"rope_interleave": config.get("rope_interleave", True) is not False})
name_map, to_hf_state_dict, from_hf_state_dict = FAMILY.name_map, FAMILY.to_hf_state_dict, FAMILY.from_hf_state_dict
