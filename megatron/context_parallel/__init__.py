"""Context parallelism: a sequence split over ranks (``layout``), the blocks attention computes (``plan``:
context-parallel chunks, packed documents, sliding windows), attention across the split, over packed documents,
in windows and with sinks (``attention``, on the block kernels of ``blocks``)."""

from megatron.context_parallel.attention import AttentionPlan, attend, masked_attention
from megatron.context_parallel.layout import chunk_ids, local_positions, split_batch

__all__ = ["AttentionPlan", "attend", "chunk_ids", "local_positions", "masked_attention", "split_batch"]
