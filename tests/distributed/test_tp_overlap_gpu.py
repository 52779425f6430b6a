"""ColumnParallelLinear's overlapped collectives on GPUs (NCCL: the asynchronous all-gather,
reduce-scatter and all-reduce run on NCCL's stream and the compute stream waits on each handle).

Needs two CUDA devices; skipped without them (the CPU tests in test_tensor_parallel.py and
test_sp_activation_memory.py cover the same code over gloo). Each check compares with nn.Linear on
one device, in fp32 with the tolerances of test_tensor_parallel.py, and asks the overlapped and the
one-after-the-other collectives for bitwise the same gradients, in fp32 and bf16.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from megatron import device as dev


def _gpus() -> int:
    return torch.cuda.device_count() if dev.cuda_available() else 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpus() < 2, reason="needs two CUDA devices")]

S, B, H = 64, 2, 128
RTOL, ATOL = 1e-5, 1e-6  # fp32 round-off (as test_tensor_parallel.py)


def _linear_grads(layer, x, dy):
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


def _check(rank: int, world: int) -> None:
    from megatron import parallel_state
    from megatron.tensor_parallel import ColumnParallelLinear, shard_full_tensor

    device = dev.get_device("gpu", rank)
    ps = parallel_state.initialize(tp=world)
    torch.manual_seed(0)
    ref = nn.Linear(H, 4 * H).to(device)
    x, dy = torch.randn(S, B, H, device=device), torch.randn(S, B, 4 * H, device=device)
    y_ref, dx_ref, w_ref, b_ref = _linear_grads(ref, x, dy)
    for dtype in (torch.float32, torch.bfloat16):
        for sp in (False, True):
            runs = []
            for async_communication in (True, False):
                layer = ColumnParallelLinear(H, 4 * H, sequence_parallel=sp, async_communication=async_communication,
                                              group=ps.group("tp"))
                with torch.no_grad():
                    for name, p in layer.named_parameters():
                        p.copy_(shard_full_tensor(getattr(ref, name).cpu(), p))
                layer.to(device=device, dtype=dtype)
                x_in = x.chunk(world, 0)[ps.tp_rank] if sp else x
                runs.append(_linear_grads(layer, x_in.to(dtype), dy.chunk(world, -1)[ps.tp_rank].to(dtype)))
            assert all(torch.equal(a, b) for a, b in zip(*runs)), f"{dtype}, sp={sp}: async changed the bits"
            if dtype != torch.float32:
                continue
            y, dx, dw, db = runs[0]
            expected = [y_ref.chunk(world, -1)[ps.tp_rank], dx_ref.chunk(world, 0)[ps.tp_rank] if sp else dx_ref,
                        w_ref.chunk(world, 0)[ps.tp_rank], b_ref.chunk(world, 0)[ps.tp_rank]]
            for got, want in zip((y, dx, dw, db), expected):
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def _worker(rank: int, world: int, store_dir: str) -> None:
    dist.init_process_group("nccl", store=dist.FileStore(os.path.join(store_dir, "store"), world), rank=rank,
                            world_size=world)
    try:
        _check(rank, world)
    finally:
        dist.destroy_process_group()


def test_column_parallel_overlap_on_nccl():
    with tempfile.TemporaryDirectory() as store_dir:  # a rank that raises fails the join
        mp.start_processes(_worker, args=(2, store_dir), nprocs=2, start_method="spawn")
