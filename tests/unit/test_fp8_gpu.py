"""FP8 matmuls on a CUDA GPU with FP8 tensor cores (benchmarks/gpu.py runs these first): ``torch._scaled_mm``'s
operand layouts and scales as ``megatron/tensor_parallel/fp8.py`` gives them, checked against the fp32 product of
the same FP8-cast operands (forward and both gradients, both formats), and a tensor-parallel layer's FP8 path in
one process equal to ``fp8_linear``."""

from __future__ import annotations

import pytest
import torch

from megatron import device as dev
from megatron.tensor_parallel import ColumnParallelLinear, FP8Recipe, enable_fp8
from megatron.tensor_parallel.fp8 import fp8_linear
from tests.unit.test_fp8 import through_fp8


def _fp8_gpu() -> bool:
    return dev.cuda_available() and dev.fp8_problem(torch.device("cuda")) is None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _fp8_gpu(), reason="needs a GPU with FP8 tensor cores")]


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_each_matmul_is_the_product_of_its_fp8_operands_on_the_gpu(fmt):
    torch.manual_seed(0)
    x = (3 * torch.randn(4, 64, 256, device="cuda")).bfloat16().requires_grad_()
    w = torch.randn(512, 256, device="cuda").bfloat16().requires_grad_()
    dy = torch.randn(4, 64, 512, device="cuda").bfloat16()
    y = fp8_linear(x, w, FP8Recipe(fmt))
    y.backward(dy)
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16
    x2, g2 = x.detach().reshape(-1, 256).float(), dy.reshape(-1, 512).float()
    grad = through_fp8(g2, torch.float8_e5m2 if fmt == "hybrid" else torch.float8_e4m3fn)
    x8, w8 = through_fp8(x2, torch.float8_e4m3fn), through_fp8(w.detach().float(), torch.float8_e4m3fn)
    expected = {"output": x8 @ w8.t(), "input grad": grad @ w8, "weight grad": grad.t() @ x8}
    got = {"output": y.detach().reshape(-1, 512), "input grad": x.grad.reshape(-1, 256), "weight grad": w.grad}
    for name, want in expected.items():  # fp32 accumulation, rounded once to bf16
        assert (got[name].float() - want).abs().max() <= 2 ** -7 * want.abs().max(), name


def test_a_column_parallel_layer_in_fp8_equals_fp8_linear():
    torch.manual_seed(1)
    layer = ColumnParallelLinear(256, 512).cuda().bfloat16()
    enable_fp8(layer, FP8Recipe("hybrid"))
    x = torch.randn(64, 4, 256, device="cuda").bfloat16()
    expected = fp8_linear(x, layer.weight, FP8Recipe("hybrid"), bias=layer.bias)
    assert torch.equal(layer(x), expected)
