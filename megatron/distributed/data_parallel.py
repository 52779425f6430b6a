"""Data parallelism: per-bucket gradient reduction, overlapped with the backward.

The main grads (fp32; bf16 under ``grad_reduce_in_bf16``, reduced in bf16) live in one flat buffer
(``ParamAndGradBuffer``) cut into buckets in the order the backward produces them. During the backward
of the last micro-batch, a hook on each parameter counts it in (``Bucket.mark_ready``); when a
bucket's last parameter is in, its reduction starts (asynchronously) while the backward goes on.
``finish_grad_sync()`` waits for them all. Other micro-batches only accumulate (``no_sync()``).

Under pipeline parallelism the schedule runs every backward in ``no_sync()`` but each model
chunk's last one (``schedules.run_pipeline_table``): a chunk's buckets start their reduction
during that backward, while the rest of the schedule (other chunks' backwards, the cool-down's
sends and receives) goes on. A bucket that spans two chunks starts when the second is done.

The reduction of a bucket is, by sharding stage (chosen by ``parallelize``):

- 1 (also without sharding): an all-reduce over every data-parallel rank (stage 1 then steps its
  slice of it);
- 2: a reduce-scatter over the sharding group into the owner's persistent gradient shard; the
  full gradient buffer is freed once every bucket is done;
- 3 (``every_micro_batch``): the same reduce-scatter after *every* micro-batch's backward of the
  bucket, whose full gradients are then freed (they exist for one bucket at a time, at most two
  reductions in flight).

With data-parallel replicas of a sharding group (hybrid sharding, HSDP), the gradient shards
are then all-reduced over the replicas. Each bucket carries its groups (``Bucket.groups``): a MoE model's
expert buckets are reduced over the expert-data-parallel ranks, the others over the data-parallel ones.

The reduction is a SUM: each rank's loss is already divided by the token count of the whole
global batch (token-exact normalisation), so the sum is the global gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from megatron.distributed.bucket import Bucket
from megatron.distributed.param_and_grad_buffer import ParamAndGradBuffer


class DataParallel(nn.Module):
    """Wraps the model; forward is the module's. Each bucket is reduced over its ``groups.reduce``
    (all-reduce, or reduce-scatter with ``reduce_scatter=True``). ``overlap=False`` reduces every bucket after
    the backward instead (for comparison and debugging). ``on_grads_done(bucket)`` runs once a
    bucket's reduction has started (stage 3 frees its gathered parameters there)."""

    def __init__(self, module: nn.Module, buffer: ParamAndGradBuffer, overlap: bool = True,
                 reduce_scatter: bool = False, every_micro_batch: bool = False,
                 on_grads_done: Callable[[Bucket], None] | None = None):
        super().__init__()
        self.module = module
        self.buffer, self.overlap = buffer, overlap
        self.reduce_scatter = reduce_scatter
        self.every_micro_batch, self.on_grads_done = every_micro_batch, on_grads_done
        self._sync_enabled = True
        for bucket in buffer.buckets:
            for p, _, _ in bucket.params:
                p.register_post_accumulate_grad_hook(lambda param, bucket=bucket: self._on_grad_ready(bucket, param))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (every backward but a chunk's last of the step; ignored under
        stage 3 without pipelining, which reduces after every micro-batch)."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _active(self) -> bool:
        return self._sync_enabled or self.every_micro_batch

    def _on_grad_ready(self, bucket: Bucket, param: torch.Tensor) -> None:
        if (self._active() and bucket.groups.reduce is not None and (self.overlap or self.every_micro_batch)
                and bucket.mark_ready(param)):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        bucket.start_grad_sync(bucket.groups.reduce, self.reduce_scatter)
        if self.every_micro_batch:  # the next micro-batch's gradients go into a fresh buffer
            bucket.point_grads(None)
        if self.on_grads_done is not None:
            self.on_grads_done(bucket)
        if self.every_micro_batch:  # bound the full gradients in flight
            pending = [b for b in self.buffer.buckets if b.grad_sync_pending]
            if len(pending) > 2:
                pending[0].finish_grad_sync()

    def finish_grad_sync(self) -> None:
        """Wait for every bucket's reduction, launching any that did not fill (unused parameters,
        no overlap, or buckets still gathered); then all-reduce the gradient shards over the replicas."""
        reduced = [b for b in self.buffer.buckets if b.groups.reduce is not None]
        for bucket in reduced:
            if not bucket.grad_sync_pending and bucket.grad_data is not None:
                self._launch(bucket)
        for bucket in reduced:
            bucket.finish_grad_sync()
            bucket.reset_ready()
        if self.reduce_scatter:
            self.buffer.release_grads()
        for bucket in self.buffer.buckets:
            if bucket.groups.replica is not None:
                dist.all_reduce(bucket.grad_shard, group=bucket.groups.replica)
