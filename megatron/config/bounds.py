"""The sane maxima of the sizes a configuration gives: the one place that bounds a size before anything proportional
to it is built (a per-layer list, a window pattern, an expert table). Whether a size that passes fits the machine is
the memory check's (``megatron/memory/check.py``); this bound only keeps a number from a flag or a foreign file
(a ``config.json``, a Megatron checkpoint's ``args``) from growing the process without limit first.

Each maximum is far above any published model (the largest: 126 layers, hidden 18432, 262,144 tokens of vocabulary,
256 experts, a 10M-token context) and far below what would exhaust memory by itself. Pure: imports nothing of ours."""

from __future__ import annotations

import math

# field -> the largest value accepted. Widths bound the matrices, counts the per-layer and per-expert tables.
MAXIMA = {
    "num_layers": 2**14,
    "hidden_size": 2**18,
    "ffn_hidden_size": 2**20,
    "moe_ffn_hidden_size": 2**20,
    "moe_shared_expert_intermediate_size": 2**20,
    "num_attention_heads": 2**14,
    "num_query_groups": 2**14,
    "kv_channels": 2**16,
    "vocab_size": 2**26,
    "max_position_embeddings": 2**27,
    "original_max_position_embeddings": 2**27,
    "max_seq_len": 2**27,
    "num_experts": 2**16,
    "moe_router_topk": 2**16,
    "moe_router_num_groups": 2**16,
    "moe_router_group_topk": 2**16,
    "q_lora_rank": 2**18,
    "kv_lora_rank": 2**18,
    "qk_head_dim": 2**16,
    "qk_pos_emb_head_dim": 2**16,
    "v_head_dim": 2**16,
    "mtp_num_layers": 2**10,
    "linear_conv_kernel_dim": 2**10,
    "linear_key_head_dim": 2**16,
    "linear_value_head_dim": 2**16,
    "linear_num_key_heads": 2**14,
    "linear_num_value_heads": 2**14,
}


# the most steps a count of training steps may claim (a Megatron-LM iteration, Adam's step, a step_N of ours): 2^40,
# 35,000 years at a step a second
MAX_STEPS = 2**40


def size_problem(name: str, value, bounded_as: str | None = None) -> str | None:
    """What is wrong with ``value`` as the size ``name`` (a whole number from 0 to the maximum of ``bounded_as``, our
    field of that meaning, default ``name``; None is no size), or None when it is fine. ``bool`` is not a size; a float
    that is whole (``64.0``, as JSON may write it) is."""
    if value is None:
        return None
    limit = MAXIMA.get(bounded_as or name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name} is {value!r}, not a whole number"
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return f"{name} is {value!r}, not a whole number"
    if value < 0:
        return f"{name} is {int(value)}, below 0"
    if limit is not None and value > limit:
        return (f"{name} is {int(value):,}, above the largest this framework accepts ({limit:,}, far beyond any "
                f"published model)")
    return None


def check_sizes(values: dict, source: str, fail, names: dict[str, str] | None = None) -> None:
    """``fail(message)`` (which raises) for the first size of ``values`` that is not a whole number within its
    maximum: our fields, or the fields ``names`` maps to ours (``{"num_hidden_layers": "num_layers"}`` for a
    ``config.json``); ``source`` says where the values came from."""
    for name, ours in ({n: n for n in MAXIMA} if names is None else names).items():
        if name in values:
            problem = size_problem(name, values[name], ours)
            if problem is not None:
                fail(f"{source}: {problem}; check the value.")


def config_size_problem(config) -> str | None:
    """The first size of a ``Config`` (its model's, and ``dataset.max_seq_len``) beyond its bound, as one sentence
    naming it (``Model.num_layers is ...``), or None. ``validate`` asks it first; so does every reader of a saved
    configuration (a checkpoint's) before building the model it describes."""
    for name in MAXIMA:
        section, owner = ("dataset", config.dataset) if name == "max_seq_len" else ("Model", config.model)
        problem = size_problem(f"{section}.{name}", getattr(owner, name, None), name)
        if problem is not None:
            return f"{problem}; check the value."
    return None
