"""Our Llama-shaped mixture-of-experts GPT with a shared expert <-> Hugging Face Qwen-MoE
(``transformers.Qwen2MoeForCausalLM``).

Qwen2-MoE is Llama (``hf_llama``: the embedding, attention, norms and head map as there) whose MoE layers hold a
router (``mlp.gate``), E SwiGLU experts without biases (``mlp.experts.{i}.{gate,up,down}_proj``) and a shared
expert (``mlp.shared_expert.*``), and whose other layers (``mlp_only_layers``) keep the dense MLP (Llama's
names). Its router is a softmax over all E, the top k, renormalised over those k with ``norm_topk_prob`` (our
default softmax router) or not (our ``moe_router_pre_softmax``), dropless. So a model of ours exports here when it
is Llama-shaped, has a shared expert (the tool's choice: without one it is Mixtral, ``hf_mixtral``) and no
setting Qwen2-MoE lacks: the sigmoid router, the expert bias, a capacity, linear biases (Qwen2-MoE's ``qkv_bias``
has no counterpart here, its other projections have none). Anything else is refused in one line.

The shared expert's gate: Qwen2-MoE multiplies the shared expert's output by ``sigmoid(shared_expert_gate(x))``, a
``[1, h]`` weight: ours with ``moe_shared_expert_gate`` (Megatron-LM's ``--moe-shared-expert-gate``), ``layers.N.mlp.
shared_expert_gate.weight``, mapped as it is both ways. The import always builds it (every Qwen2-MoE has one). A
model of ours without it exports the gate as zeros (a gate of exactly 1/2) and the shared expert's ``down_proj`` as
twice our ``dense_4h_to_h`` (a power of two: exact), so transformers computes our layer; imported into such a model
(a configuration without the gate), a gate of zeros gives ``down_proj`` halved back, any other gate is refused.

======================================================  =======================================================
ours (layer N, expert i)                                Hugging Face (``model.layers.N.mlp.``...)
======================================================  =======================================================
``layers.N.mlp.router.weight [E, h]``                   ``gate.weight``
``layers.N.mlp.experts.i.dense_h_to_4h.weight [2f, h]`` ``experts.i.gate_proj.weight`` (rows 2j),
                                                        ``experts.i.up_proj.weight`` (rows 2j + 1)
``layers.N.mlp.experts.i.dense_4h_to_h.weight``         ``experts.i.down_proj.weight``
``layers.N.mlp.shared_expert.dense_h_to_4h.weight``     ``shared_expert.{gate,up}_proj.weight`` (interleaved)
``layers.N.mlp.shared_expert.dense_4h_to_h.weight``     ``shared_expert.down_proj.weight`` (without the gate: x 2)
``layers.N.mlp.shared_expert_gate.weight [1, h]``       ``shared_expert_gate.weight`` (without the gate: zeros)
======================================================  =======================================================
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.checkpoint.hf import llama as hf_llama
from megatron.checkpoint.hf.common import ConversionError, layer_pattern, to_flags
from megatron.checkpoint.hf.mapping import Extra, Family, layers_where, rule
from megatron.checkpoint.hf.mixtral import unfused_state
from megatron.checkpoint.hf.transforms import scaled
from megatron.config.schema import ModelConfig
from megatron.config.validate_moe import first_coefficient, moe_layer_pattern

_HINT = "check num_hidden_layers, num_experts, mlp_only_layers and tie_word_embeddings"
_ARCH = "Hugging Face Qwen-MoE (Qwen2MoeForCausalLM)"
GATE, SHARED_DOWN = "mlp.shared_expert_gate.weight", "mlp.shared_expert.down_proj.weight"


def _pattern(model_cfg: ModelConfig) -> list[bool]:
    try:
        return moe_layer_pattern(model_cfg.moe_layer_freq, model_cfg.num_layers)
    except ValueError as err:
        raise ConversionError(f"{err}.") from None


def check_model(model_cfg: ModelConfig) -> None:
    """ConversionError, naming the setting, unless our ``ModelConfig`` is a Llama-shaped MoE that Qwen2-MoE is."""
    m = model_cfg
    if not m.num_experts or not m.moe_shared_expert_intermediate_size:
        raise ConversionError("the model has no shared expert: export it as Mixtral (or Llama), not Qwen-MoE.")
    hf_llama.check_model(m, "Qwen-MoE", "Qwen2MoeForCausalLM")
    check_router(m, _ARCH, "Qwen-MoE")


def check_router(model_cfg: ModelConfig, arch: str, family: str) -> None:
    """ConversionError, naming the setting, unless the MoE settings are those of Qwen's routers (Qwen2-MoE's and
    Qwen3-MoE's: a softmax, no expert bias, dropless, every expert eligible, unscaled, no linear biases)."""
    m = model_cfg
    _pattern(m)
    for differs, setting, why in (
            (m.moe_router_score_function != "softmax", f"moe_router_score_function {m.moe_router_score_function}",
             f"{family}'s router is a softmax"),
            (m.moe_router_enable_expert_bias, "moe_router_enable_expert_bias", f"{family}'s router has no expert bias"),
            (m.moe_expert_capacity_factor is not None, f"moe_expert_capacity_factor {m.moe_expert_capacity_factor}",
             f"{family} drops no tokens"),
            (bool(m.moe_router_group_topk), f"group-limited routing (moe_router_group_topk {m.moe_router_group_topk})",
             f"{family}'s router chooses among all experts"),
            (m.moe_router_topk_scaling_factor not in (None, 1.0),
             f"moe_router_topk_scaling_factor {m.moe_router_topk_scaling_factor}", f"{family} does not scale the "
             "probabilities"),
            (not m.disable_bias_linear, "linear biases (disable_bias_linear off)",
             f"{family}'s projections have no biases")):
        if differs:
            raise ConversionError(f"{setting} has no {arch} equivalent ({why}), so this checkpoint cannot be "
                                  f"exported.")


moe_layers = layers_where(lambda m: _pattern(m))
dense_layers = layers_where(lambda m: [not is_moe for is_moe in _pattern(m)])
EXPERT, HF_EXPERT = "layers.{}.mlp.experts.{}.", "model.layers.{}.mlp.experts.{}."
SHARED, HF_SHARED = "layers.{}.mlp.shared_expert.", "model.layers.{}.mlp.shared_expert."


def moe_mlp(shared: tuple[str, str] | None = (SHARED, HF_SHARED), layers=moe_layers, shared_down=None) -> list:
    """A MoE layer's router, experts and (``shared``: our and Hugging Face's prefixes) shared expert, each with
    Hugging Face's gate, up and down projections; ``shared_down``: the transform of the shared down projection
    of a model without the shared expert's gate (with it: as it is), the gate's rule after it."""
    down, gate_up = hf_llama.mlp("weight", layers, EXPERT, HF_EXPERT)
    rules = [rule("layers.{}.mlp.router.weight", "model.layers.{}.mlp.gate.weight", layers=layers), *gate_up, *down]
    if shared is not None:
        down, gate_up = hf_llama.mlp("weight", layers, *shared)
        if shared_down is not None:
            down = [dataclasses.replace(down[0], transform=shared_down, when=_ungated),
                    dataclasses.replace(down[0], when=_gated),
                    rule("layers.{}.mlp.shared_expert_gate.weight", "model.layers.{}." + GATE, layers=layers,
                         when=_gated)]
        rules += [*gate_up, *down]
    return rules


def _gated(m) -> bool:
    return bool(getattr(m, "moe_shared_expert_gate", False))


def _ungated(m) -> bool:
    return not _gated(m)


def _zero_gate(ctx, out: dict, name: str) -> torch.Tensor:
    return out[name.replace(GATE, SHARED_DOWN)].new_zeros(1, ctx.m.hidden_size)


def _check_gate(weight, ctx, hf: dict, name: str) -> None:
    if weight is None:
        raise ConversionError(f"the Hugging Face state dict lacks {name!r}; {_HINT}.")
    if torch.count_nonzero(weight):
        raise ConversionError(f"{name} is not zero: the model's shared expert has no gate here (its configuration "
                              f"lacks --moe-shared-expert-gate), so the weights cannot be imported into it.")


# Llama's names, a dense layer's MLP as Llama's; a MoE layer's router, experts and shared expert with its gate; a
# model without the gate: the down projection doubled and the gate (no tensor of ours) zeros (the module's docstring)
RULES = (hf_llama.WORD_EMBEDDING, *hf_llama.decoder(mlp_layers=dense_layers), *hf_llama.FINAL,
         *moe_mlp(shared_down=scaled(2.0)))
EXTRAS = (Extra("model.layers.{}." + GATE, _zero_gate, _check_gate, layers=moe_layers, when=_ungated),)


def strip_hf_prefix(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Qwen2-MoE state dict in the Hub's form with the ``model.`` prefix: ``hf_llama.strip_hf_prefix``, and
    transformers 5's fused experts split back into each expert's ``gate_proj``, ``up_proj`` and ``down_proj``."""
    return unfused_state(hf, "mlp", ("gate_proj", "up_proj", "down_proj"))


def hf_config(model_cfg: ModelConfig, dtype: str = "float32") -> dict:
    """``config.json`` of the equivalent ``Qwen2MoeForCausalLM``."""
    check_model(model_cfg)
    m = model_cfg
    cfg = hf_llama.hf_config(m, dtype, moe=True)
    cfg.update({
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "intermediate_size": m.ffn_hidden_size,  # the dense layers' MLP
        "moe_intermediate_size": m.moe_ffn_hidden_size or m.ffn_hidden_size,
        "shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size,
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.moe_router_topk,
        "norm_topk_prob": not m.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [n for n, is_moe in enumerate(_pattern(m)) if not is_moe],
        "qkv_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": m.num_layers,
        "router_aux_loss_coef": first_coefficient(m.moe_aux_loss_coeff),
        "output_router_logits": False,
    })
    return cfg


def model_flags(config: dict) -> list[str]:
    """Our command-line flags for the model of a Hugging Face Qwen2-MoE ``config.json`` (refuses what our GPT
    cannot represent)."""
    if config.get("model_type", "qwen2_moe") != "qwen2_moe":
        raise ConversionError(f"config.json describes a {config.get('model_type')!r} model, not qwen2_moe.")
    if config.get("qkv_bias", True):
        raise ConversionError("config.json sets qkv_bias (biases on the query/key/value projections only); this GPT "
                              "has biases on every projection or on none, so the model cannot be imported.")
    if config.get("use_sliding_window") or set(config.get("layer_types") or ()) - {"full_attention"}:
        raise ConversionError("config.json sets use_sliding_window (or layer_types other than full_attention); Qwen's "
                              "sliding-window layers are not mapped here (gpt-oss's are), so the model cannot be "
                              "imported.")
    experts, topk = config.get("num_experts"), config.get("num_experts_per_tok")
    shared, width = config.get("shared_expert_intermediate_size"), config.get("moe_intermediate_size")
    if not experts or not topk or not shared or not width:
        raise ConversionError("config.json lacks num_experts, num_experts_per_tok, moe_intermediate_size or "
                              "shared_expert_intermediate_size (each at least 1 in a Qwen-MoE model this GPT "
                              "represents).")
    if not 1 <= int(topk) <= int(experts):
        raise ConversionError(f"num_experts_per_tok ({topk}) must be from 1 to num_experts ({experts}).")
    values = hf_llama.model_values({**config, "attention_bias": False, "mlp_bias": False})
    step, dense = int(config.get("decoder_sparse_step") or 1), set(config.get("mlp_only_layers") or ())
    pattern = layer_pattern(values["num_layers"], lambda n: int(n not in dense and (n + 1) % step == 0))
    values.update({"num_experts": int(experts), "moe_router_topk": int(topk), "moe_ffn_hidden_size": int(width),
                   "moe_shared_expert_intermediate_size": int(shared), "moe_shared_expert_gate": True,
                   "moe_layer_freq": "1" if all(pattern) else str(pattern).replace(" ", ""),
                   "moe_router_pre_softmax": not config.get("norm_topk_prob", False),
                   "moe_aux_loss_coeff": float(config.get("router_aux_loss_coef", 0.0))})
    return to_flags(values)


FAMILY = Family("qwen2_moe", RULES, hf_llama.KEYS, check_model, strip_hf_prefix, hf_llama.HF_WTE, hf_llama.HF_HEAD,
                hf_llama.tied_head, extras=EXTRAS, hint=_HINT)
name_map, to_hf_state_dict, from_hf_state_dict = FAMILY.name_map, FAMILY.to_hf_state_dict, FAMILY.from_hf_state_dict
