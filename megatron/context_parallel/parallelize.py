"""Context parallelism applied to a built GPT, the recipe's step: the model's attention plans this rank's share
of the split (``cp_size`` ranks, this one ``cp_rank``, their ``group``), the communication type and the exchange
that runs it (``attention.exchange``); the data loader gives each rank its two chunks of every sample
(``layout.py``), and every attention layer attends through the plan (``megatron.attention.local.attend``)."""

from __future__ import annotations

from torch import nn

from megatron.context_parallel.attention import exchange


def apply_context_parallel(model: nn.Module, size: int, rank: int, group, comm_type: str) -> nn.Module:
    """Set the split on every module of ``model`` that plans attention (``cp_comm_type`` on its class: the GPT);
    returns it."""
    for module in model.modules():
        if "cp_comm_type" in vars(type(module)):
            module.cp_size, module.cp_rank, module.cp_group, module.cp_comm_type = size, rank, group, comm_type
            module.cp_exchange = exchange
    return model
