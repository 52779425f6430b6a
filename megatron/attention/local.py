"""Causal self-attention on this rank's tokens: over whole sequences, packed documents, sliding windows and
attention sinks, on the block kernels (``blocks.py``) the plan says (``plan.py``); a split sequence's exchange
between the context-parallel ranks is ``megatron.context_parallel.attention``'s, which the plan carries.

``attend(q, k, v, plan, dropout_p, scale, window, sinks)`` dispatches on the plan (its cp split and documents) and
the layer's window and sinks. ``scale`` is the softmax's (``q k^T x scale``; None: ``1 / sqrt(q's width)``,
multi-latent attention passes its own), and the values may have another width than the queries and keys
(multi-latent attention's ``dv`` against ``dn + dr``); ``window`` the keys before each query it sees (None: all);
``sinks`` [heads on this rank] each head's sink logit (``blocks.apply_sinks``):

- cp 1: whole sequences, each packed document on its own, by the fused kernel (``F.scaled_dot_product_attention``);
  with a window or sinks, ``LocalAttention``: the plan's blocks (windowed tiles) with the sinks folded in after the
  merge; with attention dropout as well, one masked softmax with the sink as an extra zero-valued key
  (``masked_attention``, which the KV cache's generation uses too);
- cp > 1: ``plan.exchange`` (ring, all-gather or all-to-all: ``megatron.context_parallel.attention``).

Attention dropout by position (``dropout.py``): under cp > 1 (p2p, all_gather) and wherever
``--attention-dropout-masks positional`` asks (``plan.positional_dropout``), each block's probabilities are
dropped by masks that are a function of global positions, drawn again in the backward; the default at cp 1 is the
fused kernel's own dropout over whole sequences (or the masked softmax's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.attention.blocks import apply_sinks, blocks_backward, blocks_forward, sinks_grad
from megatron.attention.dropout import BlockDropout
from megatron.attention.max_logits import observe
from megatron.attention.plan import AttentionPlan

__all__ = ["AttentionPlan", "LocalAttention", "RunningResult", "attend", "masked_attention", "sinks_or_empty",
           "whole_sequences"]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, dropout_p: float = 0.0,
           scale: float | None = None, window: int | None = None, sinks: torch.Tensor | None = None,
           layer: int = 0, head_offset: int = 0, max_logits: torch.Tensor | None = None) -> torch.Tensor:
    """q [b, nq, L, dk], k [b, ng, L, dk], v [b, ng, L, dv] (this rank's heads and local tokens) -> [b, nq, L, dv];
    ``softmax(q k^T x scale)``, ``scale`` None: ``1 / sqrt(dk)``; ``window``: the keys before each query it sees;
    ``sinks`` [nq]: each head's sink logit; ``layer``: the layer's global number and ``head_offset`` the global
    index of this rank's first head (tensor parallelism): what its dropout masks are drawn by. ``max_logits`` [nq]
    fp32: a running maximum of each head's logits (QK-clip, ``max_logits.py``) raised in place by those of the
    query-key pairs this rank's queries see (None: not tracked)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    blockwise = plan.cp_size > 1 and plan.comm_type != "a2a"
    drop = None
    if dropout_p and (blockwise or plan.positional_dropout):  # masks by global position (``dropout.py``)
        drop = plan.dropout(dropout_p, layer, q.shape[1], head_offset)
    if plan.cp_size == 1:
        observe(max_logits, q, k, plan.blocks(0, q.shape[2], window), scale)
        if drop is None:
            return whole_sequences(q, k, v, plan, dropout_p, scale, window, sinks)
        return LocalAttention.apply(q, k, v, sinks_or_empty(sinks, q), plan, scale, window, drop)
    if plan.exchange is None:
        raise ValueError(f"an attention plan split over {plan.cp_size} context-parallel ranks needs their exchange "
                         f"(context_parallel.attention.exchange: megatron.parallelize_gpt sets it)")
    if max_logits is None:
        return plan.exchange(q, k, v, plan, dropout_p, scale, window, sinks, drop)
    return plan.exchange(q, k, v, plan, dropout_p, scale, window, sinks, drop, max_logits=max_logits)


def sinks_or_empty(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The autograd Functions take a tensor: no sinks is an empty one."""
    return q.new_empty(0) if sinks is None else sinks


def whole_sequences(q, k, v, plan: AttentionPlan, dropout_p: float, scale: float, window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over whole sequences, each packed document on its own (one fused call per document
    of each sample; a sample of one document is one call); with a window or sinks, ``LocalAttention`` (or, with
    dropout, the masked softmax)."""
    if window is not None or sinks is not None:
        if dropout_p:
            return _masked_whole(q, k, v, plan, dropout_p, scale, window, sinks)
        return LocalAttention.apply(q, k, v, sinks_or_empty(sinks, q), plan, scale, window)
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


class RunningResult:
    """q's attention over the keys seen so far: fp32 (out, lse) merged block by block. The output ([b, h, L, dv])
    is allocated in q's memory layout (as the fused kernels allocate theirs): q is a view of the QKV output's
    [s, b, heads, hd] order, so the layer's permute back to [s, b, heads x hd] for the dense layer is a view, not a
    copy."""

    def __init__(self, q: torch.Tensor, value_width: int, max_logits: torch.Tensor | None = None):
        self.max_logits = max_logits  # [heads] raised by each block's logits (QK-clip), or None
        order = sorted(range(4), key=lambda i: -q.stride(i))  # q's dimensions, outermost first
        shape = [*q.shape[:3], value_width]
        self.out = torch.zeros([shape[i] for i in order], dtype=torch.float32, device=q.device).permute(
            *[order.index(i) for i in range(4)])
        self.lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)

    def add(self, q, k, v, blocks, scale: float, dropout: BlockDropout | None) -> None:
        observe(self.max_logits, q, k, blocks, scale)
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


def sinks_gradient(dout, out, lse, sinks) -> torch.Tensor | None:
    return sinks_grad(dout, out, lse, sinks) if sinks.numel() and sinks.requires_grad else None


class LocalAttention(torch.autograd.Function):
    """cp 1 with a window or sinks: the plan's blocks over this rank's whole sequences."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, plan: AttentionPlan, scale: float, window: int | None,
                dropout: BlockDropout | None = None):
        result = RunningResult(q, v.shape[-1])
        result.add(q, k, v, plan.blocks(0, q.shape[2], window), scale, dropout)
        return result.saved(ctx, q, k, v, sinks, plan, scale, window, dropout)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
        blocks_backward(dout, q, k, v, out, lse, ctx.plan.blocks(0, q.shape[2], ctx.window), ctx.scale, dq, dk, dv,
                        ctx.dropout)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), sinks_gradient(dout, out, lse, sinks), None, None,
                None, None)
