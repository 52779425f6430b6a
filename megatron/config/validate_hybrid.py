"""Hybrid models: which layers are Gated DeltaNet linear attention (``experimental_attention_variant``,
``linear_attention_freq``: Megatron-LM's forms) and the checks of those settings (part of ``validate``)."""

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
