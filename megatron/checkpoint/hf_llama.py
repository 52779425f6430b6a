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

from megatron.checkpoint.hf_common import (
    ConversionError,
    check_names,
    check_vocab_shape,
    pad_vocab,
    to_flags,
    unpad_vocab,
)
from megatron.config.schema import ModelConfig

WTE, HEAD = "embedding.word_embeddings.weight", "output_layer.weight"
HF_WTE, HF_HEAD = "model.embed_tokens.weight", "lm_head.weight"
_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")  # the same name after "[model.]layers.{i}."
# our linear (after "layers.{i}.") -> Hugging Face's (after "model.layers.{i}."), one to one
_LINEARS = {"self_attention.dense": "self_attn.o_proj", "mlp.dense_4h_to_h": "mlp.down_proj"}
_QKV, _H_TO_4H = "self_attention.query_key_value", "mlp.dense_h_to_4h"
_HINT = "check num_hidden_layers, attention_bias / mlp_bias and tie_word_embeddings"
# Buffers older Hugging Face Llama checkpoints carry, which are not weights.
_BUFFERS = ("rotary_emb.inv_freq",)
ACTIVATION = "silu"


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
            (m.multi_latent_attention, "multi-latent attention", "query/key/value projections per head")):
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


def name_map(model_cfg: ModelConfig) -> dict[str, list[str]]:
    """Our global parameter name -> the Hugging Face name(s) it holds, for every parameter of the model."""
    m = model_cfg
    suffixes = ("weight",) if m.disable_bias_linear else ("weight", "bias")
    names = {WTE: [HF_WTE]}
    for i in range(m.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for norm in _NORMS:
            names[ours + norm] = [theirs + norm]
        for suffix in suffixes:
            for a, b in _LINEARS.items():
                names[f"{ours}{a}.{suffix}"] = [f"{theirs}{b}.{suffix}"]
            names[f"{ours}{_QKV}.{suffix}"] = [f"{theirs}self_attn.{p}_proj.{suffix}" for p in "qkv"]
            names[f"{ours}{_H_TO_4H}.{suffix}"] = [f"{theirs}mlp.{p}_proj.{suffix}" for p in ("gate", "up")]
    names["final_layernorm.weight"] = ["model.norm.weight"]
    if m.untie_embeddings_and_output_weights:
        names[HEAD] = [HF_HEAD]
    return names


def _qkv_to_hf(t: torch.Tensor, nq: int, ng: int) -> list[torch.Tensor]:
    """Rows ``[ng, (r q, k, v), hd]`` -> q ``[nq * hd]``, k and v ``[ng * hd]`` rows (any trailing dims)."""
    r, rest = nq // ng, t.shape[1:]
    groups = t.reshape(ng, r + 2, -1, *rest)
    return [groups[:, :r].reshape(-1, *rest), groups[:, r].reshape(-1, *rest), groups[:, r + 1].reshape(-1, *rest)]


def _qkv_from_hf(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, nq: int, ng: int) -> torch.Tensor:
    r, rest = nq // ng, q.shape[1:]
    parts = (q.reshape(ng, r, -1, *rest), k.reshape(ng, 1, -1, *rest), v.reshape(ng, 1, -1, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def to_hf_state_dict(tensors: dict[str, torch.Tensor], model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our global tensors (``{name: full tensor}``, e.g. a checkpoint's masters) -> a ``LlamaForCausalLM``
    state dict (``lm_head.weight`` only when untied), every tensor contiguous and in its own storage."""
    check_model(model_cfg)
    return map_to_hf(tensors, name_map(model_cfg), model_cfg)


def _is_gate_up(ours: str) -> bool:
    """Whether our parameter is an MLP's (or an expert's) ``dense_h_to_4h`` of interleaved gate/up rows."""
    return ours.rsplit(".", 1)[0].endswith("dense_h_to_4h")


def map_to_hf(tensors: dict[str, torch.Tensor], names: dict[str, list[str]],
              model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``to_hf_state_dict`` by the name map ``names`` (ours -> Hugging Face's, as ``name_map``; a mapping built on
    this one, ``hf_mixtral``, adds its own names): the word embedding and head unpadded, the fused query/key/value
    split by group, an interleaved ``dense_h_to_4h`` split into its gate and up rows, the rest as they are."""
    check_names(set(tensors), set(names), "the checkpoint's tensors", "check num_layers")
    nq, ng, _ = dims(model_cfg)
    out = {}
    for ours, theirs in names.items():
        t = tensors[ours]
        if ours in (WTE, HEAD):
            parts = [unpad_vocab(t, model_cfg.vocab_size, ours)]
        elif _QKV in ours:
            parts = _qkv_to_hf(t, nq, ng)
        elif _is_gate_up(ours):
            pairs = t.reshape(-1, 2, *t.shape[1:])  # row 2j: gate_j, row 2j + 1: up_j
            parts = [pairs[:, 0], pairs[:, 1]]
        else:
            parts = [t]
        out.update({name: part.contiguous().clone() for name, part in zip(theirs, parts)})
    return out


def strip_hf_prefix(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Normalise a Hugging Face Llama state dict: ``LlamaModel`` keys (``layers.0...``) get the
    ``model.`` prefix; rotary ``inv_freq`` buffers are dropped."""
    return {key if key.startswith(("model.", "lm_head.")) else "model." + key: value
            for key, value in hf.items() if not key.endswith(_BUFFERS)}


def from_hf_state_dict(hf: dict[str, torch.Tensor], model_cfg: ModelConfig,
                       padded_vocab: int) -> dict[str, torch.Tensor]:
    """A ``LlamaForCausalLM`` (or ``LlamaModel``) state dict -> our global tensors (fp32, the word
    embedding and an untied output layer zero-padded to ``padded_vocab`` rows). With a tied head
    (``untie_embeddings_and_output_weights`` off), an ``lm_head.weight`` must equal the embedding."""
    check_model(model_cfg)
    return map_from_hf(strip_hf_prefix(hf), name_map(model_cfg), model_cfg, padded_vocab, _HINT)


def map_from_hf(hf: dict[str, torch.Tensor], names: dict[str, list[str]], model_cfg: ModelConfig,
                padded_vocab: int, hint: str) -> dict[str, torch.Tensor]:
    """``from_hf_state_dict`` by the name map ``names`` (see ``map_to_hf``) of a state dict whose keys carry the
    ``model.`` prefix; ``hint`` ends the message of a state dict that does not match the names."""
    hf = dict(hf)
    tied_head = None if model_cfg.untie_embeddings_and_output_weights else hf.pop(HF_HEAD, None)
    check_names(set(hf), {name for theirs in names.values() for name in theirs}, "the Hugging Face state dict", hint)
    vocab, hidden = model_cfg.vocab_size, model_cfg.hidden_size
    check_vocab_shape(hf[HF_WTE], HF_WTE, vocab, hidden, padded_vocab)
    if HF_HEAD in hf:
        check_vocab_shape(hf[HF_HEAD], HF_HEAD, vocab, hidden, padded_vocab)
    if tied_head is not None and not torch.equal(tied_head, hf[HF_WTE]):
        raise ConversionError("lm_head.weight differs from model.embed_tokens.weight although config.json ties them "
                              "(tie_word_embeddings); set tie_word_embeddings false to import an untied head.")
    nq, ng, _ = dims(model_cfg)
    out = {}
    for ours, theirs in names.items():
        parts = [hf[name].to(torch.float32) for name in theirs]
        if ours in (WTE, HEAD):
            t = pad_vocab(parts[0], padded_vocab)
        elif _QKV in ours:
            t = _qkv_from_hf(*parts, nq, ng)
        elif _is_gate_up(ours):
            t = torch.stack(parts, dim=1).reshape(-1, *parts[0].shape[1:])
        else:
            t = parts[0]
        out[ours] = t.contiguous().clone()
    return out


def hf_config(model_cfg: ModelConfig, dtype: str = "float32", moe: bool = False, qk_norm: bool = False) -> dict:
    """``config.json`` of the equivalent ``LlamaForCausalLM``; ``moe``: without the keys only Llama has (the base
    of the Mixtral, Qwen-MoE and Qwen3 configs); ``qk_norm``: as ``check_model``'s."""
    check_model(model_cfg, qk_norm=qk_norm)
    m = model_cfg
    nq, ng, hd = dims(m)
    bias = not m.disable_bias_linear
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": nq,
        "num_key_value_heads": ng,
        "head_dim": hd,
        "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": m.layernorm_epsilon,
        "rope_theta": float(m.rotary_base),
        "rope_scaling": None,
        "hidden_act": ACTIVATION,
        "attention_bias": bias,
        "mlp_bias": bias,
        "attention_dropout": m.attention_probs_dropout_prob,
        "initializer_range": m.initializer_range,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "bos_token_id": None,  # to-hf sets both to the end-of-document id of the run's tokenizer
        "eos_token_id": None,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if moe:
        for llama_only in ("attention_bias", "mlp_bias", "pretraining_tp"):
            del cfg[llama_only]
    return cfg


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
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (hidden // heads if hidden and heads else None)
    values = {
        "hidden_size": hidden,
        "num_layers": config.get("num_hidden_layers"),
        "num_attention_heads": heads,
        "vocab_size": config.get("vocab_size"),
        "max_position_embeddings": config.get("max_position_embeddings"),
        "ffn_hidden_size": config.get("intermediate_size"),
    }
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
        "layernorm_epsilon": config.get("rms_norm_eps", 1e-6),
        "group_query_attention": kv_heads != heads,
        "num_query_groups": kv_heads if kv_heads != heads else None,
        "kv_channels": head_dim if head_dim * heads != hidden else None,
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "disable_bias_linear": not attention_bias,
        "hidden_dropout_prob": 0.0,  # Llama has no residual dropout
        "attention_probs_dropout_prob": config.get("attention_dropout", 0.0),
        "initializer_range": config.get("initializer_range", 0.02),
    })
    return {k: v for k, v in values.items() if v is not None}
