"""Context parallelism: a sequence split over ranks (``layout``), the blocks attention computes (``plan``:
context-parallel chunks, packed documents, sliding windows), attention across the split, over packed documents,
in windows and with sinks (``attention``, on the block kernels of ``blocks``, tiled by ``tiling``).

Import from the modules (``megatron.context_parallel.attention`` for ``AttentionPlan`` and ``attend``): this
package imports nothing, so the memory estimate and the layout planner read ``tiling`` without torch.
"""
