"""Our Llama-shaped GPT parameters <-> Hugging Face Llama (``transformers.LlamaForCausalLM``).

Llama-shaped: ``position_embedding_type rope`` (``rotary_percent`` 1), ``normalization RMSNorm`` and
``swiglu``, with any number of key/value groups, head width, tied or untied head, with or without
linear biases. Both are then the same network (pre-RMSNorm decoder, rotary embeddings in the
``rotate_half`` convention with ``inv_freq = rotary_base ** -(arange(0, hd, 2) / hd)``, SwiGLU MLP
``down(silu(gate(x)) * up(x))``, grouped-query attention scaled by ``1 / sqrt(hd)``); only names and
layouts differ (``hd`` = kv_channels, ``nq`` query heads, ``ng`` key/value groups, ``r = nq / ng``):

===============================================  ====================================================  ==============
ours (global name, ``[out, in]`` Linear)         Hugging Face                                          layout change
===============================================  ====================================================  ==============
``embedding.word_embeddings.weight [Vp, h]``     ``model.embed_tokens.weight [V, h]``                  padding rows
``layers.{i}.input_layernorm.weight``            ``model.layers.{i}.input_layernorm.weight``           none
``layers.{i}.self_attention.query_key_value.*``  ``model.layers.{i}.self_attn.{q,k,v}_proj.*``         split by group
``layers.{i}.self_attention.dense.*``            ``model.layers.{i}.self_attn.o_proj.*``               none
``layers.{i}.post_attention_layernorm.weight``   ``model.layers.{i}.post_attention_layernorm.weight``  none
``layers.{i}.mlp.dense_h_to_4h.*``               ``model.layers.{i}.mlp.{gate,up}_proj.*``             interleaved
``layers.{i}.mlp.dense_4h_to_h.*``               ``model.layers.{i}.mlp.down_proj.*``                  none
``final_layernorm.weight``                       ``model.norm.weight``                                 none
``output_layer.weight [Vp, h]`` (untied only)    ``lm_head.weight [V, h]``                             padding rows
===============================================  ====================================================  ==============

- Split by group: our fused projection's output rows are ``[ng, (r queries, key, value), hd]`` (a
  tensor-parallel rank's block of rows holds whole groups); ``q_proj``'s rows are ``[nq, hd]`` with
  query head ``j`` in group ``j // r`` (Hugging Face's ``repeat_kv``), ``k_proj`` and ``v_proj``'s
  ``[ng, hd]``. Both use the same rotary convention, so no row is permuted within a head.
- Interleaved: our ``dense_h_to_4h`` rows alternate ``gate_j, up_j`` (row ``2j`` is ``gate_proj`` row
  ``j``, row ``2j + 1`` is ``up_proj`` row ``j``), so a contiguous block of rows holds whole pairs.
- Biases (``.bias``, same row layout as the weight) exist on every projection unless
  ``disable_bias_linear``: Hugging Face ``attention_bias = mlp_bias = not disable_bias_linear``.
- Padding: the word embedding (and an untied output layer) has ``padded_vocab_size`` rows, the rows
  past ``vocab_size`` zero; they are dropped on export and added back (zeros) on import.
- The LM head: tied (``tie_word_embeddings``), ours is the word embedding and ``lm_head.weight`` is
  not written (on import it must equal ``embed_tokens``); untied, it is ``output_layer.weight``.
"""

from __future__ import annotations

import torch

from megatron.checkpoint.hf.common import ConversionError, to_flags
from megatron.checkpoint.hf.mapping import Family, Key, config_in, config_out, renames, rule
from megatron.checkpoint.hf.transforms import GATE_UP, QKV_GROUPS, VOCAB
from megatron.config.schema import ModelConfig

WTE, HEAD = "embedding.word_embeddings.weight", "output_layer.weight"
HF_WTE, HF_HEAD = "model.embed_tokens.weight", "lm_head.weight"
_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")  # the same name after "[model.]layers.{i}."
_HINT = "check num_hidden_layers, attention_bias / mlp_bias and tie_word_embeddings"
# Buffers older Hugging Face Llama checkpoints carry, which are not weights.
_BUFFERS = ("rotary_emb.inv_freq",)
ACTIVATION = "silu"
LAYER, HF_LAYER = "layers.{}.", "model.layers.{}."


def untied(m: ModelConfig) -> bool:
    return bool(m.untie_embeddings_and_output_weights)


def biased(m: ModelConfig) -> bool:
    return not m.disable_bias_linear


WORD_EMBEDDING = rule(WTE, HF_WTE, VOCAB)
# the final norm and an untied head, after the layers
FINAL = [rule("final_layernorm.weight", "model.norm.weight"), rule(HEAD, HF_HEAD, VOCAB, when=untied)]
NORMS = renames({norm: norm for norm in _NORMS}, ours=LAYER, theirs=HF_LAYER)


def attention(suffix: str, when=None) -> tuple[list, list]:
    """The attention's ``suffix`` (weight, bias) tensors: (the output, the fused query/key/value split by group)."""
    return ([rule(f"{LAYER}self_attention.dense.{suffix}", f"{HF_LAYER}self_attn.o_proj.{suffix}", when=when)],
            [rule(f"{LAYER}self_attention.query_key_value.{suffix}",
                  tuple(f"{HF_LAYER}self_attn.{p}_proj.{suffix}" for p in "qkv"), QKV_GROUPS, when=when)])


def mlp(suffix: str, layers=None, ours: str = LAYER + "mlp.", theirs: str = HF_LAYER + "mlp.",
        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), when=None) -> tuple[list, list]:
    """A SwiGLU MLP's ``suffix`` tensors (``ours`` / ``theirs``: its prefixes; ``names``: Hugging Face's gate, up and
    down projections): (the down projection as it is, the interleaved gate/up rows split)."""
    gate, up, down = names
    kw = {"when": when, **({"layers": layers} if layers is not None else {})}
    return ([rule(f"{ours}dense_4h_to_h.{suffix}", f"{theirs}{down}.{suffix}", **kw)],
            [rule(f"{ours}dense_h_to_4h.{suffix}", (f"{theirs}{gate}.{suffix}", f"{theirs}{up}.{suffix}"), GATE_UP,
                  **kw)])


def decoder(mlp_layers=None, bias=biased) -> list:
    """A layer's rules in our checkpoints' order: the norms, then per suffix the output projections, the fused
    query/key/value and gate/up (``mlp_layers``: the layers with a dense MLP, default every one; False: none)."""
    rules = list(NORMS)
    for suffix, when in (("weight", None), ("bias", bias)):
        (dense, qkv), (down, gate_up) = attention(suffix, when), mlp(suffix, mlp_layers, when=when)
        rules += [*dense, *(down if mlp_layers is not False else []), *qkv,
                  *(gate_up if mlp_layers is not False else [])]
    return rules


RULES = (WORD_EMBEDDING, *decoder(), *FINAL)


def tied_head(head: torch.Tensor, hf: dict) -> None:
    if not torch.equal(head, hf[HF_WTE]):
        raise ConversionError("lm_head.weight differs from model.embed_tokens.weight although config.json ties them "
                              "(tie_word_embeddings); set tie_word_embeddings false to import an untied head.")


def is_llama_shaped(model_cfg: ModelConfig) -> bool:
    """Whether our ``ModelConfig`` asks for any of Llama's three marks (rope, RMSNorm, swiglu): such a
    model exports to Llama (``check_model`` then says if a setting does not fit) and never to GPT-2."""
    m = model_cfg
    return m.position_embedding_type == "rope" or m.normalization == "RMSNorm" or bool(m.swiglu)


def check_model(model_cfg: ModelConfig, family: str = "Llama", architecture: str = "LlamaForCausalLM",
                qk_norm: bool = False) -> None:
    """ConversionError, naming the setting, unless our ``ModelConfig`` is Llama-shaped (the message names
    ``family`` and its ``architecture``: Mixtral's decoder is Llama's); ``qk_norm``: the family normalises each
    head's queries and keys (Qwen3: ``hf_qwen3``), which then must be on."""
    m = model_cfg
    for differs, setting, llama in (
            (m.position_embedding_type != "rope", f"position_embedding_type {m.position_embedding_type}",
             "rotary embeddings (rope)"),
            (m.normalization != "RMSNorm", f"normalization {m.normalization}", "RMSNorm"),
            (not m.swiglu, "a GELU MLP (swiglu off)", "a SwiGLU MLP"),
            (m.rotary_percent != 1.0, f"rotary_percent {m.rotary_percent}", "rotary embeddings on every channel"),
            (m.rotary_interleaved, "rotary_interleaved", "rotary embeddings on the halves of each head"),
            (m.qk_layernorm != qk_norm, f"qk_layernorm {'on' if m.qk_layernorm else 'off'} (a norm on each head's "
             f"queries and keys)", "it" if qk_norm else "none"),
            (m.multi_latent_attention, "multi-latent attention", "query/key/value projections per head"),
            (m.disable_bias_linear and m.add_qkv_bias, "add_qkv_bias (a bias on the query/key/value projection alone, "
             "Qwen2's)", "biases on every projection or on none")):
        if differs:
            raise ConversionError(f"{setting} has no Hugging Face {family} equivalent ({architecture} uses {llama}), "
                                  f"so this checkpoint cannot be exported.")


def dims(model_cfg: ModelConfig) -> tuple[int, int, int]:
    """(nq query heads, ng key/value groups, hd channels per head) of our ``ModelConfig``."""
    m = model_cfg
    nq = m.num_attention_heads
    ng = (m.num_query_groups or nq) if m.group_query_attention else nq
    hd = m.kv_channels or m.hidden_size // nq
    if nq % ng:
        raise ConversionError(f"num_query_groups ({ng}) must divide num_attention_heads ({nq}).")
    return nq, ng, hd


def strip_hf_prefix(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Normalise a Hugging Face Llama state dict: ``LlamaModel`` keys (``layers.0...``) get the
    ``model.`` prefix; rotary ``inv_freq`` buffers are dropped."""
    return {key if key.startswith(("model.", "lm_head.")) else "model." + key: value
            for key, value in hf.items() if not key.endswith(_BUFFERS)}


# config.json <-> our ModelConfig, both ways (a key with ``export`` only is derived or constant, written only)
KEYS = (
    Key("architectures", export=lambda m: ["LlamaForCausalLM"]),
    Key("model_type", export=lambda m: "llama"),
    Key("vocab_size", "vocab_size"),
    Key("hidden_size", "hidden_size"),
    Key("intermediate_size", "ffn_hidden_size"),
    Key("num_hidden_layers", "num_layers"),
    Key("num_attention_heads", "num_attention_heads"),
    Key("num_key_value_heads", export=lambda m: dims(m)[1]),
    Key("head_dim", export=lambda m: dims(m)[2]),
    Key("max_position_embeddings", "max_position_embeddings"),
    Key("rms_norm_eps", "layernorm_epsilon", default=1e-6),
    Key("rope_theta", export=lambda m: float(m.rotary_base)),  # read back by _rope (which refuses any scaling)
    Key("rope_scaling", export=lambda m: None),
    Key("hidden_act", export=lambda m: ACTIVATION),
    Key("attention_bias", export=biased),
    Key("mlp_bias", export=biased),
    Key("attention_dropout", "attention_probs_dropout_prob", default=0.0),
    Key("initializer_range", "initializer_range", default=0.02),
    Key("tie_word_embeddings", "untie_embeddings_and_output_weights", to_hf=lambda v: not v,
        from_hf=lambda v: not v, default=False),
    Key("bos_token_id", export=lambda m: None),  # to-hf sets both to the end-of-document id of the run's tokenizer
    Key("eos_token_id", export=lambda m: None),
    Key("pretraining_tp", export=lambda m: 1),
    Key("use_cache", export=lambda m: True),
    Key("torch_dtype", export=lambda m: None),  # hf_config's dtype
)
_LLAMA_ONLY = ("attention_bias", "mlp_bias", "pretraining_tp")
KEY = {k.theirs: k for k in KEYS}  # Llama's keys by name, for the families that share some (gpt2, deepseek_v3, ...)


def hf_config(model_cfg: ModelConfig, dtype: str = "float32", moe: bool = False, qk_norm: bool = False) -> dict:
    """``config.json`` of the equivalent ``LlamaForCausalLM``; ``moe``: without the keys only Llama has (the base
    of the Mixtral, Qwen-MoE and Qwen3 configs); ``qk_norm``: as ``check_model``'s."""
    check_model(model_cfg, qk_norm=qk_norm)
    dims(model_cfg)
    cfg = {**config_out(KEYS, model_cfg), "torch_dtype": dtype}
    return {k: v for k, v in cfg.items() if not (moe and k in _LLAMA_ONLY)}


def _rope(config: dict) -> float:
    """``rope_theta`` of a config.json (legacy ``rope_theta`` / ``rope_scaling`` or transformers 5's
    ``rope_parameters``); ConversionError for any rope scaling."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kinds = {params.get("rope_type"), scaling.get("rope_type") or scaling.get("type")} - {None, "default"}
    if kinds:
        raise ConversionError(f"config.json sets rope scaling ({params or scaling}); this GPT's rotary embedding "
                              f"has no scaling, so the model cannot be imported.")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if float(theta) != int(theta):
        raise ConversionError(f"rope_theta {theta} is not an integer, which rotary_base must be.")
    return int(theta)


def model_flags(config: dict) -> list[str]:
    """Our command-line flags for the model of a Hugging Face Llama ``config.json`` (refuses what our
    GPT cannot represent)."""
    if config.get("model_type", "llama") != "llama":
        raise ConversionError(f"config.json describes a {config.get('model_type')!r} model, not llama.")
    return to_flags(model_values(config))


def model_values(config: dict) -> dict:
    """Our ``ModelConfig`` fields (name -> value, None left out) for the Llama-shaped decoder of a ``config.json``
    (Llama's, or a model built on it: Mixtral); ConversionError for what our GPT cannot represent."""
    act = config.get("hidden_act", ACTIVATION)
    if act != ACTIVATION:
        raise ConversionError(f"hidden_act {act!r} is not this GPT's SwiGLU activation ({ACTIVATION}).")
    attention_bias, mlp_bias = bool(config.get("attention_bias", False)), bool(config.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise ConversionError(f"config.json sets attention_bias={attention_bias} but mlp_bias={mlp_bias}; this GPT "
                              f"has biases on both or on neither (disable_bias_linear).")
    read = config_in(KEYS, config)
    hidden, heads = read["hidden_size"], read["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (hidden // heads if hidden and heads else None)
    values = {k: read[k] for k in _REQUIRED}
    missing = [k for k, v in values.items() if v is None]
    if missing:
        raise ConversionError(f"config.json lacks {', '.join(missing)} (hidden_size, num_hidden_layers, "
                              f"num_attention_heads, vocab_size, max_position_embeddings, intermediate_size).")
    if heads % kv_heads:
        raise ConversionError(f"num_key_value_heads ({kv_heads}) does not divide num_attention_heads ({heads}).")
    values.update({
        "position_embedding_type": "rope",
        "normalization": "RMSNorm",
        "swiglu": True,
        "rotary_base": _rope(config),
        "layernorm_epsilon": read["layernorm_epsilon"],
        "group_query_attention": kv_heads != heads,
        "num_query_groups": kv_heads if kv_heads != heads else None,
        "kv_channels": head_dim if head_dim * heads != hidden else None,
        "untie_embeddings_and_output_weights": read["untie_embeddings_and_output_weights"],
        "disable_bias_linear": not attention_bias,
        "hidden_dropout_prob": 0.0,  # Llama has no residual dropout
        "attention_probs_dropout_prob": read["attention_probs_dropout_prob"],
        "initializer_range": read["initializer_range"],
    })
    return {k: v for k, v in values.items() if v is not None}


_REQUIRED = ("hidden_size", "num_layers", "num_attention_heads", "vocab_size", "max_position_embeddings",
             "ffn_hidden_size")
FAMILY = Family("llama", RULES, KEYS, check_model, strip_hf_prefix, HF_WTE, HF_HEAD, tied_head, hint=_HINT)
name_map, to_hf_state_dict, from_hf_state_dict = FAMILY.name_map, FAMILY.to_hf_state_dict, FAMILY.from_hf_state_dict
