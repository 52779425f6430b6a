"""Context parallelism applied to a built GPT, the recipe's step: the model's attention plans this rank's share
of the split (``cp_size`` ranks, this one ``cp_rank``, their ``group``), the communication type and the exchange
that runs it (``attention.exchange``); the data loader gives each rank its two chunks of every sample
(``layout.py``), and every attention layer attends through the plan (``megatron.attention.local.attend``)."""

from __future__ import annotations

import functools

from torch import nn

from megatron.context_parallel.attention import CpLevels, exchange


def apply_context_parallel(model: nn.Module, size: int, rank: int, group, comm_type: str,
                           levels: CpLevels | None = None) -> nn.Module:
    """Set the split on every module of ``model`` that plans attention (``cp_comm_type`` on its class: the GPT);
    ``levels``: a2a+p2p's two levels of the group (``CpLevels.of(parallel_state.get())``). Returns ``model``."""
    if size > 1 and comm_type == "a2a+p2p" and levels is None:
        raise ValueError("--cp-comm-type a2a+p2p runs over the two levels of the cp group: pass them (levels)")
    for module in model.modules():
        if "cp_comm_type" in vars(type(module)):
            module.cp_size, module.cp_rank, module.cp_group, module.cp_comm_type = size, rank, group, comm_type
            module.cp_exchange = exchange if levels is None else functools.partial(exchange, levels=levels)
    return model
