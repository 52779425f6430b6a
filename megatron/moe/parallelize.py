"""Expert parallelism applied to a built GPT, the recipe's step: each MoE layer keeps this rank's share of the
experts (``ep``: the experts split over the ranks; ``etp``: each expert's width split, ``experts.py``), exchanges
tokens over the expert groups (``dispatch.Groups``), routes the tokens no other rank of its tensor-parallel group
routes, and counts its statistics once per micro-batch (``stats.py``). The layout comes from the rank grid
(``ExpertLayout.of``), read by the recipe and handed here."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatron.moe.dispatch import Groups
from megatron.moe.experts import Experts
from megatron.moe.layer import MoELayer
from megatron.tensor_parallel.layers import mark_sequence_parallel


@dataclass(frozen=True)
class ExpertLayout:
    """This rank's place in the expert groups: ``ep_rank`` of ``ep_size``, ``etp_rank`` of ``etp_size``; ``groups``
    (None for one rank); the tensor-parallel group whose ranks split a layer's tokens (``tp_group``, ``tp_size``);
    ``token_group``: the ranks holding parts of the same samples (tp x cp: the balancing losses' counts);
    ``token_share``: whether this rank counts each micro-batch (the first of them); ``batch_ranks``: the ranks the
    global batch is cut over (dp x sharding: the auxiliary losses' gradient scale); ``batch_group``: the
    ``data_parallel`` group (dp x sharding x cp), over which with ``tp_group`` ``global_aux_loss`` sums its counts."""

    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    groups: Groups | None = None
    tp_size: int = 1
    tp_group: object = None
    token_group: object = None
    token_share: bool = True
    batch_ranks: int = 1
    batch_group: object = None

    @classmethod
    def of(cls, ps) -> ExpertLayout:
        """The layout of the rank grid ``ps`` (``parallel_state.ParallelState``)."""
        groups = Groups(*(ps.group(n) if size > 1 else None for n, size in
                          (("ep", ps.ep_size), ("etp", ps.etp_size), ("ep_etp", ps.ep_size * ps.etp_size))))
        return cls(ps.ep_rank, ps.ep_size, ps.etp_rank, ps.etp_size, groups, ps.tp_size,
                   ps.group("tp") if ps.tp_size > 1 else None,
                   ps.group("tp_cp") if ps.tp_size * ps.cp_size > 1 else None,
                   ps.tp_rank == 0 and ps.cp_rank == 0, ps.data_parallel_size,
                   ps.group("data_parallel") if ps.gradient_sum_size > 1 else None)


def apply_expert_parallel(model: nn.Module, layout: ExpertLayout) -> nn.Module:
    """Every MoE layer of ``model`` (built whole, on the meta device) cut to ``layout``; returns ``model``."""
    for layer in (m for m in model.modules() if isinstance(m, MoELayer)):
        layer.tp_size, layer.tp_group, layer.token_group = layout.tp_size, layout.tp_group, layout.token_group
        layer.token_share, layer.batch_ranks = layout.token_share, layout.batch_ranks
        layer.groups = layout.groups or Groups()
        layer.router.batch_ranks = layout.batch_ranks
        layer.router.global_groups = tuple(g for g in (layout.tp_group, layout.batch_group) if g is not None)
        if layout.tp_size > 1:  # each tensor-parallel rank routes its own share of the tokens
            mark_sequence_parallel(layer.router)
        if (layout.ep_size, layout.etp_size) != (1, 1):
            with torch.device(layer.router.weight.device):
                layer.experts = Experts(layer.experts.cfg, layout.ep_rank, layout.ep_size, layout.etp_rank,
                                        layout.etp_size)
    return model
