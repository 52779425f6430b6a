"""Hugging Face Qwen3 (``Qwen3ForCausalLM``, transformers 5) to and from our GPT: a Llama-shaped decoder (``hf_llama``:
rope, RMSNorm, SwiGLU, grouped-query attention, any head width) whose attention normalises each head's query and key
before the rotary embedding (our ``--qk-layernorm``, the model's RMSNorm over the head width, one weight shared by the
heads), without linear biases.

=================================================  ===========================================================
ours (``layers.{i}.``)                             Hugging Face (``model.layers.{i}.``)
=================================================  ===========================================================
``self_attention.q_layernorm.weight [hd]``         ``self_attn.q_norm.weight``
``self_attention.k_layernorm.weight [hd]``         ``self_attn.k_norm.weight``
everything else                                    as ``hf_llama`` maps it
=================================================  ===========================================================

Qwen3's sliding-window layers (``use_sliding_window``, ``max_window_layers``) are not mapped here (the windows
themselves are built: gpt-oss's, ``hf_gpt_oss``): an import that turns them on is refused in one line, and an export
writes them off. An attention bias (``attention_bias``) is refused: this GPT's linear layers
have biases on all or none, and Qwen3's MLP has none.
"""

from __future__ import annotations

from megatron.checkpoint.hf import llama as hf_llama
from megatron.checkpoint.hf.common import ConversionError, to_flags
from megatron.checkpoint.hf.mapping import Family, renames
from megatron.config.schema import ModelConfig

ARCHITECTURE = "Qwen3ForCausalLM"
_QK_NORMS = {"q_layernorm": "q_norm", "k_layernorm": "k_norm"}
_HINT = "check num_hidden_layers and tie_word_embeddings"


def check_model(model_cfg: ModelConfig) -> None:
    """ConversionError, naming the setting, unless our ``ModelConfig`` is Qwen3-shaped."""
    hf_llama.check_model(model_cfg, "Qwen3", ARCHITECTURE, qk_norm=True)
    if not model_cfg.disable_bias_linear:
        raise ConversionError(f"linear biases (disable_bias_linear off) have no Hugging Face Qwen3 equivalent "
                              f"({ARCHITECTURE} has none in its MLP), so this checkpoint cannot be exported.")


# Llama's names, and the two QK norms per layer (after Llama's, as our checkpoints hold them)
QK_NORMS = renames({f"self_attention.{ours}.weight": f"self_attn.{theirs}.weight"
                    for ours, theirs in _QK_NORMS.items()}, ours=hf_llama.LAYER, theirs=hf_llama.HF_LAYER)
RULES = (*hf_llama.RULES, *QK_NORMS)


def hf_config(model_cfg: ModelConfig, dtype: str = "float32") -> dict:
    """``config.json`` of the equivalent ``Qwen3ForCausalLM``."""
    check_model(model_cfg)
    cfg = hf_llama.hf_config(model_cfg, dtype, moe=True, qk_norm=True)  # Llama's keys but those only Llama has
    cfg.update({"architectures": [ARCHITECTURE], "model_type": "qwen3", "attention_bias": False,
                "use_sliding_window": False, "sliding_window": None, "max_window_layers": model_cfg.num_layers,
                "layer_types": ["full_attention"] * model_cfg.num_layers})
    return cfg


def model_flags(config: dict) -> list[str]:
    """Our command-line flags for the model of a Hugging Face Qwen3 ``config.json``."""
    if config.get("model_type", "qwen3") != "qwen3":
        raise ConversionError(f"config.json describes a {config.get('model_type')!r} model, not qwen3.")
    if config.get("use_sliding_window") or set(config.get("layer_types") or ()) - {"full_attention"}:
        raise ConversionError("config.json turns Qwen3's sliding-window layers on (use_sliding_window) or names them "
                              "(layer_types), whose mapping is not written here (gpt-oss's windows are); import a "
                              "checkpoint that attends to every position.")
    if config.get("attention_bias"):
        raise ConversionError("config.json sets attention_bias, but Qwen3's MLP has no bias and this GPT has biases "
                              "on every linear layer or none; the model cannot be imported.")
    return to_flags({**hf_llama.model_values({**config, "mlp_bias": False}), "qk_layernorm": True})


FAMILY = Family("qwen3", RULES, hf_llama.KEYS, check_model, hf_llama.strip_hf_prefix, hf_llama.HF_WTE,
                hf_llama.HF_HEAD, hf_llama.tied_head, hint=_HINT)
name_map, to_hf_state_dict, from_hf_state_dict = FAMILY.name_map, FAMILY.to_hf_state_dict, FAMILY.from_hf_state_dict
