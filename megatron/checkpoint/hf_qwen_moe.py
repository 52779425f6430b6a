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
``[1, h]`` weight we have not (Megatron-LM's ``--moe-shared-expert-gate`` is not built). The export writes that
weight as zeros (a gate of exactly 1/2) and the shared expert's ``down_proj`` as twice our ``dense_4h_to_h`` (a
power of two: exact), so transformers computes our layer; the import takes a gate that is all zeros and halves
``down_proj`` back, and refuses any other gate (a trained one is a function we cannot represent).

======================================================  =======================================================
ours (layer N, expert i)                                Hugging Face (``model.layers.N.mlp.``...)
======================================================  =======================================================
``layers.N.mlp.router.weight [E, h]``                   ``gate.weight``
``layers.N.mlp.experts.i.dense_h_to_4h.weight [2f, h]`` ``experts.i.gate_proj.weight`` (rows 2j),
                                                        ``experts.i.up_proj.weight`` (rows 2j + 1)
``layers.N.mlp.experts.i.dense_4h_to_h.weight``         ``experts.i.down_proj.weight``
``layers.N.mlp.shared_expert.dense_h_to_4h.weight``     ``shared_expert.{gate,up}_proj.weight`` (interleaved)
``layers.N.mlp.shared_expert.dense_4h_to_h.weight``     ``shared_expert.down_proj.weight`` (times 2)
(none)                                                  ``shared_expert_gate.weight [1, h]`` (zeros)
======================================================  =======================================================
"""

from __future__ import annotations

import torch

from megatron.checkpoint import hf_llama
from megatron.checkpoint.hf_common import ConversionError, to_flags
from megatron.checkpoint.hf_mixtral import unfuse_experts
from megatron.config.schema import ModelConfig
from megatron.config.validate_moe import moe_layer_pattern

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


def name_map(model_cfg: ModelConfig) -> dict[str, list[str]]:
    """Our global parameter name -> the Hugging Face name(s) it holds: ``hf_llama``'s for everything but the MoE
    layers' MLP (a dense layer's MLP keeps Llama's names), the router, experts and shared expert in its place."""
    m = model_cfg
    pattern = _pattern(m)
    names = {ours: theirs for ours, theirs in hf_llama.name_map(m).items()
             if ".mlp." not in ours or not pattern[int(ours.split(".")[1])]}
    for n in (n for n, is_moe in enumerate(pattern) if is_moe):
        ours, theirs = f"layers.{n}.mlp.", f"model.layers.{n}.mlp."
        names[ours + "router.weight"] = [theirs + "gate.weight"]
        for expert in [f"experts.{i}." for i in range(m.num_experts)] + ["shared_expert."]:
            names[f"{ours}{expert}dense_h_to_4h.weight"] = [f"{theirs}{expert}gate_proj.weight",
                                                            f"{theirs}{expert}up_proj.weight"]
            names[f"{ours}{expert}dense_4h_to_h.weight"] = [f"{theirs}{expert}down_proj.weight"]
    return names


def _gates(model_cfg: ModelConfig) -> list[str]:
    """The Hugging Face names of the shared experts' gates, one per MoE layer."""
    return [f"model.layers.{n}.{GATE}" for n, is_moe in enumerate(_pattern(model_cfg)) if is_moe]


def to_hf_state_dict(tensors: dict[str, torch.Tensor], model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our global tensors -> a ``Qwen2MoeForCausalLM`` state dict in the Hub's form (``lm_head.weight`` only when
    untied): each shared expert's gate zeros and its ``down_proj`` doubled (see the module's docstring)."""
    check_model(model_cfg)
    out = hf_llama.map_to_hf(tensors, name_map(model_cfg), model_cfg)
    for gate in _gates(model_cfg):
        down = gate.replace(GATE, SHARED_DOWN)
        out[down] = out[down] * 2.0
        out[gate] = out[down].new_zeros(1, model_cfg.hidden_size)
    return out


def strip_hf_prefix(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Qwen2-MoE state dict in the Hub's form with the ``model.`` prefix: ``hf_llama.strip_hf_prefix``, and
    transformers 5's fused experts split back into each expert's ``gate_proj``, ``up_proj`` and ``down_proj``."""
    out = {}
    for key, value in hf_llama.strip_hf_prefix(hf).items():
        head, dot, tail = key.partition(".mlp.")
        experts = unfuse_experts(f"{head}.mlp.", tail, value, ("gate_proj", "up_proj", "down_proj")) if dot else None
        out.update(experts if experts is not None else {key: value})
    return out


def from_hf_state_dict(hf: dict[str, torch.Tensor], model_cfg: ModelConfig,
                       padded_vocab: int) -> dict[str, torch.Tensor]:
    """A ``Qwen2MoeForCausalLM`` (or ``Qwen2MoeModel``) state dict, either form -> our global tensors (fp32, the
    word embedding and an untied output layer zero-padded to ``padded_vocab`` rows). Every shared expert's gate
    must be zeros (``down_proj`` is halved); ConversionError otherwise."""
    check_model(model_cfg)
    hf = strip_hf_prefix(hf)
    for gate in _gates(model_cfg):
        weight = hf.pop(gate, None)
        if weight is None:
            raise ConversionError(f"the Hugging Face state dict lacks {gate!r}; {_HINT}.")
        if torch.count_nonzero(weight):
            raise ConversionError(f"{gate} is not zero: this GPT's shared expert has no gate (Megatron-LM's "
                                  f"--moe-shared-expert-gate is not built), so the model cannot be imported.")
        down = gate.replace(GATE, SHARED_DOWN)
        if down in hf:
            hf[down] = hf[down].to(torch.float32) * 0.5
    return hf_llama.map_from_hf(hf, name_map(model_cfg), model_cfg, padded_vocab, _HINT)


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
        "router_aux_loss_coef": m.moe_aux_loss_coeff,
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
    pattern = [int(n not in dense and (n + 1) % step == 0) for n in range(values["num_layers"])]
    values.update({"num_experts": int(experts), "moe_router_topk": int(topk), "moe_ffn_hidden_size": int(width),
                   "moe_shared_expert_intermediate_size": int(shared),
                   "moe_layer_freq": "1" if all(pattern) else str(pattern).replace(" ", ""),
                   "moe_router_pre_softmax": not config.get("norm_topk_prob", False),
                   "moe_aux_loss_coeff": float(config.get("router_aux_loss_coef", 0.0))})
    return to_flags(values)
