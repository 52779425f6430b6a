"""Gradient reductions across model-parallel ranks, after the backward and before the step.

- Sequence parallelism: parameters that saw only a sequence shard (LayerNorms, row-parallel
  biases; marked ``sequence_parallel``) have their gradients summed over the TP group.
- Pipeline parallelism: the word embedding lives on the first stage (lookup) and, as a copy,
  on the last (LM head); the two copies' gradients are summed over the embedding group so
  both take the same step and stay identical.

(Data-parallel reduction is the DataParallel wrapper's, overlapped with the backward.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron.parallel_state import ParallelState
from megatron.tensor_parallel import allreduce_sequence_parallel_grads

TIED_EMBEDDING = "embedding.word_embeddings.weight"


def _grad(param: torch.Tensor) -> torch.Tensor:
    return param.main_grad if hasattr(param, "main_grad") else param.grad


def finalize_model_grads(model: nn.Module, ps: ParallelState) -> None:
    params = list(model.parameters())
    if ps.tp_size > 1:
        allreduce_sequence_parallel_grads(params, ps.group("tp"))
    if ps.pp_size > 1 and (ps.is_first_stage or ps.is_last_stage):
        for name, param in model.named_parameters():
            if name.endswith(TIED_EMBEDDING):
                dist.all_reduce(_grad(param), group=ps.group("embedding"))
