"""The mixed-precision optimizer: fp32 master weights and main grads around AdamW.

Composition, not inheritance: this wrapper owns the flat parameter/gradient buffer, the fp32
master copy of the parameters (the model's own buffer when training in fp32), the loss
scaler and clipping; the inner ``torch.optim.AdamW`` sees one flat fp32 tensor per
weight-decay group and steps it with the fused kernel where available.

One step: unscale the fp32 gradients (fp16) and check them for inf/nan (skip the step and
back the scale off if found) -> global norm -> clip -> AdamW on the masters -> copy the
masters back into the low-precision parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron import parallel_state
from megatron.config.schema import OptimizerConfig
from megatron.distributed.param_and_grad_buffer import ParamAndGradBuffer
from megatron.optimizer.clip_grads import clip_grads, global_grad_norm, model_parallel_grad_norm
from megatron.optimizer.grad_scaler import ConstantGradScaler
from megatron.tensor_parallel.mappings import _reduce_scatter


def weight_decay_groups(model: nn.Module) -> tuple[list, list]:
    """(decay, no_decay) lists of (name, param): biases and norm weights (1-D) get no decay."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append((name, p))
    return decay, no_decay


@dataclass
class StepResult:
    applied: bool  # False when skipped for inf/nan gradients
    grad_norm: float | None  # before clipping; None when skipped


def _supports_fused(device: torch.device) -> bool:
    return device.type in ("cpu", "cuda")


class MixedPrecisionOptimizer:
    """``sharding_group``: each of its N ranks keeps fp32 master weights and AdamW states for only
    its 1/N of every buffer group, steps that slice, and all-gathers the updated parameters.
    Stage 1: gradients arrive already reduced over the whole data-parallel group. Stage 2:
    they arrive reduced over the replicas (dp) only; the step reduce-scatters each group over
    the sharding group into a persistent 1/N gradient shard and frees the full buffer, which
    is allocated again for the next backward."""

    def __init__(self, model: nn.Module, cfg: OptimizerConfig, grad_scaler: ConstantGradScaler | None = None,
                 model_parallel_group: dist.ProcessGroup | None = None,
                 sharding_group: dist.ProcessGroup | None = None, stage: int = 1):
        decay, no_decay = weight_decay_groups(model)
        # Reverse parameter order: the backward produces the last layers' gradients first, so
        # data-parallel buckets at the front of the buffer fill first.
        groups = [g[::-1] for g in (decay, no_decay) if g]
        decay_rates = [rate for g, rate in ((decay, cfg.weight_decay), (no_decay, 0.0)) if g]
        self.sharding_group = sharding_group
        n = dist.get_world_size(sharding_group) if sharding_group is not None else 1
        r = dist.get_rank(sharding_group) if sharding_group is not None else 0
        self.buffer = ParamAndGradBuffer(groups, pad_multiple=n)
        self.grad_scaler = grad_scaler
        self.max_norm = cfg.grad_clip
        low_precision = self.buffer.param_data.dtype != torch.float32
        self.shards = [(start + r * (end - start) // n, start + (r + 1) * (end - start) // n)
                       for start, end in self.buffer.group_bounds]
        self.stage = stage if sharding_group is not None else 1
        device = self.buffer.param_data.device
        shard_sizes = [b - a for a, b in self.shards]
        self.shard_grad = torch.zeros(sum(shard_sizes) if self.stage >= 2 else 0, device=device)
        self._shard_grads = list(self.shard_grad.split(shard_sizes)) if self.stage >= 2 else \
            [self.buffer.grad_data[a:b] for a, b in self.shards]
        param_groups = []
        self.masters: list[nn.Parameter] = []
        for (start, end), rate, grad in zip(self.shards, decay_rates, self._shard_grads):
            view = self.buffer.param_data[start:end]
            master = nn.Parameter(view.detach().float() if low_precision else view, requires_grad=False)
            master.grad = grad
            self.masters.append(master)
            param_groups.append({"params": [master], "weight_decay": rate})
        self.inner = torch.optim.AdamW(param_groups, lr=0.0, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                       eps=cfg.adam_epsilon, fused=_supports_fused(device))
        self._low_precision = low_precision
        # Model parallelism (tp x pp): the global norm counts every element once. A rank counts its
        # tensor-parallel shards, its TP-replicated parameters only on tp rank 0, and never the last
        # pipeline stage's copy of the tied embedding, each within its optimizer shard; the squares
        # are summed over the sharding and model-parallel groups.
        self.model_parallel_group = model_parallel_group
        self._reduce_groups = [g for g in (sharding_group, model_parallel_group) if g is not None]
        tp_rank = parallel_state.get().tp_rank
        counted = {name for name, p in decay + no_decay
                   if (getattr(p, "tensor_model_parallel", False) or tp_rank == 0)
                   and not getattr(p, "tied_copy", False)}
        self._counted = [grad[max(rg.start, a) - a:min(rg.end, b) - a]
                         for rg in self.buffer.ranges if rg.name in counted
                         for (a, b), grad in zip(self.shards, self._shard_grads) if max(rg.start, a) < min(rg.end, b)]

    @property
    def loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def zero_grad(self) -> None:
        self.buffer.zero_grad()

    def main_grads(self) -> list[torch.Tensor]:
        """The gradients this rank steps: its shard of each group (the whole buffer unsharded)."""
        if self.sharding_group is None:
            return [self.buffer.grad_data]
        return self._shard_grads

    def _found_inf(self, grads: list[torch.Tensor]) -> bool:
        found = torch.stack([~torch.isfinite(g).all() for g in grads]).any().float()
        for group in self._reduce_groups:  # every rank skips the step if any shard overflowed
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found)

    def grad_norm(self) -> torch.Tensor:
        if not self._reduce_groups:
            return global_grad_norm(self.main_grads())
        return model_parallel_grad_norm(self._counted, self._reduce_groups, self.buffer.grad_data.device)

    def _reduce_scatter_grads(self) -> None:
        """Stage 2: sum each group's gradients over the sharding group into this rank's shard,
        then free the full buffer."""
        for (start, end), shard in zip(self.buffer.group_bounds, self._shard_grads):
            shard.copy_(_reduce_scatter(self.buffer.grad_data[start:end], self.sharding_group))
        self.buffer.release_grads()

    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        if self.stage >= 2:
            self._reduce_scatter_grads()
        grads = self.main_grads()
        if self.grad_scaler is not None:
            for g in grads:
                g.mul_(1.0 / self.grad_scaler.scale)
            found_inf = self._found_inf(grads)
            self.grad_scaler.update(found_inf)
            if found_inf:
                return StepResult(False, None)
        norm = self.grad_norm()
        clip_grads(grads, self.max_norm, norm)
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()
        for master, (start, end), bounds in zip(self.masters, self.shards, self.buffer.group_bounds):
            if self._low_precision:
                self.buffer.param_data[start:end].copy_(master)
            if self.sharding_group is not None:  # every rank gets every shard's update
                size = dist.get_world_size(self.sharding_group)
                pieces = list(self.buffer.param_data[bounds[0]:bounds[1]].chunk(size))
                dist.all_gather(pieces, self.buffer.param_data[start:end].clone(), group=self.sharding_group)
        return StepResult(True, float(norm))
