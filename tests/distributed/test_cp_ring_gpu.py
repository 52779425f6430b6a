"""Ring attention (``--cp-comm-type p2p``) on GPUs: NCCL send/recv on its own stream while the compute stream
runs the current block.

Needs two CUDA devices; skipped without them (tests/distributed/test_context_parallel_attention.py covers the
same code over gloo, both block kernels included). On two GPUs: the ring's output and gradients equal one
device's masked attention (fp32; bf16 within its rounding), the overlapped and the one-after-the-other ring
give bitwise the same results, and in the overlapped ring the profiler sees a NCCL kernel running at the
same time as a compute kernel (the transfer hidden behind the block), which the waited ring never shows.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from megatron import device as dev


def _gpus() -> int:
    return torch.cuda.device_count() if dev.cuda_available() else 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpus() < 2, reason="needs two CUDA devices")]

B, NQ, NG, S, HD = 2, 8, 4, 4096, 64


def _ring(q, k, v, plan, weight, mine):
    from megatron.context_parallel.attention import attend

    local = [t[:, :, mine].detach().clone().requires_grad_() for t in (q, k, v)]
    out = attend(*local, plan)
    (out.float() * weight[:, :, mine]).sum().backward()
    return [out.detach(), *(t.grad for t in local)]


def _overlapping_nccl(prof) -> bool:
    """Whether some NCCL kernel's interval intersects a compute kernel's."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    nccl = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower()]
    compute = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()]
    return any(a < d and c < b for a, b in nccl for c, d in compute)


def _check(rank: int, world: int) -> None:
    from megatron import parallel_state
    from megatron.context_parallel.attention import RING_OVERLAP, AttentionPlan, exchange
    from megatron.context_parallel.layout import local_positions

    device = dev.get_device("gpu", rank)
    ps = parallel_state.initialize(cp=world)
    torch.manual_seed(0)
    q = torch.randn(B, NQ, S, HD, device=device)
    k, v = torch.randn(B, NG, S, HD, device=device), torch.randn(B, NG, S, HD, device=device)
    weight = torch.randn(B, NQ, S, HD, device=device)
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    (out * weight).sum().backward()
    mine = local_positions(S, ps.cp_rank, world, device)
    want = [out.detach()[:, :, mine], *(t.grad[:, :, mine] for t in ref)]
    plan = AttentionPlan(world, ps.cp_rank, ps.group("cp"), "p2p", exchange=exchange)
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
        runs = []
        for overlap in (True, False):
            RING_OVERLAP["enabled"] = overlap
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                runs.append(_ring(q.to(dtype), k.to(dtype), v.to(dtype), plan, weight, mine))
                torch.cuda.synchronize(device)
            if dtype == torch.float32:
                assert _overlapping_nccl(prof) == overlap, f"overlap={overlap}: NCCL and compute kernels"
        RING_OVERLAP["enabled"] = True
        assert all(torch.equal(a, b) for a, b in zip(*runs)), f"{dtype}: the overlap changed the bits"
        for name, got, w in zip(("out", "dq", "dk", "dv"), runs[0], want):
            torch.testing.assert_close(got.float(), w, rtol=tol, atol=tol, msg=f"{dtype} {name}")


def _worker(rank: int, world: int, store_dir: str) -> None:
    dist.init_process_group("nccl", store=dist.FileStore(os.path.join(store_dir, "store"), world), rank=rank,
                            world_size=world)
    try:
        _check(rank, world)
    finally:
        dist.destroy_process_group()


def test_ring_attention_on_nccl_overlaps_and_matches_one_device():
    with tempfile.TemporaryDirectory() as store_dir:
        mp.start_processes(_worker, args=(2, store_dir), nprocs=2, start_method="spawn")
