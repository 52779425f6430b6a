"""Tensor-parallel linear and embedding layers (Megatron-LM, Shoeybi et al. 2019).

With ``t`` ranks in the tensor-parallel group and activations ``[s, b, h]``:

- ``ColumnParallelLinear``: ``Y = X A + b`` with ``A = [A_1 .. A_t]`` split by output
  columns; rank ``i`` holds ``A_i`` (weight ``[out/t, in]``) and ``b_i``, and computes
  ``Y_i = X A_i + b_i``. One autograd function (``_ColumnParallelMatmul``) owns the input's
  communication: without sequence parallelism the forward takes ``X`` as it is and the backward
  all-reduces dX (the sum of every shard's contribution); under sequence parallelism the forward
  all-gathers the sequence ``[s/t, b, in] -> [s, b, in]`` but saves only the shard, and the
  backward all-gathers it again and reduce-scatters dX. The backward's collectives run
  asynchronously behind its matmuls (``async_communication``). ``gather_output`` all-gathers
  ``Y`` along the last dim.
- ``RowParallelLinear``: ``Y = X A + b`` with ``A`` split by input rows; rank ``i`` holds
  ``A_i`` (weight ``[out, in/t]``) and computes the partial ``X_i A_i``; the partials are
  summed by ``reduce_from_tp_region`` (all-reduce; backward identity), or
  ``reduce_scatter_to_sequence_region`` under sequence parallelism (backward all-gather).
  The bias is replicated and added once, after the reduction.
- ``VocabParallelEmbedding``: rows split over the ranks; each rank looks up the ids in its
  range ``[i V/t, (i+1) V/t)``, writes zeros for the others, and ``reduce_from_tp_region``
  sums the partial embeddings (exactly one rank contributes each row).

Parameter attributes (read by the initialiser and checkpointing): sharded ones carry
``tensor_model_parallel=True``, ``partition_dim``, ``full_shape``, ``partition_rank`` and
``partition_size``; replicated ones ``tensor_model_parallel=False``. Under sequence
parallelism, replicated parameters that see only a sequence shard (LayerNorm, row-parallel
bias) carry ``sequence_parallel=True``: their gradients are partial sums over the sequence,
summed over the group after the backward by ``megatron.distributed.finalize_grads``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron.tensor_parallel.fp8 import (
    AmaxGroups,
    FP8Recipe,
    cast_grad,
    forward_mm,
    fp8_linear,
    input_grad,
    weight_grad,
)
from megatron.tensor_parallel.mappings import (
    Pending,
    gather_from_tp_region,
    group_size_and_rank,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    resolve_group,
    scatter_to_tp_region,
    start_all_gather,
    start_all_reduce,
    start_reduce_scatter,
)


def _divide(n: int, world: int, what: str) -> int:
    if n % world:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({world})")
    return n // world


def set_tensor_parallel_attributes(param: nn.Parameter, partition_dim: int, full_shape, rank: int, size: int) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.full_shape = torch.Size(full_shape)
    param.partition_rank = rank
    param.partition_size = size


def rank_rows(whole: nn.Parameter, rank: int, size: int) -> nn.Parameter:
    """A parameter of ``whole``'s rows (dim 0) that tensor-parallel rank ``rank`` of ``size`` holds: built where
    ``whole`` is (its values copied unless it is on the meta device), with the attributes the initialiser and
    checkpoints read (a layer's per-head parameters cut with its heads)."""
    with torch.device(whole.device):
        local = nn.Parameter(torch.empty((whole.shape[0] // size, *whole.shape[1:]), dtype=whole.dtype))
    if not whole.is_meta:
        with torch.no_grad():
            local.copy_(whole.detach().chunk(size)[rank])
    set_tensor_parallel_attributes(local, 0, tuple(whole.shape), rank, size)
    return local


def set_replicated_attributes(param: nn.Parameter) -> None:
    param.tensor_model_parallel = False
    param.partition_dim = -1
    param.full_shape = param.shape


def shard_full_tensor(full: torch.Tensor, param: torch.Tensor, rank: int | None = None) -> torch.Tensor:
    """This rank's slice of ``full`` (the unsharded value) for ``param``: chunk ``rank`` of ``t``
    along ``param.partition_dim``; ``full`` itself for a replicated parameter.

    ``rank`` defaults to the rank the parameter was built for (its tensor-parallel rank).
    """
    if not getattr(param, "tensor_model_parallel", False):
        if full.shape != param.shape:
            raise ValueError(f"replicated parameter of shape {tuple(param.shape)} given {tuple(full.shape)}")
        return full
    dim = param.partition_dim
    size = param.shape[dim]
    if full.shape[dim] % size or full.dim() != param.dim():
        raise ValueError(f"cannot shard {tuple(full.shape)} into {tuple(param.shape)} along dim {dim}")
    if rank is None:
        rank = param.partition_rank
    return full.narrow(dim, rank * size, size)


def mark_sequence_parallel(module: nn.Module) -> nn.Module:
    """Flag every parameter of ``module`` (e.g. a LayerNorm) as replicated over the tensor-parallel
    group but fed only a sequence shard, so its gradient needs a sum over the group."""
    for param in module.parameters():
        param.sequence_parallel = True
    return module


def _init_sharded(param: nn.Parameter, init) -> None:
    """Draw the full tensor (same on every rank given the same seed) and keep this rank's slice,
    so the values do not depend on the tensor-parallel size. A meta parameter (ZeRO stage 3) draws nothing:
    its ``DeferredInit`` draws it later, into the shards."""
    if param.is_meta:
        return
    with torch.no_grad():
        full = torch.empty(param.full_shape, dtype=torch.float32)
        init(full)
        param.copy_(shard_full_tensor(full, param))


class _ColumnParallelMatmul(torch.autograd.Function):
    """``Y_i = X A_i + b_i`` on this rank's output columns, with the input's communication.

    Forward: ``X`` ``[s, b, in]`` as it is, or, under ``sequence_parallel``, this rank's shard
    ``[s/t, b, in]`` all-gathered along the sequence first; saved for the backward: the shard only
    (``t`` times less than the gathered input) and the weight.

    Backward, from ``dY_i`` ``[s, b, out/t]``; each collective starts before a matmul that does not
    need its result and is waited for just before its result is used:

    1. (sequence parallel) start the all-gather of the saved shard: ``X`` again;
    2. ``dX_i = dY_i A_i^T`` ``[s, b, in]`` (needs only dY and the weight);
    3. start the reduction of ``dX = sum_i dX_i``: a reduce-scatter to ``[s/t, b, in]`` under
       sequence parallelism (after waiting for the gather of 1), else an all-reduce;
    4. ``dA_i = dY_i^T X``, ``db_i = sum dY_i``; then wait for 3.

    The weight gradient is returned to autograd, which accumulates it into ``weight.grad`` (the
    fp32 main-grad view, or a bf16/fp16 gradient that the buffer's post-accumulate hook adds into
    ``main_grad``), so the buffer's and the data-parallel wrapper's hooks see it as from any layer.
    ``async_communication=False`` runs the same collectives synchronously, in the same order.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, async_communication, fp8=None):
        ctx.has_bias, ctx.group = bias is not None, group
        ctx.sequence_parallel, ctx.async_communication = sequence_parallel, async_communication
        total = start_all_gather(x, group, async_op=False).wait() if sequence_parallel else x
        ctx.fp8 = fp8  # (FP8Recipe, AmaxGroups) or None
        if fp8 is None:
            ctx.save_for_backward(x, weight)
            return F.linear(total, weight, bias)
        out, x_scale, w_scale = forward_mm(total.reshape(-1, total.shape[-1]), weight, fp8[1])
        ctx.save_for_backward(x, weight, x_scale, w_scale)
        out = out.view(*total.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, *scales = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        group, async_op = ctx.group, ctx.async_communication
        gather: Pending | None = None
        if ctx.sequence_parallel and need_weight:
            gather = start_all_gather(x, group, async_op)
        grad_out_2d = grad_out.reshape(-1, grad_out.shape[-1])
        g8 = None if ctx.fp8 is None else cast_grad(grad_out_2d, *ctx.fp8)  # once for both matmuls
        grad_input = None
        if need_input and g8 is None:
            grad_input = grad_out.matmul(weight)  # [s, b, in]: partial over the ranks
        elif need_input:
            grad_input = input_grad(g8, weight, scales[1], grad_out.dtype).view(*grad_out.shape[:-1], weight.shape[1])
        total = gather.wait() if gather is not None else x
        reduction: Pending | None = None
        if need_input:
            start = start_reduce_scatter if ctx.sequence_parallel else start_all_reduce
            reduction = start(grad_input, group, async_op)
        grad_weight = None
        if need_weight and g8 is None:
            grad_weight = grad_out_2d.t().matmul(total.reshape(-1, total.shape[-1]))
        elif need_weight:
            grad_weight = weight_grad(g8, total.reshape(-1, total.shape[-1]), scales[0], weight.dtype)
        grad_bias = grad_out_2d.sum(0) if ctx.has_bias and need_bias else None
        if reduction is not None:
            grad_input = reduction.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None


def column_parallel_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group=None,
                           sequence_parallel: bool = False, async_communication: bool = True,
                           fp8: tuple[FP8Recipe, AmaxGroups] | None = None) -> torch.Tensor:
    """``F.linear(X, weight, bias)`` for a column-parallel weight ``[out/t, in]``: see
    ``_ColumnParallelMatmul`` (forward all-gather of the sequence under ``sequence_parallel``; backward
    all-reduce or reduce-scatter of dX, hidden behind the weight-gradient matmul). One rank: ``F.linear``.
    ``fp8``: the matmuls in FP8 (``fp8.py``) with this recipe and these amax groups."""
    group = resolve_group(group)
    if group is None:
        return F.linear(x, weight, bias) if fp8 is None else fp8_linear(x, weight, *fp8, bias=bias)
    return _ColumnParallelMatmul.apply(x, weight, bias, group, sequence_parallel, async_communication, fp8)


class ColumnParallelLinear(nn.Module):
    """``Y = X A + b``, ``A`` split by output columns: weight ``[out/t, in]``, bias ``[out/t]``.

    Input ``[s, b, in]`` (``[s/t, b, in]`` under sequence parallelism); output
    ``[s, b, out/t]``, or ``[s, b, out]`` with ``gather_output``. ``async_communication``: the
    backward's collectives overlap its matmuls (False: the same collectives, one after the other;
    ``set_async_communication`` switches every layer of a model).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 sequence_parallel: bool = False, group=None, async_communication: bool = True):
        super().__init__()
        if gather_output and sequence_parallel:
            raise ValueError("gather_output is not supported with sequence parallelism")
        self.group = group
        world, rank = group_size_and_rank(group)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.async_communication = async_communication
        self.fp8: tuple[FP8Recipe, AmaxGroups] | None = None  # set by enable_fp8
        self.output_size_per_partition = _divide(out_features, world, "out_features")
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, in_features))
        set_tensor_parallel_attributes(self.weight, 0, (out_features, in_features), rank, world)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_partition))
            set_tensor_parallel_attributes(self.bias, 0, (out_features,), rank, world)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default, drawn at the full shape (layout-invariant)."""
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features else 0.0
        _init_sharded(self.weight, lambda w: nn.init.kaiming_uniform_(w, a=math.sqrt(5)))
        if self.bias is not None:
            _init_sharded(self.bias, lambda b: nn.init.uniform_(b, -bound, bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = column_parallel_matmul(x, self.weight, self.bias, self.group, self.sequence_parallel,
                                   self.async_communication, self.fp8)
        return gather_from_tp_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(per rank {self.output_size_per_partition}), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


def set_async_communication(model: nn.Module, enabled: bool) -> int:
    """Turn the overlap of the column-parallel layers' backward collectives on or off in every layer
    of ``model``; returns how many layers were set."""
    layers = [m for m in model.modules() if isinstance(m, ColumnParallelLinear)]
    for layer in layers:
        layer.async_communication = enabled
    return len(layers)


def enable_fp8(model: nn.Module, recipe: FP8Recipe, cp_group=None) -> int:
    """Run the matmuls of every tensor-parallel linear layer of ``model`` in FP8 (``fp8.py``); returns how many.
    Each operand's amax is taken over the ranks that split it: the layer's tp group (a column-parallel weight and
    output gradient, a row-parallel weight and input) and ``cp_group`` (every activation and its gradient)."""
    cp = () if cp_group is None else (cp_group,)
    layers = 0
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            group = resolve_group(module.group)
            tp = () if group is None else (group,)
            column = isinstance(module, ColumnParallelLinear)
            groups = AmaxGroups(input=cp if column else tp + cp, weight=tp, grad=tp + cp if column else cp)
            module.fp8 = (recipe, groups)
            layers += 1
    return layers


def apply_fp8(chunks: list[nn.Module], fp8_format: str, device: torch.device, cp_group=None) -> None:
    """The recipe's FP8 step: every tensor-parallel linear layer of ``chunks`` in FP8 (``enable_fp8``); refused, in
    one line on every rank, on a device without FP8 tensor cores."""
    from megatron import device as dev
    from megatron.config.cli import ConfigError

    problem = dev.fp8_problem(device)
    if problem is not None:
        raise ConfigError(f"--fp8-format: {problem}; drop --fp8-format (bf16 trains the same model).")
    for chunk in chunks:
        enable_fp8(chunk, FP8Recipe(fp8_format), cp_group)


class RowParallelLinear(nn.Module):
    """``Y = X A + b``, ``A`` split by input rows: weight ``[out, in/t]``, bias ``[out]`` replicated.

    Input ``[s, b, in/t]`` (``input_is_parallel``) or ``[s, b, in]`` (scattered here); output
    ``[s, b, out]``, or ``[s/t, b, out]`` under sequence parallelism.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, group=None):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence parallelism needs input_is_parallel=True")
        self.group = group
        world, rank = group_size_and_rank(group)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.fp8: tuple[FP8Recipe, AmaxGroups] | None = None  # set by enable_fp8
        self.input_size_per_partition = _divide(in_features, world, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, self.input_size_per_partition))
        set_tensor_parallel_attributes(self.weight, 1, (out_features, in_features), rank, world)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
            set_replicated_attributes(self.bias)
            if sequence_parallel:
                self.bias.sequence_parallel = True
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features else 0.0
        _init_sharded(self.weight, lambda w: nn.init.kaiming_uniform_(w, a=math.sqrt(5)))
        if self.bias is not None:
            with torch.no_grad():
                self.bias.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group)
        partial = F.linear(x, self.weight) if self.fp8 is None else fp8_linear(x, self.weight, *self.fp8)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(partial, self.group)
        else:
            y = reduce_from_tp_region(partial, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (per rank {self.input_size_per_partition}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding with the rows (vocabulary) split over the ranks: weight ``[V/t, h]``.

    ``forward(ids [...]) -> [..., h]``: masked local lookup, then all-reduce (sum).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None):
        super().__init__()
        self.group = group
        world, rank = group_size_and_rank(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_per_partition = _divide(num_embeddings, world, "num_embeddings")
        self.vocab_start_index = rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim))
        set_tensor_parallel_attributes(self.weight, 0, (num_embeddings, embedding_dim), rank, world)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_sharded(self.weight, nn.init.normal_)  # nn.Embedding's default N(0, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.num_embeddings_per_partition == self.num_embeddings:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local = (ids - self.vocab_start_index).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(partial, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (rows {self.vocab_start_index}:"
                f"{self.vocab_end_index} on this rank)")
