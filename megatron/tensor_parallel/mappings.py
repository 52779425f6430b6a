"""Communication between the tensor-parallel ranks, as autograd functions.

Each mapping is a pair of collectives, one in the forward and its adjoint in the backward,
over a process group of size ``t``, handed in by the caller (None: one rank). Activations
are laid out ``[s, b, h]``: tensor parallelism splits the hidden (last) dimension, sequence
parallelism the sequence (first) dimension. ``split`` keeps this rank's contiguous chunk.

=====================================  ============================  ============================
mapping                                forward                       backward
=====================================  ============================  ============================
``copy_to_tp_region``                  identity                      all-reduce (sum)
``reduce_from_tp_region``              all-reduce (sum)              identity
``scatter_to_tp_region``               split last dim                all-gather last dim
``gather_from_tp_region``              all-gather last dim           split last dim
``scatter_to_sequence_region``         split dim 0                   all-gather dim 0
``gather_from_sequence_region``        all-gather dim 0              reduce-scatter dim 0 (or split)
``reduce_scatter_to_sequence_region``  reduce-scatter dim 0          all-gather dim 0
=====================================  ============================  ============================

Why these pairs: if ``y = f(x)`` is replicated on every rank and each rank's loss term only
sees its part, the gradient of a replicated input is the *sum* of the per-rank gradients
(copy <-> all-reduce); the adjoint of "keep my chunk" is "put my chunk back in place", i.e.
a gather (split <-> all-gather); the adjoint of "sum then keep my chunk" is "gather", and
that of "gather" over a region whose consumers are themselves partial sums is "sum then
keep my chunk" (all-gather <-> reduce-scatter).

The ``start_*`` collectives return a ``Pending`` whose ``wait()`` gives the result: with
``async_op`` they run in the background (NCCL's stream on GPUs, gloo's threads on the CPU) while
the caller computes, which is how ``ColumnParallelLinear``'s backward hides its communication.

Every mapping is the identity when the group is None (single process) or has one rank.
Collectives never modify their input in place: autograd may share a tensor (the incoming
gradient of an ``a + b`` reaches both branches as one tensor object).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch >= 2.13 renamed the flat-tensor collectives; older versions only have the *_tensor names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_NATIVE_REDUCE_SCATTER: dict[str, bool] = {}  # backend -> whether its reduce_scatter works


def resolve_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """``group``, or None when there is nothing to communicate (no group: one rank; a group of one)."""
    if group is None or dist.get_world_size(group) == 1:
        return None
    return group


def group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    group = resolve_group(group)
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


# ---------------------------------------------------------------------------- raw collectives


class Pending:
    """A collective started with ``async_op`` (or already finished): ``wait()`` blocks until it is
    done and returns its result. ``finish`` post-processes the raw output (a fallback's split)."""

    def __init__(self, work: dist.Work | None, output: torch.Tensor, finish=None):
        self._work, self._output, self._finish = work, output, finish

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._output if self._finish is None else self._finish(self._output)


def start_all_reduce(x: torch.Tensor, group, async_op: bool = True) -> Pending:
    """Sum ``x`` over ``group`` into a copy (``x`` is left as it is)."""
    out = x.clone(memory_format=torch.contiguous_format)
    return Pending(dist.all_reduce(out, group=group, async_op=async_op), out)


def start_all_gather(x: torch.Tensor, group, async_op: bool = True) -> Pending:
    """Concatenate every rank's ``x`` along dim 0: ``[d0, ...] -> [t * d0, ...]``."""
    x = x.contiguous()
    out = torch.empty((dist.get_world_size(group) * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype,
                      device=x.device)
    return Pending(_all_gather_flat(out, x, group=group, async_op=async_op), out)


def start_reduce_scatter(x: torch.Tensor, group, async_op: bool = True) -> Pending:
    """Sum ``x`` over ``group`` and keep this rank's chunk of dim 0: ``[t * d0, ...] -> [d0, ...]``.
    A gloo without reduce_scatter gets an all-reduce and a split (detected on the first call; the
    check fails the same way on every rank)."""
    world = dist.get_world_size(group)
    if x.shape[0] % world:
        raise ValueError(f"dimension 0 of size {x.shape[0]} is not divisible by {world} ranks")
    backend = str(dist.get_backend(group))
    if backend != "gloo" or _NATIVE_REDUCE_SCATTER.get(backend, True):
        x = x.contiguous()
        out = torch.empty((x.shape[0] // world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        try:
            work = _reduce_scatter_flat(out, x, group=group, async_op=async_op)
            _NATIVE_REDUCE_SCATTER[backend] = True
            return Pending(work, out)
        except (RuntimeError, NotImplementedError, ValueError):
            if backend != "gloo":
                raise
            _NATIVE_REDUCE_SCATTER[backend] = False
    out = x.clone(memory_format=torch.contiguous_format)
    return Pending(dist.all_reduce(out, group=group, async_op=async_op), out, lambda t: _split(t, 0, group))


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    return start_all_reduce(x, group, async_op=False).wait()


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % world:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by {world} ranks")
    return x.chunk(world, dim)[rank].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (one flat collective, then a layout fix)."""
    out = start_all_gather(x, group, async_op=False).wait()
    if dim % x.dim() == 0:
        return out
    # [t * d0, ...] -> [t, d0, ..., d_dim, ...] -> move t next to d_dim and merge
    world = dist.get_world_size(group)
    stacked = out.view((world,) + tuple(x.shape)).movedim(0, dim % x.dim())
    shape = list(x.shape)
    shape[dim] *= world
    return stacked.reshape(shape)


def reduce_scatter_fallback(x: torch.Tensor, group) -> torch.Tensor:
    """Reduce-scatter along dim 0 as all-reduce + keep my chunk (for backends without one)."""
    return _split(_all_reduce(x, group), 0, group)


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the ranks, then keep this rank's chunk of dim 0."""
    return start_reduce_scatter(x, group, async_op=False).wait()


# ---------------------------------------------------------------------------- autograd functions


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather along ``dim``; backward reduce-scatters (dim 0 only) or splits."""

    @staticmethod
    def forward(ctx, x, dim, group, reduce_grad):
        ctx.dim, ctx.group, ctx.reduce_grad = dim, group, reduce_grad
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        out = _reduce_scatter(grad, ctx.group) if ctx.reduce_grad else _split(grad, ctx.dim, ctx.group)
        return out, None, None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, 0, ctx.group), None


# ---------------------------------------------------------------------------- public wrappers


def copy_to_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce (sum) the gradient (``x`` feeds every rank's shard)."""
    group = resolve_group(group)
    return x if group is None else _CopyToRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: all-reduce (sum) the partial results. Backward: identity."""
    group = resolve_group(group)
    return x if group is None else _ReduceFromRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather the last dim."""
    group = resolve_group(group)
    return x if group is None else _ScatterToRegion.apply(x, -1, group)


def gather_from_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: all-gather the last dim. Backward: keep this rank's chunk of the gradient."""
    group = resolve_group(group)
    return x if group is None else _GatherFromRegion.apply(x, -1, group, False)


def scatter_to_sequence_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: keep this rank's chunk of dim 0 (sequence). Backward: all-gather dim 0."""
    group = resolve_group(group)
    return x if group is None else _ScatterToRegion.apply(x, 0, group)


def gather_from_sequence_region(x: torch.Tensor, group=None, tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """Forward: all-gather dim 0 (sequence).

    Backward: reduce-scatter dim 0 when the consumer is tensor-parallel (each rank's gradient
    is a partial sum over its hidden shard: ``tensor_parallel_output_grad=True``), else just
    keep this rank's chunk (every rank already holds the full gradient).
    """
    group = resolve_group(group)
    return x if group is None else _GatherFromRegion.apply(x, 0, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: sum the partial results and keep this rank's chunk of dim 0. Backward: all-gather dim 0."""
    group = resolve_group(group)
    return x if group is None else _ReduceScatterToSequenceRegion.apply(x, group)
