"""Mixture of experts: the layers ``moe_layer_freq`` chooses, and the checks of the MoE settings (part of
``validate``)."""

from __future__ import annotations

import ast
import functools

from megatron.config.cli import fail as _fail
from megatron.config.schema import Config, ModelConfig


def _pattern_value(node: ast.AST) -> int | list[int]:
    """A Megatron-LM pattern expression: integers, lists of them, ``+`` of lists and ``*`` by an integer."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        items = [_pattern_value(item) for item in node.elts]
        if all(isinstance(item, int) for item in items):
            return items
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern_value(node.left), _pattern_value(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
            return left * right
    raise ValueError("not a pattern")


def parse_layer_pattern(text: str, num_layers: int, name: str, zero: str, one: str) -> int | list[bool]:
    """A per-layer setting in Megatron-LM's forms: an integer N (returned as is, at least 1), or a list of
    num_layers 0/1 entries, written out ('[1,0,1,0]') or as an expression of lists ('([0]*1+[1]*3)*2'), returned as
    booleans. ``name`` the key, ``zero`` / ``one`` what 0 and 1 mean, for the errors (ValueError)."""
    text = str(text).strip()
    try:
        value = _pattern_value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError):
        raise ValueError(f"{name} '{text}' must be an integer or a list of 0/1 per layer like '[1,0,1,0]' "
                         f"or '([0]*1+[1]*3)*2'") from None
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
        return value
    if len(value) != num_layers or any(v not in (0, 1) for v in value):
        raise ValueError(f"{name} '{text}' gives {len(value)} entries; it needs num_layers ({num_layers}) "
                         f"entries, each 0 ({zero}) or 1 ({one})")
    return [v == 1 for v in value]


def moe_layer_pattern(freq: str, num_layers: int) -> list[bool]:
    """Which of the ``num_layers`` layers are MoE layers under ``moe_layer_freq`` (Megatron-LM's forms): an integer
    N (layers 0, N, 2N, ...), or a pattern of num_layers 0/1 entries. Raises ValueError with the reason."""
    value = parse_layer_pattern(freq, num_layers, "moe_layer_freq", "dense", "MoE")
    if isinstance(value, int):
        return [i % value == 0 for i in range(num_layers)]
    return value


@functools.lru_cache(maxsize=64)
def _moe_layers(freq: str, num_layers: int) -> tuple[bool, ...]:
    """``moe_layer_pattern`` as a tuple, parsed once per (freq, num_layers): the memory estimate and the layout
    planner ask about every layer of every candidate layout."""
    return tuple(moe_layer_pattern(freq, num_layers))


def moe_layer_flags(cfg: ModelConfig, extra_layers: int = 0) -> tuple[bool, ...]:
    """``is_moe_layer`` of each decoder layer and of ``extra_layers`` after them (multi-token prediction modules',
    as the last layer), the pattern parsed once."""
    if not cfg.num_experts:
        return (False,) * (cfg.num_layers + extra_layers)
    pattern = _moe_layers(str(cfg.moe_layer_freq), cfg.num_layers)
    return pattern + pattern[-1:] * extra_layers


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether global layer ``layer`` is a MoE layer of the (validated) model. The layers after the decoder's
    (a multi-token prediction module's, ``megatron.model.mtp``) are as its last layer, as Megatron-LM builds them."""
    if not cfg.num_experts:
        return False
    return _moe_layers(str(cfg.moe_layer_freq), cfg.num_layers)[min(layer, cfg.num_layers - 1)]


def check_moe(config: Config) -> None:
    """The MoE settings (after the layout is known): the experts' layout (ep x etp over the ranks of a pipeline
    stage, ``megatron.parallel_state``) and the router's settings."""
    m, d = config.model, config.distributed
    _check_balancing(m)
    if d.expert_model_parallel_size < 1:
        _fail(f"expert_model_parallel_size must be at least 1, got {d.expert_model_parallel_size}.")
    if d.expert_tensor_parallel_size is not None and d.expert_tensor_parallel_size < 1:
        _fail(f"expert_tensor_parallel_size must be at least 1, got {d.expert_tensor_parallel_size}.")
    for name in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                 "moe_router_num_groups", "moe_router_group_topk"):
        if getattr(m, name) is not None and getattr(m, name) < 1:  # checked for a dense model too: a typo
            _fail(f"{name} must be at least 1, got {getattr(m, name)}.")
    for name in ("moe_z_loss_coeff", "moe_router_bias_update_rate"):
        if (getattr(m, name) or 0.0) < 0:
            _fail(f"{name} must be >= 0, got {getattr(m, name)}.")
    if m.moe_router_topk_scaling_factor is not None and not m.moe_router_topk_scaling_factor > 0:
        _fail(f"moe_router_topk_scaling_factor must be positive (or unset: 1), got {m.moe_router_topk_scaling_factor}.")
    if m.moe_expert_capacity_factor is not None and m.moe_expert_capacity_factor <= 0:
        _fail(f"moe_expert_capacity_factor must be positive (or unset: dropless), got {m.moe_expert_capacity_factor}.")
    if m.num_experts is None:
        if d.expert_model_parallel_size > 1 or d.expert_tensor_parallel_size not in (None, d.mp_degree):
            _fail("expert_model_parallel_size / expert_tensor_parallel_size lay out experts: give --num-experts too, "
                  "or leave them at their defaults for a dense model.")
        return
    try:
        pattern = moe_layer_pattern(m.moe_layer_freq, m.num_layers)
    except ValueError as err:
        _fail(str(err) + ".")
    if not 1 <= m.moe_router_topk <= m.num_experts:
        _fail(f"moe_router_topk ({m.moe_router_topk}) must be from 1 to num_experts ({m.num_experts}).")
    if not any(pattern):
        _fail(f"moe_layer_freq '{m.moe_layer_freq}' makes no layer a MoE layer; give at least one 1, or drop "
              f"--num-experts.")
    if m.moe_ffn_hidden_size is None:
        m.moe_ffn_hidden_size = m.ffn_hidden_size
    if m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
        _fail("moe_pad_expert_input_to_capacity needs a capacity: give --moe-expert-capacity-factor too.")
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        _fail("moe_router_enable_expert_bias (aux-loss-free balancing) needs --moe-router-score-function sigmoid, "
              "as in Megatron-LM.")
    _check_group_limited_routing(m)
    _check_router_extras(m)
    ep, etp, tp = d.expert_model_parallel_size, d.expert_tensor_parallel_size or d.mp_degree, d.mp_degree
    stage = tp * d.context_parallel_size * d.dp_degree * d.sharding.sharding_degree
    if m.num_experts % ep:
        _fail(f"num_experts ({m.num_experts}) must be divisible by expert_model_parallel_size ({ep}): each expert-"
              f"parallel rank holds num_experts / {ep} experts.")
    if stage % (ep * etp):
        _fail(f"expert_model_parallel_size x expert_tensor_parallel_size ({ep} x {etp}) must divide the {stage} ranks "
              f"of a pipeline stage (mp_degree x context_parallel_size x dp_degree x sharding_degree): the experts are "
              f"laid out over the same ranks.")
    if m.moe_ffn_hidden_size % etp:
        _fail(f"moe_ffn_hidden_size ({m.moe_ffn_hidden_size}) must be divisible by expert_tensor_parallel_size "
              f"({etp}).")
    if tp > 1 and not d.sequence_parallel and config.dataset.max_seq_len % tp:
        _fail(f"a MoE layer under mp_degree {tp} routes each rank's share of the sequence: max_seq_len "
              f"({config.dataset.max_seq_len}) must be divisible by {tp} (or use --sequence-parallel).")


def _check_group_limited_routing(m) -> None:
    """moe_router_num_groups G and moe_router_group_topk g: both or neither; G divides the experts; g <= G; and k
    such that each chosen group contributes to its score (k >= g) and the g groups hold k experts."""
    groups, chosen, k = m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_topk
    if groups is None and chosen is None:
        return
    if groups is None or chosen is None:
        _fail("group-limited routing takes both --moe-router-num-groups and --moe-router-group-topk; give both, or "
              "neither.")
    if groups < 1 or chosen < 1:
        _fail(f"moe_router_num_groups ({groups}) and moe_router_group_topk ({chosen}) must be at least 1.")
    if m.num_experts % groups:
        _fail(f"moe_router_num_groups ({groups}) must divide num_experts ({m.num_experts}): the groups are equal.")
    if chosen > groups:
        _fail(f"moe_router_group_topk ({chosen}) must be at most moe_router_num_groups ({groups}).")
    if k < chosen:
        _fail(f"moe_router_topk ({k}) must be at least moe_router_group_topk ({chosen}): a group is scored by the sum "
              f"of its top moe_router_topk / moe_router_group_topk scores, none with fewer.")
    if k > chosen * (m.num_experts // groups):
        _fail(f"moe_router_topk ({k}) exceeds the experts of the {chosen} chosen groups ({chosen} x "
              f"{m.num_experts // groups}); raise --moe-router-group-topk or lower the top-k.")


BALANCING_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss")  # the types that are losses (one coefficient each)


def balancing_coefficients(m) -> dict[str, float]:
    """{loss type: coefficient} of the balancing losses of a validated ``ModelConfig`` that join the objective (a
    positive coefficient): none for ``none`` and ``sinkhorn``; one entry per listed type (Megatron Core's
    ``get_aux_loss_coeff``)."""
    types, coeffs = m.moe_router_load_balancing_type or "none", m.moe_aux_loss_coeff
    types, coeffs = [types] if isinstance(types, str) else types, coeffs if isinstance(coeffs, list) else [coeffs]
    return {t: float(c) for t, c in zip(types, coeffs) if t in BALANCING_LOSSES and c and c > 0}


def first_coefficient(coeff) -> float:
    """A one-value form of ``moe_aux_loss_coeff`` (Hugging Face's ``router_aux_loss_coef``): the coefficient, or of
    a list the first type's."""
    return float(coeff[0] if isinstance(coeff, list) else coeff or 0.0)


def _check_balancing(m) -> None:
    """moe_router_load_balancing_type and moe_aux_loss_coeff: one type with one coefficient, or (Megatron Core's
    lists) several loss types with one coefficient each; a one-entry list is its entry (as Megatron-LM reads it).
    And the router input's jitter."""
    types = "none" if m.moe_router_load_balancing_type is None else m.moe_router_load_balancing_type
    coeffs = 0.0 if m.moe_aux_loss_coeff is None else m.moe_aux_loss_coeff
    types = types[0] if isinstance(types, list) and len(types) == 1 else types
    coeffs = coeffs[0] if isinstance(coeffs, list) and len(coeffs) == 1 else coeffs
    m.moe_router_load_balancing_type, m.moe_aux_loss_coeff = types, coeffs
    if m.moe_input_jitter_eps is not None and not 0 < m.moe_input_jitter_eps < float("inf"):
        _fail(f"moe_input_jitter_eps must be positive (the noise is uniform in [1 - eps, 1 + eps]), or unset, got "
              f"{m.moe_input_jitter_eps}.")
    for c in coeffs if isinstance(coeffs, list) else [coeffs]:
        if not 0 <= c < float("inf"):
            _fail(f"moe_aux_loss_coeff must be >= 0, got {c}.")
    if isinstance(types, str):
        if isinstance(coeffs, list):
            _fail(f"moe_aux_loss_coeff gives {len(coeffs)} coefficients for the one load-balancing type {types}; "
                  f"give one, or list as many types in --moe-router-load-balancing-type.")
        if types == "sinkhorn" and coeffs > 0:
            _fail("sinkhorn load balancing has no auxiliary loss: set --moe-aux-loss-coeff 0 (as Megatron-LM "
                  "requires), or choose a loss type.")
        return
    extra = [t for t in types if t not in BALANCING_LOSSES]
    if extra:
        _fail(f"moe_router_load_balancing_type lists {', '.join(extra)}; a list combines losses only ("
              f"{', '.join(BALANCING_LOSSES)}): give sinkhorn or none alone.")
    if len(set(types)) < len(types):
        _fail(f"moe_router_load_balancing_type lists a type twice ({', '.join(types)}); give each once.")
    if not isinstance(coeffs, list) or len(coeffs) != len(types):
        given = len(coeffs) if isinstance(coeffs, list) else 1
        _fail(f"moe_aux_loss_coeff gives {given} coefficient(s) for the {len(types)} load-balancing types "
              f"{', '.join(types)}; give one per type, in the same order.")


def _check_router_extras(m) -> None:
    """Sinkhorn routing's limits (Megatron Core's, and the settings it ignores), the shared expert's gate."""
    if m.moe_router_load_balancing_type == "sinkhorn":
        for on, setting in ((m.moe_expert_capacity_factor is not None, "a capacity (moe_expert_capacity_factor)"),
                            (m.moe_router_score_function != "softmax", "moe_router_score_function sigmoid"),
                            (m.moe_router_enable_expert_bias, "the expert bias"),
                            (bool(m.moe_router_group_topk), "group-limited routing"),
                            (m.moe_router_topk_scaling_factor not in (None, 1.0), "moe_router_topk_scaling_factor")):
            if on:
                _fail(f"sinkhorn routing does not take {setting} (its probabilities are the softmax, or for top-1 "
                      f"the sigmoid, of the logits, dropless); remove it or choose another load-balancing type.")
    if m.moe_shared_expert_gate and not m.moe_shared_expert_intermediate_size:
        _fail("moe_shared_expert_gate gates the shared expert: give --moe-shared-expert-intermediate-size too.")
    if (m.moe_shared_expert_overlap and m.moe_shared_expert_intermediate_size
            and m.moe_token_dispatcher_type != "alltoall"):
        _fail("moe_shared_expert_overlap runs the shared expert during the alltoall dispatcher's token exchange (as "
              "in Megatron-LM): use --moe-token-dispatcher-type alltoall or drop --moe-shared-expert-overlap.")
