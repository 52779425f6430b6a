"""megatron.tensor_parallel over gloo: every sharded computation equals the unsharded torch one.

One spawned job per layout runs every check (spawning costs seconds). Each rank builds the
same full reference (same seed), builds its sharded layer from slices of the full weights
(``shard_full_tensor``), feeds the same inputs and compares outputs and gradients with the
matching slices of the reference.

Tolerance: fp32 round-off only. A sharded layer computes the same products as the full one
but sums them in a different order (partial matmuls added by an all-reduce, the softmax
normaliser summed per shard then across ranks), which changes the last bits, nothing more.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron import parallel_state
from megatron.tensor_parallel import (
    ColumnParallelLinear,
    FP8Recipe,
    RowParallelLinear,
    VocabParallelEmbedding,
    checkpoint,
    enable_fp8,
    gather_from_sequence_region,
    get_rng_tracker,
    mappings,
    mark_sequence_parallel,
    shard_full_tensor,
    tensor_parallel_seed,
    vocab_parallel_cross_entropy,
)
from megatron.tensor_parallel.fp8 import AmaxGroups, fp8_linear
from megatron.tensor_parallel.mappings import _reduce_scatter, reduce_scatter_fallback
from tests.distributed.harness import run_distributed

RTOL, ATOL = 1e-5, 1e-6  # fp32 round-off (see the module docstring)
S, B, H = 8, 2, 8  # sequence (divisible by tp for sequence parallelism), batch, hidden


def _tp():
    """The tensor-parallel group, handed to each layer and collective (None: one rank)."""
    return parallel_state.get().group("tp")


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    diff = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert torch.allclose(actual, expected, rtol=RTOL, atol=ATOL), f"{what}: max abs diff {diff}"


def _load_shards(layer: nn.Module, ref: nn.Module) -> None:
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(shard_full_tensor(getattr(ref, name), param))


def _forward_backward(module, x, dy):
    x = x.detach().clone().requires_grad_(x.is_floating_point())
    y = module(x)
    y.backward(dy)
    return y, x.grad


def _check_linear_layers(tp: int, rank: int) -> None:
    def chunk(t, dim=-1):
        return t.chunk(tp, dim)[rank]

    for gather_output in (False, True):
        ref = nn.Linear(H, 4 * H)
        layer = ColumnParallelLinear(H, 4 * H, gather_output=gather_output, group=_tp())
        _load_shards(layer, ref)
        x, dy = torch.randn(S, B, H), torch.randn(S, B, 4 * H)
        y_ref, dx_ref = _forward_backward(ref, x, dy)
        y, dx = _forward_backward(layer, x, dy if gather_output else chunk(dy))
        what = f"column(gather_output={gather_output})"
        _close(y, y_ref if gather_output else chunk(y_ref), f"{what} output")
        _close(dx, dx_ref, f"{what} input grad")  # all-reduced by copy_to_tp_region
        for name in ("weight", "bias"):
            param = getattr(layer, name)
            _close(param.grad, shard_full_tensor(getattr(ref, name).grad, param), f"{what} {name} grad")

    for input_is_parallel in (True, False):
        ref = nn.Linear(4 * H, H)
        layer = RowParallelLinear(4 * H, H, input_is_parallel=input_is_parallel, group=_tp())
        _load_shards(layer, ref)
        x, dy = torch.randn(S, B, 4 * H), torch.randn(S, B, H)
        y_ref, dx_ref = _forward_backward(ref, x, dy)
        y, dx = _forward_backward(layer, chunk(x) if input_is_parallel else x, dy)
        what = f"row(input_is_parallel={input_is_parallel})"
        _close(y, y_ref, f"{what} output")
        _close(dx, chunk(dx_ref) if input_is_parallel else dx_ref, f"{what} input grad")
        _close(layer.weight.grad, chunk(ref.weight.grad), f"{what} weight grad")
        _close(layer.bias.grad, ref.bias.grad, f"{what} bias grad")

    ref = nn.Embedding(16 * tp, H)
    layer = VocabParallelEmbedding(16 * tp, H, group=_tp())
    _load_shards(layer, ref)
    ids, dy = torch.randint(0, 16 * tp, (S, B)), torch.randn(S, B, H)
    y_ref, _ = _forward_backward(ref, ids, dy)
    y, _ = _forward_backward(layer, ids, dy)
    _close(y, y_ref, "embedding output")
    _close(layer.weight.grad, chunk(ref.weight.grad, 0), "embedding weight grad")


def _fp8_reference(ref: nn.Linear, x: torch.Tensor, dy: torch.Tensor, recipe: FP8Recipe):
    """One process's FP8 layer: ``ref``'s parameters, the matmul in FP8; (output, input grad) and ``ref``'s grads."""
    x = x.detach().clone().requires_grad_()
    y = fp8_linear(x, ref.weight, recipe, bias=ref.bias)
    y.backward(dy)
    return y.detach(), x.grad


def _check_fp8_layers(tp: int, rank: int, group) -> None:
    """Under FP8 (hybrid) the column- and row-parallel layers, with and without sequence parallelism, equal one
    process's FP8 layer within fp32 round-off: every operand is scaled by the whole tensor's amax (the maximum over
    the ranks that split it), so every element is cast as in one process. And the cp rule: tokens split over a
    group, the input's and the gradient's amax over it, give one process's rows."""
    recipe = FP8Recipe("hybrid")

    def chunk(t, dim=-1):
        return t.chunk(tp, dim)[rank]

    for sp in (False, True):
        ref, layer = nn.Linear(H, 4 * H), ColumnParallelLinear(H, 4 * H, sequence_parallel=sp, group=_tp())
        _load_shards(layer, ref)
        assert enable_fp8(layer, recipe) == 1
        x, dy = 3 * torch.randn(S, B, H), torch.randn(S, B, 4 * H)
        y_ref, dx_ref = _fp8_reference(ref, x, dy, recipe)
        assert 1e-4 < (y_ref - F.linear(x, ref.weight, ref.bias)).abs().max() < 0.2 * y_ref.abs().max()  # FP8 ran
        y, dx = _forward_backward(layer, chunk(x, 0) if sp else x, chunk(dy))
        what = f"fp8 column (sp={sp})"
        _close(y, chunk(y_ref), f"{what} output")
        _close(dx, chunk(dx_ref, 0) if sp else dx_ref, f"{what} input grad")
        _close(layer.weight.grad, chunk(ref.weight.grad, 0), f"{what} weight grad")
        _close(layer.bias.grad, chunk(ref.bias.grad, 0), f"{what} bias grad")

        ref, layer = nn.Linear(4 * H, H), RowParallelLinear(4 * H, H, sequence_parallel=sp, group=_tp())
        _load_shards(layer, ref)
        enable_fp8(layer, recipe)
        x, dy = torch.randn(S, B, 4 * H), torch.randn(S, B, H)
        y_ref, dx_ref = _fp8_reference(ref, x, dy, recipe)
        y, dx = _forward_backward(layer, chunk(x), chunk(dy, 0) if sp else dy)
        what = f"fp8 row (sp={sp})"
        _close(y, chunk(y_ref, 0) if sp else y_ref, f"{what} output")
        _close(dx, chunk(dx_ref), f"{what} input grad")
        _close(layer.weight.grad, chunk(ref.weight.grad), f"{what} weight grad")

    w = torch.randn(4 * H, H)  # the cp rule, the group standing for a context-parallel one
    x, dy = torch.randn(S, B, H), torch.randn(S, B, 4 * H)
    ref_x, shard_x, ref_w, shard_w = x.clone().requires_grad_(), chunk(x, 0).requires_grad_(), w.clone(), w.clone()
    ref_w.requires_grad_(), shard_w.requires_grad_()
    fp8_linear(ref_x, ref_w, recipe).backward(dy)
    y = fp8_linear(shard_x, shard_w, recipe, AmaxGroups(input=(group,), grad=(group,)))
    y.backward(chunk(dy, 0))
    dist.all_reduce(shard_w.grad, group=group)  # each rank's tokens' share of dW
    _close(y, chunk(fp8_linear(x, w, recipe), 0), "fp8 split tokens output")
    _close(shard_x.grad, chunk(ref_x.grad, 0), "fp8 split tokens input grad")
    _close(shard_w.grad, ref_w.grad, "fp8 split tokens weight grad")


def _sum_sequence_parallel_grads(module: nn.Module) -> None:
    """What ``finalize_model_grads`` does for the flagged parameters: sum their gradients over the group."""
    for p in module.parameters():
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.grad, group=parallel_state.get().group("tp"))


def _check_sequence_parallel(tp: int, rank: int) -> None:
    """LayerNorm -> column -> GELU -> row with sequence parallelism equals the same pair without."""

    def block(sp: bool):
        torch.manual_seed(1)  # same values for both blocks
        ln = nn.LayerNorm(H)
        col = ColumnParallelLinear(H, 4 * H, sequence_parallel=sp, group=_tp())
        row = RowParallelLinear(4 * H, H, sequence_parallel=sp, group=_tp())
        if sp:
            mark_sequence_parallel(ln)
        return nn.Sequential(ln, col, nn.GELU(), row)

    x, dy = torch.randn(S, B, H), torch.randn(S, B, H)
    ref = block(False)
    y_ref, dx_ref = _forward_backward(ref, x, dy)
    sp = block(True)
    x_shard = x.chunk(tp, 0)[rank].clone().requires_grad_()
    y = gather_from_sequence_region(sp(x_shard), _tp(), tensor_parallel_output_grad=False)
    y.backward(dy)
    flagged = [name for name, p in sp.named_parameters() if getattr(p, "sequence_parallel", False)]
    assert flagged == ["0.weight", "0.bias", "3.bias"], flagged
    _sum_sequence_parallel_grads(sp)
    _close(y, y_ref, "sequence-parallel output")
    _close(x_shard.grad, dx_ref.chunk(tp, 0)[rank], "sequence-parallel input grad")
    for (name, p), p_ref in zip(sp.named_parameters(), ref.parameters()):
        _close(p.grad, p_ref.grad, f"sequence-parallel {name} grad")


def _check_column_parallel_communication(tp: int, rank: int) -> None:
    """ColumnParallelLinear's own autograd function (forward gather under sequence parallelism, backward
    all-gather / reduce-scatter or all-reduce behind the matmuls) equals nn.Linear on one process; the
    overlapped and the one-after-the-other collectives give bitwise the same gradients."""
    ref = nn.Linear(H, 4 * H)
    x, dy = torch.randn(S, B, H), torch.randn(S, B, 4 * H)
    y_ref, dx_ref = _forward_backward(ref, x, dy)
    for sp in (False, True):
        runs = []
        for async_communication in (True, False):
            layer = ColumnParallelLinear(H, 4 * H, sequence_parallel=sp, async_communication=async_communication,
                                         group=_tp())
            _load_shards(layer, ref)
            y, dx = _forward_backward(layer, x.chunk(tp, 0)[rank] if sp else x, dy.chunk(tp, -1)[rank])
            what = f"column(sequence_parallel={sp}, async={async_communication})"
            _close(y, y_ref.chunk(tp, -1)[rank], f"{what} output")
            _close(dx, dx_ref.chunk(tp, 0)[rank] if sp else dx_ref, f"{what} input grad")
            for name in ("weight", "bias"):
                param = getattr(layer, name)
                _close(param.grad, shard_full_tensor(getattr(ref, name).grad, param), f"{what} {name} grad")
            runs.append([dx, layer.weight.grad, layer.bias.grad])
        assert all(torch.equal(a, b) for a, b in zip(*runs)), f"sequence_parallel={sp}: async changed the bits"


def _check_column_parallel_main_grads(tp: int, rank: int) -> None:
    """bf16 parameters: the weight gradient that the function returns reaches the fp32 main grad through the
    buffer's post-accumulate hook, accumulated over micro-batches, and ``param.grad`` is freed."""
    from megatron.distributed.parallelize import ShardingPlan, build_buffer

    ref = nn.Linear(H, 4 * H)
    layer = ColumnParallelLinear(H, 4 * H, sequence_parallel=True, group=_tp())
    _load_shards(layer, ref)
    layer.to(torch.bfloat16)
    buffer = build_buffer(layer, ShardingPlan())
    micro = [torch.randn(S, B, H) for _ in range(2)]
    dys = [torch.randn(S, B, 4 * H) for _ in range(2)]
    for x, dy in zip(micro, dys):
        _forward_backward(layer, x.chunk(tp, 0)[rank].bfloat16(), dy.chunk(tp, -1)[rank].bfloat16())
        _forward_backward(ref, x, dy)  # accumulates the fp32 reference
    for name in ("weight", "bias"):
        param = getattr(layer, name)
        assert param.grad is None and param.main_grad.dtype == torch.float32
        expected = shard_full_tensor(getattr(ref, name).grad, param)
        diff = (param.main_grad - expected).abs().max().item()
        assert diff < 2e-2 * expected.abs().max().item(), f"bf16 {name} main grad: max abs diff {diff}"
    assert buffer.grad_data.abs().sum() > 0


def _check_cross_entropy(tp: int, rank: int) -> None:
    n, padded = 12, 4 * tp
    # a full vocabulary, a padded one, and one whose last shard is padding only (tp > 2)
    for vocab_size in (padded, padded - 3, padded - 4 - 1):
        logits, labels = torch.randn(n, padded) * 3, torch.randint(0, vocab_size, (n,))
        labels[0] = vocab_size - 1
        g = torch.rand(n)
        ref = logits[:, :vocab_size].clone().requires_grad_()
        losses_ref = F.cross_entropy(ref, labels, reduction="none")
        losses_ref.backward(g)
        shard = logits.chunk(tp, -1)[rank].clone().requires_grad_()
        losses = vocab_parallel_cross_entropy(shard, labels, vocab_size, _tp())
        losses.backward(g)
        grad_ref = F.pad(ref.grad, (0, padded - vocab_size))  # padded columns get no gradient
        _close(losses, losses_ref, f"cross entropy (vocab {vocab_size}/{padded})")
        _close(shard.grad, grad_ref.chunk(tp, -1)[rank], f"cross entropy grad (vocab {vocab_size}/{padded})")
    shard = logits.chunk(tp, -1)[rank].to(torch.bfloat16).requires_grad_()
    vocab_parallel_cross_entropy(shard, labels, vocab_size, _tp()).sum().backward()
    assert shard.grad.dtype == torch.bfloat16


def _check_rng(group) -> None:
    def gathered(x: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x, group=group)
        return out

    state = parallel_state.get()
    tensor_parallel_seed(1234, state.tp_rank)
    with get_rng_tracker().fork():
        inside = F.dropout(torch.ones(256), 0.5, training=True)
    outside = F.dropout(torch.ones(256), 0.5, training=True)
    masks_in, masks_out = gathered(inside), gathered(outside)
    assert all(not torch.equal(masks_in[0], m) for m in masks_in[1:]), "fork: same mask on two TP ranks"
    assert all(torch.equal(masks_out[0], m) for m in masks_out[1:]), "default stream: masks differ across TP"


def _check_checkpoint() -> None:
    """Dropout inside and outside fork in a recomputed TP region: gradients equal no recompute."""
    torch.manual_seed(2)
    col, row = ColumnParallelLinear(H, 4 * H, group=_tp()), RowParallelLinear(4 * H, H, group=_tp())
    params = [*col.parameters(), *row.parameters()]
    x = torch.randn(S, B, H)

    def region(inp):
        h = col(inp)
        with get_rng_tracker().fork():
            h = F.dropout(h, 0.5, training=True)  # sharded activation: per-rank mask
        return F.dropout(row(h), 0.3, training=True)  # replicated activation: common mask

    def run(recompute):
        tensor_parallel_seed(5, parallel_state.get().tp_rank)
        for p in params:
            p.grad = None
        xx = x.clone().requires_grad_()
        y = recompute(region, xx)
        torch.rand(4)  # move both streams on before the backward
        with get_rng_tracker().fork():
            torch.rand(4)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        return [y.detach(), xx.grad] + [p.grad.clone() for p in params]

    plain, replayed = run(lambda f, a: f(a)), run(checkpoint)
    for i, (a, b) in enumerate(zip(plain, replayed)):
        assert torch.equal(a, b), f"checkpointed tensor {i} differs"  # same ops, same order: exact


def _check_reduce_scatter(group) -> None:
    world = dist.get_world_size(group)
    base = torch.randn(2 * world, 3, generator=torch.Generator().manual_seed(3))  # equal on every rank
    x = base + dist.get_rank(group)  # sum over the ranks: world * base + world (world - 1) / 2
    expected = (world * base + world * (world - 1) / 2).chunk(world, 0)[dist.get_rank(group)]
    _close(_reduce_scatter(x, group), expected, "reduce-scatter")
    _close(reduce_scatter_fallback(x, group), expected, "reduce-scatter fallback")

    def unsupported(*args, **kwargs):
        raise RuntimeError("reduce_scatter is not supported by this backend")

    native = mappings._reduce_scatter_flat
    mappings._reduce_scatter_flat, mappings._NATIVE_REDUCE_SCATTER["gloo"] = unsupported, True
    try:  # a gloo without reduce_scatter: the first call detects it, the later ones go straight to the fallback
        _close(_reduce_scatter(x, group), expected, "reduce-scatter (detecting the fallback)")
        assert mappings._NATIVE_REDUCE_SCATTER["gloo"] is False
        _close(_reduce_scatter(x, group), expected, "reduce-scatter (fallback)")
    finally:
        mappings._reduce_scatter_flat = native
        mappings._NATIVE_REDUCE_SCATTER.clear()


def _all_checks(rank: int, world_size: int, tp: int) -> str:
    state = parallel_state.initialize(tp=tp)
    torch.manual_seed(0)  # every rank draws the same references and inputs
    _check_linear_layers(tp, state.tp_rank)
    _check_fp8_layers(tp, state.tp_rank, state.group("tp"))
    _check_sequence_parallel(tp, state.tp_rank)
    _check_column_parallel_communication(tp, state.tp_rank)
    _check_column_parallel_main_grads(tp, state.tp_rank)
    _check_cross_entropy(tp, state.tp_rank)
    _check_rng(state.group("tp"))
    _check_checkpoint()
    _check_reduce_scatter(state.group("tp"))
    return "ok"


@pytest.mark.parametrize("world_size,tp", [(2, 2), (4, 4), (4, 2)])  # (4, 2): two TP groups side by side
def test_tensor_parallel(world_size, tp):
    assert run_distributed(_all_checks, world_size, tp) == ["ok"] * world_size
