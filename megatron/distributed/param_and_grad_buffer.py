"""Contiguous parameter and gradient buffers, cut into buckets, each bucket sharded N ways.

All trainable parameters are re-pointed into one flat tensor in the model's dtype, and their
gradients ("main grads") live in one flat tensor with the same layout, in fp32 (bf16 under
``grad_reduce_in_bf16``: ``grad_dtype``, in which micro-batches accumulate and every reduction runs). The layout
(``buffer_layout.lay_out``: buckets in reverse parameter order, weight-decay parameters first
within a bucket, each padded to a multiple of the sharding degree N, rank r owning the r-th
contiguous slice of every bucket, as Megatron-LM's distributed optimizer) is computed from names
and shapes alone; this module materialises it. A bucket (``bucket.Bucket``) is the unit of
communication: all-reduced (stage 1), reduce-scattered into the owner's gradient shard
(stage 2/3), and, under stage 3, all-gathered before use and freed after.

Storage by sharding stage (P = parameters on this rank):

| stage | parameters | full gradients | gradient shard |
| --- | --- | --- | --- |
| 1 | P, one flat tensor | P, persistent | (a view of the full gradients) |
| 2 | P, one flat tensor | P during the backward, then freed | P/N, persistent |
| 3 | P/N persistent shard; a bucket's P_b while gathered | P_b while its backward runs | P/N, persistent |

Gradient flow: when the parameters' dtype is the gradients' (fp32 training; bf16 with bf16
gradients) ``param.grad`` *is* the main-grad view, and autograd accumulates into it in place (a
hook repairs the link if ``param.grad`` was reset). For bf16/fp16 parameters over fp32 gradients a
post-accumulate hook adds ``param.grad`` into the fp32 ``param.main_grad`` and frees it, so
accumulation over micro-batches happens in fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.distributed.bucket import Bucket, free_storage
from megatron.distributed.buffer_layout import BucketSpan, BufferLayout


class ParamAndGradBuffer:
    """The materialised ``layout`` over ``params`` (its names -> this rank's parameters, on the meta
    device when built for deferred initialisation: they are initialised here, bucket by bucket).
    ``shard_grads`` (stage >= 2): a persistent gradient shard; the full gradients come and go.
    ``shard_params`` (stage 3): every bucket keeps its own parameter storage, freed after sharding."""

    def __init__(self, layout: BufferLayout, params: dict[str, nn.Parameter], grad_dtype: torch.dtype = torch.float32,
                 shard_grads: bool = False, shard_params: bool = False, groups: list | None = None):
        first = params[layout.buckets[0].params[0].name]
        self.layout, self.dtype, self.grad_dtype = layout, first.dtype, grad_dtype
        self.device = first.deferred_init.device if first.is_meta else first.device
        self.shard_grads, self.shard_params = shard_grads or shard_params, shard_params
        self.numel, self.shard_numel = layout.numel, layout.shard_numel
        self._allocate()
        self.buckets = [self._materialize_bucket(span, params) for span in layout.buckets]
        for bucket, bucket_groups in zip(self.buckets, groups or []):  # one BucketGroups per bucket
            bucket.groups = bucket_groups
        self._location = {id(p): (b, s, e) for b in self.buckets for p, s, e in b.params}

    def _allocate(self) -> None:
        """The flat tensors: parameters (or, stage 3, their shard), full gradients (or their shard)."""
        n, shard, dtype, device = self.numel, self.shard_numel, self.dtype, self.device
        self.param_data = None if self.shard_params else torch.zeros(n, dtype=dtype, device=device)
        self.param_shard = torch.zeros(shard, dtype=dtype, device=device) if self.shard_params else None
        self.grad_data = torch.zeros(0 if self.shard_grads else n, dtype=self.grad_dtype, device=device)
        self.grad_shard = torch.zeros(shard if self.shard_grads else 0, dtype=self.grad_dtype, device=device)

    def _materialize_bucket(self, span: BucketSpan, params: dict[str, nn.Parameter]) -> Bucket:
        """The bucket's parameters moved (or, from the meta device, initialised) into its storage, their
        main-grad hooks installed; stage 3 keeps only this rank's slice of it."""
        if self.shard_params:
            data = torch.zeros(span.numel, dtype=self.dtype, device=self.device)
        else:
            data = self.param_data[span.start:span.end]
        bucket = Bucket(span, [(params[s.name], s.start, s.end) for s in span.params], data, self.grad_dtype,
                        owns_params=self.shard_params)
        for p, start, end in bucket.params:
            _attach(p, data[start - span.start:end - span.start].view_as(p))
            p.register_post_accumulate_grad_hook(bucket.accumulate_main_grad)
        bucket.param_shard = self.shard_param(bucket)
        bucket.grad_shard = self.shard_grad(bucket) if self.shard_grads else None
        if self.shard_params:  # keep this rank's slice, free the rest
            a, b = span.shard
            bucket.param_shard.copy_(data[a - span.start:b - span.start])
            free_storage(data)
        # stages 2, 3: the full gradients come with zero_grad (or bucket by bucket, lazily)
        bucket.point_grads(None if self.shard_grads else self.grad_data[span.start:span.end])
        return bucket

    # Views of this rank's shard ---------------------------------------------------------------

    def _shard_index(self, bucket: Bucket, a: int, b: int) -> slice:
        lo, hi = bucket.shard
        assert lo <= a <= b <= hi, "range outside this rank's shard"
        return slice(bucket.shard_offset + a - lo, bucket.shard_offset + b - lo)

    def shard_param(self, bucket: Bucket, a: int | None = None, b: int | None = None) -> torch.Tensor:
        """The stored parameters of ``[a, b)`` (default: this rank's whole slice of ``bucket``)."""
        a, b = (bucket.shard if a is None else (a, b))
        if self.shard_params:
            return self.param_shard[self._shard_index(bucket, a, b)]
        return self.param_data[a:b]

    def shard_grad(self, bucket: Bucket, a: int | None = None, b: int | None = None) -> torch.Tensor:
        """The reduced gradients of ``[a, b)`` this rank steps (default: its whole slice of ``bucket``)."""
        a, b = (bucket.shard if a is None else (a, b))
        if self.shard_grads:
            return self.grad_shard[self._shard_index(bucket, a, b)]
        return self.grad_data[a:b]

    def pieces(self) -> list[tuple[Bucket, int, int, bool]]:
        """This rank's shard cut at the weight-decay boundary: (bucket, start, end, decay)."""
        out = []
        for bucket in self.buckets:
            a, b = bucket.shard
            for lo, hi, decay in ((a, min(b, bucket.decay_end), True), (max(a, bucket.decay_end), b, False)):
                if lo < hi:
                    out.append((bucket, lo, hi, decay))
        return out

    def reduced_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """After the gradient sync: the part of ``param``'s reduced gradient this rank holds (all of
        it unless the gradients are sharded; None if its shard holds none of ``param``)."""
        bucket, start, end = self._location[id(param)]
        if not self.shard_grads:
            return param.main_grad
        lo, hi = max(start, bucket.shard[0]), min(end, bucket.shard[1])
        return self.shard_grad(bucket, lo, hi) if lo < hi else None

    # Gradients ----------------------------------------------------------------------------------

    def zero_grad(self) -> None:
        """Before a step's first backward: zero the gradients this rank keeps; stage 2 allocates the
        full buffer again, stage 3 allocates each bucket's as its backward begins."""
        self.grad_shard.zero_()
        if self.shard_params:
            return
        if self.shard_grads:
            self.allocate_grads()
        else:
            self.grad_data.zero_()

    def allocate_grads(self) -> None:
        """A fresh zeroed full gradient buffer, the parameters' main grads pointed into it."""
        self.grad_data = torch.zeros(self.numel, dtype=self.grad_dtype, device=self.device)
        for bucket in self.buckets:
            bucket.point_grads(self.grad_data[bucket.start:bucket.end])

    def release_grads(self) -> None:
        """Free the full gradients (stage 2/3, once they have been reduced into the shards)."""
        for bucket in self.buckets:
            bucket.point_grads(None)
        self.grad_data = torch.zeros(0, dtype=self.grad_dtype, device=self.device)


def _attach(param: nn.Parameter, view: torch.Tensor) -> None:
    """Point ``param`` at ``view`` in the buffer, its value copied in (or, for a meta parameter, its
    deferred initialisation run into it)."""
    if param.is_meta:
        view.copy_(param.deferred_init())
        _swap_in(param, view)
    else:
        view.copy_(param.detach())
        param.data = view


def _swap_in(param: nn.Parameter, data: torch.Tensor) -> None:
    """Turn a meta parameter into one over ``data`` in place (same object, same attributes). Attached
    with ``.data =``, the parameter keeps a version counter of its own: gathering into the bucket
    storage later does not look like an in-place change to what autograd saved."""
    attrs = {k: v for k, v in param.__dict__.items() if k != "deferred_init"}
    real = nn.Parameter(torch.empty(0, dtype=data.dtype, device=data.device), requires_grad=param.requires_grad)
    real.data = data
    real.__dict__.update(attrs)
    torch.utils.swap_tensors(param, real)
