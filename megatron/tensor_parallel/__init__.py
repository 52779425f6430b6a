"""Tensor (and sequence) parallelism in the style of Megatron-LM: communication mappings,
column/row-parallel linear layers, a vocabulary-parallel embedding, the fused cross entropy (one
rank or vocabulary-parallel), and random streams with activation recompute that replays them.
Activations are ``[s, b, h]``."""

from megatron.tensor_parallel.cross_entropy import token_cross_entropy, vocab_parallel_cross_entropy
from megatron.tensor_parallel.fp8 import FP8Recipe
from megatron.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_matmul,
    enable_fp8,
    mark_sequence_parallel,
    set_async_communication,
    shard_full_tensor,
)
from megatron.tensor_parallel.mappings import (
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tp_region,
)
from megatron.tensor_parallel.random import (
    TENSOR_PARALLEL_RNG,
    RNGStatesTracker,
    checkpoint,
    get_rng_tracker,
    tensor_parallel_seed,
)

__all__ = [
    "TENSOR_PARALLEL_RNG",
    "ColumnParallelLinear",
    "FP8Recipe",
    "RNGStatesTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "checkpoint",
    "column_parallel_matmul",
    "copy_to_tp_region",
    "enable_fp8",
    "gather_from_sequence_region",
    "gather_from_tp_region",
    "get_rng_tracker",
    "mark_sequence_parallel",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_sequence_region",
    "scatter_to_tp_region",
    "set_async_communication",
    "shard_full_tensor",
    "tensor_parallel_seed",
    "token_cross_entropy",
    "vocab_parallel_cross_entropy",
]
