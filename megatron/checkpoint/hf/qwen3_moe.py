"""Hugging Face Qwen3-MoE (``Qwen3MoeForCausalLM``, transformers 5) to and from our GPT: Qwen3's attention
(``hf_qwen3``: Llama's names and the per-head query / key norms) and Qwen's mixture of experts without a shared expert.

Its MoE layers hold a router (``mlp.gate``) and E SwiGLU experts without biases
(``mlp.experts.{i}.{gate,up,down}_proj``, or transformers 5's fused form, read by ``hf_qwen_moe.strip_hf_prefix``);
its other layers (``mlp_only_layers``, ``decoder_sparse_step``) keep the dense MLP. The router is a softmax over all
E, the top k, renormalised over those k with ``norm_topk_prob`` (our default softmax router) or not
(``moe_router_pre_softmax``), dropless. So a Llama-shaped model of ours with ``--qk-layernorm``, experts and no shared
expert exports here (with a shared expert it is ``hf_qwen_moe``'s Qwen2-MoE; without the QK norms, ``hf_mixtral``'s
Mixtral); the router settings Qwen's lacks are refused as there (``hf_qwen_moe.check_router``), and so are sliding
windows and an attention bias on import.
"""

from __future__ import annotations

from megatron.checkpoint.hf import llama as hf_llama
from megatron.checkpoint.hf import qwen2_moe as hf_qwen_moe
from megatron.checkpoint.hf import qwen3 as hf_qwen3
from megatron.checkpoint.hf.common import ConversionError, layer_pattern, to_flags
from megatron.checkpoint.hf.mapping import BLOCK, Family
from megatron.config.schema import ModelConfig
from megatron.config.validate_moe import first_coefficient

ARCHITECTURE = "Qwen3MoeForCausalLM"
_ARCH = f"Hugging Face Qwen3-MoE ({ARCHITECTURE})"
_HINT = "check num_hidden_layers, num_experts, mlp_only_layers and tie_word_embeddings"


def check_model(model_cfg: ModelConfig) -> None:
    """ConversionError, naming the setting, unless our ``ModelConfig`` is a Qwen3-MoE."""
    m = model_cfg
    if not m.num_experts or m.moe_shared_expert_intermediate_size:
        raise ConversionError("Qwen3-MoE has experts and no shared expert: export this model as Qwen-MoE (with a "
                              "shared expert) or Qwen3 (dense).")
    hf_llama.check_model(m, "Qwen3-MoE", ARCHITECTURE, qk_norm=True)
    hf_qwen_moe.check_router(m, _ARCH, "Qwen3-MoE")


# Qwen3's names (``hf_qwen3``), a dense layer's MLP as Llama's; a MoE layer's router and experts (no shared expert)
RULES = (hf_llama.WORD_EMBEDDING, *hf_llama.decoder(mlp_layers=hf_qwen_moe.dense_layers), *hf_llama.FINAL,
         *hf_qwen3.QK_NORMS, BLOCK, *hf_qwen_moe.moe_mlp(shared=None))


def hf_config(model_cfg: ModelConfig, dtype: str = "float32") -> dict:
    """``config.json`` of the equivalent ``Qwen3MoeForCausalLM``."""
    check_model(model_cfg)
    m = model_cfg
    cfg = hf_llama.hf_config(m, dtype, moe=True, qk_norm=True)
    cfg.update({
        "architectures": [ARCHITECTURE], "model_type": "qwen3_moe", "attention_bias": False,
        "intermediate_size": m.ffn_hidden_size,  # the dense layers' MLP
        "moe_intermediate_size": m.moe_ffn_hidden_size or m.ffn_hidden_size,
        "num_experts": m.num_experts, "num_experts_per_tok": m.moe_router_topk,
        "norm_topk_prob": not m.moe_router_pre_softmax, "decoder_sparse_step": 1,
        "mlp_only_layers": [n for n, is_moe in enumerate(hf_qwen_moe._pattern(m)) if not is_moe],
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": m.num_layers,
        "router_aux_loss_coef": first_coefficient(m.moe_aux_loss_coeff), "output_router_logits": False,
    })
    return cfg


def model_flags(config: dict) -> list[str]:
    """Our command-line flags for the model of a Hugging Face Qwen3-MoE ``config.json``."""
    if config.get("model_type", "qwen3_moe") != "qwen3_moe":
        raise ConversionError(f"config.json describes a {config.get('model_type')!r} model, not qwen3_moe.")
    dense = hf_qwen3.model_flags({**config, "model_type": "qwen3"})  # attention, sliding windows, biases checked
    experts = config.get("num_experts") or config.get("num_local_experts")  # transformers 5 writes the latter
    topk, width = config.get("num_experts_per_tok"), config.get("moe_intermediate_size")
    if not experts or not topk or not width:
        raise ConversionError("config.json lacks num_experts, num_experts_per_tok or moe_intermediate_size (each at "
                              "least 1 in a Qwen3-MoE model).")
    if not 1 <= int(topk) <= int(experts):
        raise ConversionError(f"num_experts_per_tok ({topk}) must be from 1 to num_experts ({experts}).")
    layers = int(config["num_hidden_layers"])
    step, only_dense = int(config.get("decoder_sparse_step") or 1), set(config.get("mlp_only_layers") or ())
    pattern = layer_pattern(layers, lambda n: int(n not in only_dense and (n + 1) % step == 0))
    return dense + to_flags({"num_experts": int(experts), "moe_router_topk": int(topk),
                             "moe_ffn_hidden_size": int(width),
                             "moe_layer_freq": "1" if all(pattern) else str(pattern).replace(" ", ""),
                             "moe_router_pre_softmax": not config.get("norm_topk_prob", False),
                             "moe_aux_loss_coeff": float(config.get("router_aux_loss_coef", 0.0))})


FAMILY = Family("qwen3_moe", RULES, hf_llama.KEYS, check_model, hf_qwen_moe.strip_hf_prefix, hf_llama.HF_WTE,
                hf_llama.HF_HEAD, hf_llama.tied_head, hint=_HINT)
name_map, to_hf_state_dict, from_hf_state_dict = FAMILY.name_map, FAMILY.to_hf_state_dict, FAMILY.from_hf_state_dict
