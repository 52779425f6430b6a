"""The context-parallel block kernel on a CUDA GPU (benchmarks/gpu.py runs these first): the flash kernel passes
its probe there, and for full and causal blocks, with the merged output and log-sum-exp of several blocks, its
forward and backward equal the plain fp32 kernel's within bf16's rounding (MLA's unequal widths included)."""

from __future__ import annotations

import pytest
import torch

from megatron import device as dev
from megatron.attention import blocks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not dev.cuda_available(), reason="needs a CUDA device")]


def _run(q, k, v, dout, parts, fused: bool):
    """Two blocks (the diagonal causal one, and a full one of earlier keys) merged, then their backward."""
    blocks.FUSED_ON_GPU["enabled"] = fused
    try:
        b, h, n, _ = q.shape
        out = torch.zeros(b, h, n, v.shape[-1], device=q.device)
        lse = torch.full((b, h, n), float("-inf"), device=q.device)
        blocks.blocks_forward(q, k, v, parts, q.shape[-1] ** -0.5, out, lse)
        dq, dk, dv = (torch.zeros(t.shape, device=q.device) for t in (q, k, v))
        blocks.blocks_backward(dout, q, k, v, out.to(q.dtype), lse, parts, q.shape[-1] ** -0.5, dq, dk, dv)
        return out, lse, dq, dk, dv
    finally:
        blocks.FUSED_ON_GPU["enabled"] = True


@pytest.mark.parametrize("widths", [(128, 128), (64, 64), (192, 128)], ids=["128", "64", "mla-192-128"])
def test_the_flash_kernel_equals_the_plain_one(widths):
    device, (dqk, dv_width) = torch.device("cuda"), widths
    assert blocks.gpu_flash(device, torch.bfloat16, max(widths)) is None
    assert blocks.kernel_name(device, torch.bfloat16, max(widths)) == "the GPU's flash kernel"
    torch.manual_seed(0)
    n = 512
    q = torch.randn(2, 4, n, dqk, device=device, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 2 * n, dqk, device=device, dtype=torch.bfloat16)  # grouped: 2 key/value groups
    v = torch.randn(2, 2, 2 * n, dv_width, device=device, dtype=torch.bfloat16)
    dout = torch.randn(2, 4, n, dv_width, device=device, dtype=torch.bfloat16)
    parts = [blocks.Block(slice(0, n), slice(n, 2 * n), 0), blocks.Block(slice(0, n), slice(0, n), n)]
    fused, plain = _run(q, k, v, dout, parts, True), _run(q, k, v, dout, parts, False)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), fused, plain):
        scale = want.abs().max()
        assert (got - want).abs().max() <= 2e-2 * scale, name
