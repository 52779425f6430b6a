"""Context parallelism and packed documents: the checks of their settings (part of ``validate``)."""

from __future__ import annotations

from megatron.config.cli import fail as _fail
from megatron.config.schema import Config


def check_context_parallel(config: Config) -> None:
    """``context_parallel_size`` cuts every sample into 2 x cp chunks (x tp under sequence parallelism, which
    splits each rank's chunks again); ``a2a`` gives each cp rank whole heads and query groups."""
    d, m, seq = config.distributed, config.model, config.dataset.max_seq_len
    cp, tp = d.context_parallel_size, d.mp_degree
    if cp == 1:
        return
    unit = 2 * cp * (tp if d.sequence_parallel else 1)
    if seq % unit:
        how = f"2 x context_parallel_size x mp_degree = {unit} (sequence parallelism splits each rank's chunks " \
              f"over the tensor-parallel ranks)" if d.sequence_parallel else f"2 x context_parallel_size = {unit}"
        _fail(f"--context-parallel-size {cp} cuts each sample into {2 * cp} chunks: max_seq_len ({seq}) must be "
              f"divisible by {how}; change --seq-length or --context-parallel-size.")
    if d.cp_comm_type == "a2a":
        nq = m.num_attention_heads
        ng = m.num_query_groups if m.group_query_attention and m.num_query_groups else nq
        for what, count in (("attention heads", nq), ("query groups", ng)):
            if count % (tp * cp):
                _fail(f"--cp-comm-type a2a gives each context-parallel rank whole heads: the {what} per tensor-"
                      f"parallel rank ({count} / mp_degree {tp}) must be divisible by --context-parallel-size {cp}; "
                      f"use --cp-comm-type p2p or all_gather, or another size.")
