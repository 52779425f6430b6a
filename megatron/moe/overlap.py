"""The expert-parallel token exchange overlapped with computation (Megatron-LM's ``--moe-shared-expert-overlap``
and ``--delay-wgrad-compute``), for the alltoall dispatcher at ep > 1.

Without overlap each exchange of ``megatron.moe.dispatch.alltoall`` waits for its all-to-all before anything else
runs. ``ExpertExchange`` instead runs the dispatch all-to-all, the rank's local expert computation and the combine
all-to-all as one autograd function, and fills the time an exchange is in flight:

- **forward** (``--moe-shared-expert-overlap``): the dispatch all-to-all is started, the shared expert's forward
  runs on the layer's input while it is in flight (``during_dispatch``), then the local experts run.
- **backward** (``--delay-wgrad-compute``): the gradient of the combine comes back (all-to-all), the backward runs
  through the local experts for the activation gradients only (the input's, and those at each expert's two matmul
  outputs), the dispatch's adjoint all-to-all is started with them, and the experts' weight gradients (``g^T x``
  for each linear layer, the biases' sums) are computed while it is in flight. The weight gradients leave this
  function as its inputs' gradients, so autograd accumulates them into the parameters as before and the
  data-parallel hooks fire as before: nothing downstream knows.

Without ``--delay-wgrad-compute`` the backward computes every gradient at once, then exchanges. Both give the same
values as the plain dispatcher (the same matmuls, in another order): ``tests/unit/test_moe_overlap.py``.

This is Megatron's intent for one micro-batch; Megatron-LM's ``--overlap-moe-expert-parallel-comm`` (the exchanges
of one micro-batch hidden behind another micro-batch's attention, on separate CUDA streams) is not built: see
docs/moe.md. On the CPU, gloo runs an asynchronous all-to-all on its own threads: ``benchmarks/moe_overlap.py``
measures what the overlap gains there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.ops.activations import activate


@dataclass
class Overlap:
    """What fills the exchanges: ``during_dispatch`` (the shared expert's forward, run with autograd on) while the
    dispatch all-to-all is in flight; ``delay_wgrad``: the experts' weight gradients while the dispatch's adjoint is
    in flight."""

    delay_wgrad: bool = False
    during_dispatch: Callable[[], None] | None = None


def _start_exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> tuple[torch.Tensor, object]:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    return out, dist.all_to_all_single(out, x.contiguous(), recv, send, group=group, async_op=True)


def expert_parameters(experts) -> list[torch.nn.Parameter]:
    """Every parameter of this rank's experts, in a fixed order (the function's inputs)."""
    return [p for expert in experts.values() for p in expert.parameters()]


class ExpertExchange(torch.autograd.Function):
    """``rows`` (this rank's (token, expert) pairs sorted by expert) -> the experts' outputs on them, back on this
    rank, as ``dispatch.alltoall`` computes them; ``local(rows_received, record)`` is the rank's part between the
    two exchanges (etp collectives, reordering, the experts, which append their intermediates to ``record``)."""

    @staticmethod
    def forward(ctx, rows, send, recv, group, local, overlap, *params):
        received, work = _start_exchange(rows, send, recv, group)
        if overlap.during_dispatch is not None:
            with torch.enable_grad():
                overlap.during_dispatch()
        work.wait()
        record: list[tuple] = []
        with torch.enable_grad():
            local_in = received.detach().requires_grad_()
            local_out = local(local_in, record)
        ctx.send, ctx.recv, ctx.group, ctx.delay = send, recv, group, overlap.delay_wgrad
        ctx.local_in, ctx.local_out, ctx.record, ctx.params = local_in, local_out, record, params
        out, work = _start_exchange(local_out.detach(), recv, send, group)
        work.wait()
        return out

    @staticmethod
    def backward(ctx, grad):
        local_grad, work = _start_exchange(grad, ctx.send, ctx.recv, ctx.group)  # the combine's adjoint
        work.wait()
        if not ctx.delay:
            grads = torch.autograd.grad(ctx.local_out, [ctx.local_in, *ctx.params], local_grad, allow_unused=True)
            back, work = _start_exchange(grads[0], ctx.recv, ctx.send, ctx.group)
            work.wait()
            return (back, None, None, None, None, None, *grads[1:])
        record = ctx.record
        outputs = [entry[5] for entry in record] + [entry[3] for entry in record]  # each group's o, then h1
        grads = torch.autograd.grad(ctx.local_out, [ctx.local_in, *outputs], local_grad, allow_unused=True)
        back, work = _start_exchange(grads[0], ctx.recv, ctx.send, ctx.group)  # the dispatch's adjoint, in flight
        weight_grads = _weight_grads(record, grads[1:1 + len(record)], grads[1 + len(record):])
        work.wait()
        ctx.local_in = ctx.local_out = ctx.record = None
        return (back, None, None, None, None, None, *[weight_grads.get(p) for p in ctx.params])


def _weight_grads(record: list[tuple], grad_outputs: tuple, grad_hidden: tuple) -> dict:
    """Each expert's weight and bias gradients from its matmuls' inputs and output gradients: fc2's
    ``g_o^T y`` (``y`` recomputed from ``h1`` when the activation is recomputed), fc1's ``g_h1^T x``. A record
    entry is one expert's rows, or (the grouped matmul) several experts' rows cut by ``sizes``."""
    grads: dict = {}

    def add(param, value):
        if param is not None:
            grads[param] = value if param not in grads else grads[param] + value

    for (experts, sizes, x, h1, y, o), g_o, g_h1 in zip(record, grad_outputs, grad_hidden):
        g_o = torch.zeros_like(o) if g_o is None else g_o
        g_h1 = torch.zeros_like(h1) if g_h1 is None else g_h1
        if y is None:
            with torch.no_grad():
                y = activate(h1, experts[0].activation)
        sizes = sizes or [x.shape[0]]
        for expert, x_e, y_e, g_o_e, g_h1_e in zip(experts, x.split(sizes), y.split(sizes), g_o.split(sizes),
                                                   g_h1.split(sizes)):
            fc1, fc2 = expert.dense_h_to_4h, expert.dense_4h_to_h
            add(fc2.weight, (g_o_e.t() @ y_e.to(g_o_e.dtype)).to(fc2.weight.dtype))
            if fc2.bias is not None and expert.add_bias:
                add(fc2.bias, g_o_e.sum(0).to(fc2.bias.dtype))
            add(fc1.weight, (g_h1_e.t() @ x_e.to(g_h1_e.dtype)).to(fc1.weight.dtype))
            if fc1.bias is not None:
                add(fc1.bias, g_h1_e.sum(0).to(fc1.bias.dtype))
    return grads
