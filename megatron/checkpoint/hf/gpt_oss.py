"""Hugging Face gpt-oss (``GptOssForCausalLM``, transformers 5) to and from our GPT.

gpt-oss is a Llama-shaped decoder (``hf_llama``: pre-RMSNorm, rotate-half rotary embeddings, grouped-query attention,
any head width, tied or untied head) with every layer a mixture of experts and these marks, each one of our settings:

- sliding windows (``sliding_window`` W in the layers ``layer_types`` marks ``sliding_attention``): our
  ``window_size`` "W-1,0" (transformers' mask keeps ``kv_idx > q_idx - W``: the query and the W - 1 keys before it),
  the layers by ``window_attn_skip_freq`` (N when the sliding layers are those whose 1-based number N does not
  divide, e.g. 2: gpt-oss's alternation starting with a sliding layer; else a 0/1 pattern);
- attention sinks (``self_attn.sinks`` [nq]): ``softmax_type learnable``, ``self_attention.softmax_offset``
  (``off-by-one`` exports as zero sinks, and imports back as learnable);
- biases on the query/key/value/output projections, the router and the experts: ``disable_bias_linear`` off; with it
  on (Megatron-LM's own gpt-oss recipe trains without linear biases) the export sets ``attention_bias`` false and
  writes the router's and the experts' biases, which gpt-oss always has, as zeros, the same model; an import with
  ``attention_bias`` false is such a model, its router's and experts' biases checked zero;
- the experts' clamped quick GeGLU ``(clamp(up, -c, c) + 1) * g sigmoid(1.702 g)``, ``g = clamp(gate, max=c)``:
  ``quick_geglu``, ``glu_linear_offset 1``, ``activation_func_clamp_value`` c = ``swiglu_limit`` (a
  ``swiglu_alpha`` other than 1.702 is refused);
- the router: logits ``x W^T + b``, the top k, a softmax over those k (our default softmax router), dropless;
- YaRN (``rope_parameters`` rope_type yarn): ``position_embedding_type yarn`` with ``rotary_scaling_factor`` =
  factor, ``original_max_position_embeddings``, ``yarn_beta_fast`` / ``yarn_beta_slow``,
  ``yarn_correction_range_round_to_int`` = truncate (gpt-oss: false, the ramp unrounded), and cos and sin scaled by
  ``0.1 ln(factor) + 1`` (our ``mscale 1``, ``mscale_all_dim 0``; transformers' default ``attention_factor``: another
  one is refused). Plain rope (rope_type default) is ``position_embedding_type rope``.

The names (layer N; ``E`` experts of width ``f``; transformers 5 keeps the experts fused, transposed against ours):

====================================================  ==========================================================
ours (``layers.N.``)                                  Hugging Face (``model.layers.N.``)
====================================================  ==========================================================
``self_attention.softmax_offset [nq]``                ``self_attn.sinks [nq]``
``mlp.router.weight [E, h]``, ``.bias [E]``           ``mlp.router.weight``, ``mlp.router.bias``
``mlp.experts.i.dense_h_to_4h.weight [2f, h]``        ``mlp.experts.gate_up_proj [E, h, 2f]`` (its [i], transposed;
                                                      column 2j gate_j, 2j + 1 up_j: our interleaved rows)
``mlp.experts.i.dense_h_to_4h.bias [2f]``             ``mlp.experts.gate_up_proj_bias [E, 2f]`` (its [i])
``mlp.experts.i.dense_4h_to_h.weight [h, f]``         ``mlp.experts.down_proj [E, f, h]`` (its [i], transposed)
``mlp.experts.i.dense_4h_to_h.bias [h]``              ``mlp.experts.down_proj_bias [E, h]`` (its [i])
everything else                                       as ``hf_llama`` maps it (q/k/v split by group, with biases)
====================================================  ==========================================================

The Hub's openai checkpoints hold the experts in MXFP4 (``*_blocks``, ``*_scales``, ``quantization_config``): they are
refused in one line; dequantize them first. A model of ours without sliding windows exports with every layer
``full_attention`` (``sliding_window`` is then the positions, which no layer uses). transformers before 5 reads
``rope_scaling`` and a fixed clamp of 7: the export writes that key too.
"""

from __future__ import annotations

import math

import torch

from megatron.checkpoint.hf import llama as hf_llama
from megatron.checkpoint.hf.common import ConversionError, layer_pattern, to_flags
from megatron.checkpoint.hf.config_checks import DEFAULTS
from megatron.checkpoint.hf.mapping import BLOCK, Extra, Family, Key, config_in, config_out, rule
from megatron.checkpoint.hf.transforms import TRANSPOSED
from megatron.config.schema import ModelConfig
from megatron.config.validate_attention import parse_window, window_layers
from megatron.config.validate_moe import first_coefficient, moe_layer_pattern
from megatron.model.rotary import yarn_mscale

ARCHITECTURE = "GptOssForCausalLM"
_ARCH = f"Hugging Face gpt-oss ({ARCHITECTURE})"
_HINT = "check num_hidden_layers, num_local_experts and tie_word_embeddings"
ALPHA = 1.702  # the quick GELU's sigmoid gain, ours and gpt-oss's
SLIDING, FULL = "sliding_attention", "full_attention"
# GptOssConfig's defaults for the keys a config.json may leave out (config_checks.DEFAULTS, where every family's are)
_DEFAULTS = {k: v for k, v in DEFAULTS["gpt_oss"].items() if k not in ("rope_parameters", "default_theta")}
_DEFAULT_ROPE, _DEFAULT_THETA = DEFAULTS["gpt_oss"]["rope_parameters"], DEFAULTS["gpt_oss"]["default_theta"]


def is_gpt_oss_shaped(model_cfg: ModelConfig) -> bool:
    """Whether our ``ModelConfig`` has any of gpt-oss's marks (sliding windows, sinks, the quick GeGLU, its offset or
    clamp, YaRN on standard attention): such a model exports here (``check_model`` says what else does not fit), and
    never to an architecture that would drop the mark."""
    m = model_cfg
    return (parse_window(m.window_size) is not None or m.softmax_type != "vanilla" or m.quick_geglu
            or m.glu_linear_offset != 0.0 or m.activation_func_clamp_value is not None
            or (m.position_embedding_type == "yarn" and not m.multi_latent_attention))


def _refusal(setting: str, why: str) -> ConversionError:
    return ConversionError(f"{setting} has no {_ARCH} equivalent ({why}), so this checkpoint cannot be exported.")


def check_model(model_cfg: ModelConfig) -> None:
    """ConversionError, naming the setting, unless our ``ModelConfig`` is a gpt-oss."""
    m = model_cfg
    if not m.num_experts:
        raise _refusal("a dense model (num_experts unset)", "every gpt-oss layer is a mixture of experts")
    try:
        dense = [n for n, is_moe in enumerate(moe_layer_pattern(m.moe_layer_freq, m.num_layers)) if not is_moe]
    except ValueError as err:
        raise ConversionError(f"{err}.") from None
    for differs, setting, why in (
            (m.multi_latent_attention, "multi-latent attention", "gpt-oss projects queries, keys and values per head"),
            (m.normalization != "RMSNorm", f"normalization {m.normalization}", "gpt-oss uses RMSNorm"),
            (m.position_embedding_type not in ("rope", "yarn"), f"position_embedding_type {m.position_embedding_type}",
             "gpt-oss rotates queries and keys (yarn, or rope)"),
            (m.rotary_percent != 1.0, f"rotary_percent {m.rotary_percent}", "gpt-oss rotates every channel"),
            (m.rotary_interleaved, "rotary_interleaved", "gpt-oss rotates the halves of each head"),
            (m.qk_layernorm, "qk_layernorm", "gpt-oss does not normalise queries and keys"),
            (m.disable_bias_linear and m.add_qkv_bias, "add_qkv_bias (a bias on the query/key/value projection "
             "alone)", "gpt-oss's attention has biases on every projection or on none"),
            (not m.quick_geglu, "an MLP other than the quick GeGLU (quick_geglu off)",
             "gpt-oss's experts are quick GeGLUs"),
            (m.glu_linear_offset != 1.0, f"glu_linear_offset {m.glu_linear_offset}", "gpt-oss adds 1 to the up half"),
            (m.activation_func_clamp_value is None, "no activation_func_clamp_value",
             "gpt-oss always clamps the gate and up halves, by swiglu_limit"),
            (m.softmax_type == "vanilla", "softmax_type vanilla", "gpt-oss's attention has a sink logit per head: "
             "softmax_type learnable"),
            (bool(dense), f"moe_layer_freq {m.moe_layer_freq} (dense layers {dense})",
             "every gpt-oss layer is a mixture of experts"),
            (bool(m.moe_shared_expert_intermediate_size), "a shared expert", "gpt-oss has none"),
            (m.moe_router_score_function != "softmax", f"moe_router_score_function {m.moe_router_score_function}",
             "gpt-oss's router is a softmax"),
            (m.moe_router_pre_softmax, "moe_router_pre_softmax", "gpt-oss takes the softmax over the top k logits"),
            (m.moe_router_enable_expert_bias, "moe_router_enable_expert_bias", "gpt-oss's router has no expert bias"),
            (m.moe_expert_capacity_factor is not None, f"moe_expert_capacity_factor {m.moe_expert_capacity_factor}",
             "gpt-oss drops no tokens"),
            (bool(m.moe_router_group_topk), f"moe_router_group_topk {m.moe_router_group_topk}",
             "gpt-oss's router chooses among all experts"),
            (m.moe_router_topk_scaling_factor not in (None, 1.0),
             f"moe_router_topk_scaling_factor {m.moe_router_topk_scaling_factor}", "gpt-oss does not scale them"),
            (m.position_embedding_type == "yarn" and (m.mscale, m.mscale_all_dim) != (1.0, 0.0),
             f"YaRN's mscale {m.mscale} / mscale_all_dim {m.mscale_all_dim}",
             "gpt-oss scales cos and sin by 0.1 ln(factor) + 1: mscale 1, mscale_all_dim 0")):
        if differs:
            raise _refusal(setting, why)
    hf_llama.dims(m)


def _f(m: ModelConfig) -> int:
    return m.moe_ffn_hidden_size or m.ffn_hidden_size


EXPERT, HF_EXPERTS = "layers.{}.mlp.experts.{}.", "model.layers.{}.mlp.experts."
# Llama's attention, norms, embedding and head (``hf_llama``); each layer's sinks and router; then each layer's
# experts, one Hugging Face tensor stacking every expert's (transposed against ours), its shape per expert
RULES = (hf_llama.WORD_EMBEDDING, *hf_llama.decoder(mlp_layers=False), *hf_llama.FINAL, BLOCK,
         rule("layers.{}.self_attention.softmax_offset", "model.layers.{}.self_attn.sinks",
              when=lambda m: m.softmax_type == "learnable"),
         rule("layers.{}.mlp.router.weight", "model.layers.{}.mlp.router.weight"),
         rule("layers.{}.mlp.router.bias", "model.layers.{}.mlp.router.bias", when=hf_llama.biased),
         rule(EXPERT + "dense_h_to_4h.weight", HF_EXPERTS + "gate_up_proj", TRANSPOSED,
              shape=lambda m: (m.hidden_size, 2 * _f(m))),
         rule(EXPERT + "dense_h_to_4h.bias", HF_EXPERTS + "gate_up_proj_bias", shape=lambda m: (2 * _f(m),),
              when=hf_llama.biased),
         rule(EXPERT + "dense_4h_to_h.weight", HF_EXPERTS + "down_proj", TRANSPOSED,
              shape=lambda m: (_f(m), m.hidden_size)),
         rule(EXPERT + "dense_4h_to_h.bias", HF_EXPERTS + "down_proj_bias", shape=lambda m: (m.hidden_size,),
              when=hf_llama.biased))


def _check_zero_sinks(sinks, ctx, hf: dict, name: str) -> None:
    if sinks is not None and torch.count_nonzero(sinks):
        raise ConversionError(f"{name} is not zero, which softmax_type off-by-one is; import it with "
                              f"softmax_type learnable.")


def _check_zero_bias(bias, ctx, hf: dict, name: str) -> None:
    if bias is not None and torch.count_nonzero(bias):
        raise ConversionError(f"{name} is not zero, but config.json sets attention_bias false, which this GPT imports "
                              f"as a model without any linear bias (disable_bias_linear); the model cannot be "
                              f"imported.")


def _zeros(shape):
    return lambda ctx, out, name: torch.zeros(shape(ctx.m))


def _unbiased(m: ModelConfig) -> bool:
    return not hf_llama.biased(m)


# off-by-one: a zero sink logit per head, which our model holds no tensor for; without linear biases
# (disable_bias_linear: Megatron-LM's gpt-oss recipe), the router's and the experts' biases gpt-oss always has, zero
EXTRAS = (Extra("model.layers.{}.self_attn.sinks", lambda ctx, out, name: torch.zeros(ctx.m.num_attention_heads),
                _check_zero_sinks, when=lambda m: m.softmax_type == "off-by-one"),
          Extra("model.layers.{}.mlp.router.bias", _zeros(lambda m: (m.num_experts,)), _check_zero_bias,
                when=_unbiased),
          Extra(HF_EXPERTS + "gate_up_proj_bias", _zeros(lambda m: (m.num_experts, 2 * _f(m))), _check_zero_bias,
                when=_unbiased),
          Extra(HF_EXPERTS + "down_proj_bias", _zeros(lambda m: (m.num_experts, m.hidden_size)), _check_zero_bias,
                when=_unbiased))


def prepare(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``hf_llama.strip_hf_prefix``; MXFP4-quantized experts refused."""
    hf = hf_llama.strip_hf_prefix(hf)
    quantized = sorted(k for k in hf if k.endswith(("_blocks", "_scales")))
    if quantized:
        raise ConversionError(f"the state dict holds MXFP4-quantized experts ({quantized[0]}); dequantize them to "
                              f"bfloat16 or float32 first, then import them.")
    return hf


def _rope_parameters(model_cfg: ModelConfig) -> dict:
    m = model_cfg
    if m.position_embedding_type == "rope":
        return {"rope_type": "default", "rope_theta": float(m.rotary_base)}
    return {"rope_type": "yarn", "rope_theta": float(m.rotary_base), "factor": m.rotary_scaling_factor,
            "beta_fast": m.yarn_beta_fast, "beta_slow": m.yarn_beta_slow,
            "truncate": m.yarn_correction_range_round_to_int,
            "original_max_position_embeddings": m.original_max_position_embeddings}


def _rope_scaling(model_cfg: ModelConfig) -> dict | None:
    """``rope_scaling``, which transformers before 5 reads: YaRN's ``rope_parameters`` but the theta (None: rope)."""
    rope = _rope_parameters(model_cfg)
    return {k: v for k, v in rope.items() if k != "rope_theta"} if rope["rope_type"] == "yarn" else None


def _sliding_window(model_cfg: ModelConfig) -> int:
    """The window's positions (the query and those before it): the positions when the model has no window."""
    left = parse_window(model_cfg.window_size)
    return model_cfg.max_position_embeddings if left is None else left + 1


L = hf_llama.KEY  # Llama's keys, where gpt-oss's are the same
# config.json <-> our ModelConfig, both ways (a key with ``export`` only is constant or derived, written only: the
# rope keys are read back by ``rope_values``, the window's by ``window_values``, Llama's by ``hf_llama.model_values``;
# the import reads the keys on GptOssConfig's defaults, ``_DEFAULTS``)
KEYS = (
    Key("architectures", export=lambda m: [ARCHITECTURE]),
    Key("model_type", export=lambda m: "gpt_oss"),
    L["vocab_size"], L["hidden_size"],
    Key("intermediate_size", "moe_ffn_hidden_size", export=_f, from_hf=int),  # the experts' width
    L["num_hidden_layers"], L["num_attention_heads"], L["num_key_value_heads"], L["head_dim"],
    L["max_position_embeddings"], L["rms_norm_eps"],
    Key("rope_parameters", export=_rope_parameters),
    L["rope_theta"],  # the two keys transformers before 5 reads
    Key("rope_scaling", export=_rope_scaling),
    Key("sliding_window", export=_sliding_window),
    Key("layer_types", export=lambda m: [SLIDING if s else FULL for s in window_layers(m)]),
    L["hidden_act"],
    Key("swiglu_alpha", export=lambda m: ALPHA),  # checked on import
    Key("swiglu_limit", "activation_func_clamp_value", from_hf=float),
    L["attention_bias"], L["attention_dropout"],
    Key("num_local_experts", "num_experts", read=lambda c: int(c.get("num_local_experts") or c.get("num_experts"))),
    Key("num_experts_per_tok", "moe_router_topk", from_hf=int),
    Key("router_aux_loss_coef", "moe_aux_loss_coeff", to_hf=first_coefficient, from_hf=lambda v: float(v or 0.0)),
    Key("output_router_logits", export=lambda m: False),
    L["initializer_range"], L["tie_word_embeddings"], L["bos_token_id"], L["eos_token_id"], L["use_cache"],
    L["torch_dtype"],
)
_FIELDS = ("activation_func_clamp_value", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
           "moe_aux_loss_coeff")  # what the import reads off the table (with Llama's), in the order of its flags


def hf_config(model_cfg: ModelConfig, dtype: str = "float32") -> dict:
    """``config.json`` of the equivalent ``GptOssForCausalLM``."""
    check_model(model_cfg)
    return {**config_out(KEYS, model_cfg), "torch_dtype": dtype}


def window_values(config: dict, layers: int) -> dict:
    """Our ``window_size`` and ``window_attn_skip_freq`` for a config.json's ``sliding_window`` and ``layer_types``
    (GptOssConfig's default: sliding, full, sliding, ...)."""
    types = config.get("layer_types") or layer_pattern(layers, lambda n: SLIDING if (n + 1) % 2 else FULL)
    others = sorted({str(t)[:40] for t in types} - {SLIDING, FULL})
    if len(types) != layers or others:
        raise ConversionError(f"config.json's layer_types must give num_hidden_layers ({layers:,}) entries, each "
                              f"{SLIDING!r} or {FULL!r}; got {len(types):,}"
                              f"{', among them ' + repr(others[0]) if others else ''}.")
    sliding = [t == SLIDING for t in types]
    if not any(sliding):
        return {}
    width = config.get("sliding_window")
    if not isinstance(width, int) or width < 1:
        raise ConversionError(f"config.json marks sliding_attention layers but its sliding_window is {width!r}, not "
                              f"a number of positions (at least 1).")
    freq = None
    if not all(sliding):
        n = sliding.index(False) + 1  # the only skip frequency that can fit: the first full layer's number
        fits = n > 1 and sliding == layer_pattern(layers, lambda i: (i + 1) % n != 0)
        freq = str(n) if fits else str([int(s) for s in sliding]).replace(" ", "")
    return {"window_size": f"{width - 1},0", "window_attn_skip_freq": freq}


def rope_values(config: dict) -> dict:
    """Our rotary settings for a config.json's ``rope_parameters`` (transformers 5; else ``rope_theta`` and
    ``rope_scaling``; else GptOssConfig's default YaRN): rope, or YaRN whose cos/sin scale is ours."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or _DEFAULT_ROPE
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta", config.get("rope_theta", _DEFAULT_THETA))
    if float(theta) != int(theta):
        raise ConversionError(f"rope_theta {theta} is not an integer, which rotary_base must be.")
    if float(params.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ConversionError(f"config.json sets partial_rotary_factor {params['partial_rotary_factor']}; gpt-oss "
                              f"rotates every channel of a head, so the model cannot be imported.")
    if kind == "default":
        return {"position_embedding_type": "rope", "rotary_base": int(theta)}
    if kind != "yarn":
        raise ConversionError(f"config.json sets rope type {kind!r}; this GPT's gpt-oss attention takes YaRN or the "
                              f"plain rotary embedding, so the model cannot be imported.")
    original = params.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
    if not original:
        raise ConversionError("config.json's YaRN lacks original_max_position_embeddings.")
    f = float(params.get("factor") or config["max_position_embeddings"] / int(original))
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    target = params.get("attention_factor")  # transformers' rule for the cos / sin scale
    if target is None:
        target = yarn_mscale(f, mscale) / yarn_mscale(f, all_dim) if mscale and all_dim else yarn_mscale(f)
    if not math.isclose(float(target), yarn_mscale(f), rel_tol=1e-9):
        raise ConversionError(f"config.json's YaRN scales cos and sin by {target}, not 0.1 ln(factor) + 1 = "
                              f"{yarn_mscale(f)} as this GPT's YaRN on standard attention does; the model cannot be "
                              f"imported.")
    return {"position_embedding_type": "yarn", "rotary_base": int(theta), "rotary_scaling_factor": f,
            "original_max_position_embeddings": int(original),
            "yarn_beta_fast": float(params.get("beta_fast") or 32.0),
            "yarn_beta_slow": float(params.get("beta_slow") or 1.0),
            "yarn_correction_range_round_to_int": bool(params.get("truncate", True))}


def model_flags(config: dict) -> list[str]:
    """Our command-line flags for the model of a Hugging Face gpt-oss ``config.json`` (refuses what our GPT cannot
    represent)."""
    if config.get("model_type", "gpt_oss") != "gpt_oss":
        raise ConversionError(f"config.json describes a {config.get('model_type')!r} model, not gpt_oss.")
    if config.get("quantization_config"):
        raise ConversionError("config.json sets quantization_config (gpt-oss's MXFP4 experts); dequantize the weights "
                              "to bfloat16 or float32 first, then import them.")
    config = {**_DEFAULTS, **config}
    if not math.isclose(float(config["swiglu_alpha"]), ALPHA):
        raise ConversionError(f"config.json sets swiglu_alpha {config['swiglu_alpha']}; this GPT's quick GeGLU has the "
                              f"sigmoid gain {ALPHA}, so the model cannot be imported.")
    limit = config["swiglu_limit"]
    if not isinstance(limit, (int, float)) or not math.isfinite(limit) or limit <= 0:
        raise ConversionError(f"config.json's swiglu_limit {limit!r} is not a positive number, which this GPT's "
                              f"activation_func_clamp_value must be.")
    experts, topk = config.get("num_local_experts") or config.get("num_experts"), config["num_experts_per_tok"]
    if not experts or not topk or not 1 <= int(topk) <= int(experts):
        raise ConversionError(f"num_experts_per_tok ({topk}) must be from 1 to num_local_experts ({experts}).")
    biased = bool(config["attention_bias"])  # false: no linear bias (the router's and experts' then checked zero)
    values = hf_llama.model_values({**config, "hidden_act": hf_llama.ACTIVATION, "attention_bias": biased,
                                    "mlp_bias": biased, "rope_parameters": None, "rope_scaling": None,
                                    "rope_theta": 10000})
    del values["swiglu"]
    values.update(rope_values(config))
    values.update(window_values(config, int(values["num_layers"])))
    read = config_in(KEYS, config, _FIELDS)
    values.update({"quick_geglu": True, "glu_linear_offset": 1.0,
                   "activation_func_clamp_value": read["activation_func_clamp_value"], "softmax_type": "learnable",
                   **{k: read[k] for k in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size")},
                   "moe_layer_freq": "1", "moe_aux_loss_coeff": read["moe_aux_loss_coeff"]})
    unrounded = values.pop("yarn_correction_range_round_to_int", True) is False
    return to_flags({k: v for k, v in values.items() if v is not None}) + (
        ["--no-yarn-correction-range-round-to-int"] if unrounded else [])


FAMILY = Family("gpt_oss", RULES, KEYS, check_model, prepare, hf_llama.HF_WTE, hf_llama.HF_HEAD, hf_llama.tied_head,
                extras=EXTRAS, hint=_HINT, export_hint="check num_layers and num_experts",
                stack_hint=" (num_local_experts, hidden_size, intermediate_size)")
name_map, to_hf_state_dict, from_hf_state_dict = FAMILY.name_map, FAMILY.to_hf_state_dict, FAMILY.from_hf_state_dict
