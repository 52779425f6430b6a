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

from megatron.checkpoint import hf_llama, hf_qwen_moe
from megatron.checkpoint.hf_common import ConversionError, to_flags
from megatron.checkpoint.hf_config_checks import DEFAULTS
from megatron.config.schema import ModelConfig
from megatron.config.validate_moe import moe_layer_pattern
from megatron.model.rotary import yarn_mscale

_ARCH = "Hugging Face DeepSeek-V3 (DeepseekV3ForCausalLM)"
_HINT = "check num_hidden_layers, n_routed_experts, first_k_dense_replace, q_lora_rank and num_nextn_predict_layers"
LATENT_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm
BIAS = "mlp.gate.e_score_correction_bias"
_DEFAULTS = DEFAULTS["deepseek_v3"]  # DeepseekV3Config's, for a key a config.json leaves out
_ATTENTION = {"linear_q_down_proj": "q_a_proj", "q_layernorm": "q_a_layernorm", "linear_q_up_proj": "q_b_proj",
              "linear_q_proj": "q_proj", "linear_kv_down_proj": "kv_a_proj_with_mqa", "kv_layernorm": "kv_a_layernorm",
              "linear_kv_up_proj": "kv_b_proj", "dense": "o_proj"}
_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
            "final_layernorm.weight": "shared_head.norm.weight"}
_MTP_COPIES = {"embed_tokens.weight": hf_llama.HF_WTE, "shared_head.head.weight": hf_llama.HF_HEAD}


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
        (pattern != [i >= first_dense for i in range(m.num_layers)], f"moe_layer_freq {m.moe_layer_freq}",
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


def _layer_names(m: ModelConfig, ours: str, theirs: str, moe: bool) -> dict[str, list[str]]:
    """One decoder layer's names (our prefix ``ours`` -> Hugging Face's ``theirs``)."""
    names = {ours + norm: [theirs + norm] for norm in hf_llama._NORMS}
    kept = ("linear_q_proj",) if m.q_lora_rank is None else ("linear_q_down_proj", "q_layernorm", "linear_q_up_proj")
    for a in (*kept, "linear_kv_down_proj", "kv_layernorm", "linear_kv_up_proj", "dense"):
        names[f"{ours}self_attention.{a}.weight"] = [f"{theirs}self_attn.{_ATTENTION[a]}.weight"]
    mlps = {"": ""}
    if moe:
        names[ours + "mlp.router.weight"] = [theirs + "mlp.gate.weight"]
        mlps = {f"experts.{i}.": f"experts.{i}." for i in range(m.num_experts)}
        if m.moe_shared_expert_intermediate_size:
            mlps["shared_expert."] = "shared_experts."
    for a, b in mlps.items():
        names[f"{ours}mlp.{a}dense_h_to_4h.weight"] = [f"{theirs}mlp.{b}gate_proj.weight",
                                                       f"{theirs}mlp.{b}up_proj.weight"]
        names[f"{ours}mlp.{a}dense_4h_to_h.weight"] = [f"{theirs}mlp.{b}down_proj.weight"]
    return names


def _mtp_moe(m: ModelConfig) -> bool:
    """Whether the multi-token prediction layers are MoE layers: as the decoder's last layer."""
    return _moe_pattern(m)[-1]


def name_map(model_cfg: ModelConfig) -> dict[str, list[str]]:
    """Our global parameter name -> the Hugging Face name(s) it holds (not the copies an MTP layer stores)."""
    m = model_cfg
    names = {k: v for k, v in hf_llama.name_map(m).items() if not k.startswith("layers.")}
    for n, moe in enumerate(_moe_pattern(m)):
        names.update(_layer_names(m, f"layers.{n}.", f"model.layers.{n}.", moe))
    for k in range(m.mtp_num_layers or 0):
        ours, theirs = f"mtp.layers.{k}.", f"model.layers.{m.num_layers + k}."
        names.update({ours + a: [theirs + b] for a, b in _MTP_OWN.items()})
        names.update(_layer_names(m, ours + "transformer_layer.", theirs, _mtp_moe(m)))
    return names


def moe_layers(model_cfg: ModelConfig) -> list[int]:
    """The global indices of the MoE layers, the MTP layers' (num_layers + k) included."""
    m = model_cfg
    mtp = [m.num_layers + k for k in range(m.mtp_num_layers or 0)] if _mtp_moe(m) else []
    return [n for n, moe in enumerate(_moe_pattern(m)) if moe] + mtp


def _latent_scale(model_cfg: ModelConfig) -> float:
    """c with ``rms(c x, 1e-6) = rms(x, layernorm_epsilon)``: transformers' latent norms take epsilon 1e-6."""
    return math.sqrt(LATENT_EPS / model_cfg.layernorm_epsilon)


def _scale_latents(hf: dict[str, torch.Tensor], model_cfg: ModelConfig, factor: float) -> None:
    """Multiply, in place in ``hf``, the rows of every down-projection that feed a latent norm by ``factor``."""
    if factor == 1.0:
        return
    kv = model_cfg.kv_lora_rank
    for name in list(hf):
        if name.endswith("self_attn.q_a_proj.weight"):
            hf[name] = hf[name].to(torch.float32) * factor
        elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            t = hf[name].to(torch.float32)
            hf[name] = torch.cat([t[:kv] * factor, t[kv:]])


def _shared_width(model_cfg: ModelConfig) -> tuple[int, int]:
    """(n_shared_experts, zero units padded) of our shared expert in units of moe_ffn_hidden_size."""
    shared, unit = model_cfg.moe_shared_expert_intermediate_size or 0, model_cfg.moe_ffn_hidden_size
    n = -(-shared // unit)
    return n, n * unit - shared


def to_hf_state_dict(tensors: dict[str, torch.Tensor], model_cfg: ModelConfig,
                     train_state: dict | None = None) -> dict[str, torch.Tensor]:
    """Our global tensors (and the expert biases of a checkpoint's ``train_state``) -> a ``DeepseekV3ForCausalLM``
    state dict in the Hub's form, MTP layers included (see the module's docstring)."""
    check_model(model_cfg)
    m = model_cfg
    out = hf_llama.map_to_hf(tensors, name_map(m), m)
    _scale_latents(out, m, _latent_scale(m))
    saved = (train_state or {}).get("moe_expert_bias") or {}
    n_shared, pad = _shared_width(m)
    for n in moe_layers(m):
        theirs = f"model.layers.{n}."
        bias = saved.get(str(n)) if m.moe_router_enable_expert_bias else None
        out[theirs + BIAS] = (torch.tensor(bias, dtype=torch.float32) if bias is not None
                              else torch.zeros(m.num_experts, dtype=torch.float32))
        shared = theirs + "mlp.shared_experts."
        if not n_shared:  # transformers builds a shared expert of width 0
            for proj, shape in (("gate_proj", (0, m.hidden_size)), ("up_proj", (0, m.hidden_size)),
                                ("down_proj", (m.hidden_size, 0))):
                out[f"{shared}{proj}.weight"] = torch.zeros(shape)
        elif pad:
            for proj in ("gate_proj", "up_proj"):
                t = out[f"{shared}{proj}.weight"]
                out[f"{shared}{proj}.weight"] = torch.cat([t, t.new_zeros(pad, t.shape[1])])
            t = out[shared + "down_proj.weight"]
            out[shared + "down_proj.weight"] = torch.cat([t, t.new_zeros(t.shape[0], pad)], dim=1)
    head = out.get(hf_llama.HF_HEAD, out[hf_llama.HF_WTE])
    for k in range(m.mtp_num_layers or 0):
        theirs = f"model.layers.{m.num_layers + k}."
        out[theirs + "embed_tokens.weight"] = out[hf_llama.HF_WTE].clone()
        out[theirs + "shared_head.head.weight"] = head.clone()
    return out


def _interleave_rope(hf: dict[str, torch.Tensor], model_cfg: ModelConfig) -> None:
    """``rope_interleave: false`` weights (rotate-half pairs ``(j, j + dr/2)``) -> ours (pairs ``(2j, 2j + 1)``):
    the rotary rows of every query projection (each head's last dr) and of ``kv_a_proj_with_mqa`` (its last dr)."""
    m = model_cfg
    dn, dr = m.qk_head_dim, m.qk_pos_emb_head_dim
    order = torch.stack([torch.arange(dr // 2), torch.arange(dr // 2) + dr // 2], dim=1).flatten()
    for name in list(hf):
        t = hf[name]
        if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
            heads = t.reshape(m.num_attention_heads, dn + dr, -1)
            hf[name] = torch.cat([heads[:, :dn], heads[:, dn:][:, order]], dim=1).reshape(t.shape)
        elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            hf[name] = torch.cat([t[:-dr], t[-dr:][order]])


def from_hf_state_dict(hf: dict[str, torch.Tensor], model_cfg: ModelConfig, padded_vocab: int,
                       rope_interleave: bool = True) -> dict[str, torch.Tensor]:
    """A ``DeepseekV3ForCausalLM`` (or ``DeepseekV3Model``) state dict, either form of the experts -> our global
    tensors (fp32, the word embedding and an untied head zero-padded to ``padded_vocab`` rows). The expert biases
    are not parameters: ``expert_biases``."""
    check_model(model_cfg)
    m = model_cfg
    hf = hf_qwen_moe.strip_hf_prefix(hf)  # the model. prefix, the experts in the Hub's form
    for n in moe_layers(m):
        hf.pop(f"model.layers.{n}.{BIAS}", None)  # checked by expert_biases
        if not m.moe_shared_expert_intermediate_size:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                weight = hf.pop(f"model.layers.{n}.mlp.shared_experts.{proj}.weight", None)
                if weight is not None and weight.numel():
                    raise ConversionError(f"model.layers.{n}.mlp.shared_experts.{proj}.weight is not empty although "
                                          f"config.json sets n_shared_experts 0; {_HINT}.")
    for k in range(m.mtp_num_layers or 0):
        for copy, main in _MTP_COPIES.items():
            name = f"model.layers.{m.num_layers + k}.{copy}"
            weight = hf.pop(name, None)
            reference = hf.get(main, hf.get(hf_llama.HF_WTE))
            if weight is not None and reference is not None and not torch.equal(weight, reference):
                raise ConversionError(f"{name} differs from {main if main in hf else hf_llama.HF_WTE}: this GPT's "
                                      f"multi-token prediction shares the model's embedding and head, so the model "
                                      f"cannot be imported.")
    if not rope_interleave:
        _interleave_rope(hf, m)
    _scale_latents(hf, m, 1.0 / _latent_scale(m))
    return hf_llama.map_from_hf(hf, name_map(m), m, padded_vocab, _HINT)


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
    want = int(config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 1)) or 0)
    prefixes = (f"model.layers.{n}.", f"layers.{n}.")
    return want if want and any(key.startswith(prefixes) for key in hf_keys) else 0


def hf_config(model_cfg: ModelConfig, dtype: str = "float32") -> dict:
    """``config.json`` of the equivalent ``DeepseekV3ForCausalLM``."""
    check_model(model_cfg)
    m = model_cfg
    pattern = _moe_pattern(m)
    n_group, topk_group = _groups(m) if m.num_experts else (1, 1)
    if (m.rope_type or "yarn") == "yarn":
        f = m.rotary_scaling_factor
        scaling = {"type": "yarn", "rope_type": "yarn", "factor": f,
                   "original_max_position_embeddings": m.original_max_position_embeddings, "mscale": m.mscale,
                   "mscale_all_dim": m.mscale_all_dim, "beta_fast": 32, "beta_slow": 1,
                   "attention_factor": yarn_mscale(f, m.mscale) / yarn_mscale(f, m.mscale_all_dim)}
    else:
        scaling = None
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "moe_intermediate_size": m.moe_ffn_hidden_size or m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_attention_heads,
        "n_shared_experts": _shared_width(m)[0] if m.num_experts else 0,
        "n_routed_experts": m.num_experts or 1,
        "routed_scaling_factor": m.moe_router_topk_scaling_factor or 1.0,
        "kv_lora_rank": m.kv_lora_rank,
        "q_lora_rank": m.q_lora_rank,
        "qk_rope_head_dim": m.qk_pos_emb_head_dim,
        "v_head_dim": m.v_head_dim,
        "qk_nope_head_dim": m.qk_head_dim,
        "n_group": n_group,
        "topk_group": topk_group,
        "num_experts_per_tok": m.moe_router_topk if m.num_experts else 1,
        "first_k_dense_replace": pattern.index(True) if any(pattern) else m.num_layers,
        "norm_topk_prob": bool(m.num_experts) and m.moe_router_topk > 1,
        "num_nextn_predict_layers": m.mtp_num_layers or 0,
        "hidden_act": hf_llama.ACTIVATION,
        "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": m.layernorm_epsilon,
        "rope_theta": float(m.rotary_base),
        "rope_scaling": scaling,
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": m.attention_probs_dropout_prob,
        "initializer_range": m.initializer_range,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "bos_token_id": None,  # to-hf sets both to the end-of-document id of the run's tokenizer
        "eos_token_id": None,
        "pretraining_tp": 1,
        "output_router_logits": False,
        "use_cache": True,
        "torch_dtype": dtype,
    }


def _rope_values(config: dict) -> dict:
    """Our rotary settings of a config.json's ``rope_parameters`` (transformers 5) or ``rope_theta`` and
    ``rope_scaling`` (DeepSeek's, transformers 4): plain rope, or YaRN with transformers' effective concentration
    (``attention_factor``, else mscale / mscale_all_dim when both are set, else mscale(factor)) as ours."""
    params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if float(theta) != int(theta):
        raise ConversionError(f"rope_theta {theta} is not an integer, which rotary_base must be.")
    if kind == "default":
        return {"rotary_base": int(theta), "rope_type": "rope"}
    if kind != "yarn":
        raise ConversionError(f"config.json sets rope type {kind!r}; this GPT's multi-latent attention takes the plain "
                              f"rotary embedding or YaRN, so the model cannot be imported.")
    if float(params.get("partial_rotary_factor") or 1.0) != 1.0:  # transformers' YaRN rotates that share only
        raise ConversionError(f"config.json sets partial_rotary_factor {params['partial_rotary_factor']}; this GPT's "
                              f"YaRN rotates every channel of qk_rope_head_dim, so the model cannot be imported.")
    unusual = {k: params[k] for k, v in (("beta_fast", 32), ("beta_slow", 1), ("truncate", True))
               if params.get(k) is not None and params[k] != v}
    if unusual:
        raise ConversionError(f"config.json sets YaRN's {unusual}; this GPT's YaRN has beta_fast 32, beta_slow 1 and "
                              f"truncate true, so the model cannot be imported.")
    original = int(params.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
                   or config["max_position_embeddings"])
    f = float(params.get("factor") or config["max_position_embeddings"] / original)
    all_dim, mscale = float(params.get("mscale_all_dim") or 0.0), params.get("mscale")
    target = params.get("attention_factor")
    if target is None:
        target = yarn_mscale(f, mscale) / yarn_mscale(f, all_dim) if mscale and all_dim else yarn_mscale(f)
    ours = float(mscale) if mscale and all_dim else 1.0
    if abs(yarn_mscale(f, ours) / yarn_mscale(f, all_dim) - target) > 1e-9 * target and f > 1:
        ours = (target * yarn_mscale(f, all_dim) - 1.0) / (0.1 * math.log(f))  # the concentration solved for mscale
    if ours < 0 or abs(yarn_mscale(f, ours) / yarn_mscale(f, all_dim) - target) > 1e-9 * target:
        raise ConversionError(f"config.json's YaRN attention factor {target} is not mscale(f, m) / mscale(f, "
                              f"mscale_all_dim) for any mscale m >= 0, as this GPT's YaRN scales cos and sin.")
    return {"rotary_base": int(theta), "rope_type": "yarn", "rotary_scaling_factor": f,
            "original_max_position_embeddings": original, "mscale": ours, "mscale_all_dim": all_dim}


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
    layers = values["num_layers"]
    latent = {ours: config.get(theirs, _DEFAULTS[theirs]) for ours, theirs in (
        ("q_lora_rank", "q_lora_rank"), ("kv_lora_rank", "kv_lora_rank"), ("qk_head_dim", "qk_nope_head_dim"),
        ("qk_pos_emb_head_dim", "qk_rope_head_dim"), ("v_head_dim", "v_head_dim"))}
    values.update({"multi_latent_attention": True, "qk_layernorm": True, **latent})
    mtp = int(config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 1)) or 0)
    if mtp:
        values["mtp_num_layers"] = mtp
    first_dense = min(int(config.get("first_k_dense_replace", 3) or 0), layers)
    if first_dense == layers:
        return to_flags(values)  # every layer dense
    router = {key: config.get(key, _DEFAULTS[key]) for key in ("n_routed_experts", "num_experts_per_tok", "n_group",
                                                                "topk_group")}
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
    unit = int(config.get("moe_intermediate_size", _DEFAULTS["moe_intermediate_size"]) or 0)
    shared = int(config.get("n_shared_experts", 1) or 0)
    scale = float(config.get("routed_scaling_factor", 2.5))
    values.update({
        "num_experts": experts, "moe_router_topk": k, "moe_ffn_hidden_size": unit,
        "moe_shared_expert_intermediate_size": shared * unit or None,
        "moe_layer_freq": "1" if first_dense == 0 else f"([0]*{first_dense}+[1]*{layers - first_dense})",
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": n_group if topk_group < n_group else None,
        "moe_router_group_topk": topk_group if topk_group < n_group else None,
        "moe_router_topk_scaling_factor": scale if scale != 1.0 else None})
    return to_flags({name: v for name, v in values.items() if v is not None})
