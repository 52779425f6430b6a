"""The MoE layer on a CUDA device: the same outputs and gradients as on the CPU (fp32), and ``--moe-grouped-gemm``
(``torch._grouped_mm`` over the experts' stacked weights, bf16) equal to the experts run one after another within
bf16's rounding, empty experts included. Skipped without a CUDA device (the CPU runs the loop: test_moe.py)."""

from __future__ import annotations

import pytest
import torch

from megatron import device as dev
from megatron import parallel_state
from megatron.config import parse_config, validate
from megatron.model.init import init_parameters
from megatron.model.transformer import MLP
from megatron.moe.layer import MoELayer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not dev.cuda_available(), reason="needs a CUDA device")]

H, E = 64, 8


def _layer(*flags: str) -> MoELayer:
    config = parse_config(["--mock-data", "--num-layers", "1", "--hidden-size", str(H), "--num-attention-heads", "4",
                           "--vocab-size", "64", "--max-seq-len", "64", "--ffn-hidden-size", "128", "--num-experts",
                           str(E), "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--swiglu",
                           "--disable-bias-linear", *flags])
    validate(config)
    parallel_state.initialize()
    layer = MoELayer(config.model, MLP, 0)
    with torch.no_grad():
        init_parameters(layer, 7, config.model)
    return layer


def _run(layer: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = layer(x)
    (out.float() * torch.linspace(-1, 1, out.numel(), device=x.device).view_as(out)).sum().backward()
    return out.detach().float().cpu(), {n: p.grad.float().cpu().clone() for n, p in layer.named_parameters()}


def test_cuda_equals_cpu_in_fp32():
    layer = _layer()
    x = torch.randn(64, 4, H, generator=torch.Generator().manual_seed(0))
    out_cpu, grads_cpu = _run(layer, x)
    out_gpu, grads_gpu = _run(layer.cuda(), x.cuda())
    torch.testing.assert_close(out_gpu, out_cpu, rtol=1e-5, atol=1e-5)
    for name, grad in grads_cpu.items():  # within 1e-5 of the tensor's scale (the router's sums cancel)
        error = (grads_gpu[name] - grad).abs().max() / grad.abs().max()
        assert error <= 1e-5, name


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no grouped matmul")
def test_grouped_gemm_equals_the_loop_in_bf16():
    """The experts on tokens sorted by expert, one expert given none (the grouped matmul's empty group)."""
    loop, grouped = _layer("--no-moe-grouped-gemm").experts, _layer("--moe-grouped-gemm").experts
    grouped.load_state_dict(loop.state_dict())
    loop, grouped = loop.cuda().bfloat16(), grouped.cuda().bfloat16()
    counts = [40, 0, 17, 64, 1, 30, 8, 96]
    tokens = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(1)).cuda().bfloat16()
    results = []
    for experts in (loop, grouped):
        experts.zero_grad(set_to_none=True)
        x = tokens.clone().requires_grad_()
        out = experts(x, counts)
        (out.float() * torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)).sum().backward()
        results.append((out.float(), x.grad.float(), {n: p.grad.float() for n, p in experts.named_parameters()}))
    (out_loop, dx_loop, grads_loop), (out_grouped, dx_grouped, grads_grouped) = results
    assert (out_grouped - out_loop).abs().max() <= 2e-2 * out_loop.abs().max()
    assert (dx_grouped - dx_loop).abs().max() <= 2e-2 * dx_loop.abs().max()
    for name, grad in grads_loop.items():
        assert (grads_grouped[name] - grad).abs().max() <= 2e-2 * grad.abs().max().clamp(min=1e-6), name
    assert grads_loop["1.dense_h_to_4h.weight"].abs().max() == grads_grouped["1.dense_h_to_4h.weight"].abs().max() == 0
