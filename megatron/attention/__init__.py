"""Attention on blocks of queries and keys, the engine every attention layer runs: which blocks a micro-batch
computes (``plan``: packed documents, sliding windows, a context-parallel split's chunk pairs), their kernels with
log-sum-exp and the merge (``blocks``, tiled by ``tiling``), attention dropout by position (``dropout``), and the
paths on this rank's tokens (``local``: whole sequences, windows, sinks, the masked softmax). A split sequence's
exchange between ranks is ``megatron.context_parallel``'s, carried by the plan.

Import from the modules: this package imports nothing, so the memory estimate and the layout planner read
``tiling`` without torch.
"""
