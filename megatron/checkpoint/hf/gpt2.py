"""Our GPT parameters <-> Hugging Face GPT-2 (``transformers.GPT2LMHeadModel``).

Both are the same network (pre-LayerNorm decoder, learned positions, tanh-approximated GELU, LM
head tied to the word embedding, attention scaled by ``1 / sqrt(head_dim)``); only names and
layouts differ:

==============================================  ==========================================  ===============
ours (global name, ``[out, in]`` Linear)         Hugging Face                                layout change
==============================================  ==========================================  ===============
``embedding.word_embeddings.weight [Vp, h]``     ``transformer.wte.weight [V, h]``           padding rows
``embedding.position_embeddings.weight``         ``transformer.wpe.weight``                  none
``layers.{i}.input_layernorm.*``                 ``transformer.h.{i}.ln_1.*``                none
``layers.{i}.self_attention.query_key_value.*``  ``transformer.h.{i}.attn.c_attn.*``         QKV order, T
``layers.{i}.self_attention.dense.*``            ``transformer.h.{i}.attn.c_proj.*``         T
``layers.{i}.post_attention_layernorm.*``        ``transformer.h.{i}.ln_2.*``                none
``layers.{i}.mlp.dense_h_to_4h.*``               ``transformer.h.{i}.mlp.c_fc.*``            T
``layers.{i}.mlp.dense_4h_to_h.*``               ``transformer.h.{i}.mlp.c_proj.*``          T
``final_layernorm.*``                            ``transformer.ln_f.*``                      none
==============================================  ==========================================  ===============

- T: Hugging Face's ``Conv1D`` stores its weight ``[in, out]``, the transpose of a Linear's.
- QKV order: our fused projection's output rows are ordered ``[head, (q, k, v), head_dim]``
  (``SelfAttention.forward`` views them as ``(heads, 3, head_dim)``), so a contiguous block of rows
  holds whole heads for tensor parallelism; ``c_attn``'s output columns are ``[q | k | v]``, each
  ``[head, head_dim]``.
- Padding: our word embedding has ``padded_vocab_size`` rows (a multiple of 128 x tp), the rows past
  ``vocab_size`` zero and never used; they are dropped on export and added back (zeros) on import.
- The LM head: ours is the word embedding itself; Hugging Face's ``lm_head.weight`` is tied to
  ``wte`` (``tie_word_embeddings``), so the export does not write it and the import checks it.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron.checkpoint.hf import llama as hf_llama
from megatron.checkpoint.hf.common import ConversionError, to_flags
from megatron.checkpoint.hf.mapping import Family, Key, chain, config_in, config_out, renames, rule
from megatron.checkpoint.hf.transforms import CONV1D, QKV_HEADS, VOCAB
from megatron.config.schema import ModelConfig
from megatron.ops.activations import gelu_approximation

__all__ = ["ConversionError", "check_model", "from_hf_state_dict", "hf_config", "model_flags", "name_map",
           "strip_hf_prefix", "to_hf_state_dict"]

LAYER, HF_LAYER = "layers.{}.", "transformer.h.{}."
# our name (after "layers.{}.") -> Hugging Face name (after "transformer.h.{}."), the transform of its weight and bias
_LAYER_NAMES = {
    "input_layernorm": ("ln_1", None),
    "self_attention.query_key_value": ("attn.c_attn", chain(QKV_HEADS, CONV1D)),
    "self_attention.dense": ("attn.c_proj", CONV1D),
    "post_attention_layernorm": ("ln_2", None),
    "mlp.dense_h_to_4h": ("mlp.c_fc", CONV1D),
    "mlp.dense_4h_to_h": ("mlp.c_proj", CONV1D),
}
RULES = (rule("embedding.word_embeddings.weight", "transformer.wte.weight", VOCAB),
         rule("embedding.position_embeddings.weight", "transformer.wpe.weight"),
         *[r for ours, (theirs, transform) in _LAYER_NAMES.items()
           for r in renames({f"{ours}.weight": f"{theirs}.weight", f"{ours}.bias": f"{theirs}.bias"},
                            *([transform] if transform else []), ours=LAYER, theirs=HF_LAYER)],
         *renames({"final_layernorm.weight": "transformer.ln_f.weight",
                   "final_layernorm.bias": "transformer.ln_f.bias"}))
# Our activation: F.gelu(approximate="tanh"), or exact with --no-bias-gelu-fusion (ops.activations.gelu_approximation).
# Hugging Face's names for the same functions.
ACTIVATION = "gelu_new"
_SAME_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
_EXACT_ACTIVATIONS = ("gelu", "gelu_python")
# Buffers some Hugging Face GPT-2 checkpoints carry (the causal mask), which are not weights.
_BUFFERS = (".attn.bias", ".attn.masked_bias")


def name_map(num_layers: int) -> dict[str, str]:
    """Our global parameter name -> the Hugging Face name, for every parameter of the model."""
    return {ours: theirs for ours, (theirs,) in FAMILY.name_map(SimpleNamespace(num_layers=num_layers)).items()}


def check_model(model_cfg: ModelConfig) -> None:
    """ConversionError unless our ``ModelConfig`` is GPT-2-shaped: learned positions, LayerNorm, GELU MLP,
    one key/value head per query head of hidden_size / heads channels, tied head, biases."""
    m = model_cfg
    heads = m.num_attention_heads
    groups = (m.num_query_groups or heads) if m.group_query_attention else heads
    for differs, setting in (
            (m.position_embedding_type != "learned_absolute", f"position_embedding_type {m.position_embedding_type}"),
            (m.normalization != "LayerNorm", f"normalization {m.normalization}"),
            (m.swiglu, "swiglu"),
            (m.squared_relu, "squared_relu"),
            (groups != heads, f"num_query_groups {groups} (grouped-query attention)"),
            (m.kv_channels not in (None, m.hidden_size // heads), f"kv_channels {m.kv_channels}"),
            (m.untie_embeddings_and_output_weights, "untie_embeddings_and_output_weights"),
            (m.disable_bias_linear, "disable_bias_linear"),
            (m.qk_layernorm, "qk_layernorm"),
            (m.multi_latent_attention, "multi_latent_attention")):
        if differs:
            raise ConversionError(f"{setting} has no Hugging Face GPT-2 equivalent, and a Llama export needs rope, "
                                  f"RMSNorm and swiglu together.")


def strip_hf_prefix(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Normalise a Hugging Face GPT-2 state dict: ``GPT2Model`` keys (``h.0...``, as in the original
    ``gpt2`` repository) get the ``transformer.`` prefix; the causal-mask buffers are dropped."""
    out = {}
    for key, value in hf.items():
        if key.endswith(_BUFFERS):
            continue
        if not key.startswith(("transformer.", "lm_head.")):
            key = "transformer." + key
        out[key] = value
    return out


def tied_head(head: torch.Tensor, hf: dict) -> None:
    if not torch.equal(head, hf["transformer.wte.weight"]):
        raise ConversionError("lm_head.weight differs from transformer.wte.weight: the model does not tie its LM "
                              "head to the word embedding, which this GPT always does.")


# the named transforms of the keys that are not a plain copy of one field
def _eod(m: ModelConfig) -> int | None:
    """GPT-2's <|endoftext|>, when the vocabulary has it; to-hf replaces it with the end-of-document id of the run's
    tokenizer."""
    return 50256 if m.vocab_size > 50256 else None


def _inner(m: ModelConfig) -> int:
    return m.ffn_hidden_size or 4 * m.hidden_size


def _inner_in(config: dict) -> int | None:
    """``n_inner``, or (null or absent) GPT-2's default of 4 x ``n_embd``."""
    hidden = HIDDEN.value_in(config)
    return config.get("n_inner") or (4 * hidden if hidden else None)


def _activation(m: ModelConfig) -> str:
    return ACTIVATION if gelu_approximation(m) == "tanh" else _EXACT_ACTIVATIONS[0]


def _activation_in(activation: str) -> bool:
    """Our ``bias_gelu_fusion`` (the tanh approximation) for ``activation_function``; ConversionError for another
    function than GELU."""
    if activation not in _SAME_ACTIVATIONS + _EXACT_ACTIVATIONS:
        raise ConversionError(f"activation_function {activation!r} is neither the tanh-approximated GELU "
                              f"({' or '.join(_SAME_ACTIVATIONS)}) nor the exact one "
                              f"({' or '.join(_EXACT_ACTIVATIONS)}) this GPT computes.")
    return activation in _SAME_ACTIVATIONS


HIDDEN = Key("n_embd", "hidden_size", aliases=("hidden_size",))
# config.json <-> our ModelConfig, both ways (a key with ``export`` only is constant or derived, written only; the
# import also reads each key under the name transformers gives it: ``hidden_size`` for ``n_embd``, ...)
KEYS = (
    Key("architectures", export=lambda m: ["GPT2LMHeadModel"]),
    Key("model_type", export=lambda m: "gpt2"),
    hf_llama.KEY["vocab_size"],
    Key("n_positions", "max_position_embeddings", aliases=("max_position_embeddings",)),
    HIDDEN,
    Key("n_layer", "num_layers", aliases=("num_hidden_layers",)),
    Key("n_head", "num_attention_heads", aliases=("num_attention_heads",)),
    Key("n_inner", "ffn_hidden_size", export=_inner, read=_inner_in),
    Key("activation_function", "bias_gelu_fusion", export=_activation, from_hf=_activation_in, default=ACTIVATION),
    Key("resid_pdrop", "hidden_dropout_prob", default=0.1),
    Key("embd_pdrop", export=lambda m: m.hidden_dropout_prob),
    Key("attn_pdrop", "attention_probs_dropout_prob", default=0.1),
    Key("layer_norm_epsilon", "layernorm_epsilon", default=1e-5),
    hf_llama.KEY["initializer_range"],
    Key("scale_attn_weights", export=lambda m: True),
    Key("scale_attn_by_inverse_layer_idx", export=lambda m: False),
    Key("reorder_and_upcast_attn", export=lambda m: False),
    Key("tie_word_embeddings", export=lambda m: True),
    Key("bos_token_id", export=_eod),
    Key("eos_token_id", export=_eod),
    hf_llama.KEY["use_cache"],
    hf_llama.KEY["torch_dtype"],
)
# what the import reads, in the order of its flags
_FIELDS = ("hidden_size", "num_layers", "num_attention_heads", "vocab_size", "max_position_embeddings",
           "ffn_hidden_size", "layernorm_epsilon", "hidden_dropout_prob", "attention_probs_dropout_prob",
           "initializer_range")


def hf_config(model_cfg, dtype: str = "float32") -> dict:
    """``config.json`` of the equivalent ``GPT2LMHeadModel``."""
    check_model(model_cfg)
    return {**config_out(KEYS, model_cfg), "torch_dtype": dtype}


def model_flags(config: dict) -> list[str]:
    """Our command-line flags for the model of a Hugging Face GPT-2 ``config.json`` (refuses what our
    GPT cannot represent)."""
    if config.get("model_type", "gpt2") != "gpt2":
        raise ConversionError(f"config.json describes a {config.get('model_type')!r} model, not gpt2.")
    fused = config_in(KEYS, config, ("bias_gelu_fusion",))["bias_gelu_fusion"]
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False), ("tie_word_embeddings", True)):
        if config.get(key, want) != want:
            raise ConversionError(f"config.json sets {key}={config[key]}; this GPT supports only {want}.")
    values = config_in(KEYS, config, _FIELDS)
    missing = [k for k, v in values.items() if v is None]
    if missing:
        raise ConversionError(f"config.json lacks {', '.join(missing)} (n_embd, n_layer, n_head, vocab_size, "
                              f"n_positions).")
    return to_flags(values) + ([] if fused else ["--no-bias-gelu-fusion"])


FAMILY = Family("gpt2", RULES, KEYS, check_model, strip_hf_prefix, "transformer.wte.weight", "lm_head.weight",
                tied_head)
to_hf_state_dict, from_hf_state_dict = FAMILY.to_hf_state_dict, FAMILY.from_hf_state_dict
