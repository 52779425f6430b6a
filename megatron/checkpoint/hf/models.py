"""Which Hugging Face family (a module of ``hf``, its ``FAMILY``) converts a model: by our ``ModelConfig`` (export)
or by a ``config.json`` (import: by its family, ``config_checks.model_type_of``). The one place that decides it, for
``tools/convert_checkpoint.py``: the registry of the families."""

from __future__ import annotations

from megatron.checkpoint.hf import deepseek_v3 as hf_deepseek
from megatron.checkpoint.hf import gpt2 as hf_gpt2
from megatron.checkpoint.hf import gpt_oss as hf_gpt_oss
from megatron.checkpoint.hf import llama as hf_llama
from megatron.checkpoint.hf import mixtral as hf_mixtral
from megatron.checkpoint.hf import nemotron_h as hf_nemotron_h
from megatron.checkpoint.hf import qwen2_moe as hf_qwen_moe
from megatron.checkpoint.hf import qwen3 as hf_qwen3
from megatron.checkpoint.hf import qwen3_moe as hf_qwen3_moe
from megatron.checkpoint.hf import qwen3_next as hf_qwen3_next
from megatron.checkpoint.hf.common import ConversionError
from megatron.checkpoint.hf.config_checks import checked, model_type_of
from megatron.config.validate_mup import attention_scale, changes_the_function, embedding_multiplier, output_multiplier


def converter_for_model(model_cfg):
    """The mapping for our ``ModelConfig``: multi-latent attention is ``hf_deepseek``; any of gpt-oss's marks (sliding
    windows, attention sinks, the quick GeGLU or its offset and clamp, YaRN on standard attention) ``hf_gpt_oss``,
    which refuses what else does not fit (no other mapping would keep the mark); a mixture of experts is
    ``hf_qwen_moe`` with a shared expert, else ``hf_qwen3_moe`` with QK-norm or ``hf_mixtral``; a dense model
    ``hf_qwen3`` (with QK-norm), ``hf_llama`` or ``hf_gpt2``.
    ConversionError, naming the setting, for a model that has no Hugging Face equivalent (muP's multipliers among
    them: ``refuse_mup``)."""
    refuse_mup(model_cfg)
    if model_cfg.hybrid_override_pattern:
        module = hf_nemotron_h  # a hybrid model's layers, one part each: only Nemotron-H holds them
    elif model_cfg.experimental_attention_variant or model_cfg.attention_output_gate:
        module = hf_qwen3_next  # Gated DeltaNet, gated attention: only Qwen3-Next holds them
    elif model_cfg.multi_latent_attention:
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


def refuse_mup(model_cfg) -> None:
    """ConversionError for a muP model whose function differs from the plain one's with the same weights (a logit or
    embedding multiplier other than 1, an attention scale other than 1 / sqrt(d)): no family's config.json here has
    keys for them, and folding them into the weights would change what a reloaded model trains as. muP's
    initialisation and learning rates alone (width multiplier 1, mup_base_head_dim = the head width with
    mup_attn_scale_power 1) leave the function unchanged and export."""
    if not changes_the_function(model_cfg):
        return
    scale = "" if model_cfg.multi_latent_attention else f", attention scale {attention_scale(model_cfg):.6g}"
    raise ConversionError(
        f"the model uses muP's multipliers (use_mup: logits x {output_multiplier(model_cfg):.6g}, embedding x "
        f"{embedding_multiplier(model_cfg):.6g}{scale}), which no Hugging Face config here can express; convert it to "
        f"Megatron-LM's format instead (to-megatron carries --use-mup and the --mup-* settings).")


# model_type (``config_checks.model_type_of``) -> the mapping
_MAPPINGS = {"llama": hf_llama, "mixtral": hf_mixtral, "qwen2_moe": hf_qwen_moe, "deepseek_v3": hf_deepseek,
             "qwen3": hf_qwen3, "qwen3_moe": hf_qwen3_moe, "gpt_oss": hf_gpt_oss, "qwen3_next": hf_qwen3_next,
             "nemotron_h": hf_nemotron_h, "gpt2": hf_gpt2}


def converter_for_hf(hf_cfg: dict):
    """The mapping for a Hugging Face config.json, by its model_type and architectures, once the config has passed
    ``config_checks.checked`` (its sizes bounded, its types and its paired keys checked; ConversionError
    otherwise): no mapping ever sees a config that would make it build without bound."""
    checked(hf_cfg)
    return _MAPPINGS[model_type_of(hf_cfg)]
