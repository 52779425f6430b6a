"""Causal self-attention over a sequence split by context parallelism: how the ranks' keys and values meet
(``exchange``, which a split plan carries: ``megatron.attention.plan.AttentionPlan.exchange``), over packed
documents, in sliding windows and with attention sinks, on the block kernels of ``megatron.attention``
(``attend`` and the cp-1 paths: ``megatron.attention.local``).

- ``p2p`` (ring attention, ``RingAttention``): the keys and values (packed in one flat buffer whatever their
  widths and head counts, ``_KeysValues``) go round the cp ring by send/recv; at step t rank r holds those of
  rank r - t and merges its blocks' result by log-sum-exp rescaling; the next transfer runs while the current
  block computes. The backward sends the keys and values round again, with the accumulating dK/dV, which
  arrive at their owner after the last step. Pairs of chunks the window or the documents leave empty are skipped.
- ``all_gather``: every rank's keys and values gathered for the local queries (gathered again in the
  backward rather than kept); their gradients reduce-scattered.
- ``a2a`` (Ulysses): an all-to-all turns [local tokens, all heads] into [all tokens, heads / cp]; attention
  runs over whole sequences (the cp-1 path, with the sinks of the heads held); a second all-to-all turns the result
  back.
- ``a2a+p2p`` (hierarchical, ``CpLevels``): Ulysses's all-to-all within groups of I neighbouring cp ranks (a node),
  then the ring over the cp / I groups on the I times longer chunks it gives, and the all-to-all back.

Attention dropout: p2p, all_gather and a2a+p2p drop each block's probabilities by masks that are a function of global
positions (``dropout.py``: the seed of the micro-batch, the layer, the sample, the head, the query and the key
positions), drawn again in the backward; so do cp 1 and ``a2a`` under ``--attention-dropout-masks positional``
(``plan.positional_dropout``), whose default is the fused kernel's own dropout over whole sequences (or the masked
softmax's). Positional masks give every layout the one process's masks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.attention.blocks import blocks_backward
from megatron.attention.dropout import BlockDropout
from megatron.attention.local import (
    AttentionPlan,
    LocalAttention,
    RunningResult,
    attend,
    masked_attention,
    sinks_gradient,
    sinks_or_empty,
    whole_sequences,
)
from megatron.attention.max_logits import observe
from megatron.context_parallel.layout import merge_chunks, scatter_chunks

__all__ = ["AttentionPlan", "attend", "exchange", "masked_attention"]  # attend: megatron.attention.local's

RING_OVERLAP = {"enabled": True}  # benchmarks turn the ring's transfer / compute overlap off to measure it
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _KeysValues:
    """Keys and values of any shapes in one flat buffer (one transfer or collective moves both): ``pack`` copies
    them in, ``unpack`` gives contiguous views of a buffer of the same layout (a received one, a gradient
    accumulator)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.shapes, self.split = (k.shape, v.shape), k.numel()

    @staticmethod
    def pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.cat([k.reshape(-1), v.reshape(-1)])

    def unpack(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return flat[:self.split].view(self.shapes[0]), flat[self.split:].view(self.shapes[1])


# ------------------------------------------------------------------------------------------------ p2p ring

class _Transfer:
    """``send`` on its way to the next rank of the ring while the previous rank's arrives in a new buffer;
    ``received()`` waits (once: gloo never returns from a second wait on a finished request)."""

    def __init__(self, send: torch.Tensor, plan: AttentionPlan):
        nxt, prev = plan.ring_ranks
        self.buffer = torch.empty_like(send)
        self._requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, plan.group),
                                                 dist.P2POp(dist.irecv, self.buffer, prev, plan.group)])

    def received(self) -> torch.Tensor:
        for request in self._requests:
            request.wait()
        self._requests = []
        return self.buffer


def _next_keys(kv: torch.Tensor, t: int, plan: AttentionPlan) -> _Transfer | None:
    """Step ``t``'s transfer of the keys and values held to the next rank (none after the last step),
    left running through the step's compute unless the overlap is off."""
    if t == plan.cp_size - 1:
        return None
    transfer = _Transfer(kv, plan)
    if not RING_OVERLAP["enabled"]:
        transfer.received()
    return transfer


class RingAttention(torch.autograd.Function):
    """Ring attention (p2p): see the module's docstring."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, plan: AttentionPlan, scale: float, window: int | None,
                dropout: BlockDropout | None = None, max_logits: torch.Tensor | None = None):
        cp, r, length = plan.cp_size, plan.cp_rank, q.shape[2]
        layout = _KeysValues(k, v)
        kv = layout.pack(k, v)
        result = RunningResult(q, v.shape[-1], max_logits)  # QK-clip's maxima from the keys as they come round
        for t in range(cp):
            transfer = _next_keys(kv, t, plan)
            result.add(q, *layout.unpack(kv), plan.blocks((r - t) % cp, length, window), scale, dropout)
            if transfer is not None:
                kv = transfer.received()
        return result.saved(ctx, q, k, v, sinks, plan, scale, window, dropout)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        cp, r, length = plan.cp_size, plan.cp_rank, q.shape[2]
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        layout = _KeysValues(k, v)
        kv = layout.pack(k, v)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # for the keys held now, from those before
        for t in range(cp):
            transfer = _next_keys(kv, t, plan)
            blocks = plan.blocks((r - t) % cp, length, ctx.window)
            if blocks:
                blocks_backward(dout, q, *layout.unpack(kv), out, lse, blocks, scale, dq, *layout.unpack(dkv),
                                ctx.dropout)
            gradients = _Transfer(dkv, plan)  # the held keys' gradients go on with them; the last step's home
            if transfer is not None:
                kv = transfer.received()
            dkv = gradients.received()
        dk, dv = layout.unpack(dkv)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), sinks_gradient(dout, out, lse, sinks), None, None,
                None, None, None)


# ------------------------------------------------------------------------------------------------ all_gather

def _gather_kv(k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """[cp, n]: every cp rank's keys and values, packed (``_KeysValues``)."""
    kv = _KeysValues.pack(k, v)
    gathered = torch.empty(plan.cp_size * kv.numel(), dtype=kv.dtype, device=kv.device)  # flat: as gloo needs
    _all_gather_flat(gathered, kv, group=plan.group)
    return gathered.view(plan.cp_size, kv.numel())


class GatheredAttention(torch.autograd.Function):
    """all_gather: see the module's docstring."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, plan: AttentionPlan, scale: float, window: int | None,
                dropout: BlockDropout | None = None, max_logits: torch.Tensor | None = None):
        gathered, layout = _gather_kv(k, v, plan), _KeysValues(k, v)
        result = RunningResult(q, v.shape[-1], max_logits)
        for j in range(plan.cp_size):
            result.add(q, *layout.unpack(gathered[j]), plan.blocks(j, q.shape[2], window), scale, dropout)
        return result.saved(ctx, q, k, v, sinks, plan, scale, window, dropout)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        plan, scale, length = ctx.plan, ctx.scale, q.shape[2]
        gathered, dout, layout = _gather_kv(k, v, plan), dout.contiguous(), _KeysValues(k, v)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(gathered.shape, dtype=torch.float32, device=q.device)
        for j in range(plan.cp_size):
            blocks = plan.blocks(j, length, ctx.window)
            if blocks:
                blocks_backward(dout, q, *layout.unpack(gathered[j]), out, lse, blocks, scale, dq,
                                *layout.unpack(dkv[j]), ctx.dropout)
        mine = torch.empty(dkv.shape[1:], dtype=dkv.dtype, device=dkv.device)
        _reduce_scatter_flat(mine, dkv.view(-1), group=plan.group)
        dk, dv = layout.unpack(mine)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), sinks_gradient(dout, out, lse, sinks), None, None,
                None, None, None)


# ------------------------------------------------------------------------------------------------ a2a (Ulysses)

class _AllToAll(torch.autograd.Function):
    """[cp, ...] -> [cp, ...]: part j goes to rank j; part j of the result came from rank j. Its own transpose."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad.contiguous(), ctx.group), None


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty_like(x)
    dist.all_to_all(list(out.unbind(0)), list(x.contiguous().unbind(0)), group=group)
    return out


def _to_heads(t: torch.Tensor, size: int, group) -> torch.Tensor:
    """[b, n, L, d] -> [b, n / size, size L, d]: the ``size`` ranks' tokens (each rank's two chunks) of this rank's
    n / size heads, in order of position (``merge_chunks``)."""
    parts = _AllToAll.apply(torch.stack(t.chunk(size, dim=1)), group)  # [size, b, n / size, L, d]
    return merge_chunks(list(parts.unbind(0)), dim=2)


def _to_tokens(out: torch.Tensor, size: int, group) -> torch.Tensor:
    """``_to_heads`` inverted: [b, n / size, size L, d] -> [b, n, L, d]."""
    back = _AllToAll.apply(torch.stack(scatter_chunks(out, size, dim=2)), group)  # [size, b, n / size, L, d]
    return torch.cat(list(back.unbind(0)), dim=1)


def _ulysses(q, k, v, plan: AttentionPlan, dropout_p: float, scale: float, window: int | None,
             sinks: torch.Tensor | None, drop: BlockDropout | None = None,
             max_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Sequence-sharded -> head-sharded, whole-sequence attention (the sinks of the heads held), and back; ``drop``
    (positional dropout): the plan's blocks over whole sequences, the heads held numbered globally; ``max_logits``
    (QK-clip): the heads held raised over the whole sequence."""
    cp = plan.cp_size

    def to_heads(t: torch.Tensor) -> torch.Tensor:  # [b, n, L, d] -> [b, n / cp, s, d]
        return _to_heads(t, cp, plan.group)

    held = None if sinks is None else sinks.chunk(cp)[plan.cp_rank]
    whole = AttentionPlan(document_ids=plan.document_ids, _cache=plan._cache.setdefault("whole", {}))
    q_held, k_held, v_held = to_heads(q), to_heads(k), to_heads(v)
    heads = q.shape[1] // cp
    if max_logits is not None:
        observe(max_logits[plan.cp_rank * heads:(plan.cp_rank + 1) * heads], q_held, k_held,
                whole.blocks(0, q_held.shape[2], window), scale)
    if drop is None:
        out = whole_sequences(q_held, k_held, v_held, whole, dropout_p, scale, window, held)
    else:
        drop = dataclasses.replace(drop, first_head=drop.first_head + plan.cp_rank * heads)
        out = LocalAttention.apply(q_held, k_held, v_held, sinks_or_empty(held, q), whole, scale, window, drop)
    return _to_tokens(out, cp, plan.group)


# ------------------------------------------------------------------------------------------------ a2a+p2p

@dataclass(frozen=True)
class CpLevels:
    """a2a+p2p's two levels of the cp group (``parallel_state``'s cp_inner and cp_outer groups): cp rank r is
    rank r % I of its inner group of I neighbouring cp ranks and rank r // I of its outer ring of cp / I."""

    inner_size: int
    inner_rank: int
    inner_group: dist.ProcessGroup | None
    outer_size: int
    outer_rank: int
    outer_group: dist.ProcessGroup | None

    @classmethod
    def of(cls, state) -> CpLevels:
        """The levels of a ``parallel_state.ParallelState`` built with ``cp_inner``."""
        inner = state.cp_inner_size
        return cls(inner, state.cp_rank % inner, state.group("cp_inner"), state.cp_size // inner,
                   state.cp_rank // inner, state.group("cp_outer"))


def _hierarchical(q, k, v, plan: AttentionPlan, levels: CpLevels, dropout_p: float, scale: float,
                  window: int | None, sinks: torch.Tensor | None, drop: BlockDropout | None,
                  max_logits: torch.Tensor | None = None) -> torch.Tensor:
    """a2a+p2p (TransformerEngine's): an all-to-all over the inner group turns [L tokens, n heads] into
    [I L tokens, n / I heads]; the inner group's cp ranks o I .. o I + I - 1 (o its outer rank) hold chunks
    o I .. (o + 1) I - 1 and their mirrors of the 2 cp, so those tokens are the two chunks outer rank o holds of a
    split into 2 x cp / I chunks (``layout.py``'s, I times longer): the ring runs over the outer group on them (its
    dropout by global positions, the heads held numbered globally, the sinks of those heads), and a second
    all-to-all turns the result back. Its size-1 levels are the plain ring (I = 1) or Ulysses (I = cp)."""
    inner, outer = levels.inner_size, levels.outer_size
    if inner == 1 or outer == 1:
        return exchange(q, k, v, dataclasses.replace(plan, comm_type="p2p" if inner == 1 else "a2a"), dropout_p,
                        scale, window, sinks, drop, max_logits=max_logits)
    ring = plan._cache.get("outer plan")
    if ring is None:  # the plan of the outer ring, shared by the layers of the micro-batch (its blocks cached)
        ring = plan._cache["outer plan"] = AttentionPlan(outer, levels.outer_rank, levels.outer_group, "p2p",
                                                         plan.document_ids)
    held = None if sinks is None else sinks.chunk(inner)[levels.inner_rank]
    heads = [_to_heads(t, inner, levels.inner_group) for t in (q, k, v)]
    first = levels.inner_rank * q.shape[1] // inner  # the first head held, of this tensor-parallel rank's
    if drop is not None:
        drop = dataclasses.replace(drop, first_head=drop.first_head + first)
    held_max = None if max_logits is None else max_logits[first:first + q.shape[1] // inner]  # QK-clip's: theirs
    out = RingAttention.apply(*heads, sinks_or_empty(held, q), ring, scale, window, drop, held_max)
    return _to_tokens(out, inner, levels.inner_group)


def exchange(q, k, v, plan: AttentionPlan, dropout_p: float, scale: float, window: int | None,
             sinks: torch.Tensor | None, drop: BlockDropout | None, levels: CpLevels | None = None,
             max_logits: torch.Tensor | None = None) -> torch.Tensor:
    """The keys and values of the ``plan.cp_size`` ranks met by ``plan.comm_type`` (ring, all-gather, all-to-all,
    a2a+p2p over ``levels``): what ``attend`` calls for a split sequence (``AttentionPlan.exchange``).
    ``max_logits`` [nq] (QK-clip, ``megatron.attention.max_logits``): raised by the logits of this rank's queries
    against every key they see (ring, all-gather), or, after an all-to-all, of every query of the heads held; the
    maximum over the sequence is the one over the cp ranks (taken after the step)."""
    if plan.comm_type == "a2a":
        return _ulysses(q, k, v, plan, dropout_p, scale, window, sinks, drop, max_logits)
    if plan.comm_type == "a2a+p2p":
        return _hierarchical(q, k, v, plan, levels, dropout_p, scale, window, sinks, drop, max_logits)
    function = GatheredAttention if plan.comm_type == "all_gather" else RingAttention
    return function.apply(q, k, v, sinks_or_empty(sinks, q), plan, scale, window, drop, max_logits)
