"""The configuration of a checkpoint converted from another framework (``tools/convert_checkpoint.py``'s ``from-hf``
and ``from-megatron``): the model read off the source, pretrain_gpt.py flags on top that may not change its shape
(``shaped_config``), and the base configuration a run loading it inherits (``model_base``)."""

from __future__ import annotations

import yaml

from megatron import device as dev
from megatron.config import Config, ConfigError, parse_config, to_dict, validate
from megatron.tokenizer import configured_tokenizer

# Model shape and architecture: from config.json, never overridden by a flag (the weights fit these).
SHAPE_FIELDS = ("hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
                 "position_embedding_type", "rotary_percent", "normalization", "swiglu", "group_query_attention",
                 "num_query_groups", "kv_channels", "untie_embeddings_and_output_weights", "disable_bias_linear",
                 "num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                 "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
                 "moe_router_enable_expert_bias", "moe_expert_capacity_factor", "multi_latent_attention",
                 "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "qk_layernorm")
SHAPE_FIELDS += ("moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor", "rope_type",
                  "rotary_scaling_factor", "original_max_position_embeddings", "mscale", "mscale_all_dim",
                  "mtp_num_layers")  # the DeepSeek-V3 shape's
SHAPE_FIELDS += ("window_size", "window_attn_skip_freq", "softmax_type", "quick_geglu", "glu_linear_offset",
                  "activation_func_clamp_value", "yarn_beta_fast", "yarn_beta_slow",
                  "yarn_correction_range_round_to_int",  # gpt-oss's
                  "rotary_base", "rotary_interleaved", "layernorm_epsilon")  # any rope's and norm's
SHAPE_FIELDS += ("use_mup", "mup_base_hidden_size", "mup_embedding_mult", "mup_output_mult", "mup_base_head_dim",
                 "mup_attn_scale_power")  # muP's multipliers and scale: part of the function the weights compute


class ToolError(Exception):
    """A one-line message for the user (exit status 2)."""


def shaped_config(derived: list[str], flags: list[str], source: str) -> Config:
    """Our resolved config of the model flags ``derived`` (read off ``source``) with ``flags`` on top: the shape
    fields must stay as ``derived`` says, vocab_size may only grow."""
    try:
        want = parse_config(derived).model
    except ConfigError as err:  # what the source says, before any flag of the user's
        raise ToolError(f"{source}: {err}") from None
    config = parse_config([*derived, *flags])
    for name in SHAPE_FIELDS:
        if getattr(config.model, name) != getattr(want, name):
            raise ToolError(f"{name} is {getattr(want, name)} in {source}; it cannot be changed "
                            f"(got {getattr(config.model, name)}).")
    if config.model.vocab_size < want.vocab_size:
        raise ToolError(f"vocab_size {config.model.vocab_size} is smaller than the model's ({want.vocab_size}).")
    d = config.distributed
    no_data = not config.dataset.mock_data and not config.dataset.input_dir
    config.dataset.mock_data = config.dataset.mock_data or no_data  # validation needs a data source
    world_size = d.mp_degree * d.pp_degree * d.sharding.sharding_degree * (d.dp_degree or 1)
    # a TokenizerError is reported in one line, by main
    tokenizer = configured_tokenizer(config.tokenizer, config.model.vocab_size)
    validate(config, world_size=world_size, cuda_available=config.device == "gpu" or dev.cuda_available(),
             tokenizer_vocab_size=None if tokenizer is None else tokenizer.vocab_size)
    if no_data:
        config.dataset.mock_data = False  # the run that loads the checkpoint names its data
    return config


def model_base(config: Config, schedule: bool = False) -> str:
    """``config.yaml`` of a converted checkpoint: a run loading it takes the model, which the weights fix, and its
    tokenizer from it, and with ``schedule`` (from-megatron) Megatron's optimizer settings, learning-rate schedule,
    training length and global batch (``megatron_schedule``); the rest (and what its flags give) is that run's own."""
    sections = to_dict(config)
    named = config.tokenizer.tokenizer_type is not None
    base = {"Model": sections["Model"], **({"tokenizer": sections["tokenizer"]} if named else {})}
    if schedule:
        base.update({"Optimizer": sections["Optimizer"], "max_steps": sections["max_steps"],
                     "train_samples": sections["train_samples"],
                     "batch_size": {"global_batch_size": sections["batch_size"]["global_batch_size"]}})
    return yaml.safe_dump(base, sort_keys=False)
