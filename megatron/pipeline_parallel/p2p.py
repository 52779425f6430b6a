"""Point-to-point communication between pipeline stages (gloo or NCCL).

Peers are *global* ranks, given by the caller (e.g. from :mod:`megatron.parallel_state`); ``group`` is
the pipeline group they belong to (``None`` for the default group). Shapes and dtypes are known on
both sides ahead of time (fixed sequence length and micro-batch size), so there is no shape
handshake: the receiver allocates the buffer. Messages between the same two ranks are matched in the
order they are posted (all use tag 0), so both sides must post them in the same order -- the tables of
:mod:`megatron.pipeline_parallel.schedule_tables` do (``simulate`` checks it).

Every exchange goes through ``dist.batch_isend_irecv``. A send completes only once the peer has posted
the matching receive (on gloo as on NCCL), so the combined calls post a send and a receive together:
two neighbours that each send to the other and receive from the other at the same moment (the steady
state of 1F1B) do not deadlock. :func:`communicate` posts any such batch (the interleaved schedule's
batches hold up to two sends and two receives). With ``async_op=True`` the sending calls return the
pending work handles instead of waiting: the caller must keep the tensor unchanged and ``wait()`` them
later (e.g. at the end of the step), which gives buffered sends.

With NCCL, the first p2p call on a group must involve all of its ranks (a torch requirement of
``batch_isend_irecv``), and the current CUDA device must be set.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

Shape = Sequence[int]


def communicate(sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[Shape, torch.dtype, int]],
                device: torch.device | str | None = None, group: dist.ProcessGroup | None = None,
                async_op: bool = False) -> tuple[list[torch.Tensor], list]:
    """Post the sends ``[(tensor, dst)]`` and the receives ``[(shape, dtype, src)]`` as one batch.

    Returns the receive buffers (allocated on ``device``) and the work handles; unless ``async_op``,
    every operation has completed on return (the buffers are filled). ``dst``/``src`` are global ranks.
    """
    buffers = [torch.empty(tuple(shape), dtype=dtype, device=device) for shape, dtype, _ in recvs]
    ops = [dist.P2POp(dist.isend, tensor.detach().contiguous(), dst, group) for tensor, dst in sends]
    ops += [dist.P2POp(dist.irecv, buf, src, group) for buf, (_, _, src) in zip(buffers, recvs)]
    works = dist.batch_isend_irecv(ops) if ops else []
    if not async_op:
        for work in works:
            work.wait()
    return buffers, works


def send_forward(tensor: torch.Tensor, group: dist.ProcessGroup | None, next_rank: int,
                 async_op: bool = False) -> list:
    """Send an activation to the next stage (global rank ``next_rank``); return the work handles."""
    return communicate([(tensor, next_rank)], [], group=group, async_op=async_op)[1]


def recv_forward(shape: Shape, dtype: torch.dtype, device: torch.device | str | None,
                 group: dist.ProcessGroup | None, prev_rank: int) -> torch.Tensor:
    """Receive an activation from the previous stage (global rank ``prev_rank``)."""
    return communicate([], [(shape, dtype, prev_rank)], device, group)[0][0]


def send_backward(tensor_grad: torch.Tensor, group: dist.ProcessGroup | None, prev_rank: int,
                  async_op: bool = False) -> list:
    """Send the gradient of a stage's input to the previous stage; return the work handles."""
    return communicate([(tensor_grad, prev_rank)], [], group=group, async_op=async_op)[1]


def recv_backward(shape: Shape, dtype: torch.dtype, device: torch.device | str | None,
                  group: dist.ProcessGroup | None, next_rank: int) -> torch.Tensor:
    """Receive the gradient of a stage's output from the next stage."""
    return communicate([], [(shape, dtype, next_rank)], device, group)[0][0]


def send_forward_recv_backward(tensor: torch.Tensor, group: dist.ProcessGroup | None, next_rank: int,
                               shape: Shape | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Send an activation to the next stage and receive, from it, the gradient of an output, in one
    batch. The gradient has the activation's shape, dtype and device unless ``shape``/``dtype`` say."""
    recv = (tensor.shape if shape is None else shape, tensor.dtype if dtype is None else dtype, next_rank)
    return communicate([(tensor, next_rank)], [recv], tensor.device, group)[0][0]


def send_backward_recv_forward(tensor_grad: torch.Tensor, group: dist.ProcessGroup | None, prev_rank: int,
                               shape: Shape | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Send an input gradient to the previous stage and receive, from it, the next activation, in one
    batch. The activation has the gradient's shape, dtype and device unless ``shape``/``dtype`` say."""
    recv = (tensor_grad.shape if shape is None else shape, tensor_grad.dtype if dtype is None else dtype, prev_rank)
    return communicate([(tensor_grad, prev_rank)], [recv], tensor_grad.device, group)[0][0]
