"""Context parallelism and packed documents: the checks of their settings (part of ``validate``)."""

from __future__ import annotations

import math

from megatron.config.cli import fail as _fail
from megatron.config.schema import Config


def check_context_parallel(config: Config) -> None:
    """``context_parallel_size`` cuts every sample into 2 x cp chunks (x tp under sequence parallelism, which
    splits each rank's chunks again); ``a2a`` gives each cp rank whole heads and query groups, ``a2a+p2p`` each rank
    of its inner (all-to-all) level."""
    d, m, seq = config.distributed, config.model, config.dataset.max_seq_len
    cp, tp = d.context_parallel_size, d.mp_degree
    _check_hierarchy(d.hierarchical_context_parallel_sizes, cp, d.cp_comm_type)
    if cp == 1:
        return
    unit = 2 * cp * (tp if d.sequence_parallel else 1)
    if seq % unit:
        how = f"2 x context_parallel_size x mp_degree = {unit} (sequence parallelism splits each rank's chunks " \
              f"over the tensor-parallel ranks)" if d.sequence_parallel else f"2 x context_parallel_size = {unit}"
        _fail(f"--context-parallel-size {cp} cuts each sample into {2 * cp} chunks: max_seq_len ({seq}) must be "
              f"divisible by {how}; change --seq-length or --context-parallel-size.")
    if d.cp_comm_type in ("a2a", "a2a+p2p"):
        nq = m.num_attention_heads
        ng = m.num_query_groups if m.group_query_attention and m.num_query_groups else nq
        a2a = cp if d.cp_comm_type == "a2a" else d.hierarchical_context_parallel_sizes[0]
        for what, count in (("attention heads", nq), ("query groups", ng)):
            if count % (tp * a2a) == 0:  # TransformerEngine's a2a splits the query groups too: none is repeated
                continue
            if d.cp_comm_type == "a2a":
                _fail(f"--cp-comm-type a2a gives each context-parallel rank whole heads: the {what} per tensor-"
                      f"parallel rank ({count} / mp_degree {tp}) must be divisible by --context-parallel-size {cp}; "
                      f"use --cp-comm-type p2p or all_gather, or another size.")
            _fail(f"--cp-comm-type a2a+p2p gives each rank of its all-to-all whole heads: the {what} per tensor-"
                  f"parallel rank ({count} / mp_degree {tp}) must be divisible by the inner size {a2a} of "
                  f"--hierarchical-context-parallel-sizes; use a smaller inner size, or --cp-comm-type p2p.")


def _check_hierarchy(sizes: list[int] | None, cp: int, comm_type: str) -> None:
    """``a2a+p2p`` needs the two levels of the cp group, whose product is its size (Megatron-LM's checks); given with
    another type they build no group and change nothing (as in Megatron-LM), but must still multiply to cp."""
    if sizes is None:
        if comm_type == "a2a+p2p":
            _fail("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes INNER OUTER (all-to-all within "
                  "groups of INNER cp ranks, a ring over OUTER groups); give them, their product "
                  f"--context-parallel-size {cp}.")
        return
    if comm_type == "a2a+p2p" and len(sizes) != 2:
        _fail(f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))} gives {len(sizes)} levels: a2a+p2p "
              f"has two (INNER for the all-to-all, OUTER for the ring); give two sizes.")
    if any(s < 1 for s in sizes) or math.prod(sizes) != cp:
        _fail(f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))} must be positive and multiply to "
              f"--context-parallel-size {cp}; change one of them.")
