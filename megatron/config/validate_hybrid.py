"""Hybrid models: which layers are Gated DeltaNet linear attention (``experimental_attention_variant``,
``linear_attention_freq``: Megatron-LM's forms), the layers of a hybrid model (``hybrid_override_pattern``: a Mamba-2
mixer, attention, an MLP or a mixture of experts, one per layer), and the checks of those settings (part of
``validate``)."""

from __future__ import annotations

import functools

from megatron.config.bounds import size_problem
from megatron.config.cli import fail as _fail
from megatron.config.schema import Config, ModelConfig
from megatron.config.validate_moe import parse_layer_pattern


def linear_attention_pattern(freq: str, num_layers: int) -> list[bool]:
    """Which of the ``num_layers`` layers are linear attention under ``linear_attention_freq``: an integer N ((N-1)
    linear layers, then one attention layer: layer i is attention when (i + 1) is a multiple of N), or a pattern of
    num_layers 0/1 entries (1: linear). Raises ValueError with the reason."""
    value = parse_layer_pattern(freq, num_layers, "linear_attention_freq", "attention", "linear attention")
    if isinstance(value, int):
        return [(i + 1) % value != 0 for i in range(num_layers)]
    return value


@functools.lru_cache(maxsize=64)
def _linear_layers(freq: str, num_layers: int) -> tuple[bool, ...]:
    return tuple(linear_attention_pattern(freq, num_layers))


def is_linear_attention_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether global layer ``layer`` of the (validated) model is Gated DeltaNet. The layers after the decoder's
    (multi-token prediction's) have softmax attention."""
    if cfg.experimental_attention_variant != "gated_delta_net" or layer >= cfg.num_layers:
        return False
    return _linear_layers(str(cfg.linear_attention_freq), cfg.num_layers)[layer]


def check_hybrid(config: Config) -> None:
    """The linear-attention settings, and what they do not compose with yet."""
    m, d = config.model, config.distributed
    for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                 "linear_num_value_heads"):
        problem = size_problem(name, getattr(m, name))
        if problem is not None or getattr(m, name) < 1:
            _fail(f"{problem or f'{name} is {getattr(m, name)}, below 1'}: give a width or count of at least 1.")
    if m.experimental_attention_variant is None:
        if m.linear_attention_freq is not None:
            _fail("linear_attention_freq chooses the linear-attention layers of experimental_attention_variant: give "
                  "--experimental-attention-variant gated_delta_net too, or drop it.")
        return
    if m.experimental_attention_variant != "gated_delta_net":
        _fail(f"experimental_attention_variant {m.experimental_attention_variant!r} is not built here (Megatron-LM's "
              f"dsa is DeepSeek sparse attention): the one built is gated_delta_net.")
    if m.linear_attention_freq is None:
        _fail("experimental_attention_variant gated_delta_net needs linear_attention_freq, the layers it replaces "
              "(e.g. --linear-attention-freq 4: three linear-attention layers, then one attention layer).")
    try:
        _linear_layers(str(m.linear_attention_freq), m.num_layers)
    except ValueError as err:
        _fail(f"{err}.")
    if m.linear_num_value_heads % m.linear_num_key_heads:
        _fail(f"linear_num_value_heads ({m.linear_num_value_heads}) must be a multiple of linear_num_key_heads "
              f"({m.linear_num_key_heads}): each key head serves the same number of value heads.")
    if m.linear_num_key_heads % d.mp_degree:
        _fail(f"linear_num_key_heads ({m.linear_num_key_heads}) must be divisible by the tensor-parallel size "
              f"({d.mp_degree}): each rank holds whole key heads with their value heads.")
    chunk = config.dataset.max_seq_len // (2 * d.context_parallel_size)
    if d.context_parallel_size > 1 and chunk < m.linear_conv_kernel_dim - 1:
        _fail(f"under context parallelism each rank's chunks hold {chunk} tokens (max_seq_len / (2 x cp)), fewer than "
              f"the Gated DeltaNet convolution's reach ({m.linear_conv_kernel_dim - 1} tokens back): use longer "
              f"sequences or a smaller context-parallel size.")


HYBRID_KINDS = {"M": "a Mamba-2 mixer", "*": "attention", "-": "an MLP", "E": "a mixture of experts"}
_MAMBA_SIZES = ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads")


def hybrid_layer_kind(cfg: ModelConfig, layer: int) -> str | None:
    """The kind of global layer ``layer`` of a hybrid model (``HYBRID_KINDS``), or None: a transformer layer
    (attention and an MLP)."""
    pattern = cfg.hybrid_override_pattern
    return pattern[layer] if pattern and layer < len(pattern) else None


def check_hybrid_pattern(config: Config) -> None:
    """A hybrid model's pattern and Mamba-2 sizes; fills ``moe_layer_freq`` from the pattern's E layers (the one rule
    every reader of MoE layers asks)."""
    m, d = config.model, config.distributed
    for name in _MAMBA_SIZES:
        value = getattr(m, name)
        problem = size_problem(name, value, "num_attention_heads" if name == "mamba_num_heads" else "kv_channels")
        if value is not None and (problem is not None or value < 1):
            _fail(f"{problem or f'{name} is {value}, below 1'}: give a width or count of at least 1.")
    pattern = m.hybrid_override_pattern
    if not pattern:
        if m.is_hybrid_model:
            _fail("is_hybrid_model needs hybrid_override_pattern, the layers one by one (e.g. "
                  "--hybrid-override-pattern 'M-M*-M-'): the ratios of Megatron-LM's allocation are not built here.")
        return
    unknown = sorted(set(pattern) - set(HYBRID_KINDS))
    if unknown:
        _fail(f"hybrid_override_pattern holds {''.join(unknown)!r}; its characters are "
              f"{', '.join(f'{k} ({v})' for k, v in HYBRID_KINDS.items())}.")
    if len(pattern) != m.num_layers:
        _fail(f"hybrid_override_pattern gives {len(pattern)} layers but num_layers is {m.num_layers}: make them equal.")
    for setting, why in ((m.experimental_attention_variant, "experimental_attention_variant"),
                         (m.mtp_num_layers, "mtp_num_layers (multi-token prediction)")):
        if setting:
            _fail(f"a hybrid model (hybrid_override_pattern) does not take {why} here: drop it.")
    experts = "E" in pattern
    if experts != bool(m.num_experts):
        _fail("hybrid_override_pattern's E layers are mixtures of experts: give --num-experts with them, and E "
              "layers with --num-experts.")
    if experts:
        m.moe_layer_freq = str([int(kind == "E") for kind in pattern]).replace(" ", "")
    if "M" in pattern:
        heads = m.mamba_num_heads or 2 * m.hidden_size // m.mamba_head_dim
        if heads < 1 or heads % m.mamba_num_groups or heads % d.mp_degree or m.mamba_num_groups % d.mp_degree:
            _fail(f"Mamba-2's {heads} heads must be a multiple of mamba_num_groups ({m.mamba_num_groups}), and both "
                  f"divisible by the tensor-parallel size ({d.mp_degree}).")
        chunk = config.dataset.max_seq_len // (2 * d.context_parallel_size)
        if d.context_parallel_size > 1 and chunk < 3:
            _fail(f"under context parallelism each rank's chunks hold {chunk} tokens (max_seq_len / (2 x cp)), fewer "
                  f"than the Mamba-2 convolution's reach (3 tokens back): use longer sequences or a smaller "
                  f"context-parallel size.")
