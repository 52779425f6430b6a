"""Forward/backward schedules over the micro-batches of one step.

The contract (Megatron-LM's): ``forward_step(micro_batch, model) -> (output, loss_fn)`` and
``loss_fn(output) -> (loss_sum, token_count)``, the masked sum of token losses and the
number of tokens it covers. Schedules never look inside the model.

Token-exact normalisation: every micro-batch's backward uses ``loss_sum / num_tokens``
where ``num_tokens`` counts the loss tokens of the whole global batch, so the gradient is
that of (sum of all token losses) / (all tokens), however the batch is cut into
micro-batches and ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from typing import Any

import torch

from megatron.pipeline_parallel import p2p
from megatron.pipeline_parallel import schedule_tables as tables
from megatron.pipeline_parallel.schedule_tables import COMM, Action

ForwardStep = Callable[[Any, torch.nn.Module], tuple[torch.Tensor, Callable]]


def forward_backward_no_pipelining(forward_step: ForwardStep, micro_batches: Sequence[Any],
                                   model: torch.nn.Module, num_tokens: float, loss_scale: float = 1.0,
                                   forward_only: bool = False) -> torch.Tensor:
    """Run every micro-batch through forward and (unless ``forward_only``) backward,
    accumulating gradients; return the detached sum of token losses of all micro-batches.

    A data-parallel model (one with ``no_sync()``) synchronises gradients only during the last
    micro-batch's backward."""
    total = None
    no_sync = getattr(model, "no_sync", nullcontext)
    for i, micro_batch in enumerate(micro_batches):
        with no_sync() if i < len(micro_batches) - 1 else nullcontext():
            output, loss_fn = forward_step(micro_batch, model)
            loss_sum, _ = loss_fn(output)
            if not forward_only:
                (loss_sum * (loss_scale / num_tokens)).backward()
        loss_sum = loss_sum.detach().float()
        total = loss_sum if total is None else total + loss_sum
    return total


def _pipeline_peers(ps) -> tuple[int, int]:
    """Global ranks of the previous and next pipeline stage (wrapping, for interleaved chunks)."""
    ranks = ps.ranks["pp"]
    return ranks[(ps.pp_rank - 1) % ps.pp_size], ranks[(ps.pp_rank + 1) % ps.pp_size]


def _free_storage(tensor: torch.Tensor) -> None:
    """Drop an activation's storage once it has been sent: the backward needs only its graph
    (the residual add that produced it saves no output), not its values (Megatron-LM's
    ``deallocate_output_tensor``). The in-flight send keeps its own reference until it completes."""
    tensor.data = torch.empty((1,), device=tensor.device, dtype=tensor.dtype)


def _backward(output: torch.Tensor, grad: torch.Tensor | None) -> None:
    """``torch.autograd.backward(output, grad)``, also for an output whose storage was freed: the
    engine is called directly, skipping the root shape check the freed placeholder would fail."""
    if grad is None or output.shape == grad.shape:
        torch.autograd.backward(output, grad)
        return
    torch.autograd.Variable._execution_engine.run_backward(
        (output,), (grad,), False, False, (), True, True)  # keep_graph, create_graph, inputs, allow_unreachable,
    # accumulate_grad


def run_pipeline_table(table: list[Action], forward_step: ForwardStep, micro_batches: Sequence[Any], chunks: list,
                       num_tokens: float, loss_scale: float, ps, shape: Sequence[int], dtype: torch.dtype,
                       device: torch.device, stats: dict | None = None,
                       no_sync: Callable[[], ContextManager] | None = None) -> torch.Tensor:
    """Execute one rank's schedule table (see ``schedule_tables``) with real model chunks.

    Runs of consecutive communication actions are posted as one ``batch_isend_irecv``; sends are
    asynchronous (kept alive until the step ends), receives are waited for, which is exactly the
    buffered-send model under which the tables are checked deadlock-free. The last virtual stage
    backpropagates ``loss_sum * loss_scale / num_tokens`` and returns the summed token losses; other
    stages backpropagate the received output gradient and return 0. ``stats``, if given, receives
    ``peak_in_flight``: the most micro-batch activations held at once (forwarded, not yet
    backwarded), the activation-memory measure of a schedule.

    ``no_sync`` (a data-parallel model's): every backward runs inside it but each chunk's last one
    in the table, during which the model's gradient hooks start the data-parallel reduction of the
    buckets that chunk completes (as the last micro-batch does without pipelining; Megatron-LM's
    ``is_last_microbatch``). A parameter belongs to one chunk, so its gradient is final then.
    """
    run = _TableRun(forward_step, micro_batches, chunks, ps, (tuple(shape), dtype, device), stats)
    if no_sync is not None:
        run.no_sync = no_sync
        run.last_backward = {a.chunk: a for a in table if a.kind == "B"}  # the last one of each chunk wins
    i = 0
    while i < len(table):
        if table[i].kind in COMM:
            j = i
            while j < len(table) and table[j].kind in COMM:
                j += 1
            run.exchange(table[i:j])
            i = j
        else:
            run.compute(table[i], loss_scale / num_tokens)
            i += 1
    run.wait_for_sends()
    return run.total


class _TableRun:
    """One rank's state while it executes a table: stage inputs, outputs and output gradients keyed by
    (micro-batch, chunk), and the sends still in flight."""

    def __init__(self, forward_step: ForwardStep, micro_batches: Sequence[Any], chunks: list, ps,
                 activation: tuple[tuple[int, ...], torch.dtype, torch.device], stats: dict | None):
        self.forward_step, self.micro_batches, self.chunks, self.stats = forward_step, micro_batches, chunks, stats
        self.pp_size, self.pp_rank = ps.pp_size, ps.pp_rank
        self.prev_rank, self.next_rank = _pipeline_peers(ps)
        self.last_virtual = ps.pp_size * len(chunks) - 1
        self.shape, self.dtype, self.device = activation
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.output_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.pending: list[tuple[list, list]] = []  # (send works, sent tensors): each work waited for once
        self.total = torch.zeros((), dtype=torch.float32, device=self.device)
        self.no_sync: Callable[[], ContextManager] = nullcontext  # around every backward but ...
        self.last_backward: dict[int, Action] = {}  # ... these: a chunk's last, with the gradient sync armed

    def compute(self, a: Action, scale: float) -> None:
        """``F``: forward of micro-batch ``a.micro_batch`` through chunk ``a.chunk`` (on the last virtual
        stage, the loss times ``scale``); ``B``: its backward, from the received output gradient."""
        key, chunk = (a.micro_batch, a.chunk), self.chunks[a.chunk]
        last = a.chunk * self.pp_size + self.pp_rank == self.last_virtual
        if a.kind == "B":
            output = self.outputs.pop(key)
            with nullcontext() if self.last_backward.get(a.chunk) == a else self.no_sync():
                _backward(output, None if last else self.output_grads.pop(key))
            return
        chunk.set_input_tensor(self.inputs.get(key))
        output, loss_fn = self.forward_step(self.micro_batches[a.micro_batch], chunk)
        if output is self.inputs.get(key):  # a chunk without layers (a layout's empty stage) passes its input on:
            output = output.clone()  # sending frees the output's storage, and the input's must outlive it
        if last:
            loss_sum, _ = loss_fn(output)
            self.total = self.total + loss_sum.detach().float()
            output = loss_sum * scale
        self.outputs[key] = output
        if self.stats is not None:
            self.stats["peak_in_flight"] = max(self.stats.get("peak_in_flight", 0), len(self.outputs))

    def exchange(self, actions: Sequence[Action]) -> None:
        """Post a run of communication actions as one batch: the sends asynchronously, the receives
        waited for; then free the storage of the activations sent."""
        sends, recvs, slots = [], [], []
        for a in actions:
            key = (a.micro_batch, a.chunk)
            if a.kind == "SEND_F":
                sends.append((self.outputs[key].detach(), self.next_rank))
            elif a.kind == "SEND_B":
                sends.append((self.inputs.pop(key).grad, self.prev_rank))
            else:
                recvs.append((self.shape, self.dtype, self.prev_rank if a.kind == "RECV_F" else self.next_rank))
                slots.append((a.kind, key))
        buffers, works = p2p.communicate(sends, recvs, self.device, async_op=True)
        self.pending.append((works[:len(sends)], sends))
        for work in works[len(sends):]:
            work.wait()
        for (kind, key), buf in zip(slots, buffers):
            (self.inputs if kind == "RECV_F" else self.output_grads)[key] = buf.requires_grad_(kind == "RECV_F")
        for a in actions:
            if a.kind == "SEND_F":
                _free_storage(self.outputs[(a.micro_batch, a.chunk)])
        self.pending = [(w, t) for w, t in self.pending if not all(work.is_completed() for work in w)]

    def wait_for_sends(self) -> None:
        for works, _ in self.pending:  # the sent tensors stay referenced until here
            for work in works:
                work.wait()


def forward_backward_pipelining(forward_step: ForwardStep, micro_batches: Sequence[Any], model: torch.nn.Module,
                                num_tokens: float, loss_scale: float = 1.0, forward_only: bool = False, *,
                                ps, schedule: str, shape: Sequence[int], dtype: torch.dtype,
                                device: torch.device) -> torch.Tensor:
    """The pipelined counterpart of ``forward_backward_no_pipelining`` (same contract).

    ``schedule``: "1f1b" or "gpipe"; a model of several chunks (a ModuleList) runs the interleaved
    1F1B. A data-parallel model (one with ``no_sync()``) only accumulates gradients, except during
    each chunk's last backward of the step: there its buckets' reductions start as they fill,
    overlapping the rest of the schedule; ``finish_grad_sync()`` after it waits for them.
    """
    module = model.module if hasattr(model, "no_sync") else model
    chunks = list(module) if isinstance(module, torch.nn.ModuleList) else [module]
    m, pp, rank = len(micro_batches), ps.pp_size, ps.pp_rank
    if len(chunks) > 1:
        table = tables.interleaved_one_f_one_b(pp, rank, m, len(chunks))
    elif forward_only or schedule == "gpipe":
        table = tables.gpipe(pp, rank, m)
    else:
        table = tables.one_f_one_b(pp, rank, m)
    if forward_only:  # the forwards (and their sends) of any valid table form a valid schedule
        table = [a for a in table if a.kind in ("F", "SEND_F", "RECV_F")]
    no_sync = getattr(model, "no_sync", None)
    with torch.no_grad() if forward_only else nullcontext():
        return run_pipeline_table(table, forward_step, micro_batches, chunks, num_tokens, loss_scale, ps, shape,
                                  dtype, device, no_sync=no_sync)
