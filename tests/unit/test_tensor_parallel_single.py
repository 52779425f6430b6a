"""megatron.tensor_parallel with one rank (no process group): every layer is the plain torch layer.

With a single rank every mapping is the identity and the layers call the same torch kernels
on the same tensors, so the results are compared bit for bit (``torch.equal``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron import parallel_state
from megatron.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    checkpoint,
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    get_rng_tracker,
    mark_sequence_parallel,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tp_region,
    shard_full_tensor,
    tensor_parallel_seed,
    token_cross_entropy,
    vocab_parallel_cross_entropy,
)


@pytest.fixture(autouse=True)
def _single_process():
    parallel_state.destroy()
    yield
    parallel_state.destroy()


def _run(module: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    x = x.detach().clone().requires_grad_(x.is_floating_point())
    y = module(x)
    y.backward(dy)
    return y, x.grad, [p.grad for p in module.parameters()]


def _assert_same(a, b):
    ya, dxa, dpa = a
    yb, dxb, dpb = b
    assert torch.equal(ya, yb)
    assert (dxa is None and dxb is None) or torch.equal(dxa, dxb)
    assert len(dpa) == len(dpb) and all(torch.equal(p, q) for p, q in zip(dpa, dpb))


def test_mappings_are_identity():
    x = torch.randn(4, 2, 6)
    for fn in (copy_to_tp_region, reduce_from_tp_region, scatter_to_tp_region, gather_from_tp_region,
               scatter_to_sequence_region, gather_from_sequence_region, reduce_scatter_to_sequence_region):
        assert fn(x) is x


@pytest.mark.parametrize("gather_output", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_column_parallel_linear(gather_output, bias):
    torch.manual_seed(0)
    ref = nn.Linear(8, 12, bias=bias)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(8, 12, bias=bias, gather_output=gather_output)
    assert torch.equal(layer.weight, ref.weight)  # same default init, drawn at the full shape
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0
    assert layer.weight.full_shape == (12, 8)
    x, dy = torch.randn(5, 3, 8), torch.randn(5, 3, 12)
    _assert_same(_run(layer, x, dy), _run(ref, x, dy))


@pytest.mark.parametrize("input_is_parallel", [False, True])
def test_row_parallel_linear(input_is_parallel):
    torch.manual_seed(0)
    ref = nn.Linear(12, 8)
    torch.manual_seed(0)
    layer = RowParallelLinear(12, 8, input_is_parallel=input_is_parallel)
    assert torch.equal(layer.weight, ref.weight) and torch.equal(layer.bias, ref.bias)
    assert layer.weight.partition_dim == 1 and layer.weight.full_shape == (8, 12)
    assert layer.bias.tensor_model_parallel is False
    assert not getattr(layer.bias, "sequence_parallel", False)
    x, dy = torch.randn(5, 3, 12), torch.randn(5, 3, 8)
    _assert_same(_run(layer, x, dy), _run(ref, x, dy))


def test_sequence_parallel_pair_single_rank():
    torch.manual_seed(0)
    col = ColumnParallelLinear(8, 16, sequence_parallel=True)
    row = RowParallelLinear(16, 8, sequence_parallel=True)
    assert row.bias.sequence_parallel
    ln = mark_sequence_parallel(nn.LayerNorm(8))
    assert all(p.sequence_parallel for p in ln.parameters())
    ref = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    ref.load_state_dict({"0.weight": ln.weight, "0.bias": ln.bias, "1.weight": col.weight, "1.bias": col.bias,
                         "3.weight": row.weight, "3.bias": row.bias})
    sp = nn.Sequential(ln, col, nn.GELU(), row)
    x, dy = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    out = _run(sp, x, dy)
    _assert_same(out, _run(ref, x, dy))


def test_vocab_parallel_embedding():
    torch.manual_seed(0)
    ref = nn.Embedding(20, 6)
    torch.manual_seed(0)
    layer = VocabParallelEmbedding(20, 6)
    assert torch.equal(layer.weight, ref.weight) and layer.weight.partition_dim == 0
    ids, dy = torch.randint(0, 20, (7, 3)), torch.randn(7, 3, 6)
    _assert_same(_run(layer, ids, dy), _run(ref, ids, dy))


def test_shard_full_tensor():
    layer = ColumnParallelLinear(4, 6)
    full = torch.randn(6, 4)
    assert torch.equal(shard_full_tensor(full, layer.weight), full)
    # what rank 1 of a tp=3 layout holds: rows 2:4 (partition_dim 0), columns 2:4 (partition_dim 1)
    param = nn.Parameter(torch.empty(2, 4))
    param.tensor_model_parallel, param.partition_dim = True, 0
    assert torch.equal(shard_full_tensor(full, param, rank=1), full[2:4])
    param = nn.Parameter(torch.empty(6, 2))
    param.tensor_model_parallel, param.partition_dim = True, 1
    assert torch.equal(shard_full_tensor(full, param, rank=1), full[:, 2:4])
    bias = RowParallelLinear(4, 6).bias
    column = full[:, 0]
    assert shard_full_tensor(column, bias) is column  # replicated: the full tensor itself


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab_size", [16, 13])  # 13: three padded columns
def test_cross_entropy_equals_token_cross_entropy(dtype, vocab_size):
    torch.manual_seed(0)
    logits, labels = torch.randn(9, 16, dtype=dtype), torch.randint(0, vocab_size, (9,))
    g = torch.rand(9)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    la = vocab_parallel_cross_entropy(a, labels, vocab_size)
    lb = token_cross_entropy(b, labels, vocab_size)
    la.backward(g)
    lb.backward(g)
    assert torch.equal(la, lb) and torch.equal(a.grad, b.grad) and a.grad.dtype == dtype
    ref = logits.float()[:, :vocab_size].requires_grad_()
    F.cross_entropy(ref, labels, reduction="none").backward(g)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # fp32 round-off; bf16 storage of the gradient
    assert torch.allclose(a.grad[:, :vocab_size].float(), ref.grad, atol=tol)
    assert not a.grad[:, vocab_size:].any()


def test_rng_tracker_fork_is_isolated():
    tensor_parallel_seed(1234, tp_rank=0)
    with get_rng_tracker().fork():
        inside = torch.rand(8)
    after_fork = torch.rand(8)
    tensor_parallel_seed(1234, tp_rank=0)
    assert torch.equal(torch.rand(8), after_fork)  # forked draws do not advance the default stream
    with get_rng_tracker().fork():
        assert torch.equal(torch.rand(8), inside)
    tensor_parallel_seed(1234, tp_rank=1)
    with get_rng_tracker().fork():
        assert not torch.equal(torch.rand(8), inside)  # another TP rank, another stream
    states = get_rng_tracker().get_states()
    with get_rng_tracker().fork():
        first = torch.rand(8)
    get_rng_tracker().set_states(states)
    with get_rng_tracker().fork():
        assert torch.equal(torch.rand(8), first)
    with pytest.raises(ValueError):
        get_rng_tracker().add("other", 1234 + 2718 + 1)  # seed already tracked
    with pytest.raises(KeyError):
        with get_rng_tracker().fork("missing"):
            pass


def _dropout_block(lin1: nn.Module, lin2: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = lin1(x)
    with get_rng_tracker().fork():
        h = F.dropout(h, 0.5, training=True)
    return F.dropout(lin2(h), 0.3, training=True)


def test_checkpoint_replays_dropout():
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(8, 16), nn.Linear(16, 8)
    x = torch.randn(4, 2, 8)

    def grads(ckpt):
        tensor_parallel_seed(7, tp_rank=0)
        xx = x.clone().requires_grad_()
        y = ckpt(_dropout_block, lin1, lin2, xx)
        torch.rand(3)  # advance both streams between forward and backward
        with get_rng_tracker().fork():
            torch.rand(3)
        for p in (*lin1.parameters(), *lin2.parameters()):
            p.grad = None
        (y * torch.arange(y.numel()).view_as(y)).sum().backward()
        return [y.detach(), xx.grad] + [p.grad.clone() for p in (*lin1.parameters(), *lin2.parameters())]

    plain = grads(lambda f, *a: f(*a))
    replayed = grads(checkpoint)
    assert all(torch.equal(a, b) for a, b in zip(plain, replayed))
    untracked = grads(lambda f, *a: torch.utils.checkpoint.checkpoint(f, *a, use_reentrant=False))
    assert not all(torch.equal(a, b) for a, b in zip(plain, untracked))  # the test can see a wrong mask
