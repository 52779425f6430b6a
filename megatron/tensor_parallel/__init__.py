"""Tensor (and sequence) parallelism in the style of Megatron-LM: communication mappings,
column/row-parallel linear layers, a vocabulary-parallel embedding and cross entropy, and
random streams with activation recompute that replays them. Activations are ``[s, b, h]``."""

from megatron.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    mark_sequence_parallel,
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
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    get_rng_tracker,
    model_parallel_seed,
)

__all__ = [
    "MODEL_PARALLEL_RNG",
    "ColumnParallelLinear",
    "RNGStatesTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "allreduce_sequence_parallel_grads",
    "checkpoint",
    "copy_to_tp_region",
    "gather_from_sequence_region",
    "gather_from_tp_region",
    "get_cuda_rng_tracker",
    "get_rng_tracker",
    "mark_sequence_parallel",
    "model_parallel_seed",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_sequence_region",
    "scatter_to_tp_region",
    "shard_full_tensor",
    "vocab_parallel_cross_entropy",
]
