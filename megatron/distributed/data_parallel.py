"""Data parallelism: per-bucket gradient reduction, overlapped with the backward.

(Under pipeline parallelism the whole schedule runs in ``no_sync()`` and the buckets are reduced
by ``finish_grad_sync()`` after it.)

The fp32 main grads live in one flat buffer (``ParamAndGradBuffer``) cut into buckets in the
order the backward produces them. During the backward of the last micro-batch, a hook on each
parameter counts it in; when a bucket's last parameter is in, its reduction starts
(asynchronously) while the backward goes on. ``finish_grad_sync()`` waits for them all. Other
micro-batches only accumulate (``no_sync()``).

The reduction of a bucket is, by sharding stage:

- 0 and 1: an all-reduce over every data-parallel rank (stage 1 then steps its slice of it);
- 2: a reduce-scatter over the sharding group into the owner's persistent gradient shard; the
  full gradient buffer is freed once every bucket is done;
- 3 (``every_micro_batch``): the same reduce-scatter after *every* micro-batch's backward of the
  bucket, whose full gradients are then freed (they exist for one bucket at a time).

With data-parallel replicas of a sharding group (hybrid sharding, HSDP), the gradient shards
are then all-reduced over the replicas (``replica_group``).

The reduction is a SUM: each rank's loss is already divided by the token count of the whole
global batch (token-exact normalisation), so the sum is the global gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from megatron.distributed.param_and_grad_buffer import Bucket, ParamAndGradBuffer

_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class DataParallel(nn.Module):
    """Wraps the model; forward is the module's. ``group``: the ranks to reduce over (all-reduce,
    or reduce-scatter with ``reduce_scatter=True``). ``overlap=False`` reduces every bucket after
    the backward instead (for comparison and debugging). ``on_grads_done(bucket)`` runs once a
    bucket's reduction has started (stage 3 frees its gathered parameters there)."""

    def __init__(self, module: nn.Module, buffer: ParamAndGradBuffer, group: dist.ProcessGroup | None,
                 overlap: bool = True, reduce_scatter: bool = False, replica_group: dist.ProcessGroup | None = None,
                 every_micro_batch: bool = False, on_grads_done: Callable[[Bucket], None] | None = None):
        super().__init__()
        self.module = module
        self.buffer, self.group, self.overlap = buffer, group, overlap
        self.reduce_scatter, self.replica_group = reduce_scatter, replica_group
        self.every_micro_batch, self.on_grads_done = every_micro_batch, on_grads_done
        self.size = dist.get_world_size(group) if group is not None else 1
        self._sync_enabled = True
        self._bucket_of: dict[int, Bucket] = {}
        self._ready: dict[int, set] = {b.index: set() for b in buffer.buckets}
        self._pending: dict[int, tuple] = {}  # bucket index -> (work, scattered output)
        for bucket in buffer.buckets:
            for p, _, _ in bucket.params:
                self._bucket_of[id(p)] = bucket
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (all micro-batches but the last; ignored under stage 3)."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _active(self) -> bool:
        return (self._sync_enabled or self.every_micro_batch) and self.size > 1

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not (self._active() and (self.overlap or self.every_micro_batch)):
            return
        bucket = self._bucket_of[id(param)]
        ready = self._ready[bucket.index]
        ready.add(id(param))
        if len(ready) == len(bucket.params):
            ready.clear()
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        if bucket.index in self._pending:  # stage 3, next micro-batch: finish the previous reduction first
            self._complete(bucket)
        grads = bucket.grad_data
        if not self.reduce_scatter:
            self._pending[bucket.index] = (dist.all_reduce(grads, group=self.group, async_op=True), None, grads)
        else:
            out = torch.empty(bucket.numel // self.size, dtype=grads.dtype, device=grads.device)
            work = _reduce_scatter_flat(out, grads, group=self.group, async_op=True)
            self._pending[bucket.index] = (work, out, grads)
        if self.every_micro_batch:  # the next micro-batch's gradients go into a fresh buffer
            self.buffer.release_bucket_grads(bucket)
        if self.on_grads_done is not None:
            self.on_grads_done(bucket)
        if self.every_micro_batch and len(self._pending) > 2:  # bound the full gradients in flight
            self._complete(self.buffer.buckets[next(iter(self._pending))])

    def _complete(self, bucket: Bucket) -> None:
        work, out, _ = self._pending.pop(bucket.index)  # the full gradients are freed with the entry
        work.wait()
        if out is not None:
            self.buffer.shard_grad(bucket).add_(out)

    def finish_grad_sync(self) -> None:
        """Wait for every bucket's reduction, launching any that did not fill (unused parameters,
        no overlap, or buckets still gathered); then all-reduce the gradient shards over the replicas."""
        if self.size > 1:
            for bucket in self.buffer.buckets:
                if bucket.index not in self._pending and bucket.grad_data is not None:
                    self._launch(bucket)
            for bucket in self.buffer.buckets:
                if bucket.index in self._pending:
                    self._complete(bucket)
            for ready in self._ready.values():
                ready.clear()
            if self.reduce_scatter:
                self.buffer.release_grads()
        if self.replica_group is not None:
            dist.all_reduce(self.buffer.grad_shard, group=self.replica_group)
