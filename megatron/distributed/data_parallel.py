"""Data parallelism: bucketed all-reduce of the main-grad buffer, overlapped with the backward.

The fp32 main grads live in one flat buffer (``ParamAndGradBuffer``), laid out in reverse
parameter order, so that the gradients of the last layers, which the backward produces
first, sit at the front. The buffer is cut into buckets of about ``bucket_size`` elements
(never splitting a parameter). During the backward of the last micro-batch, a hook on each
parameter counts it in; when a bucket's last parameter is in, its all-reduce starts
(asynchronously) while the backward goes on. ``finish_grad_sync()`` waits for them all.
Other micro-batches only accumulate (``no_sync()``).

The reduction is a SUM: each rank's loss is already divided by the token count of the whole
global batch (token-exact normalisation), so the sum is the global gradient.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megatron.distributed.param_and_grad_buffer import ParamAndGradBuffer


@dataclass
class Bucket:
    start: int
    end: int
    params: set = field(default_factory=set)
    ready: set = field(default_factory=set)
    handle: dist.Work | None = None


class DataParallel(nn.Module):
    """Wraps the model; forward is the module's. ``overlap=False`` reduces the whole buffer
    after the backward instead (for comparison and debugging)."""

    def __init__(self, module: nn.Module, buffer: ParamAndGradBuffer, group: dist.ProcessGroup | None,
                 bucket_size: int = 40_000_000, overlap: bool = True):
        super().__init__()
        self.module = module
        self.buffer, self.group, self.overlap = buffer, group, overlap
        self.size = dist.get_world_size(group) if group is not None else 1
        self.buckets = self._make_buckets(bucket_size)
        self._sync_enabled = True
        self._bucket_of: dict[int, Bucket] = {}
        ranges = {r.name: r for r in buffer.ranges}
        for name, p in module.named_parameters():
            if name in ranges and p.requires_grad:
                bucket = next(b for b in self.buckets if b.start <= ranges[name].start < b.end)
                bucket.params.add(id(p))
                self._bucket_of[id(p)] = bucket
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _make_buckets(self, bucket_size: int) -> list[Bucket]:
        buckets, start = [], 0
        for r in self.buffer.ranges:  # buffer order = the order gradients become ready
            if r.end - start >= bucket_size:
                buckets.append(Bucket(start, r.end))
                start = r.end
        if start < self.buffer.grad_data.numel():
            buckets.append(Bucket(start, self.buffer.grad_data.numel()))
        return buckets

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (all micro-batches but the last)."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not (self._sync_enabled and self.overlap and self.size > 1):
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params) and bucket.handle is None:
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        bucket.handle = dist.all_reduce(self.buffer.grad_data[bucket.start:bucket.end], group=self.group,
                                        async_op=True)

    def finish_grad_sync(self) -> None:
        """Wait for every bucket's all-reduce (launching any that did not fill, e.g. unused parameters)."""
        if self.size == 1:
            return
        if not self.overlap:
            dist.all_reduce(self.buffer.grad_data, group=self.group)
            return
        for bucket in self.buckets:
            if bucket.handle is None:
                self._launch(bucket)
            bucket.handle.wait()
            bucket.handle = None
            bucket.ready.clear()
