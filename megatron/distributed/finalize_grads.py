"""Gradient reductions across model-parallel ranks, after the backward and before the step.

- Sequence parallelism: parameters that saw only a sequence shard (LayerNorms, row-parallel
  biases; marked ``sequence_parallel``) have their gradients summed over the TP group.
- Pipeline parallelism, tied head: the word embedding lives on the first stage (lookup) and, as a
  copy, on the last (LM head); the two copies' gradients (parameters marked ``shared_embedding``)
  are summed over the embedding group so both take the same step and stay identical. An untied
  model (``output_layer``) marks nothing on either stage, so neither joins the sum.

- Experts cut over the expert-tensor-parallel ranks: an expert's replicated output bias is added on the first
  of them only (``megatron.moe.experts``; marked ``expert_tp_replicated``): its gradient is summed over the etp group.

(Data-parallel reduction is the DataParallel wrapper's, done before this.) Under
ZeRO stage 2/3 the gradients are already reduce-scattered here, so each rank reduces the part of
these gradients its shard holds: the layouts agree across the TP group (same shapes) and across
the embedding group (the tied embedding is a bucket of its own).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron.distributed.param_and_grad_buffer import ParamAndGradBuffer
from megatron.parallel_state import ParallelState


def finalize_model_grads(model: nn.Module, ps: ParallelState, buffer: ParamAndGradBuffer) -> None:
    if ps.tp_size > 1:
        sp = [g for p in model.parameters() if getattr(p, "sequence_parallel", False)
              if (g := buffer.reduced_grad(p)) is not None]
        _all_reduce_coalesced(sp, ps.group("tp"))
    if ps.etp_size > 1:
        replicated = [g for p in model.parameters() if getattr(p, "expert_tp_replicated", False)
                      if (g := buffer.reduced_grad(p)) is not None]
        _all_reduce_coalesced(replicated, ps.group("etp"))
    if ps.pp_size > 1 and (ps.is_first_stage or ps.is_last_stage):
        tied = [g for p in model.parameters() if getattr(p, "shared_embedding", False)
                if (g := buffer.reduced_grad(p)) is not None]
        _all_reduce_coalesced(tied, ps.group("embedding"))


def _all_reduce_coalesced(grads: list[torch.Tensor], group) -> None:
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(reduced.view_as(g))
