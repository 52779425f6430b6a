"""A Hugging Face ``config.json`` read as transformers 5 reads it, bounded and unambiguous, before any mapping
(``hf_*``) builds anything from it: the one place that decides what ``convert_checkpoint.py from-hf`` accepts.

``read_hf_config`` loads the file (at most 64 MiB; nesting too deep for Python's parser and text that is not JSON are
one line) and returns ``checked``'s form of it, which is what the mappings read. ``checked`` (also run by
``hf_models.converter_for_hf``, so no caller of a mapping skips it) refuses, in one ConversionError line naming the
key:

- a size (``SIZES``: every count and width of every family, inside ``rope_parameters`` too) that is not a whole
  number (64.0 is 64, though transformers 5's typed fields refuse it: the number is not in doubt), is below the least
  a model can have, or is above the maximum of our field of that meaning (``megatron/config/bounds.py``): 10^9
  layers never reaches a per-layer list;
- a number read as one (``FLOATS``: epsilons, rope_theta, YaRN's factor and betas, ...) that is text, a boolean,
  null where transformers takes none, infinite or NaN; a switch (``BOOLS``) that is not true or false;
- two keys that name one setting with different values, where transformers' reading depends on the order of the
  keys in the file or on its version: its aliases (``ALIASES``: gpt2's ``n_layer`` and ``num_hidden_layers``,
  ``num_local_experts`` and ``num_experts``, ...); ``rope_theta``, ``partial_rotary_factor`` or
  ``original_max_position_embeddings`` both inside the rope dict and beside it (transformers 4 reads the one beside,
  5 the one inside, or, for the last, each in a different place); ``type`` and ``rope_type``. Where every version
  agrees it is followed instead: ``rope_scaling`` beside ``rope_parameters`` is read, the other ignored, as
  transformers builds the model;
- what transformers itself refuses or cannot run: ``layer_types`` without one entry per layer, ``mlp_only_layers``
  that are not layer numbers, YaRN without a factor, rotary settings per layer type, a factor below 1 or
  ``beta_fast`` below ``beta_slow`` (transformers only warns on these two: they invert what YaRN does, and our own
  flags refuse them, ``validate_attention.yarn_problem``).

The form returned: every alias under transformers' own field name, every key a mapping reads that the file leaves
out given transformers' default for the family (``DEFAULTS``, checked against transformers' classes by
tests/unit/test_hf_config_checks.py; a model's shape, its layers, widths, heads, vocabulary and positions, is never
guessed: the mappings refuse a config without it), sizes as ``int``, and one ``rope_parameters`` dict (no
``rope_scaling``, no ``rope_theta`` beside it) holding what transformers' rotary embedding reads. Checking it again
changes nothing."""

from __future__ import annotations

import json
import math
import reprlib

from megatron.checkpoint.hf.common import ConversionError
from megatron.checkpoint.small_files import UnsafeCheckpoint, read_small
from megatron.config.bounds import size_problem
from megatron.config.validate_attention import yarn_problem

# config.json key (of any family) -> (our field whose maximum bounds it, the least value a model of it can have)
SIZES = {
    "num_hidden_layers": ("num_layers", 1), "n_layer": ("num_layers", 1),
    "hidden_size": ("hidden_size", 1), "n_embd": ("hidden_size", 1),
    "intermediate_size": ("ffn_hidden_size", 1), "n_inner": ("ffn_hidden_size", 1),
    "num_attention_heads": ("num_attention_heads", 1), "n_head": ("num_attention_heads", 1),
    "num_key_value_heads": ("num_query_groups", 1), "head_dim": ("kv_channels", 1),
    "vocab_size": ("vocab_size", 1),
    "max_position_embeddings": ("max_position_embeddings", 1), "n_positions": ("max_position_embeddings", 1),
    "original_max_position_embeddings": ("original_max_position_embeddings", 1),
    "num_local_experts": ("num_experts", 1), "n_routed_experts": ("num_experts", 1),
    "num_experts": ("num_experts", 0),  # Qwen3-Next's dense model: 0 (each MoE family refuses 0 itself)
    "num_experts_per_tok": ("moe_router_topk", 1), "moe_intermediate_size": ("moe_ffn_hidden_size", 1),
    "shared_expert_intermediate_size": ("moe_shared_expert_intermediate_size", 0),
    "n_shared_experts": ("num_experts", 0),
    "n_group": ("moe_router_num_groups", 1), "topk_group": ("moe_router_group_topk", 1),
    "q_lora_rank": ("q_lora_rank", 1), "kv_lora_rank": ("kv_lora_rank", 1),
    "qk_nope_head_dim": ("qk_head_dim", 1), "qk_rope_head_dim": ("qk_pos_emb_head_dim", 1),
    "v_head_dim": ("v_head_dim", 1),
    "num_nextn_predict_layers": ("mtp_num_layers", 0), "num_mtp_layers": ("mtp_num_layers", 0),
    "first_k_dense_replace": ("num_layers", 0), "decoder_sparse_step": ("num_layers", 1),
    "sliding_window": ("max_position_embeddings", 0), "max_window_layers": ("num_layers", 0),
    "linear_conv_kernel_dim": ("linear_conv_kernel_dim", 1), "linear_key_head_dim": ("linear_key_head_dim", 1),
    "linear_value_head_dim": ("linear_value_head_dim", 1), "linear_num_key_heads": ("linear_num_key_heads", 1),
    "linear_num_value_heads": ("linear_num_value_heads", 1),
    "mamba_num_heads": ("num_attention_heads", 1), "mamba_head_dim": ("kv_channels", 1),
    "n_groups": ("num_attention_heads", 1), "ssm_state_size": ("kv_channels", 1),
}
# numbers read as floats -> whether transformers takes null for it
FLOATS = {"rms_norm_eps": False, "layer_norm_epsilon": False, "initializer_range": False, "attention_dropout": True,
          "resid_pdrop": False, "attn_pdrop": False, "router_aux_loss_coef": False, "router_jitter_noise": False,
          "routed_scaling_factor": False, "swiglu_alpha": False, "swiglu_limit": False, "rope_theta": True,
          "partial_rotary_factor": True}
# switches -> whether transformers takes null for it
BOOLS = {"tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "qkv_bias": False,
         "use_sliding_window": False, "norm_topk_prob": True, "rope_interleave": True, "scale_attn_weights": False,
         "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False}
TEXTS = ("hidden_act", "activation_function")  # names compared with ours
ROPE_FLOATS = ("rope_theta", "factor", "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
               "partial_rotary_factor")
# transformers' attribute_map per family: the field -> its alias (the same setting under another name)
ALIASES = {
    "gpt2": {"n_embd": "hidden_size", "n_positions": "max_position_embeddings", "n_head": "num_attention_heads",
             "n_layer": "num_hidden_layers"},
    "mixtral": {"num_local_experts": "num_experts"}, "qwen3_moe": {"num_local_experts": "num_experts"},
    "gpt_oss": {"num_local_experts": "num_experts"},
    "nemotron_h": {"layers_block_type": "layer_types", "n_routed_experts": "num_local_experts"},
    "deepseek_v3": {"n_routed_experts": "num_local_experts", "num_nextn_predict_layers": "num_mtp_layers"},
}
_LLAMA = {"num_key_value_heads": None, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
          "attention_dropout": 0.0, "initializer_range": 0.02}
_QWEN_MOE = {"decoder_sparse_step": 1, "norm_topk_prob": False, "router_aux_loss_coef": 0.001,
             "mlp_only_layers": None, "use_sliding_window": False}
# transformers 5's defaults for the keys the mappings read (a model's shape aside): what a config.json leaving one out
# means. "default_theta" and "rope_parameters" are the rotary embedding's when the file gives none.
DEFAULTS = {
    "gpt2": {"n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.1,
             "attn_pdrop": 0.1, "initializer_range": 0.02, "scale_attn_weights": True,
             "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False, "tie_word_embeddings": True},
    "llama": {**_LLAMA, "head_dim": None, "attention_bias": False, "mlp_bias": False, "default_theta": 10000.0},
    "qwen3": {**_LLAMA, "num_key_value_heads": 32, "head_dim": 128, "attention_bias": False,
              "use_sliding_window": False, "default_theta": 10000.0},
    "mixtral": {**_LLAMA, "num_key_value_heads": 8, "head_dim": None, "rms_norm_eps": 1e-5, "num_local_experts": 8,
                "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
                "sliding_window": None, "default_theta": 1000000.0},
    "qwen2_moe": {**_LLAMA, **_QWEN_MOE, "num_key_value_heads": 16, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60,
                  "qkv_bias": True, "default_theta": 10000.0},
    "qwen3_moe": {**_LLAMA, **_QWEN_MOE, "num_key_value_heads": 4, "attention_bias": False,
                  "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_local_experts": 128,
                  "default_theta": 10000.0},
    "qwen3_next": {**_LLAMA, "num_key_value_heads": 2, "head_dim": 256, "attention_bias": False,
                   "decoder_sparse_step": 1, "norm_topk_prob": True, "router_aux_loss_coef": 0.001,
                   "mlp_only_layers": None, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                   "num_experts_per_tok": 10, "num_experts": 512, "linear_conv_kernel_dim": 4,
                   "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
                   "linear_num_value_heads": 32, "default_theta": 10000.0,
                   "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}},
    "nemotron_h": {"num_key_value_heads": 8, "head_dim": 128, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False,
                   "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "conv_kernel": 4, "use_conv_bias": True,
                   "attention_bias": False, "mlp_bias": False, "use_bias": False, "mamba_proj_bias": False,
                   "initializer_range": 0.02, "attention_dropout": 0.0, "mamba_num_heads": 128, "mamba_head_dim": 64,
                   "n_groups": 8, "ssm_state_size": 128, "n_routed_experts": 8, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 7688, "moe_shared_expert_intermediate_size": 7688, "n_shared_experts": 1,
                   "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
                   "moe_latent_size": None},
    "deepseek_v3": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
                    "attention_dropout": 0.0, "initializer_range": 0.02, "moe_intermediate_size": 2048,
                    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
                    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
                    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
                    "norm_topk_prob": True, "rope_interleave": True, "num_nextn_predict_layers": 1,
                    "default_theta": 10000.0},
    "gpt_oss": {"head_dim": 64, "num_key_value_heads": 8, "sliding_window": 128, "num_local_experts": 128,
                "num_experts_per_tok": 4, "rms_norm_eps": 1e-5, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
                "router_aux_loss_coef": 0.001, "attention_bias": True, "tie_word_embeddings": False,
                "hidden_act": "silu", "attention_dropout": 0.0, "initializer_range": 0.02, "default_theta": 150000.0,
                "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 4096}},
}
_SCALED = ("yarn", "llama3", "longrope")  # rope types transformers gives original_max_position_embeddings


def read_hf_config(path: str) -> dict:
    """``checked``'s form of the config.json at ``path``; ConversionError, one line, for a file that cannot be read,
    is larger than 64 MiB, is not JSON (nesting too deep to parse included) or is refused by ``checked``."""
    try:
        raw = read_small(path, "any model's config.json")
    except UnsafeCheckpoint as err:
        raise ConversionError(f"{path}: {err}; check the file.") from None
    except OSError as err:
        raise ConversionError(f"cannot read {path} ({type(err).__name__}: {err}).") from err
    try:
        config = json.loads(raw)
    except RecursionError:
        raise ConversionError(f"{path} nests its JSON too deeply to read; check the file.") from None
    except ValueError as err:
        raise ConversionError(f"cannot read {path} ({type(err).__name__}: {' '.join(str(err).split())[:200]}).") \
            from None
    return checked(config)


# model_type -> the architecture a config.json without model_type names (hf_models maps each to its mapping)
FAMILIES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
            "deepseek_v3": "DeepseekV3ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "gpt_oss": "GptOssForCausalLM", "qwen3_next": "Qwen3NextForCausalLM", "nemotron_h": "NemotronHForCausalLM",
            "gpt2": "GPT2LMHeadModel"}


def model_type_of(hf_cfg: dict) -> str:
    """The ``model_type`` a config.json describes (a key of ``FAMILIES``): its own, or, without one, the family its
    ``architectures`` names (gpt2 when it names none we know). ConversionError for any other model."""
    model_type, architectures = hf_cfg.get("model_type"), hf_cfg.get("architectures") or []
    if model_type is None:
        named = [family for family, architecture in FAMILIES.items() if architecture in architectures]
        return named[0] if named else "gpt2"
    if model_type in FAMILIES:
        return model_type
    names = ", ".join(str(a) for a in architectures)[:200] if isinstance(architectures, list) else ""
    known = ", ".join(f"{family} ({architecture})" for family, architecture in sorted(FAMILIES.items()))
    raise ConversionError(f"config.json describes a {model_type[:60]!r} model ({names or 'no architectures'}); this "
                          f"tool converts {known}.")


def checked(config) -> dict:
    """The form of a config.json's dict the mappings read (see the module's docstring); ConversionError, naming the
    key, for what it refuses. Pure: ``config`` is not changed."""
    if not isinstance(config, dict):
        raise ConversionError(f"config.json holds {_kind(config)}, not a JSON object of settings; check the file.")
    model_type, architectures = config.get("model_type"), config.get("architectures")
    if model_type is not None and not isinstance(model_type, str):
        _fail("model_type", model_type, "not a name")
    if architectures is not None and not (isinstance(architectures, list) and all(isinstance(a, str) for a in
                                                                                   architectures)):
        _fail("architectures", architectures, "not a list of names")
    family, out = model_type_of(config), dict(config)
    for key, (ours, least) in SIZES.items():
        if key in out:
            out[key] = _size(key, out[key], ours, least)
    for table, check in ((FLOATS, _float), (BOOLS, _bool), (dict.fromkeys(TEXTS, False), _text)):
        for key, nullable in table.items():
            if key in out and not (nullable and out[key] is None):
                check(key, out[key])
    out = _merged_aliases(out, family)
    defaults = DEFAULTS[family]
    out.update({key: value for key, value in defaults.items() if key not in out and key not in (
        "default_theta", "rope_parameters")})
    _check_layer_lists(out)
    if family not in ("gpt2", "nemotron_h"):  # GPT-2 has learned positions, Nemotron-H none
        out = _rope(out, defaults)
    return out


def _kind(value) -> str:
    return {list: "a list", str: "text", bool: "a boolean", type(None): "null"}.get(type(value), "a number")


def _text(key: str, value) -> None:
    if not isinstance(value, str):
        _fail(key, value, "not a name")


_REPR = reprlib.Repr()  # a value's text bounded in depth and length, whatever the file nests
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 6, 4, 50, 50


def _shown(value) -> str:
    text = _REPR.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fail(key: str, value, problem: str):
    raise ConversionError(f"config.json: {key} is {_shown(value)}, {problem}; check the value.")


def _merged_aliases(config: dict, family: str) -> dict:
    """A copy of ``config`` with each alias of ``ALIASES`` under its field's name; two that differ are refused."""
    out = dict(config)
    for field, alias in ALIASES.get(family, {}).items():
        value = out.pop(alias, None)
        if value is None:
            continue
        if out.get(field) is not None and out[field] != value:
            raise ConversionError(f"config.json gives {field} {_shown(out[field])} and {alias} {_shown(value)}, two "
                                  f"names of one setting (transformers reads whichever it meets last); keep one.")
        out[field] = value
    return out


def _size(key: str, value, ours: str, least: int):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(key, value, "not a whole number")
    problem = size_problem(key, value, ours)
    if problem is not None:
        raise ConversionError(f"config.json: {problem}; check the value.")
    if value < least:
        _fail(key, value, f"below {least}, the least a model can have")
    return int(value)


def _float(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _fail(key, value, "not a finite number")


def _bool(key: str, value) -> None:
    if not isinstance(value, bool):
        _fail(key, value, "not true or false")


def _check_layer_lists(config: dict) -> None:
    """``layer_types``: one name per layer (transformers refuses other lengths); ``mlp_only_layers``: layer
    numbers. The layer count is bounded already."""
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    types = config.get("layer_types", config.get("layers_block_type"))  # (Nemotron-H's name of it)
    if types is not None:
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            _fail("layer_types", types, "not a list of layer kinds")
        if isinstance(layers, int) and len(types) != layers:
            raise ConversionError(f"config.json's layer_types has {len(types):,} entries but num_hidden_layers is "
                                  f"{layers:,}; transformers takes one per layer, so does this tool.")
    only = config.get("mlp_only_layers")
    if only is not None and not (isinstance(only, list) and all(isinstance(n, int) and not isinstance(n, bool)
                                                                 for n in only)):
        _fail("mlp_only_layers", only, "not a list of layer numbers")


def _rope(config: dict, defaults: dict) -> dict:
    """``config`` with the one rope dict transformers' rotary embedding reads as ``rope_parameters``: its
    ``rope_scaling`` when that is set, else its ``rope_parameters`` (the family's default when null), with
    ``rope_theta``, ``partial_rotary_factor`` and ``original_max_position_embeddings`` from beside it when it lacks
    them and ``rope_type`` from ``type``. Every transformers version reads ``rope_scaling`` first (5's
    ``PreTrainedConfig.convert_rope_params_to_dict``; 4 knew no other), so a ``rope_parameters`` beside it is ignored
    here too, whatever it says."""
    scaling, params = config.get("rope_scaling"), config.get("rope_parameters")
    for key, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        if value is not None and not isinstance(value, dict):
            _fail(key, value, "not a dict of rotary settings")
    chosen = _effective(scaling if scaling else params, config, defaults,
                        "rope_scaling" if scaling else "rope_parameters")
    out = {k: v for k, v in config.items() if k not in ("rope_scaling", "rope_theta", "partial_rotary_factor")}
    out["rope_parameters"] = chosen
    return out


def _effective(given: dict | None, config: dict, defaults: dict, name: str) -> dict:
    """The rope dict transformers builds from ``given`` (the dict named ``name``, or null) and the keys beside it."""
    rope = dict(defaults.get("rope_parameters") or {}) if given is None else dict(given)
    if any(isinstance(v, dict) for v in rope.values()):
        raise ConversionError(f"config.json's {name} gives rotary settings per layer type "
                              f"({', '.join(k for k, v in rope.items() if isinstance(v, dict))}); this GPT has one "
                              f"rotary embedding for every layer, so the model cannot be imported.")
    if "type" in rope and "rope_type" in rope and rope["type"] != rope["rope_type"]:
        raise ConversionError(f"config.json's {name} gives type {_shown(rope['type'])} and rope_type "
                              f"{_shown(rope['rope_type'])}, two names of one setting; keep one.")
    kind = rope.setdefault("rope_type", rope.get("type", "default"))
    if not isinstance(kind, str):
        _fail(f"{name}.rope_type", kind, "not a name")
    beside = {"rope_theta": config.get("rope_theta", defaults["default_theta"]),
              "partial_rotary_factor": config.get("partial_rotary_factor")}
    if kind in _SCALED:
        beside["original_max_position_embeddings"] = config.get("original_max_position_embeddings",
                                                                config.get("max_position_embeddings"))
    for key, value in beside.items():
        outside = key in config and config[key] is not None
        if outside and rope.get(key) is not None and rope[key] != value:
            raise ConversionError(f"config.json gives {key} {_shown(value)} beside {name} and {_shown(rope[key])} in "
                                  f"it, two values of one setting that transformers' versions take differently; keep "
                                  f"one.")
        if value is not None:
            rope.setdefault(key, value)
    for key in ROPE_FLOATS:
        if rope.get(key) is not None:
            _float(f"{name}.{key}", rope[key])
    if "original_max_position_embeddings" in rope:
        rope["original_max_position_embeddings"] = _size(f"{name}.original_max_position_embeddings",
                                                         rope["original_max_position_embeddings"],
                                                         "original_max_position_embeddings", 1)
    if rope.get("truncate") is not None:
        _bool(f"{name}.truncate", rope["truncate"])
    if rope.get("rope_theta") is None or rope["rope_theta"] <= 0:
        _fail(f"{name}.rope_theta", rope.get("rope_theta"), "not a positive number")
    if kind == "yarn":
        if "factor" not in rope:
            raise ConversionError(f"config.json's {name} is YaRN without its factor, which transformers requires; "
                                  f"give the factor.")
        original, longest = rope.get("original_max_position_embeddings"), config.get("max_position_embeddings")
        factor = rope["factor"] if rope["factor"] is not None else longest / original if longest and original else 1.0
        problem = yarn_problem(factor, rope.get("beta_fast") or 32.0, rope.get("beta_slow") or 1.0,
                               (f"{name}.factor", f"{name}.beta_fast", f"{name}.beta_slow"))
        if problem is not None:
            raise ConversionError(f"config.json: {problem}; the model cannot be imported.")
    return rope
