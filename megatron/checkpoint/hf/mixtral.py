"""Our Llama-shaped mixture-of-experts GPT <-> Hugging Face Mixtral (``transformers.MixtralForCausalLM``).

Mixtral is Llama (``hf_llama``: the embedding, attention, norms and head map as there) with every layer's MLP a
mixture of experts: a router (``block_sparse_moe.gate``) and E SwiGLU experts without biases (``w1`` gate, ``w3``
up, ``w2`` down). Its routing is a softmax over all E logits, the top k, renormalised over those k: the same
probabilities as our default softmax router (the top k logits, then a softmax over them), dropless. So a model of
ours exports when it is Llama-shaped (``hf_llama.check_model``) and its MoE is Mixtral's:

- every layer a MoE layer (``moe_layer_freq`` 1 or a pattern of ones): Mixtral has no dense layers;
- the softmax router without ``moe_router_pre_softmax`` (a softmax over all E, the top k not renormalised: other
  probabilities) and without the expert bias; no shared expert (that form is Qwen-MoE's, ``hf_qwen_moe``);
- no capacity (Mixtral is dropless); no linear biases (Mixtral's projections have none).

Anything else is refused in one line naming the setting. The names (layer N, expert i):

======================================================  ========================================================
ours                                                    Hugging Face (``model.layers.N.block_sparse_moe.``...)
======================================================  ========================================================
``layers.N.mlp.router.weight [E, h]``                   ``gate.weight [E, h]``
``layers.N.mlp.experts.i.dense_h_to_4h.weight [2f, h]`` ``experts.i.w1.weight [f, h]`` (rows 2j: gate_j) and
                                                        ``experts.i.w3.weight [f, h]`` (rows 2j + 1: up_j)
``layers.N.mlp.experts.i.dense_4h_to_h.weight [h, f]``  ``experts.i.w2.weight [h, f]``
======================================================  ========================================================

That is the form of the checkpoints on the Hub, which transformers' ``save_pretrained`` writes and its
``from_pretrained`` reads (transformers 5 holds the experts fused in memory, ``mlp.experts.gate_up_proj [E, 2f, h]``
(gate rows first) and ``mlp.experts.down_proj [E, h, f]``, and converts on loading and saving). The import reads
both forms (``strip_hf_prefix``). ``router_aux_loss_coef`` is our ``moe_aux_loss_coeff`` both ways (transformers'
balancing loss, used only with ``output_router_logits``, is normalised otherwise: k times ours, over all layers'
tokens together); ``output_router_logits`` is written false.
"""

from __future__ import annotations

import torch

from megatron.checkpoint.hf import llama as hf_llama
from megatron.checkpoint.hf.common import ConversionError, to_flags
from megatron.checkpoint.hf.mapping import Family, rule
from megatron.checkpoint.hf.transforms import GATE_UP
from megatron.config.schema import ModelConfig
from megatron.config.validate_moe import first_coefficient, moe_layer_pattern

MOE = "block_sparse_moe"
_HINT = "check num_hidden_layers, num_local_experts and tie_word_embeddings"
_ARCH = "Hugging Face Mixtral (MixtralForCausalLM)"


def _refusal(setting: str, why: str) -> ConversionError:
    return ConversionError(f"{setting} has no {_ARCH} equivalent ({why}), so this checkpoint cannot be exported.")


def check_model(model_cfg: ModelConfig) -> None:
    """ConversionError, naming the setting, unless our ``ModelConfig`` is a Llama-shaped MoE that Mixtral is."""
    m = model_cfg
    if not m.num_experts:
        raise ConversionError("the model has no experts (num_experts unset): export it as Llama, not Mixtral.")
    hf_llama.check_model(m, "Mixtral", "MixtralForCausalLM")
    try:
        pattern = moe_layer_pattern(m.moe_layer_freq, m.num_layers)
    except ValueError as err:
        raise ConversionError(f"{err}.") from None
    dense = [i for i, is_moe in enumerate(pattern) if not is_moe]
    for differs, setting, why in (
            (bool(dense), f"moe_layer_freq {m.moe_layer_freq} (dense layers {dense})",
             "every Mixtral layer is a mixture of experts"),
            (bool(m.moe_shared_expert_intermediate_size), "a shared expert (moe_shared_expert_intermediate_size "
             f"{m.moe_shared_expert_intermediate_size})", "Mixtral has none; that form exports as Qwen-MoE"),
            (m.moe_router_score_function != "softmax", f"moe_router_score_function {m.moe_router_score_function}",
             "Mixtral's router is a softmax"),
            (m.moe_router_pre_softmax, "moe_router_pre_softmax", "Mixtral renormalises the top k probabilities "
             "to sum to 1, the pre-softmax router does not"),
            (m.moe_router_enable_expert_bias, "moe_router_enable_expert_bias", "Mixtral's router has no expert bias"),
            (m.moe_expert_capacity_factor is not None, f"moe_expert_capacity_factor {m.moe_expert_capacity_factor}",
             "Mixtral drops no tokens"),
            (bool(m.moe_router_group_topk), f"group-limited routing (moe_router_group_topk {m.moe_router_group_topk})",
             "Mixtral's router chooses among all experts"),
            (m.moe_router_topk_scaling_factor not in (None, 1.0),
             f"moe_router_topk_scaling_factor {m.moe_router_topk_scaling_factor}", "Mixtral does not scale the "
             "probabilities"),
            (not m.disable_bias_linear, "linear biases (disable_bias_linear off)",
             "Mixtral's projections have no biases")):
        if differs:
            raise _refusal(setting, why)


EXPERT, HF_EXPERT = "layers.{}.mlp.experts.{}.", f"model.layers.{{}}.{MOE}.experts.{{}}."
# Llama's names but the MLP's (``hf_llama``), then each layer's router and experts (Hugging Face's w1, w3, w2)
RULES = (hf_llama.WORD_EMBEDDING, *hf_llama.decoder(mlp_layers=False), *hf_llama.FINAL,
         rule("layers.{}.mlp.router.weight", f"model.layers.{{}}.{MOE}.gate.weight"),
         rule(EXPERT + "dense_h_to_4h.weight", (HF_EXPERT + "w1.weight", HF_EXPERT + "w3.weight"), GATE_UP),
         rule(EXPERT + "dense_4h_to_h.weight", HF_EXPERT + "w2.weight"))


def unfuse_experts(prefix: str, tail: str, value: torch.Tensor,
                   names: tuple[str, str, str]) -> dict[str, torch.Tensor] | None:
    """transformers 5's fused experts, ``experts.gate_up_proj [E, 2f, h]`` (the gate rows, then the up rows) or
    ``experts.down_proj [E, h, f]`` (``tail``), as each expert's ``{prefix}experts.{i}.{name}.weight``, ``names``
    those of (gate, up, down); None for any other ``tail``."""
    gate, up, down = names
    if tail == "experts.gate_up_proj":
        f = value.shape[1] // 2
        return {f"{prefix}experts.{i}.{name}.weight": part for i, fused in enumerate(value)
                for name, part in ((gate, fused[:f]), (up, fused[f:]))}
    if tail == "experts.down_proj":
        return {f"{prefix}experts.{i}.{down}.weight": w for i, w in enumerate(value)}
    return None


def strip_hf_prefix(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Mixtral state dict in the Hub's form with the ``model.`` prefix: ``hf_llama.strip_hf_prefix``, and
    transformers 5's in-memory form (``mlp.gate``, ``mlp.experts.gate_up_proj`` / ``down_proj``) split back into
    ``block_sparse_moe.gate`` and each expert's ``w1``, ``w3`` and ``w2``."""
    return unfused_state(hf, MOE, ("w1", "w3", "w2"))


def unfused_state(hf: dict[str, torch.Tensor], moe: str, names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """``hf_llama.strip_hf_prefix(hf)`` with every layer's ``mlp.`` tensors under ``moe.`` and transformers 5's fused
    experts split into each expert's ``names`` (gate, up, down): ``unfuse_experts``."""
    out = {}
    for key, value in hf_llama.strip_hf_prefix(hf).items():
        head, dot, tail = key.partition(".mlp.")
        experts = unfuse_experts(f"{head}.{moe}.", tail, value, names) if dot else None
        out.update(experts if experts is not None else {f"{head}.{moe}.{tail}" if dot else key: value})
    return out


def hf_config(model_cfg: ModelConfig, dtype: str = "float32") -> dict:
    """``config.json`` of the equivalent ``MixtralForCausalLM``."""
    check_model(model_cfg)
    m = model_cfg
    cfg = hf_llama.hf_config(m, dtype, moe=True)
    cfg.update({
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": m.moe_ffn_hidden_size or m.ffn_hidden_size,
        "num_local_experts": m.num_experts,
        "num_experts_per_tok": m.moe_router_topk,
        "router_aux_loss_coef": first_coefficient(m.moe_aux_loss_coeff),
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    })
    return cfg


def model_flags(config: dict) -> list[str]:
    """Our command-line flags for the model of a Hugging Face Mixtral ``config.json`` (refuses what our GPT cannot
    represent)."""
    if config.get("model_type", "mixtral") != "mixtral":
        raise ConversionError(f"config.json describes a {config.get('model_type')!r} model, not mixtral.")
    for key, ours in (("attention_bias", "no linear biases"), ("mlp_bias", "no linear biases")):
        if config.get(key):
            raise ConversionError(f"config.json sets {key}, which Mixtral's projections do not have ({ours}).")
    if config.get("sliding_window") is not None:
        raise ConversionError(f"config.json sets sliding_window {config['sliding_window']}; Mixtral's sliding window "
                              f"is not mapped here (gpt-oss's is), so the model cannot be imported.")
    if float(config.get("router_jitter_noise") or 0.0) != 0.0:
        raise ConversionError(f"config.json sets router_jitter_noise {config['router_jitter_noise']}; this GPT's "
                              f"router has no input jitter, so the model cannot be imported.")
    experts, topk = config.get("num_local_experts"), config.get("num_experts_per_tok")
    if experts is None or topk is None:
        raise ConversionError("config.json lacks num_local_experts or num_experts_per_tok (a Mixtral model has both).")
    if not 1 <= int(topk) <= int(experts):
        raise ConversionError(f"num_experts_per_tok ({topk}) must be from 1 to num_local_experts ({experts}).")
    values = hf_llama.model_values({**config, "attention_bias": False, "mlp_bias": False})
    values.update({"num_experts": int(experts), "moe_router_topk": int(topk),
                   "moe_aux_loss_coeff": float(config.get("router_aux_loss_coef", 0.0))})
    return to_flags(values)


FAMILY = Family("mixtral", RULES, hf_llama.KEYS, check_model, strip_hf_prefix, hf_llama.HF_WTE, hf_llama.HF_HEAD,
                hf_llama.tied_head, hint=_HINT)
name_map, to_hf_state_dict, from_hf_state_dict = FAMILY.name_map, FAMILY.to_hf_state_dict, FAMILY.from_hf_state_dict
