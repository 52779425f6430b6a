"""The attention's settings: multi-latent attention and YaRN (``megatron.model.mla``, ``megatron.model.rotary.Yarn``),
sliding windows and the softmax's sinks (``window_layers``, ``megatron.context_parallel``), gated MLPs' offsets and
clamps; multi-token prediction (``megatron.model.mtp``)."""

from __future__ import annotations

import math

from megatron.config.bounds import MAXIMA
from megatron.config.cli import fail as _fail
from megatron.config.schema import Config

YARN_DEFAULTS = {"rope_type": None, "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
                 "original_max_position_embeddings": 4096}


def check_attention(config: Config, warnings: list[str] | None = None) -> None:
    m, d = config.model, config.distributed
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                 "original_max_position_embeddings"):  # checked for every model: a typo is never meant
        if getattr(m, name) < 1:
            _fail(f"{name} must be at least 1, got {getattr(m, name)}.")
    if m.q_lora_rank is not None and m.q_lora_rank < 1:
        _fail(f"q_lora_rank must be at least 1 (or unset: one query projection), got {m.q_lora_rank}.")
    for name in ("rotary_scaling_factor", "mscale", "mscale_all_dim"):
        value = getattr(m, name)
        if not math.isfinite(value) or value < 0 or (name == "rotary_scaling_factor" and value <= 0):
            _fail(f"{name} must be a finite {'positive' if name == 'rotary_scaling_factor' else 'non-negative'} "
                  f"number, got {value}.")
    for name in ("yarn_beta_fast", "yarn_beta_slow"):
        if not math.isfinite(getattr(m, name)) or getattr(m, name) <= 0:
            _fail(f"{name} must be a finite positive number, got {getattr(m, name)}.")
    problem = yarn_problem(m.rotary_scaling_factor, m.yarn_beta_fast, m.yarn_beta_slow)
    if problem is not None:
        _fail(f"{problem}.")
    check_window(config)
    if m.multi_latent_attention and m.add_qkv_bias:
        _fail("add_qkv_bias puts a bias on the fused query/key/value projection, which multi-latent attention does not "
              "have (its projections have no bias); drop one of them.")
    if not m.multi_latent_attention:
        yarn = m.position_embedding_type == "yarn"
        if m.rope_type not in (None, "rope"):
            _fail(f"rope_type {m.rope_type} is multi-latent attention's; other attention takes YaRN from "
                  f"--position-embedding-type yarn.")
        changed = [name for name, default in YARN_DEFAULTS.items() if name != "rope_type" and
                   getattr(m, name) != default and not yarn]  # rope_type rope: Megatron-LM's for any attention
        if changed:
            _fail(f"{', '.join(changed)} given without --multi-latent-attention or --position-embedding-type yarn: "
                  f"they set YaRN's frequencies and would change nothing; drop them or pass "
                  f"--position-embedding-type yarn (Llama 3's --use-rope-scaling is not built).")
        return
    if m.position_embedding_type not in ("rope", "yarn"):
        _fail(f"multi-latent attention takes --position-embedding-type rope (its rotary channels; rope_type chooses "
              f"YaRN), got {m.position_embedding_type}.")
    if m.qk_pos_emb_head_dim % 2:
        _fail(f"qk_pos_emb_head_dim ({m.qk_pos_emb_head_dim}) must be even: rotary embeddings turn channel pairs.")
    if m.group_query_attention:
        _fail("group_query_attention shapes SelfAttention's heads; multi-latent attention's are qk_head_dim, "
              "qk_pos_emb_head_dim and v_head_dim: drop it.")
    if m.kv_channels is not None and warnings is not None:  # Megatron-LM's DeepSeek scripts give it; unused there too
        warnings.append(f"kv_channels ({m.kv_channels}) shapes nothing under multi-latent attention, as in "
                        f"Megatron-LM: its heads are qk_head_dim + qk_pos_emb_head_dim and v_head_dim wide.")
    if m.num_attention_heads % d.mp_degree:
        _fail(f"num_attention_heads ({m.num_attention_heads}) must be divisible by the tensor-parallel size "
              f"mp_degree ({d.mp_degree}): each rank holds whole heads.")


def yarn_problem(factor: float, beta_fast: float, beta_slow: float,
                 names: tuple[str, str, str] = ("rotary_scaling_factor", "yarn_beta_fast", "yarn_beta_slow")
                 ) -> str | None:
    """What is wrong with YaRN's factor and ramp (named ``names``: ours, or a config.json's), or None. Both are
    refused where transformers only warns (``_validate_yarn_rope_parameters``: "must be ... >= 1", "must be greater
    than beta_slow") and builds the model anyway: a factor below 1 shrinks the context YaRN is there to extend (its
    frequencies interpolated upwards, its attention scale left at 1), and ``beta_fast`` below ``beta_slow`` reverses
    the ramp, interpolating the fast channels YaRN keeps and keeping the slow ones it interpolates. No published
    model has either, so refusing breaks none; a factor of 1 (no scaling) and equal betas (a step for a ramp) stay
    allowed. The one rule for our flags (``check_attention``) and a config.json
    (``megatron/checkpoint/hf/config_checks.py``)."""
    factor_name, fast_name, slow_name = names
    if factor < 1:
        return (f"{factor_name} {factor} is below 1: YaRN extends the original context by this factor (1 leaves the "
                f"rotary frequencies as they are), so it must be at least 1")
    if beta_fast < beta_slow:
        return (f"{fast_name} {beta_fast} is below {slow_name} {beta_slow}: YaRN keeps the channels turning at least "
                f"{fast_name} times over the original context and interpolates those turning at most {slow_name} "
                f"times, so {fast_name} must be at least {slow_name}")
    return None


def check_mtp(config: Config) -> None:
    m = config.model
    if not math.isfinite(m.mtp_loss_scaling_factor) or m.mtp_loss_scaling_factor < 0:
        _fail(f"mtp_loss_scaling_factor must be a finite non-negative number, got {m.mtp_loss_scaling_factor}.")
    if m.mtp_num_layers is None:
        return
    seq = config.dataset.max_seq_len
    if not 1 <= m.mtp_num_layers < seq:
        _fail(f"mtp_num_layers must be at least 1 and below the sequence length ({seq}), got {m.mtp_num_layers} "
              f"(unset it to turn multi-token prediction off).")


def parse_window(text: str | None) -> int | None:
    """``window_size`` 'LEFT,RIGHT' -> LEFT (the keys before each query it sees), or None: no window (unset, or LEFT
    -1). ValueError with the reason."""
    if text is None:
        return None
    parts = [p.strip() for p in str(text).strip("()[] ").split(",")]
    try:
        left, right = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"window_size must be two integers LEFT,RIGHT like 127,0, got '{text}'") from None
    if right != 0:
        raise ValueError(f"window_size's RIGHT must be 0 (a causal model sees no later token), got '{text}'")
    if left < -1:
        raise ValueError(f"window_size's LEFT must be at least 0 (or -1: no limit), got '{text}'")
    if left >= MAXIMA["max_position_embeddings"]:  # its export's sliding_window (LEFT + 1) is bounded as positions
        raise ValueError(f"window_size's LEFT is {left:,}, not below the most positions this framework accepts "
                         f"({MAXIMA['max_position_embeddings']:,}): for no limit give -1,0")
    return None if left == -1 else left


def window_layers(cfg) -> list[bool]:
    """Per decoder layer (0-based), whether it has the sliding window (Megatron Core's
    ``is_layer_window_attention`` over 1-based layer numbers): ``window_attn_skip_freq`` N keeps full attention in
    the layers numbered N, 2N, ...; a pattern marks the window layers with 1."""
    from megatron.config.validate_moe import parse_layer_pattern

    if parse_window(cfg.window_size) is None:
        return [False] * cfg.num_layers
    freq = cfg.window_attn_skip_freq
    if freq is None:
        return [True] * cfg.num_layers
    pattern = parse_layer_pattern(freq, cfg.num_layers, "window_attn_skip_freq", "full attention", "sliding window")
    if isinstance(pattern, int):
        return [(i + 1) % pattern != 0 for i in range(cfg.num_layers)]
    return pattern


def layer_window(cfg, layer: int) -> int | None:
    """The window (keys before each query) of global layer ``layer``, or None: full attention. Layers after the
    decoder's (multi-token prediction's) are as its last layer."""
    left = parse_window(cfg.window_size)
    if left is None:
        return None
    return left if window_layers(cfg)[min(layer, cfg.num_layers - 1)] else None


def check_window(config: Config) -> None:
    m = config.model
    try:
        left = parse_window(m.window_size)
        window_layers(m)
    except ValueError as err:
        _fail(f"{err}.")
    if left is None and m.window_attn_skip_freq is not None:
        _fail("window_attn_skip_freq chooses which layers keep the sliding window of window_size, which is unset: "
              "set --window-size LEFT,0 or drop it.")
    if m.multi_latent_attention and (left is not None or m.softmax_type != "vanilla"):
        _fail("sliding windows and attention sinks (window_size, softmax_type) are built for standard attention, "
              "not multi-latent attention: drop them or --multi-latent-attention.")
    if m.activation_func_clamp_value is not None and not m.activation_func_clamp_value > 0:
        _fail(f"activation_func_clamp_value must be positive (or unset), got {m.activation_func_clamp_value}.")
    gated = m.swiglu or m.quick_geglu
    if not gated and (m.glu_linear_offset != 0.0 or m.activation_func_clamp_value is not None):
        _fail("glu_linear_offset and activation_func_clamp_value shape gated MLPs: add --quick-geglu or --swiglu, or "
              "drop them.")
    chosen = [name for name in ("swiglu", "quick_geglu", "squared_relu") if getattr(m, name)]
    if len(chosen) > 1:
        _fail(f"{' and '.join(chosen)} are different MLP activations: choose one.")
