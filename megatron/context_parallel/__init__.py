"""Context parallelism: a sequence split over ranks (``layout``), attention across the split and over
packed documents (``attention``, on the block kernels of ``blocks``)."""

from megatron.context_parallel.attention import AttentionPlan, attend
from megatron.context_parallel.layout import chunk_ids, local_positions, split_batch

__all__ = ["AttentionPlan", "attend", "chunk_ids", "local_positions", "split_batch"]
