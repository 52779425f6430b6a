"""Point-to-point communication between pipeline stages (gloo or NCCL).

Peers are *global* ranks, given by the caller (e.g. from :mod:`megatron.parallel_state`); ``group`` is
the pipeline group they belong to (``None`` for the default group). Shapes and dtypes are known on
both sides ahead of time (fixed sequence length and micro-batch size), so there is no shape
handshake: the receiver allocates the buffer. Messages between the same two ranks are matched in the
order they are posted (all use tag 0), so both sides must post them in the same order -- the tables of
:mod:`megatron.pipeline_parallel.schedule_tables` do (``simulate`` checks it).

Every exchange goes through ``dist.batch_isend_irecv``. A send completes only once the peer has posted
the matching receive (on gloo as on NCCL), so a send and a receive are posted together, in one batch:
two neighbours that each send to the other and receive from the other at the same moment (the steady
state of 1F1B) do not deadlock. :func:`communicate` posts any such batch (the interleaved schedule's
batches hold up to two sends and two receives). With ``async_op=True`` it returns the pending work
handles instead of waiting: the caller must keep the sent tensors unchanged and ``wait()`` them
before reusing them (e.g. at the end of the step), which gives buffered sends.

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
