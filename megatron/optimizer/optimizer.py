"""The mixed-precision optimizer: fp32 master weights and main grads around AdamW (or SGD, ``sgd.py``).

Composition, not inheritance: this wrapper owns the flat parameter/gradient buffer, the fp32
master copy of the parameters (the model's own buffer when training in fp32), the loss
scaler and clipping; the inner AdamW (``megatron.optimizer.adamw``: torch's fused kernel without
``torch.optim``'s machinery) sees one flat fp32 tensor per piece and steps it.

One step: unscale the fp32 gradients (fp16) and check them for inf/nan (skip the step and
back the scale off if found) -> global norm (skip the step if it is not finite, in every
precision) -> clip -> AdamW on the masters -> copy the masters back into the low-precision
parameters.

Sharding (ZeRO, by the ``ShardingPlan``, over its sharding group of N ranks): the buffer it is
given is cut into buckets and each rank owns a contiguous 1/N slice of every bucket; it keeps fp32
master weights and AdamW states for that slice only, and steps it. The gradients arrive reduced
(all-reduced, or reduce-scattered into a 1/N shard from stage 2); after the step each bucket
publishes the updated slice (all-gathered into every rank's full parameters, or, under stage 3,
kept as the shard). Offload: the masters and AdamW states live on the CPU and the step runs there
(torch's fused CPU AdamW kernel); the clipped gradient shard goes down, the updated low-precision
parameters come back. The optimizer builds no buckets and decides no stage: ``parallelize`` does.

bf16 main grads (``grad_reduce_in_bf16``: accumulated and reduced in bf16): the step first copies this rank's
reduced slice into fp32 (exact), as Megatron-LM's optimizer does, and computes the norm, clips and steps in fp32;
the copy lives for the step only (on the CPU under offload, its gradient copy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron import device as dev
from megatron.config.schema import OptimizerConfig
from megatron.distributed.parallelize import ShardingPlan, counts_once
from megatron.distributed.param_and_grad_buffer import ParamAndGradBuffer
from megatron.optimizer.adamw import AdamW, has_fused_kernel
from megatron.optimizer.clip_grads import clip_grads, global_grad_norm, model_parallel_grad_norm
from megatron.optimizer.grad_scaler import ConstantGradScaler
from megatron.optimizer.muon import ChainedInner, Muon, MuonMatrix, MuonSettings, cut_pieces
from megatron.optimizer.param_groups import regroup
from megatron.optimizer.sgd import SGD


@dataclass
class StepResult:
    applied: bool  # False when skipped for inf/nan gradients
    grad_norm: float | None  # before clipping; None when skipped
    moe: dict | None = None  # a MoE model's load_balancing_loss and expert_load_max (megatron.moe.stats)
    mtp: dict | None = None  # multi-token prediction's mtp_loss, one per depth (megatron.model.mtp)
    max_attention_logit: float | None = None  # QK-clip's largest logit of the step (megatron.optimizer.qk_clip)


class MixedPrecisionOptimizer:
    """AdamW (``cfg.optimizer`` sgd: SGD) over this rank's slice of ``buffer`` (the whole buffer unsharded), sharded
    and offloaded as ``plan`` says (see the module doc)."""

    def __init__(self, buffer: ParamAndGradBuffer, plan: ShardingPlan, cfg: OptimizerConfig,
                 grad_scaler: ConstantGradScaler | None = None,
                 muon: tuple[MuonSettings, list[MuonMatrix]] | None = None, mup_width: float = 1.0):
        """``muon``: Muon's settings and matrices (``muon.muon_matrices``), which it steps instead of AdamW.
        ``mup_width``: muP's width multiplier m (``validate_mup.width_mult``); != 1 puts the parameters muP scales
        (``param_groups.mup_scaled``) in groups of their own, at ``self.mup_lr`` (and AdamW's epsilon / m)."""
        self.buffer, self.plan, self.offload = buffer, plan, plan.offload
        self.sharding_group, self.model_parallel_group = plan.sharding_group, plan.model_parallel_group
        self.grad_scaler, self.max_norm = grad_scaler, cfg.grad_clip
        self._low_precision = buffer.dtype != torch.float32
        pieces = cut_pieces(buffer.pieces(), muon[1]) if muon else [(*p, False) for p in buffer.pieces()]
        pieces = regroup(pieces, buffer, cfg, mup_width != 1.0)  # (.., decay, muon, decoupled, mup): param_groups
        self._pieces = [piece[:4] for piece in pieces]
        self._params = [buffer.shard_param(b, lo, hi) for b, lo, hi, _ in self._pieces]  # what this rank updates
        self._grads = [buffer.shard_grad(b, lo, hi) for b, lo, hi, _ in self._pieces]  # and its reduced gradients
        master_views, step_grads = self._make_masters([piece[2] - piece[1] for piece in pieces])
        self.masters: list[nn.Parameter] = []
        # (decays, decoupled lr, muP-scaled) -> masters; the plain groups first, as before decoupled_lr existed
        groups: dict[tuple[bool, bool, bool], list] = {
            (d, c, m): [] for m in (False, True) for c in (False, True) for d in (True, False)}
        muon_pieces: list[tuple] = []  # (master, bucket, lo, hi, decay) of the pieces Muon steps
        for view, grad, (bucket, lo, hi, decay, by_muon, decoupled, scaled) in zip(master_views, step_grads, pieces):
            master = nn.Parameter(view, requires_grad=False)
            master.grad = grad
            self.masters.append(master)
            if by_muon:
                muon_pieces.append((master, bucket, lo, hi, decay))
            else:
                groups[decay, decoupled, scaled].append(master)
        # "decays": the group whose weight decay the schedule sets each step (biases and norms never decay);
        # "decoupled": the word embedding and output layer, at decoupled_lr's schedule (``decoupled_lr``)
        # "mup": muP's scaled parameters, at mup_lr (lr_schedule.mup_schedule), AdamW's epsilon / m (Megatron Core's)
        param_groups = [{"params": ps, "weight_decay": cfg.weight_decay if decays else 0.0, "decays": decays,
                         "decoupled": decoupled, "mup": scaled,
                         **({"eps": cfg.adam_epsilon / mup_width} if scaled and cfg.optimizer == "adam" else {})}
                        for (decays, decoupled, scaled), ps in groups.items() if ps]
        self.decoupled_lr: float | None = None  # this step's, set by the trainer (lr_schedule.decoupled_schedule)
        self.mup_lr: float | None = None  # this step's for the "mup" groups, set by the trainer (mup_schedule)
        if cfg.optimizer == "sgd":
            self.inner = SGD(param_groups, lr=0.0, momentum=cfg.sgd_momentum)
        else:
            self.inner = AdamW(param_groups, lr=0.0, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                               fused=has_fused_kernel(self._master_device()))
        if muon:
            self.inner = ChainedInner(self.inner, Muon(
                [p[:4] for p in muon_pieces], [p[4] for p in muon_pieces], muon[1], buffer.buckets, muon[0],
                cfg.weight_decay, buffer.device))
        self._mup_factor = mup_width if cfg.optimizer == "sgd" else 1.0 / mup_width  # validate_mup.mup_lr_factor
        self._distributed = dist.is_initialized() and dist.get_world_size() > 1
        self._counted = self._counted_grads()

    def _make_masters(self, sizes: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(master views, the gradients AdamW reads), piece by piece: a separate fp32 copy (on the CPU when
        offloading, with a CPU gradient copy) unless training in fp32 on the device, where the parameters
        are the masters."""
        device = self._master_device()
        pin = self.offload and self.buffer.device.type == "cuda"  # page-locked: the copies run at full speed
        if self._low_precision or self.offload:
            self.master_data = torch.empty(sum(sizes), dtype=torch.float32, device=device, pin_memory=pin)
            master_views = list(self.master_data.split(sizes))
            for master, param in zip(master_views, self._params):
                master.copy_(param.detach())
        else:
            self.master_data, master_views = None, self._params
        self.cpu_grad = torch.zeros(sum(sizes) if self.offload else 0, pin_memory=pin)
        if self.offload:
            return master_views, list(self.cpu_grad.split(sizes))
        # bf16 main grads: the masters get fp32 copies at each step (``_upcast_grads``)
        return master_views, self._grads if self.buffer.grad_dtype == torch.float32 else [None] * len(sizes)

    def _master_device(self) -> torch.device:
        return torch.device("cpu") if self.offload else self.buffer.device

    def _counted_grads(self) -> list[torch.Tensor]:
        """The global norm counts every element of the model once, over all ranks: a rank counts the part of
        its optimizer shard it holds the first copy of (``counts_once``); the squares are summed over every rank."""
        spans = [(b, max(s, b.shard[0]), min(e, b.shard[1])) for b in self.buffer.buckets for p, s, e in b.params
                 if counts_once(p, b)]
        return [self.buffer.shard_grad(b, lo, hi) for b, lo, hi in spans if lo < hi]

    @property
    def loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def zero_grad(self) -> None:
        self.buffer.zero_grad()

    def main_grads(self) -> list[torch.Tensor]:
        """The reduced gradients this rank steps: its slice of every bucket (all of them unsharded)."""
        return self._grads

    def _found_inf(self, grads: list[torch.Tensor]) -> bool:
        found = torch.stack([~torch.isfinite(g).all() for g in grads]).any().float()
        if self._distributed:  # every rank skips the step if any shard overflowed
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found)

    def grad_norm(self) -> torch.Tensor:
        if not self._distributed:
            return global_grad_norm(self.main_grads())
        return model_parallel_grad_norm(self._counted, [None], self.buffer.device)

    @torch.no_grad()
    def step(self, lr: float, weight_decay: float | None = None) -> StepResult:
        """One AdamW step at ``lr`` (the word embedding and output layer at ``self.decoupled_lr`` when set) with
        decoupled ``weight_decay`` (None: OptimizerConfig.weight_decay) on the decaying parameters, unless the
        gradients are not finite (then skipped: StepResult.applied False)."""
        upcast = self._upcast_grads()
        try:
            grads = self.main_grads() if upcast is None else upcast
            if self.grad_scaler is not None:
                torch._foreach_mul_(grads, 1.0 / self.grad_scaler.scale)
                found_inf = self._found_inf(grads)
                self.grad_scaler.update(found_inf)
                if found_inf:
                    return StepResult(False, None)
            norm = self.grad_norm()  # in fp32, from the main grads (a bf16 one's square is exact in fp32)
            if not math.isfinite(float(norm)):  # bf16 / fp32: no scaler, but an inf or nan must not reach the
                return StepResult(False, None)  # weights either; the norm is global, so every rank skips
            clip_grads(grads, self.max_norm, norm)
            if self.offload and upcast is None:
                for cpu, grad in zip(self.cpu_grad.split([g.numel() for g in grads]), grads):
                    cpu.copy_(grad, non_blocking=True)
                dev.wait_for_copies(self.buffer.device)
            for group in self.inner.param_groups:
                group["lr"] = self.decoupled_lr if group.get("decoupled") and self.decoupled_lr is not None else lr
                if group.get("mup"):
                    group["lr"] = self.mup_lr if self.mup_lr is not None else lr * self._mup_factor
                if group["decays"] and weight_decay is not None:
                    group["weight_decay"] = weight_decay
            self.inner.step()
        finally:
            if upcast is not None and not self.offload:  # the step's fp32 copies go with it
                for master in self.masters:
                    master.grad = None
        self.publish_params()
        return StepResult(True, float(norm))

    def _upcast_grads(self) -> list[torch.Tensor] | None:
        """Under bf16 main grads (``grad_reduce_in_bf16``): the reduced gradients this rank steps copied into fp32
        (exactly), as Megatron's optimizer upcasts them before unscaling and clipping: into the CPU copy when
        offloading, else into a buffer of this step's, the masters' gradients until it ends. None under fp32."""
        if self.buffer.grad_dtype == torch.float32:
            return None
        sizes = [g.numel() for g in self._grads]
        flat = self.cpu_grad if self.offload else torch.empty(sum(sizes), dtype=torch.float32,
                                                              device=self.buffer.device)
        views = list(flat.split(sizes))
        for view, grad in zip(views, self._grads):
            view.copy_(grad, non_blocking=self.offload)
        if self.offload:
            dev.wait_for_copies(self.buffer.device)
        else:
            for master, view in zip(self.masters, views):
                master.grad = view
        return views

    @torch.no_grad()
    def publish_params(self) -> None:
        """The masters into the parameters: cast (and moved up from the CPU) into this rank's slices,
        which every bucket then publishes (all-gathered over the sharding group; stage 3 keeps them sharded)."""
        if self.master_data is not None:
            updated = self.master_data.to(self.buffer.device, non_blocking=True)
            torch._foreach_copy_(self._params, list(updated.split([p.numel() for p in self._params])))
        for bucket in self.buffer.buckets:
            bucket.publish(bucket.groups.sharding)

    def adam_state(self, master: nn.Parameter, step: int = 0) -> dict:
        """AdamW's state for one master view, created (zeroed, at ``step``) if it does not exist yet."""
        return self.inner.state_for(master, step)

    def pieces(self) -> list[tuple]:
        """(bucket, start, end, master) for every slice this rank steps."""
        return [(b, lo, hi, m) for (b, lo, hi, _), m in zip(self._pieces, self.masters)]
