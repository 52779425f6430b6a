"""megatron.pipeline_parallel.p2p over gloo: ranks in a chain run the schedule tables with a toy model.

A toy executor plays each rank's table: ``F`` at virtual stage ``v`` maps its input ``x`` to
``x + v + 1`` (virtual stage 0 starts from a tensor that encodes the micro-batch), the last virtual
stage's output is its own output gradient, and ``B`` maps the output gradient ``g`` to ``2 * g + x``
(using the saved input, so mixing up micro-batches or chunks changes the values). Every input
gradient is compared with a single-process reference; all values are small integers in fp32, so the
comparison is exact.

Two ways to communicate: ``fused`` posts each run of adjacent communication actions with one call
(``send_forward_recv_backward`` / ``send_backward_recv_forward`` for the 1F1B steady state, the single
calls for runs of one, ``communicate`` otherwise) and waits for it -- blocking semantics, since gloo
sends complete only once the receive is posted; ``async`` sends with ``async_op=True`` and waits for
the sends at the end -- buffered semantics.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.pipeline_parallel import p2p
from megatron.pipeline_parallel.p2p import Shape
from megatron.pipeline_parallel.schedule_tables import Action, gpipe, interleaved_one_f_one_b, one_f_one_b
from tests.distributed.harness import run_distributed

SHAPE = (2, 3)

# Megatron-LM's named p2p calls, each one ``communicate`` batch: the exchanges the tables are made of (the
# executor, ``schedules.run_pipeline_table``, posts whole runs with ``communicate`` itself).


def send_forward(tensor: torch.Tensor, group: dist.ProcessGroup | None, next_rank: int,
                 async_op: bool = False) -> list:
    """Send an activation to the next stage (global rank ``next_rank``); return the work handles."""
    return p2p.communicate([(tensor, next_rank)], [], group=group, async_op=async_op)[1]


def recv_forward(shape: Shape, dtype: torch.dtype, device: torch.device | str | None,
                 group: dist.ProcessGroup | None, prev_rank: int) -> torch.Tensor:
    """Receive an activation from the previous stage (global rank ``prev_rank``)."""
    return p2p.communicate([], [(shape, dtype, prev_rank)], device, group)[0][0]


def send_backward(tensor_grad: torch.Tensor, group: dist.ProcessGroup | None, prev_rank: int,
                  async_op: bool = False) -> list:
    """Send the gradient of a stage's input to the previous stage; return the work handles."""
    return p2p.communicate([(tensor_grad, prev_rank)], [], group=group, async_op=async_op)[1]


def recv_backward(shape: Shape, dtype: torch.dtype, device: torch.device | str | None,
                  group: dist.ProcessGroup | None, next_rank: int) -> torch.Tensor:
    """Receive the gradient of a stage's output from the next stage."""
    return p2p.communicate([], [(shape, dtype, next_rank)], device, group)[0][0]


def send_forward_recv_backward(tensor: torch.Tensor, group: dist.ProcessGroup | None, next_rank: int,
                               shape: Shape | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Send an activation to the next stage and receive, from it, the gradient of an output, in one
    batch. The gradient has the activation's shape, dtype and device unless ``shape``/``dtype`` say."""
    recv = (tensor.shape if shape is None else shape, tensor.dtype if dtype is None else dtype, next_rank)
    return p2p.communicate([(tensor, next_rank)], [recv], tensor.device, group)[0][0]


def send_backward_recv_forward(tensor_grad: torch.Tensor, group: dist.ProcessGroup | None, prev_rank: int,
                               shape: Shape | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Send an input gradient to the previous stage and receive, from it, the next activation, in one
    batch. The activation has the gradient's shape, dtype and device unless ``shape``/``dtype`` say."""
    recv = (tensor_grad.shape if shape is None else shape, tensor_grad.dtype if dtype is None else dtype, prev_rank)
    return p2p.communicate([(tensor_grad, prev_rank)], [recv], tensor_grad.device, group)[0][0]


CALLS = {f.__name__: f for f in (send_forward, recv_forward, send_backward, recv_backward, send_forward_recv_backward,
                                  send_backward_recv_forward, p2p.communicate)}


def _first_input(k: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).reshape(SHAPE) + 100 * k


def _reference(m: int, stages: int) -> dict:
    """Input gradient of every (micro-batch, virtual stage)."""
    grads = {}
    for k in range(m):
        xs = [_first_input(k)]
        for v in range(stages):
            xs.append(xs[-1] + v + 1)
        g = xs[-1]
        for v in reversed(range(stages)):
            g = 2 * g + xs[v]
            grads[(k, v)] = g
    return grads


def _execute(table: list[Action], rank: int, pp: int, vpp: int, mode: str) -> tuple[dict, set]:
    stages, used, works = pp * vpp, set(), []
    inputs, saved, outputs, out_grads, in_grads, result = {}, {}, {}, {}, {}, {}

    def peer(a: Action) -> int:  # global rank of the neighbouring virtual stage
        v = a.chunk * pp + rank
        return (v + 1 if a.kind in ("SEND_F", "RECV_B") else v - 1) % pp

    def payload(a: Action) -> torch.Tensor:
        return (outputs if a.kind == "SEND_F" else in_grads).pop((a.micro_batch, a.chunk))

    def store(a: Action, tensor: torch.Tensor) -> None:
        (inputs if a.kind == "RECV_F" else out_grads)[(a.micro_batch, a.chunk)] = tensor

    def call(name: str, *args, **kwargs):
        used.add(name)
        return CALLS[name](*args, **kwargs)

    i = 0
    while i < len(table):
        a, key = table[i], (table[i].micro_batch, table[i].chunk)
        v = a.chunk * pp + rank
        if a.kind == "F":
            x = _first_input(a.micro_batch) if v == 0 else inputs.pop(key)
            saved[key], outputs[key] = x, x + v + 1
            if v == stages - 1:
                out_grads[key] = outputs.pop(key)
        elif a.kind == "B":
            result[(a.micro_batch, v)] = in_grads[key] = 2 * out_grads.pop(key) + saved.pop(key)
            if v == 0:
                in_grads.pop(key)
        elif mode == "async":
            if a.kind.startswith("SEND"):
                works += call("send_forward" if a.kind == "SEND_F" else "send_backward", payload(a), None, peer(a),
                              async_op=True)
            else:
                name = "recv_forward" if a.kind == "RECV_F" else "recv_backward"
                store(a, call(name, SHAPE, torch.float32, "cpu", None, peer(a)))
        else:  # fused: one call for this run of communication actions
            run = [a]
            while i + len(run) < len(table) and table[i + len(run)].kind not in ("F", "B"):
                run.append(table[i + len(run)])
            kinds = [b.kind for b in run]
            if kinds in (["SEND_F", "RECV_B"], ["SEND_B", "RECV_F"]) and peer(run[0]) == peer(run[1]):
                name = "send_forward_recv_backward" if kinds[0] == "SEND_F" else "send_backward_recv_forward"
                store(run[1], call(name, payload(run[0]), None, peer(run[0])))
            elif len(run) == 1 and a.kind.startswith("SEND"):
                call("send_forward" if a.kind == "SEND_F" else "send_backward", payload(a), None, peer(a))
            elif len(run) == 1:
                store(a, call("recv_forward" if a.kind == "RECV_F" else "recv_backward", SHAPE, torch.float32,
                              "cpu", None, peer(a)))
            else:
                sends = [(payload(b), peer(b)) for b in run if b.kind.startswith("SEND")]
                recv_actions = [b for b in run if b.kind.startswith("RECV")]
                received, _ = call("communicate", sends, [(SHAPE, torch.float32, peer(b)) for b in recv_actions])
                for b, tensor in zip(recv_actions, received):
                    store(b, tensor)
            i += len(run) - 1
        i += 1
    for work in works:
        work.wait()
    assert not (inputs or saved or outputs or out_grads or in_grads), "tensors left over"
    return result, used


def _chain(rank: int, world_size: int, cases: list) -> list:
    out = []
    for schedule, m, vpp, mode in cases:
        if schedule == "interleaved":
            table = interleaved_one_f_one_b(world_size, rank, m, vpp)
        else:
            table = {"gpipe": gpipe, "1f1b": one_f_one_b}[schedule](world_size, rank, m)
        out.append(_execute(table, rank, world_size, vpp, mode))
    # the combined calls directly: every rank exchanges with both neighbours at once
    nxt, prv = rank + 1, rank - 1
    if nxt < world_size:
        grad = send_forward_recv_backward(torch.full(SHAPE, 10.0 + rank), None, nxt)
        assert torch.equal(grad, torch.full(SHAPE, 20.0 + nxt))
    if prv >= 0:
        act = send_backward_recv_forward(torch.full(SHAPE, 20.0 + rank), None, prv)
        assert torch.equal(act, torch.full(SHAPE, 10.0 + prv))
    return out


CASES = {  # (schedule, micro-batches, vpp, mode)
    2: [("1f1b", 5, 1, "fused"), ("gpipe", 3, 1, "fused"), ("interleaved", 4, 2, "fused"), ("1f1b", 4, 1, "async"),
        ("interleaved", 4, 3, "async")],
    3: [("1f1b", 5, 1, "fused"), ("1f1b", 2, 1, "fused"), ("gpipe", 2, 1, "fused"), ("interleaved", 6, 2, "fused")],
}


def _check(world_size: int) -> None:
    results = run_distributed(_chain, world_size, CASES[world_size], timeout=60.0)
    used = set()
    for c, (_, m, vpp, _) in enumerate(CASES[world_size]):
        got = {}
        for rank in range(world_size):
            grads, names = results[rank][c]
            got.update(grads)
            used |= names
        expected = _reference(m, world_size * vpp)
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(got[key], value), f"case {CASES[world_size][c]}, (micro-batch, stage) {key}"
    assert {"send_forward", "recv_forward", "send_backward", "recv_backward", "send_forward_recv_backward",
            "send_backward_recv_forward", "communicate"} <= used


def test_p2p_chain_of_2():
    _check(2)


def test_p2p_chain_of_3():
    _check(3)
