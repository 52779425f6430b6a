"""A bucket of the parameter buffer: the unit of communication, with its own state.

A bucket knows its place in the buffer (a ``BucketSpan``), its parameters, the storage of their
values and (while they exist) of their gradients (``grad_dtype``: fp32, or bf16; every reduction runs in it),
and what is in flight for it:

- **gradient sync** (``DataParallel``): ``mark_ready(param)`` counts a parameter's gradient in and
  says when the bucket is complete; ``start_grad_sync`` launches the all-reduce (stage 1) or the
  reduce-scatter into this rank's gradient shard (stages 2, 3) asynchronously;
  ``finish_grad_sync`` waits for it and adds the scattered shard in;
- **parameter gathering** (stage 3, ``FullyShardedParameters``): ``gather`` all-gathers the
  parameters from every rank's shard into the bucket's own storage (asynchronously for a
  prefetch), ``wait`` waits for such a gather, ``free`` releases the storage;
- **after the optimizer step**: ``publish`` spreads the owner's updated slice (all-gathered over
  the sharding group when every rank keeps full parameters; a stage-3 bucket's gathered copy,
  now stale, is freed instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron.distributed.buffer_layout import BucketSpan
from megatron.tensor_parallel.mappings import _all_gather_flat

_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class BucketGroups:
    """Whom a bucket's gradients and parameters are exchanged with (``parallelize.plan_sharding`` decides):
    ``reduce``: its gradients are summed over these ranks (an all-reduce, or a reduce-scatter when the gradients
    are sharded; None: nothing to reduce); ``sharding``: the ranks its slices are spread over (publish, stage 3's
    gather; None: unsharded); ``replica``: the replicas of its shard, whose gradient shards are all-reduced
    (HSDP); ``first_replica``: this rank is the first of the ranks holding its shard (it writes it to checkpoints
    and counts it in the gradient norm)."""

    reduce: dist.ProcessGroup | None = None
    sharding: dist.ProcessGroup | None = None
    replica: dist.ProcessGroup | None = None
    first_replica: bool = True


def free_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _materialize(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().size() != nbytes:
        t.untyped_storage().resize_(nbytes)


class Bucket:
    """``params``: (parameter, start, end) in buffer coordinates. ``param_data``: the bucket's parameters
    (a view of the flat buffer, or under stage 3 storage of its own, ``owns_params``, freed between
    uses). ``param_shard`` / ``grad_shard``: this rank's slice of the stored parameters and of the
    persistent gradient shard (None unless the gradients are sharded). ``grad_data``: the full gradients
    (``grad_dtype``), while they exist."""

    def __init__(self, span: BucketSpan, params: list[tuple[nn.Parameter, int, int]], param_data: torch.Tensor,
                 grad_dtype: torch.dtype, owns_params: bool):
        self.span, self.params, self.param_data = span, params, param_data
        self.grad_dtype, self.owns_params = grad_dtype, owns_params
        self.param_shard: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.grad_data: torch.Tensor | None = None
        self._ready: set[int] = set()  # parameters whose gradient is in, this backward
        # (work, scattered output or None, the full gradients it reads, what makes the output of what arrived)
        self._grad_sync: tuple | None = None
        self.fp32_accumulation = False  # a bf16 reduce-scatter summed in fp32 (reduce_scatter_with_fp32_accumulation)
        self._gather: dist.Work | None = None
        self.groups = BucketGroups()  # set by the buffer's builder

    index = property(lambda self: self.span.index)
    start = property(lambda self: self.span.start)
    end = property(lambda self: self.span.end)
    decay_end = property(lambda self: self.span.decay_end)
    shard = property(lambda self: self.span.shard)
    shard_offset = property(lambda self: self.span.shard_offset)
    numel = property(lambda self: self.span.numel)

    # Gradients ------------------------------------------------------------------------------------

    def point_grads(self, grads: torch.Tensor | None) -> None:
        """Make ``grads`` (or nothing) the bucket's full gradients: each parameter's ``main_grad`` (and,
        when the dtypes agree, ``grad``, so autograd accumulates in place) is a view of it."""
        self.grad_data = grads
        for p, start, end in self.params:
            p.main_grad = None if grads is None else grads[start - self.start:end - self.start].view_as(p)
            p.grad = p.main_grad if p.dtype == self.grad_dtype else None

    def allocate_grads(self) -> None:
        """Zeroed full gradients, unless they exist (stage 3, as the bucket's backward begins)."""
        if self.grad_data is None:
            self.point_grads(torch.zeros(self.numel, dtype=self.grad_dtype, device=self.param_data.device))

    def accumulate_main_grad(self, param: nn.Parameter) -> None:
        """Move a freshly accumulated ``param.grad`` into the main grad (a post-accumulate hook).

        For parameters of the gradients' dtype ``param.grad`` normally already is the main grad (nothing to do); if
        something reset it to None (``model.zero_grad()``), autograd stored a new tensor, which is
        folded back here so that no gradient is lost. Under stage 3 the bucket's full gradients are
        allocated here, when its first gradient of a backward arrives."""
        grad = param.grad
        if param.main_grad is None:
            self.allocate_grads()
        if grad is param.main_grad:
            return
        param.main_grad.add_(grad)
        param.grad = param.main_grad if grad.dtype == param.main_grad.dtype else None

    # Gradient sync --------------------------------------------------------------------------------

    def mark_ready(self, param: nn.Parameter) -> bool:
        """Count ``param``'s gradient in; True once every parameter of the bucket is (the count restarts)."""
        self._ready.add(id(param))
        if len(self._ready) < len(self.params):
            return False
        self._ready.clear()
        return True

    def reset_ready(self) -> None:
        self._ready.clear()

    @property
    def grad_sync_pending(self) -> bool:
        return self._grad_sync is not None

    def start_grad_sync(self, group: dist.ProcessGroup | None, reduce_scatter: bool) -> None:
        """Launch the reduction of the full gradients over ``group``, asynchronously: an all-reduce in
        place, or a reduce-scatter of this rank's slice (added to ``grad_shard`` by ``finish_grad_sync``).
        A reduction still pending from the previous micro-batch (stage 3) is finished first."""
        self.finish_grad_sync()
        grads = self.grad_data
        if not reduce_scatter:
            self._grad_sync = (dist.all_reduce(grads, group=group, async_op=True), None, grads, None)
            return
        if self.fp32_accumulation and grads.dtype != torch.float32 and group is not None:
            # Megatron-LM's reduce-scatter with fp32 accumulation: every rank's chunk of my shard arrives as it is
            # (an all-to-all, the traffic of a ring reduce-scatter), then is summed here in fp32 and rounded once
            received = torch.empty_like(grads)
            chunks = dist.get_world_size(group)
            self._grad_sync = (dist.all_to_all_single(received, grads, group=group, async_op=True), received, grads,
                               lambda got: got.view(chunks, -1).float().sum(0).to(got.dtype))
            return
        out = torch.empty(self.shard[1] - self.shard[0], dtype=grads.dtype, device=grads.device)
        self._grad_sync = (_reduce_scatter_flat(out, grads, group=group, async_op=True), out, grads, None)

    def finish_grad_sync(self) -> None:
        """Wait for the pending reduction, if any (the full gradients it read are released with it)."""
        if self._grad_sync is None:
            return
        work, out, _, combine = self._grad_sync
        self._grad_sync = None
        work.wait()
        if out is not None:
            self.grad_shard.add_(out if combine is None else combine(out))

    # Parameters (stage 3) -------------------------------------------------------------------------

    @property
    def gathered(self) -> bool:
        """Whether the full parameters exist (or are being gathered into the storage)."""
        return self.param_data.untyped_storage().size() > 0

    def gather(self, group: dist.ProcessGroup, async_op: bool) -> bool:
        """All-gather every rank's shard into the bucket's storage; False (nothing done) if it is gathered
        or being gathered. Asynchronous gathers are completed by ``wait`` (or ``free``)."""
        if self.gathered:
            return False
        _materialize(self.param_data)
        # The parameters are attached to the bucket storage with ``.data =``, so they keep version
        # counters of their own: gathering into it is not an in-place change to what autograd saved.
        with torch.no_grad():
            work = _all_gather_flat(self.param_data, self.param_shard, group=group, async_op=async_op)
        if async_op:
            self._gather = work
        return True

    def wait(self) -> bool:
        """Wait for an asynchronous gather; False if none was in flight."""
        work, self._gather = self._gather, None
        if work is None:
            return False
        work.wait()
        return True

    def free(self) -> None:
        """Release the gathered parameters (buckets with storage of their own only), after any gather in flight."""
        self.wait()
        if self.owns_params:
            free_storage(self.param_data)

    @torch.no_grad()
    def publish(self, group: dist.ProcessGroup | None) -> None:
        """After the step updated this rank's slice: every rank's slice all-gathered over ``group`` into the
        full parameters; a bucket that stores only its shard (stage 3) drops its gathered copy instead,
        which would now be stale."""
        if self.owns_params:
            self.free()
        elif group is not None:
            _all_gather_flat(self.param_data, self.param_shard.clone(), group=group)
