"""Megatron-LM's saved ``args`` (an ``argparse.Namespace``) <-> our model configuration.

``model_flags(args)``: the Megatron-LM command-line flags of the saved model's shape (which ``parse_config``
accepts: ours are Megatron's, ``megatron.config.megatron_flags``); ConversionError, naming the setting, for what
our GPT does not build (``--squared-relu``, zero-centred LayerNorm, one grouped weight for all experts, ...);
``moe_grouped_gemm`` is carried (the same parameters, run as one grouped matmul where it can).
``to_args(model, ...)``: the Namespace a ``to-megatron`` export saves, with the fields Megatron-LM's
``--use-checkpoint-args`` reads and those ``from-megatron`` reads back (``megatron_experts.export_layout`` sets its
expert parallelism, grouped GEMM and spec).

Multi-latent attention (DeepSeek-V2/V3) is carried by its own fields, the same names on both sides
(``multi_latent_attention``, ``q_lora_rank``, ``kv_lora_rank``, ``qk_head_dim``, ``qk_pos_emb_head_dim``,
``v_head_dim``, ``qk_layernorm``, and YaRN's ``rope_type``, ``rotary_scaling_factor``, ``mscale``,
``mscale_all_dim``, ``original_max_position_embeddings``); an MLA model's ``kv_channels``, query groups,
``rotary_percent`` / ``rotary_interleaved`` shape nothing (its heads are the widths above) and are not carried in.
Multi-token prediction by ``mtp_num_layers`` and ``mtp_loss_scaling_factor``; muP by ``use_mup`` and the ``mup_*``
fields (Megatron-LM's newer args; read back only with ``use_mup``); DeepSeek-V3's router by the
``moe_router_*`` fields and ``moe_layer_freq`` (its dense first layers: a list).

gpt-oss's shape (``_gpt_oss_flags``): ``window_size`` (a tuple (LEFT, RIGHT); ours "LEFT,RIGHT", RIGHT 0 only),
``window_attn_skip_freq`` (an int or a 0/1 list; ours its string), ``softmax_type``, ``quick_geglu`` (gated, quick
GELU) with ``glu_linear_offset`` and ``activation_func_clamp_value`` (any gated MLP's), and YaRN on standard
attention (``position_embedding_type`` yarn with ``rotary_scaling_factor``, ``yarn_original_max_position_embeddings``,
``yarn_beta_fast``, ``yarn_beta_slow``, ``yarn_correction_range_round_to_int``, ``mscale``, ``mscale_all_dim``, None
read as Megatron-LM's defaults: ``_apply_yarn_config_from_args``); ``enable_gpt_oss`` (Megatron-LM's ModelOpt
builder) sets gpt-oss's YaRN over them, as that builder does.

``check_saved(head, where)``: the one check of what a Megatron-LM file says about itself, before anything
proportional to it is built, by every reader (``from-megatron``'s and ``checkpoint_info.py``'s): ``args`` a
Namespace, every size in it within ``megatron.config.bounds`` (``MAXIMA`` is keyed by our names, which are
Megatron's; ``padded_vocab_size``, ``seq_length`` and YaRN's original length are bounded as ours), the parallel sizes
whole numbers from 1, and the iteration (``saved_iteration``) a whole number from 0 to ``MAX_STEPS``.
"""

from __future__ import annotations

import argparse

import torch

from megatron.checkpoint.format import CheckpointError
from megatron.checkpoint.hf.common import ConversionError
from megatron.config.bounds import MAX_STEPS, MAXIMA, check_sizes, size_problem
from megatron.config.schema import ModelConfig, padded_vocab_size
from megatron.config.validate_attention import parse_window
from megatron.config.validate_moe import moe_layer_pattern, parse_layer_pattern

# Megatron's sizes that our fields name otherwise (bounds.MAXIMA is keyed by ours)
_MEGATRON_SIZES = {"padded_vocab_size": "vocab_size", "seq_length": "max_seq_len",
                   "yarn_original_max_position_embeddings": "original_max_position_embeddings"}
_PARALLEL_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                   "expert_tensor_parallel_size")
# Megatron arg -> our ModelConfig field, the same value on both sides.
_SAME = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
         "position_embedding_type", "rotary_base", "rotary_percent", "rotary_interleaved", "normalization", "swiglu",
         "group_query_attention", "num_query_groups", "kv_channels", "untie_embeddings_and_output_weights",
         "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_pre_softmax",
         "moe_router_score_function", "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
         "moe_router_enable_expert_bias", "moe_expert_capacity_factor", "moe_token_drop_policy",
         "moe_pad_expert_input_to_capacity", "moe_shared_expert_intermediate_size", "moe_token_dispatcher_type",
         "moe_router_bias_update_rate", "moe_router_dtype", "moe_router_num_groups", "moe_router_group_topk",
         "moe_router_topk_scaling_factor", "qk_layernorm", "multi_latent_attention", "moe_grouped_gemm",
         "apply_layernorm_1p", "squared_relu", "moe_shared_expert_gate")
# multi-latent attention's own (with multi_latent_attention only), and multi-token prediction's
_MLA = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
        "rotary_scaling_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings")
_NOT_MLA = ("kv_channels", "group_query_attention", "num_query_groups", "rotary_percent", "rotary_interleaved")
_MTP = ("mtp_num_layers", "mtp_loss_scaling_factor")
# muP (Megatron-LM's newer --use-mup; read back with use_mup only): the same names on both sides
_MUP = ("use_mup", "mup_base_hidden_size", "mup_embedding_mult", "mup_output_mult", "mup_base_head_dim",
        "mup_attn_scale_power")
# a runtime choice, not the network's: carried only when ours has it (Megatron's flex dispatcher has no weights)
_DISPATCHERS = ("alltoall", "allgather")
# Megatron settings that change the network or its parameters' names, which our GPT does not build.
_REFUSED = {"moe_single_grouped_weight": "one weight for all of a layer's experts (--moe-single-grouped-weight)",
            "moe_single_grouped_bias": "one bias for all of a layer's experts (--moe-single-grouped-bias)",
            "moe_mlp_glu_interleave_size": "interleaved gated expert rows (--moe-mlp-glu-interleave-size)",
            "moe_shared_expert_glu_interleave_size": "interleaved gated shared-expert rows "
                                                     "(--moe-shared-expert-glu-interleave-size)",
            "moe_latent_size": "experts on a latent projection (--moe-latent-size)",
            "add_qkv_bias_only": ("a bias on the QKV projection only (--add-qkv-bias without linear biases; built "
                                  "here, its conversion from Megatron-LM not written)"),
            "use_rope_scaling": "Llama 3's rope scaling (--use-rope-scaling)",
            "no_rope_freq": "layers without rotary embeddings (--no-rope-freq)",
            "rotary_seq_len_interpolation_factor": "interpolated rotary positions "
                                                   "(--rotary-seq-len-interpolation-factor)",
            "experimental_attention_variant": "an experimental attention variant (Gated DeltaNet or DeepSeek sparse "
                                              "attention; Gated DeltaNet trains here, its conversion is not written "
                                              "yet)",
            "attention_output_gate": "gated attention (--attention-output-gate: it trains here, its conversion is "
                                     "not written yet)"}
# Megatron-LM's YaRN args for standard attention -> (our flag, Megatron-LM's default for None)
_YARN = {"rotary_scaling_factor": ("--rotary-scaling-factor", 1.0),
         "yarn_original_max_position_embeddings": ("--original-max-position-embeddings", 4096),
         "yarn_beta_fast": ("--yarn-beta-fast", 32.0), "yarn_beta_slow": ("--yarn-beta-slow", 1.0),
         "mscale": ("--mscale", 1.0), "mscale_all_dim": ("--mscale-all-dim", 0.0)}
# what --enable-gpt-oss sets (Megatron-LM's megatron/post_training/model_builder.py, over the args)
_GPT_OSS_YARN = {"position_embedding_type": "yarn", "rotary_scaling_factor": 32.0,
                 "yarn_original_max_position_embeddings": 131072, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0,
                 "mscale": 1.0, "mscale_all_dim": 0.0, "yarn_correction_range_round_to_int": False}


def check_saved(head: dict, where: str) -> tuple[argparse.Namespace, int]:
    """(the ``args``, the iteration) of a Megatron-LM checkpoint's saved dict ``head`` (a rank file's, or torch_dist's
    ``common.pt``) read from ``where``; CheckpointError (one line) for args that are not a Namespace, a size beyond
    its bound or not a whole number, a parallel size below 1, or an iteration ``saved_iteration`` refuses."""
    args = head.get("args")
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{where} has no 'args' (Megatron-LM saves its arguments there; they give the model's "
                              f"shape).")
    values = vars(args)

    def fail(message: str):
        raise CheckpointError(message)

    check_sizes(values, f"{where}: its args", fail, names={**{n: n for n in MAXIMA}, **_MEGATRON_SIZES})
    for name in _PARALLEL_SIZES:
        value = values.get(name)
        problem = size_problem(name, value) or (f"{name} is {value}, below 1" if value is not None and value < 1
                                                else None)
        if problem is not None:
            fail(f"{where}: its args: {problem}; check the value.")
    return args, saved_iteration(head, args, where)


def iteration_problem(value) -> str | None:
    """What is wrong with ``value`` as a Megatron-LM iteration (a whole number from 0 to ``MAX_STEPS``), or
    None."""
    problem = size_problem("iteration", value)
    if problem is None and value > MAX_STEPS:
        problem = f"iteration is {value:,}" if isinstance(value, int) else f"iteration is {value!r}"
        problem += f", above {MAX_STEPS:,} (2^40)"
    return problem


def saved_iteration(head: dict, args: argparse.Namespace, where: str) -> int:
    """The iteration a checkpoint's saved dict ``head`` says (its ``iteration``, else its ``args.iteration``; 0 when
    None), checked: the step of the converted checkpoint (``step_N``), which every loader of ours must accept."""
    value = head.get("iteration", getattr(args, "iteration", 0))
    if value is None:
        return 0
    problem = iteration_problem(value)
    if problem is not None:
        raise CheckpointError(f"{where}: its {problem}; a Megatron-LM iteration is a whole number from 0 to 2^40: "
                              f"the checkpoint is damaged.")
    return int(value)


def model_flags(args: argparse.Namespace) -> list[str]:
    """Megatron-LM flags for the model of a checkpoint's saved ``args``."""
    a = {**vars(args), **(_GPT_OSS_YARN if getattr(args, "enable_gpt_oss", False) else {})}
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
    names = [n for n in (*_SAME, *(_MLA if mla else ()), *(_MTP if a.get("mtp_num_layers") else ()),
                         *(_MUP if a.get("use_mup") else ())) if not (mla and n in _NOT_MLA)]
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
        elif name == "position_embedding_type" and value not in ("learned_absolute", "rope", "yarn"):
            raise ConversionError(f"position_embedding_type {value!r} is not converted (learned_absolute, rope, "
                                  f"yarn).")
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, *map(str, value if isinstance(value, list) else [value])]
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
    if not a.get("bias_gelu_fusion", True) and not a.get("quick_geglu"):  # Megatron Core's exact GELU
        flags.append("--no-bias-gelu-fusion")  # (ops.activations.gelu_approximation; quick GeGLU's MLP has no GELU)
    flags += _gpt_oss_flags(a, mla)
    flags += ["--vocab-size", str(vocab_size(args))]
    if a.get("seq_length"):
        flags += ["--seq-length", str(a["seq_length"])]
    return flags


def _gpt_oss_flags(a: dict, mla: bool) -> list[str]:
    """Our flags for gpt-oss's settings in the args ``a``: the sliding window and the layers it skips, the softmax,
    quick GeGLU and a gated MLP's offset and clamp, YaRN on standard attention (see the module's docstring)."""
    flags = _window_flags(a.get("window_size"), a.get("window_attn_skip_freq"))
    if a.get("softmax_type") not in (None, "vanilla"):
        flags += ["--softmax-type", str(a["softmax_type"])]
    if a.get("quick_geglu"):
        flags.append("--quick-geglu")
    if a.get("swiglu") or a.get("quick_geglu"):  # Megatron Core's glu(); an ungated MLP reads neither
        if a.get("glu_linear_offset"):
            flags += ["--glu-linear-offset", str(float(a["glu_linear_offset"]))]
        if a.get("activation_func_clamp_value") is not None:
            flags += ["--activation-func-clamp-value", str(float(a["activation_func_clamp_value"]))]
    if a.get("position_embedding_type") == "yarn" and not mla:
        for name, (flag, default) in _YARN.items():
            flags += [flag, str(default if a.get(name) is None else a[name])]
        if a.get("yarn_correction_range_round_to_int") is False:
            flags.append("--no-yarn-correction-range-round-to-int")
    return flags


def _window_flags(window, skip_freq) -> list[str]:
    """``--window-size LEFT,0`` and ``--window-attn-skip-freq`` of Megatron's ``window_size`` (LEFT, RIGHT) and
    ``window_attn_skip_freq`` (an int N, or a 0/1 list); none for no window (None, or LEFT -1: no limit)."""
    if not window:
        return []  # Megatron Core reads the skip frequency only with a window
    try:
        left, right = (int(v) for v in window)
    except (TypeError, ValueError):
        raise ConversionError(f"the checkpoint's window_size {window!r} is not two integers (LEFT, RIGHT).") from None
    if right != 0:
        raise ConversionError(f"the checkpoint's sliding window ({left}, {right}) lets each token see {right} later "
                              f"token(s) (window_size RIGHT > 0), which this causal GPT does not build.")
    if left == -1:
        return []
    flags = ["--window-size", f"{left},0"]
    if isinstance(skip_freq, (list, tuple)):
        flags += ["--window-attn-skip-freq", "[" + ",".join(str(int(v)) for v in skip_freq) + "]"]
    elif skip_freq is not None:
        flags += ["--window-attn-skip-freq", str(skip_freq)]
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
    format, expert parallelism 1, no grouped GEMM)."""
    values = {name: getattr(model, name) for name in (*_SAME, *_MLA, *_MTP, *_MUP)}
    if model.hybrid_override_pattern:
        raise ConversionError("the model is a hybrid (hybrid_override_pattern), whose conversion to Megatron-LM's "
                              "MambaModel is not written yet (docs/hybrid.md); it trains and resumes here.")
    if model.experimental_attention_variant or model.attention_output_gate:
        raise ConversionError("the model has Gated DeltaNet or gated-attention layers (Qwen3-Next's), whose "
                              "conversion to Megatron-LM is not written yet (docs/hybrid.md); it trains and resumes "
                              "here.")
    if model.add_qkv_bias and model.disable_bias_linear:
        raise ConversionError("the model has a bias on its query/key/value projection alone (add_qkv_bias), whose "
                              "conversion to Megatron-LM is not written here; it trains and loads under any layout "
                              "here.")
    if model.multi_latent_attention:
        from megatron.model.mla import mla_rope_type

        values["rope_type"] = mla_rope_type(model)  # explicit: Megatron's default differs by attention
        ramp = (model.yarn_beta_fast, model.yarn_beta_slow, model.yarn_correction_range_round_to_int)
        if ramp != (32.0, 1.0, True):  # Megatron Core's multi-latent attention reads no yarn_* field
            raise ConversionError(f"the model's multi-latent attention has YaRN's (yarn_beta_fast, yarn_beta_slow, "
                                  f"yarn_correction_range_round_to_int) {ramp}; Megatron Core builds (32, 1, True) "
                                  f"there only.")
    values.update(_gpt_oss_args(model))
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
        ckpt_format="torch", moe_grouped_gemm=False,
        bias_gelu_fusion=model.bias_gelu_fusion and not model.quick_geglu, openai_gelu=False,
        params_dtype=torch.float32,
        iteration=iteration, consumed_train_samples=consumed_train_samples, consumed_valid_samples=0)
    return argparse.Namespace(**values)


def _gpt_oss_args(model: ModelConfig) -> dict:
    """gpt-oss's settings as Megatron-LM's args: the window (a tuple) and the layers it skips (an int or a 0/1 list),
    the softmax, quick GeGLU, a gated MLP's offset and clamp, YaRN's ramp; the fused activations off where Megatron
    Core's fusion would not compute them (quick GeGLU's MLP has no fused form; SwiGLU's ignores the offset and
    clamp)."""
    left, skip = parse_window(model.window_size), None
    if left is not None and model.window_attn_skip_freq is not None:
        skip = parse_layer_pattern(model.window_attn_skip_freq, model.num_layers, "window_attn_skip_freq",
                                   "full attention", "sliding window")
        skip = skip if isinstance(skip, int) else [int(x) for x in skip]
    shaped_glu = model.glu_linear_offset != 0.0 or model.activation_func_clamp_value is not None
    return dict(window_size=None if left is None else (left, 0), window_attn_skip_freq=skip,
                softmax_type=model.softmax_type, quick_geglu=model.quick_geglu,
                glu_linear_offset=model.glu_linear_offset,
                activation_func_clamp_value=model.activation_func_clamp_value,
                bias_swiglu_fusion=not (model.swiglu and shaped_glu),
                yarn_original_max_position_embeddings=model.original_max_position_embeddings,
                yarn_beta_fast=model.yarn_beta_fast, yarn_beta_slow=model.yarn_beta_slow,
                yarn_correction_range_round_to_int=model.yarn_correction_range_round_to_int)
