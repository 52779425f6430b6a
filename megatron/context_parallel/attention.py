"""Causal self-attention over a sequence split by context parallelism, over packed documents, in sliding windows
and with attention sinks.

``attend(q, k, v, plan, dropout_p, scale, window, sinks)`` dispatches on the plan (``plan.py``: the cp group and
its communication type, the documents) and the layer's window and sinks. ``scale`` is the softmax's (``q k^T x
scale``; None: ``1 / sqrt(q's width)``, multi-latent attention passes its own), and the values may have another
width than the queries and keys (multi-latent attention's ``dv`` against ``dn + dr``); ``window`` the keys before
each query it sees (None: all); ``sinks`` [heads on this rank] each head's sink logit (``blocks.apply_sinks``):

- cp 1: whole sequences, each packed document on its own, by the fused kernel (``F.scaled_dot_product_attention``);
  with a window or sinks, ``LocalAttention``: the plan's blocks (windowed tiles) with the sinks folded in after the
  merge; with attention dropout as well, one masked softmax with the sink as an extra zero-valued key
  (``masked_attention``, which the KV cache's generation uses too).
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

Attention dropout: p2p and all_gather drop each block's probabilities by masks that are a function of global
positions (``dropout.py``: the seed of the micro-batch, the layer, the sample, the head, the query and the key
positions), drawn again in the backward; so do cp 1 and ``a2a`` under ``--attention-dropout-masks positional``
(``plan.positional_dropout``), whose default is the fused kernel's own dropout over whole sequences (or the masked
softmax's). Positional masks give every layout the one process's masks.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.context_parallel.blocks import apply_sinks, blocks_backward, blocks_forward, sinks_grad
from megatron.context_parallel.dropout import BlockDropout
from megatron.context_parallel.layout import merge_chunks, scatter_chunks
from megatron.context_parallel.plan import AttentionPlan

__all__ = ["AttentionPlan", "attend", "masked_attention"]

RING_OVERLAP = {"enabled": True}  # benchmarks turn the ring's transfer / compute overlap off to measure it
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, dropout_p: float = 0.0,
           scale: float | None = None, window: int | None = None, sinks: torch.Tensor | None = None,
           layer: int = 0, head_offset: int = 0) -> torch.Tensor:
    """q [b, nq, L, dk], k [b, ng, L, dk], v [b, ng, L, dv] (this rank's heads and local tokens) -> [b, nq, L, dv];
    ``softmax(q k^T x scale)``, ``scale`` None: ``1 / sqrt(dk)``; ``window``: the keys before each query it sees;
    ``sinks`` [nq]: each head's sink logit; ``layer``: the layer's global number and ``head_offset`` the global
    index of this rank's first head (tensor parallelism): what its dropout masks are drawn by."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    blockwise = plan.cp_size > 1 and plan.comm_type != "a2a"
    drop = None
    if dropout_p and (blockwise or plan.positional_dropout):  # masks by global position (``dropout.py``)
        drop = plan.dropout(dropout_p, layer, q.shape[1], head_offset)
    if plan.cp_size == 1:
        if drop is None:
            return _whole_sequences(q, k, v, plan, dropout_p, scale, window, sinks)
        return LocalAttention.apply(q, k, v, _sinks_or_empty(sinks, q), plan, scale, window, drop)
    if plan.comm_type == "a2a":
        return _ulysses(q, k, v, plan, dropout_p, scale, window, sinks, drop)
    function = GatheredAttention if plan.comm_type == "all_gather" else RingAttention
    return function.apply(q, k, v, _sinks_or_empty(sinks, q), plan, scale, window, drop)


def _sinks_or_empty(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The autograd Functions take a tensor: no sinks is an empty one."""
    return q.new_empty(0) if sinks is None else sinks


def _whole_sequences(q, k, v, plan: AttentionPlan, dropout_p: float, scale: float, window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over whole sequences, each packed document on its own (one fused call per document
    of each sample; a sample of one document is one call); with a window or sinks, ``LocalAttention`` (or, with
    dropout, the masked softmax)."""
    if window is not None or sinks is not None:
        if dropout_p:
            return _masked_whole(q, k, v, plan, dropout_p, scale, window, sinks)
        return LocalAttention.apply(q, k, v, _sinks_or_empty(sinks, q), plan, scale, window)
    extra = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    if plan.document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, **extra)
    samples = []
    for i, ends in enumerate(plan.document_ends()):
        pieces, start = [], 0
        for end in ends:
            piece = slice(start, end)
            pieces.append(F.scaled_dot_product_attention(q[i:i + 1, :, piece], k[i:i + 1, :, piece],
                                                         v[i:i + 1, :, piece], dropout_p=dropout_p, is_causal=True,
                                                         scale=scale, **extra))
            start = end
        samples.append(torch.cat(pieces, 2) if len(pieces) > 1 else pieces[0])
    return torch.cat(samples, 0)


def masked_attention(q, k, v, visible: torch.Tensor, sinks: torch.Tensor | None, dropout_p: float,
                     scale: float | None) -> torch.Tensor:
    """``softmax(q k^T scale)`` under ``visible`` (bool, True: may attend; broadcast to [b, nq, sq, sk]), each head's
    sink logit (``sinks`` [nq] or None) joining the softmax as a key of zero value, then dropout: one fused call over
    a float mask. Every row must see a key or have a sink."""
    extra = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, visible, dropout_p=dropout_p, scale=scale, **extra)
    sk, nq = k.shape[2], q.shape[1]
    k, v = F.pad(k, (0, 0, 0, 1)), F.pad(v, (0, 0, 0, 1))  # the sink's key and value: zeros, scored by the mask
    rows = visible.expand(visible.shape[0], nq, q.shape[2], sk)
    bias = torch.zeros(rows.shape, dtype=q.dtype, device=q.device).masked_fill_(~rows, float("-inf"))
    column = sinks.to(q.dtype).view(1, nq, 1, 1).expand(rows.shape[0], nq, q.shape[2], 1)
    return F.scaled_dot_product_attention(q, k, v, torch.cat([bias, column], dim=-1), dropout_p=dropout_p,
                                          scale=scale, **extra)


def _masked_whole(q, k, v, plan: AttentionPlan, dropout_p: float, scale: float, window: int | None,
                  sinks: torch.Tensor | None) -> torch.Tensor:
    """``masked_attention`` over whole sequences: causal, within the window and within each document."""
    s = q.shape[2]
    d = torch.arange(s, device=q.device).view(-1, 1) - torch.arange(s, device=q.device)
    visible = (d >= 0) & (d <= window) if window is not None else d >= 0
    visible = visible.view(1, 1, s, s)
    if plan.document_ids is not None:
        docs = plan.document_ids
        visible = visible & (docs[:, None, :, None] == docs[:, None, None, :])
    return masked_attention(q, k, v, visible, sinks, dropout_p, scale)


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


class _RunningResult:
    """q's attention over the keys seen so far: fp32 (out, lse) merged block by block. The output ([b, h, L, dv])
    is allocated in q's memory layout (as the fused kernels allocate theirs): q is a view of the QKV output's
    [s, b, heads, hd] order, so the layer's permute back to [s, b, heads x hd] for the dense layer is a view, not a
    copy."""

    def __init__(self, q: torch.Tensor, value_width: int):
        order = sorted(range(4), key=lambda i: -q.stride(i))  # q's dimensions, outermost first
        shape = [*q.shape[:3], value_width]
        self.out = torch.zeros([shape[i] for i in order], dtype=torch.float32, device=q.device).permute(
            *[order.index(i) for i in range(4)])
        self.lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)

    def add(self, q, k, v, blocks, scale: float, dropout: BlockDropout | None) -> None:
        blocks_forward(q, k, v, blocks, scale, self.out, self.lse, dropout)

    def saved(self, ctx, q, k, v, sinks, plan: AttentionPlan, scale: float, window: int | None,
              dropout: BlockDropout | None) -> torch.Tensor:
        """The output in q's dtype (the sinks folded in), kept for the backward with q, k, v, the sinks and the
        log-sum-exp."""
        if sinks.numel():
            apply_sinks(self.out, self.lse, sinks)
        out = self.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, sinks, out, self.lse)
        ctx.plan, ctx.scale, ctx.window, ctx.dropout = plan, scale, window, dropout  # the masks drawn again
        return out


def _sinks_gradient(dout, out, lse, sinks) -> torch.Tensor | None:
    return sinks_grad(dout, out, lse, sinks) if sinks.numel() and sinks.requires_grad else None


class LocalAttention(torch.autograd.Function):
    """cp 1 with a window or sinks: the plan's blocks over this rank's whole sequences."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, plan: AttentionPlan, scale: float, window: int | None,
                dropout: BlockDropout | None = None):
        result = _RunningResult(q, v.shape[-1])
        result.add(q, k, v, plan.blocks(0, q.shape[2], window), scale, dropout)
        return result.saved(ctx, q, k, v, sinks, plan, scale, window, dropout)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
        blocks_backward(dout, q, k, v, out, lse, ctx.plan.blocks(0, q.shape[2], ctx.window), ctx.scale, dq, dk, dv,
                        ctx.dropout)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), _sinks_gradient(dout, out, lse, sinks), None, None,
                None, None)


class RingAttention(torch.autograd.Function):
    """Ring attention (p2p): see the module's docstring."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, plan: AttentionPlan, scale: float, window: int | None,
                dropout: BlockDropout | None = None):
        cp, r, length = plan.cp_size, plan.cp_rank, q.shape[2]
        layout = _KeysValues(k, v)
        kv = layout.pack(k, v)
        result = _RunningResult(q, v.shape[-1])
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
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), _sinks_gradient(dout, out, lse, sinks), None, None,
                None, None)


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
                dropout: BlockDropout | None = None):
        gathered, result, layout = _gather_kv(k, v, plan), _RunningResult(q, v.shape[-1]), _KeysValues(k, v)
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
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), _sinks_gradient(dout, out, lse, sinks), None, None,
                None, None)


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


def _ulysses(q, k, v, plan: AttentionPlan, dropout_p: float, scale: float, window: int | None,
             sinks: torch.Tensor | None, drop: BlockDropout | None = None) -> torch.Tensor:
    """Sequence-sharded -> head-sharded, whole-sequence attention (the sinks of the heads held), and back; ``drop``
    (positional dropout): the plan's blocks over whole sequences, the heads held numbered globally."""
    cp = plan.cp_size

    def to_heads(t: torch.Tensor) -> torch.Tensor:  # [b, n, L, d] -> [b, n / cp, s, d]
        parts = _AllToAll.apply(torch.stack(t.chunk(cp, dim=1)), plan.group)  # [cp, b, n/cp, L, d]
        return merge_chunks(list(parts.unbind(0)), dim=2)

    held = None if sinks is None else sinks.chunk(cp)[plan.cp_rank]
    whole = AttentionPlan(document_ids=plan.document_ids, _cache=plan._cache.setdefault("whole", {}))
    if drop is None:
        out = _whole_sequences(to_heads(q), to_heads(k), to_heads(v), whole, dropout_p, scale, window, held)
    else:
        heads = q.shape[1] // cp
        drop = dataclasses.replace(drop, first_head=drop.first_head + plan.cp_rank * heads)
        out = LocalAttention.apply(to_heads(q), to_heads(k), to_heads(v), _sinks_or_empty(held, q), whole, scale,
                                   window, drop)
    back = _AllToAll.apply(torch.stack(scatter_chunks(out, cp, dim=2)), plan.group)  # [cp, b, nq/cp, L, dv]
    return torch.cat(list(back.unbind(0)), dim=1)
