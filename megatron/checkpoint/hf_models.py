"""Which Hugging Face mapping (``hf_*``) converts a model: by our ``ModelConfig`` (export) or by a ``config.json``
(import). The one place that decides it, for ``tools/convert_checkpoint.py``."""

from __future__ import annotations

from megatron.checkpoint import (
    hf_deepseek,
    hf_gpt2,
    hf_gpt_oss,
    hf_llama,
    hf_mixtral,
    hf_qwen3,
    hf_qwen3_moe,
    hf_qwen_moe,
)
from megatron.checkpoint.hf_common import ConversionError


def converter_for_model(model_cfg):
    """The mapping for our ``ModelConfig``: multi-latent attention is ``hf_deepseek``; any of gpt-oss's marks (sliding
    windows, attention sinks, the quick GeGLU or its offset and clamp, YaRN on standard attention) ``hf_gpt_oss``,
    which refuses what else does not fit (no other mapping would keep the mark); a mixture of experts is
    ``hf_qwen_moe`` with a shared expert, else ``hf_qwen3_moe`` with QK-norm or ``hf_mixtral``; a dense model
    ``hf_qwen3`` (with QK-norm), ``hf_llama`` or ``hf_gpt2``.
    ConversionError, naming the setting, for a model that has no Hugging Face equivalent."""
    if model_cfg.multi_latent_attention:
        module = hf_deepseek
    elif hf_gpt_oss.is_gpt_oss_shaped(model_cfg):
        module = hf_gpt_oss
    elif model_cfg.num_experts and model_cfg.moe_shared_expert_intermediate_size:
        module = hf_qwen_moe
    elif model_cfg.num_experts:
        module = hf_qwen3_moe if model_cfg.qk_layernorm else hf_mixtral
    elif hf_llama.is_llama_shaped(model_cfg):
        module = hf_qwen3 if model_cfg.qk_layernorm else hf_llama
    else:
        module = hf_gpt2
    module.check_model(model_cfg)
    return module


def converter_for_hf(hf_cfg: dict):
    """The mapping for a Hugging Face config.json, by its model_type and architectures."""
    model_type, architectures = hf_cfg.get("model_type"), hf_cfg.get("architectures") or []
    if model_type == "llama" or (model_type is None and "LlamaForCausalLM" in architectures):
        return hf_llama
    if model_type == "mixtral" or (model_type is None and "MixtralForCausalLM" in architectures):
        return hf_mixtral
    if model_type == "qwen2_moe" or (model_type is None and "Qwen2MoeForCausalLM" in architectures):
        return hf_qwen_moe
    if model_type == "deepseek_v3" or (model_type is None and "DeepseekV3ForCausalLM" in architectures):
        return hf_deepseek
    if model_type == "qwen3" or (model_type is None and hf_qwen3.ARCHITECTURE in architectures):
        return hf_qwen3
    if model_type == "qwen3_moe" or (model_type is None and hf_qwen3_moe.ARCHITECTURE in architectures):
        return hf_qwen3_moe
    if model_type == "gpt_oss" or (model_type is None and hf_gpt_oss.ARCHITECTURE in architectures):
        return hf_gpt_oss
    if model_type in (None, "gpt2"):
        return hf_gpt2
    named = ", ".join(architectures) or "no architectures"
    raise ConversionError(f"config.json describes a {model_type!r} model ({named}); this tool converts gpt2 "
                          f"(GPT2LMHeadModel), llama (LlamaForCausalLM), mixtral (MixtralForCausalLM), qwen2_moe "
                          f"(Qwen2MoeForCausalLM), qwen3 (Qwen3ForCausalLM), qwen3_moe (Qwen3MoeForCausalLM), "
                          f"deepseek_v3 (DeepseekV3ForCausalLM) and gpt_oss (GptOssForCausalLM).")
