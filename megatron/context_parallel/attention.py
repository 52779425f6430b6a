"""Causal self-attention over a sequence split by context parallelism, and over packed documents.

``AttentionPlan`` (built once per micro-batch by the model, shared by its layers) says what attention
must respect beyond the lower triangle: the context-parallel group this rank's tokens are split over
(``layout.py``'s chunks) and the documents of packed samples (``document_ids``, [b, s] over the whole
sequence). ``attend(q, k, v, plan, dropout_p, scale)`` dispatches on the communication type; ``scale`` is the
softmax's (``q k^T x scale``; None: ``1 / sqrt(q's width)``, multi-latent attention passes its own), and the
values may have another width than the queries and keys (multi-latent attention's ``dv`` against ``dn + dr``):

- ``p2p`` (ring attention, ``RingAttention``): the keys and values (packed in one flat buffer whatever their
  widths and head counts, ``_KeysValues``) go round the cp ring by send/recv; at step t rank r holds those of
  rank r - t and merges its block result by log-sum-exp rescaling; the next transfer runs while the current
  block computes. The backward sends the keys and values round again, with the accumulating dK/dV, which
  arrive at their owner after the last step.
- ``all_gather``: every rank's keys and values gathered for the local queries (gathered again in the
  backward rather than kept); their gradients reduce-scattered.
- ``a2a`` (Ulysses): an all-to-all turns [local tokens, all heads] into [all tokens, heads / cp]; attention
  runs over whole sequences; a second all-to-all turns the result back.

Which blocks of (query chunk, key chunk) are computed: with rank r's chunks (r, 2cp-1-r) and rank j's,
j = r: the lower triangle of the local tokens; j < r: every local query against j's first chunk; j > r:
the second local chunk against all of j's tokens; the rest is above the diagonal, skipped. Each step then
costs the same. With packed documents each block is cut into its documents' sub-blocks (no sequence x
sequence mask is built); a pair that shares no document is skipped.

Attention dropout is drawn only where a whole sequence is attended by ``F.scaled_dot_product_attention``
(``a2a``, and packed documents without context parallelism); validation refuses it with p2p and all_gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.context_parallel.blocks import (
    Block,
    blocks_backward,
    blocks_forward,
    dense_blocks,
    document_blocks,
    merge,
)
from megatron.context_parallel.layout import local_positions, merge_chunks, scatter_chunks

RING_OVERLAP = {"enabled": True}  # benchmarks turn the ring's transfer / compute overlap off to measure it
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class AttentionPlan:
    """What this micro-batch's attention respects: the cp split and the documents of packed samples."""

    cp_size: int = 1
    cp_rank: int = 0
    group: dist.ProcessGroup | None = None
    comm_type: str = "p2p"
    document_ids: torch.Tensor | None = None  # [b, s] over the whole sequence, or None: one document per sample
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def ring_ranks(self) -> tuple[int, int]:
        """(next, previous) global ranks of this rank's ring."""
        if "ring" not in self._cache:
            ranks = dist.get_process_group_ranks(self.group)
            self._cache["ring"] = ranks[(self.cp_rank + 1) % self.cp_size], ranks[(self.cp_rank - 1) % self.cp_size]
        return self._cache["ring"]

    def _docs(self, rank: int, length: int) -> torch.Tensor:
        seq = length * self.cp_size
        return self.document_ids.index_select(1, local_positions(seq, rank, self.cp_size, self.document_ids.device))

    def document_ends(self) -> list[list[int]]:
        """Per sample, the end of each of its documents over the whole sequence (cached: read once per
        micro-batch, not per layer)."""
        if "ends" not in self._cache:
            self._cache["ends"] = [_boundaries(ids) for ids in self.document_ids.tolist()]
        return self._cache["ends"]

    def blocks(self, kv_rank: int, length: int) -> list[Block]:
        """The blocks of this rank's ``length`` local queries against rank ``kv_rank``'s keys (cached)."""
        key = (kv_rank, length)
        if key not in self._cache:
            r, c = self.cp_rank, length // 2
            if kv_rank == r:
                q_rows, k_rows, causal = slice(0, length), slice(0, length), True
            elif kv_rank < r:
                q_rows, k_rows, causal = slice(0, length), slice(0, c), False
            else:
                q_rows, k_rows, causal = slice(c, length), slice(0, length), False
            if self.document_ids is None:
                self._cache[key] = dense_blocks(q_rows, k_rows, causal)
            else:
                self._cache[key] = document_blocks(self._docs(r, length), self._docs(kv_rank, length), q_rows,
                                                    k_rows, causal)
        return self._cache[key]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, dropout_p: float = 0.0,
           scale: float | None = None) -> torch.Tensor:
    """q [b, nq, L, dk], k [b, ng, L, dk], v [b, ng, L, dv] (this rank's heads and local tokens) -> [b, nq, L, dv];
    ``softmax(q k^T x scale)``, ``scale`` None: ``1 / sqrt(dk)``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if plan.cp_size == 1:
        return _whole_sequences(q, k, v, plan, dropout_p, scale)
    if plan.comm_type == "a2a":
        return _ulysses(q, k, v, plan, dropout_p, scale)
    if plan.comm_type == "all_gather":
        return GatheredAttention.apply(q, k, v, plan, scale)
    return RingAttention.apply(q, k, v, plan, scale)


def _whole_sequences(q, k, v, plan: AttentionPlan, dropout_p: float, scale: float) -> torch.Tensor:
    """Causal attention over whole sequences, each packed document on its own (one fused call per document
    of each sample; a sample of one document is one call)."""
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


def _boundaries(ids: list[int]) -> list[int]:
    """The end of every run of equal ids."""
    return [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]] + [len(ids)]


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

    def add(self, q, k, v, blocks: list[Block], scale: float) -> None:
        if blocks:
            rows, block_out, block_lse = blocks_forward(q, k, v, blocks, scale)
            merge(self.out[:, :, rows], self.lse[:, :, rows], block_out, block_lse)

    def saved(self, ctx, q, k, v, plan: AttentionPlan, scale: float) -> torch.Tensor:
        """The output in q's dtype, kept for the backward with q, k, v and the log-sum-exp."""
        out = self.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, self.lse)
        ctx.plan, ctx.scale = plan, scale
        return out


class RingAttention(torch.autograd.Function):
    """Ring attention (p2p): see the module's docstring."""

    @staticmethod
    def forward(ctx, q, k, v, plan: AttentionPlan, scale: float):
        cp, r, length = plan.cp_size, plan.cp_rank, q.shape[2]
        layout = _KeysValues(k, v)
        kv = layout.pack(k, v)
        result = _RunningResult(q, v.shape[-1])
        for t in range(cp):
            transfer = _next_keys(kv, t, plan)
            result.add(q, *layout.unpack(kv), plan.blocks((r - t) % cp, length), scale)
            if transfer is not None:
                kv = transfer.received()
        return result.saved(ctx, q, k, v, plan, scale)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        cp, r, length = plan.cp_size, plan.cp_rank, q.shape[2]
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        layout = _KeysValues(k, v)
        kv = layout.pack(k, v)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # for the keys held now, from those before
        for t in range(cp):
            transfer = _next_keys(kv, t, plan)
            blocks = plan.blocks((r - t) % cp, length)
            if blocks:
                blocks_backward(dout, q, *layout.unpack(kv), out, lse, blocks, scale, dq, *layout.unpack(dkv))
            gradients = _Transfer(dkv, plan)  # the held keys' gradients go on with them; the last step's home
            if transfer is not None:
                kv = transfer.received()
            dkv = gradients.received()
        dk, dv = layout.unpack(dkv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


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
    def forward(ctx, q, k, v, plan: AttentionPlan, scale: float):
        gathered, result, layout = _gather_kv(k, v, plan), _RunningResult(q, v.shape[-1]), _KeysValues(k, v)
        for j in range(plan.cp_size):
            result.add(q, *layout.unpack(gathered[j]), plan.blocks(j, q.shape[2]), scale)
        return result.saved(ctx, q, k, v, plan, scale)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale, length = ctx.plan, ctx.scale, q.shape[2]
        gathered, dout, layout = _gather_kv(k, v, plan), dout.contiguous(), _KeysValues(k, v)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(gathered.shape, dtype=torch.float32, device=q.device)
        for j in range(plan.cp_size):
            blocks = plan.blocks(j, length)
            if blocks:
                blocks_backward(dout, q, *layout.unpack(gathered[j]), out, lse, blocks, scale, dq,
                                *layout.unpack(dkv[j]))
        mine = torch.empty(dkv.shape[1:], dtype=dkv.dtype, device=dkv.device)
        _reduce_scatter_flat(mine, dkv.view(-1), group=plan.group)
        dk, dv = layout.unpack(mine)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


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


def _ulysses(q, k, v, plan: AttentionPlan, dropout_p: float, scale: float) -> torch.Tensor:
    """Sequence-sharded -> head-sharded, whole-sequence attention, and back."""
    cp = plan.cp_size

    def to_heads(t: torch.Tensor) -> torch.Tensor:  # [b, n, L, d] -> [b, n / cp, s, d]
        parts = _AllToAll.apply(torch.stack(t.chunk(cp, dim=1)), plan.group)  # [cp, b, n/cp, L, d]
        return merge_chunks(list(parts.unbind(0)), dim=2)

    out = _whole_sequences(to_heads(q), to_heads(k), to_heads(v), plan, dropout_p, scale)
    back = _AllToAll.apply(torch.stack(scatter_chunks(out, cp, dim=2)), plan.group)  # [cp, b, nq/cp, L, dv]
    return torch.cat(list(back.unbind(0)), dim=1)
