"""Megatron-LM's saved ``args`` (an ``argparse.Namespace``) <-> our model configuration.

``model_flags(args)``: the Megatron-LM command-line flags of the saved model's shape (which ``parse_config``
accepts: ours are Megatron's, ``megatron.config.megatron_flags``); ConversionError, naming the setting, for what
our GPT does not build (``--squared-relu``, zero-centred LayerNorm, grouped-GEMM experts, ...).
``to_args(model, ...)``: the Namespace a ``to-megatron`` export saves, with the fields Megatron-LM's
``--use-checkpoint-args`` reads and those ``from-megatron`` reads back.

Multi-latent attention (DeepSeek-V2/V3) is carried by its own fields, the same names on both sides
(``multi_latent_attention``, ``q_lora_rank``, ``kv_lora_rank``, ``qk_head_dim``, ``qk_pos_emb_head_dim``,
``v_head_dim``, ``qk_layernorm``, and YaRN's ``rope_type``, ``rotary_scaling_factor``, ``mscale``,
``mscale_all_dim``, ``original_max_position_embeddings``); an MLA model's ``kv_channels``, query groups,
``rotary_percent`` / ``rotary_interleaved`` shape nothing (its heads are the widths above) and are not carried in.
Multi-token prediction by ``mtp_num_layers`` and ``mtp_loss_scaling_factor``; DeepSeek-V3's router by the
``moe_router_*`` fields and ``moe_layer_freq`` (its dense first layers: a list).
"""

from __future__ import annotations

import argparse

import torch

from megatron.checkpoint.hf_common import ConversionError
from megatron.config.schema import ModelConfig, padded_vocab_size
from megatron.config.validate_moe import moe_layer_pattern

# Megatron arg -> our ModelConfig field, the same value on both sides.
_SAME = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
         "position_embedding_type", "rotary_base", "rotary_percent", "rotary_interleaved", "normalization", "swiglu",
         "group_query_attention", "num_query_groups", "kv_channels", "untie_embeddings_and_output_weights",
         "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_pre_softmax",
         "moe_router_score_function", "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
         "moe_router_enable_expert_bias", "moe_expert_capacity_factor", "moe_token_drop_policy",
         "moe_pad_expert_input_to_capacity", "moe_shared_expert_intermediate_size", "moe_token_dispatcher_type",
         "moe_router_bias_update_rate", "moe_router_dtype", "moe_router_num_groups", "moe_router_group_topk",
         "moe_router_topk_scaling_factor", "qk_layernorm", "multi_latent_attention")
# multi-latent attention's own (with multi_latent_attention only), and multi-token prediction's
_MLA = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
        "rotary_scaling_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings")
_NOT_MLA = ("kv_channels", "group_query_attention", "num_query_groups", "rotary_percent", "rotary_interleaved")
_MTP = ("mtp_num_layers", "mtp_loss_scaling_factor")
# a runtime choice, not the network's: carried only when ours has it (Megatron's flex dispatcher has no weights)
_DISPATCHERS = ("alltoall", "allgather")
# Megatron settings that change the network or its parameters' names, which our GPT does not build.
_REFUSED = {"squared_relu": "the squared-ReLU MLP (--squared-relu)",
            "apply_layernorm_1p": "zero-centred LayerNorm (--apply-layernorm-1p)",
            "moe_grouped_gemm": "grouped-GEMM experts (--moe-grouped-gemm: other parameter names)",
            "add_qkv_bias_only": "a bias on the QKV projection only (--add-qkv-bias without linear biases)"}


def model_flags(args: argparse.Namespace) -> list[str]:
    """Megatron-LM flags for the model of a checkpoint's saved ``args``."""
    a = vars(args)
    refused = dict(a, add_qkv_bias_only=bool(a.get("add_qkv_bias")) and not a.get("add_bias_linear", True))
    for name, what in _REFUSED.items():
        if refused.get(name):
            raise ConversionError(f"the checkpoint's model uses {what}, which this GPT does not build.")
    missing = [n for n in ("num_layers", "hidden_size", "num_attention_heads") if not a.get(n)]
    if missing:
        raise ConversionError(f"the checkpoint's args lack {', '.join(missing)}; they give the model's shape.")
    mla = bool(a.get("multi_latent_attention"))
    if mla:
        _check_mla_rope(a)
    names = [n for n in (*_SAME, *(_MLA if mla else ()), *(_MTP if a.get("mtp_num_layers") else ()))
             if not (mla and n in _NOT_MLA)]
    flags: list[str] = []
    for name in names:
        value = a.get(name)
        if value is None or value is False or (name == "num_query_groups" and not a.get("group_query_attention")):
            continue
        if name == "kv_channels" and value * a["num_attention_heads"] == a["hidden_size"]:
            continue  # the default
        if name == "moe_token_dispatcher_type" and value not in _DISPATCHERS:
            continue
        if name == "position_embedding_type" and mla and value in ("rope", "yarn"):
            value = "rope"  # multi-latent attention's own rotary channels (rope_type says which)
        elif name == "position_embedding_type" and value not in ("learned_absolute", "rope"):
            raise ConversionError(f"position_embedding_type {value!r} is not converted (learned_absolute, rope).")
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    layer_freq = a.get("moe_layer_freq")
    if a.get("num_experts") and layer_freq is not None:
        flags += ["--moe-layer-freq", str(layer_freq).replace(" ", "")]
    eps = a.get("norm_epsilon", a.get("layernorm_epsilon"))
    if eps is not None:
        flags += ["--norm-epsilon", str(eps)]
    for name in ("hidden_dropout", "attention_dropout", "init_method_std"):  # Megatron's flag names
        if a.get(name) is not None:
            flags += ["--" + name.replace("_", "-"), str(a[name])]
    if not a.get("add_bias_linear", True):
        flags.append("--disable-bias-linear")
    if not a.get("bias_gelu_fusion", True):  # Megatron Core's exact GELU (blocks.gelu_approximation)
        flags.append("--no-bias-gelu-fusion")
    flags += ["--vocab-size", str(vocab_size(args))]
    if a.get("seq_length"):
        flags += ["--seq-length", str(a["seq_length"])]
    return flags


def _check_mla_rope(a: dict) -> None:
    """Multi-latent attention's rotary settings that Megatron Core reads and this GPT does not build: YaRN's ramp
    other than (beta_fast 32, beta_slow 1), and with plain rope a rotary_percent other than 1."""
    for name, default in (("beta_fast", 32), ("beta_slow", 1)):
        if a.get(name, default) != default:
            raise ConversionError(f"the checkpoint's YaRN has {name} {a[name]}; this GPT builds {default} only.")
    if a.get("rope_type") == "rope" and a.get("rotary_percent", 1.0) != 1.0:
        raise ConversionError(f"the checkpoint's multi-latent attention rotates {a['rotary_percent']} of its rotary "
                              f"channels (rotary_percent); this GPT rotates them all.")


def vocab_size(args: argparse.Namespace) -> int:
    """The vocabulary: ``args.vocab_size`` when the run gave it, else the saved padded size (Megatron-LM keeps the
    tokenizer's size only in its padding; the extra rows are ids no tokenizer produces)."""
    size = getattr(args, "vocab_size", None) or getattr(args, "padded_vocab_size", None)
    if not size:
        raise ConversionError("the checkpoint's args have neither vocab_size nor padded_vocab_size.")
    return int(size)


def to_args(model: ModelConfig, *, tp: int, pp: int, seq_length: int, iteration: int,
            consumed_train_samples: int) -> argparse.Namespace:
    """The ``args`` of a legacy export of ``model`` cut for ``tp`` x ``pp`` (Megatron Core model, ``torch``
    format, expert parallelism 1)."""
    values = {name: getattr(model, name) for name in (*_SAME, *_MLA, *_MTP)}
    if model.multi_latent_attention:
        from megatron.model.mla import mla_rope_type

        values["rope_type"] = mla_rope_type(model)  # explicit: Megatron's default differs by attention
    nq, hd = model.num_attention_heads, model.kv_channels or model.hidden_size // model.num_attention_heads
    values.update(
        ffn_hidden_size=model.ffn_hidden_size, kv_channels=hd,
        num_query_groups=model.num_query_groups if model.group_query_attention else nq,
        moe_layer_freq=[int(x) for x in moe_layer_pattern(model.moe_layer_freq, model.num_layers)] if model.num_experts
        else 1,
        norm_epsilon=model.layernorm_epsilon, add_bias_linear=not model.disable_bias_linear,
        add_qkv_bias=not model.disable_bias_linear, share_embeddings_and_output_weights=not
        model.untie_embeddings_and_output_weights, vocab_size=model.vocab_size,
        make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
        padded_vocab_size=padded_vocab_size(model.vocab_size, tp, model.make_vocab_size_divisible_by),
        seq_length=seq_length, hidden_dropout=model.hidden_dropout_prob,
        attention_dropout=model.attention_probs_dropout_prob, init_method_std=model.initializer_range,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, use_mcore_models=True, transformer_impl="local",
        ckpt_format="torch", moe_grouped_gemm=False, squared_relu=False,
        bias_gelu_fusion=model.bias_gelu_fusion, openai_gelu=False, params_dtype=torch.float32,
        iteration=iteration, consumed_train_samples=consumed_train_samples, consumed_valid_samples=0)
    return argparse.Namespace(**values)
