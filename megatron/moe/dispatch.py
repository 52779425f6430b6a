"""Token dispatchers: each rank's routed tokens to the ranks holding their experts and the experts' outputs back
(Megatron-LM's ``MoEAlltoAllTokenDispatcher`` and ``MoEAllGatherTokenDispatcher``), as autograd functions.

Every rank holds its own tokens (``T`` rows: its share of the micro-batch's sequence) and has routed them: the
probabilities ``probs [T, E]`` (0 off the kept experts) and the routing map ``kept [T, E]``. Each returns the
layer's routed output ``[T, h]`` in fp32 (at least): sum over a token's kept experts of probability x expert
output. Expert ``e`` lives on ep rank ``e // (E/ep)``, cut over the etp ranks of that rank's etp group.

**alltoall** (default), per layer:

1. permute: the (token, expert) pairs sorted by expert (then token): ``N`` rows, ``counts[e]`` per expert;
2. all-to-all over the ep group: the rows of ep rank j's experts to j (sizes exchanged first); a rank receives,
   from each source, its local experts' rows, expert by expert;
3. all-gather over the etp group (every etp rank of an expert computes on the same rows), the chunks reordered
   expert-major;
4. the local experts (``Experts``), each etp rank's partial output;
5. the inverse of 3: reordered back and reduce-scattered over etp (the partial outputs summed, each rank keeping
   its rows); the inverse of 2: all-to-all back;
6. unpermute: each row weighted by its probability and summed into its token's row (fp32).

**allgather**: the tokens, their probabilities and routing maps all-gathered over the ep x etp group (every
rank there holds the same T, so the sizes are equal); each rank runs its local experts on the gathered pairs
that chose them, weights and sums them into the gathered rows, and a reduce-scatter over the group sums every
rank's contributions into each owner's rows. More traffic than alltoall (every token goes to every rank), no
size exchange.

The collectives of uneven sizes (2, 3, 5) are ``all_to_all_single`` with split sizes, whose adjoint is the same
exchange with the sizes swapped: an all-gather of uneven chunks is an all-to-all sending the same rows to every
rank, its adjoint a reduce-scatter (receive every rank's chunk of mine and sum).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.moe.overlap import ExpertExchange, Overlap, expert_parameters
from megatron.tensor_parallel.mappings import gather_from_sequence_region, reduce_scatter_to_sequence_region


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows ``send[j]`` to rank j, ``recv[j]`` from it; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


class _AllGatherV(torch.autograd.Function):
    """Every rank's rows (``sizes[j]`` from rank j) on every rank; the backward sums each rank's gradients of my
    rows (a reduce-scatter of uneven chunks)."""

    @staticmethod
    def forward(ctx, x, sizes, rank, group):
        ctx.sizes, ctx.rank, ctx.group = sizes, rank, group
        n = len(sizes)
        return _exchange(x.repeat((n,) + (1,) * (x.dim() - 1)), [x.shape[0]] * n, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        mine, n = ctx.sizes[ctx.rank], len(ctx.sizes)
        parts = _exchange(grad, ctx.sizes, [mine] * n, ctx.group)
        return parts.view((n, mine) + tuple(grad.shape[1:])).sum(0), None, None, None


class _ReduceScatterV(torch.autograd.Function):
    """The adjoint of ``_AllGatherV``: rows ``[sum(sizes), ...]`` summed over the ranks, rank j keeping its
    ``sizes[j]``; the backward all-gathers."""

    @staticmethod
    def forward(ctx, x, sizes, rank, group):
        ctx.sizes, ctx.rank, ctx.group = sizes, rank, group
        mine, n = sizes[rank], len(sizes)
        return _exchange(x, sizes, [mine] * n, group).view((n, mine) + tuple(x.shape[1:])).sum(0)

    @staticmethod
    def backward(ctx, grad):
        n = len(ctx.sizes)
        return _exchange(grad.repeat((n,) + (1,) * (grad.dim() - 1)), [grad.shape[0]] * n, ctx.sizes,
                         ctx.group), None, None, None


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_to_all_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """``counts [G, k]`` (row j: what I send rank j) -> ``[G, k]`` (row j: what rank j sends me)."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def _all_gather_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """``counts`` of every rank of ``group``: ``[G, *counts.shape]``."""
    out = counts.new_empty((_size(group) * counts.shape[0],) + tuple(counts.shape[1:]))
    dist.all_gather_into_tensor(out, counts.contiguous(), group=group)
    return out.view((_size(group),) + tuple(counts.shape))


def _expert_major(chunks: torch.Tensor) -> torch.Tensor:
    """``chunks [sources, local experts]``: the sizes of the chunks as they arrived, source by source; the row
    indices that take them expert by expert (each expert's rows from every source, in source order)."""
    flat = chunks.reshape(-1).cpu()
    starts = (torch.cumsum(flat, 0) - flat).view_as(chunks).t().reshape(-1)  # each chunk's first row, expert-major
    sizes = chunks.t().reshape(-1).cpu()
    total = int(sizes.sum())
    offsets = torch.cumsum(sizes, 0) - sizes  # where each chunk starts in the new order
    return torch.repeat_interleave(starts - offsets, sizes, output_size=total) + torch.arange(total)


def _weighted_sum(rows: torch.Tensor, weights: torch.Tensor, token_index: torch.Tensor, num_tokens: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """``sum over rows r of token t: weights[r] x rows[r]`` into ``[num_tokens, h]`` (``dtype``)."""
    weighted = rows.to(dtype) * weights.unsqueeze(-1).to(dtype)
    return torch.zeros(num_tokens, rows.shape[-1], dtype=dtype, device=rows.device).index_add(0, token_index, weighted)


class Groups:
    """The expert groups a dispatcher exchanges over (None for one rank) and this rank's place in them."""

    def __init__(self, ep=None, etp=None, ep_etp=None):
        self.ep, self.etp, self.ep_etp = ep, etp, ep_etp
        self.ep_size, self.etp_size = _size(ep), _size(etp)
        self.etp_rank = dist.get_rank(etp) if etp is not None else 0


def kept_pairs(kept: torch.Tensor, pairs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert index, token index) of the kept (token, expert) pairs of ``kept [T, E]``, sorted by expert, then
    token. ``pairs``: their number when it is known (dropless routing: T x topk), found then without waiting for
    the device (``nonzero_static``); else ``nonzero``, which does."""
    if pairs is None:
        return kept.t().nonzero(as_tuple=True)
    flat = torch.nonzero_static(kept.t().reshape(-1), size=pairs).squeeze(1)
    return flat // kept.shape[0], flat % kept.shape[0]


def alltoall(tokens: torch.Tensor, probs: torch.Tensor, kept: torch.Tensor, experts, groups: Groups,
             acc_dtype: torch.dtype, pad_to: int | None = None, pairs: int | None = None,
             overlap: Overlap | None = None) -> torch.Tensor:
    """The alltoall dispatcher (see the module doc); ``experts``: this rank's ``Experts``; ``pairs``: see
    ``kept_pairs``. With one expert-parallel and one expert-tensor-parallel rank nothing waits for the device:
    the experts take their row counts as a tensor (a grouped matmul reads them there). ``overlap``
    (``megatron.moe.overlap``): the exchanges overlapped with the shared expert and the weight gradients, at ep > 1
    while training."""
    num_tokens, num_experts = kept.shape
    ep, etp = groups.ep_size, groups.etp_size
    local = num_experts // ep
    expert_index, token_index = kept_pairs(kept, pairs)
    rows = tokens[token_index]
    counts = kept.sum(dim=0)  # [E]
    if ep > 1:
        received = _all_to_all_counts(counts.view(ep, local), groups.ep)  # [ep source, local expert]
        send, recv = counts.view(ep, local).sum(1).tolist(), received.sum(1).tolist()
    else:
        received = counts.view(1, local)
    gathered = _all_gather_counts(received, groups.etp) if etp > 1 else received.unsqueeze(0)

    def between(rows: torch.Tensor, record: list | None = None) -> torch.Tensor:
        """The rank's part between the exchanges: etp gather, expert-major order, the experts, and back."""
        sizes = gathered.sum(dim=(1, 2)).tolist() if etp > 1 else None
        if etp > 1:  # gathered: [etp source, ep source, local expert]
            rows = _AllGatherV.apply(rows, sizes, groups.etp_rank, groups.etp)
        order = None
        if gathered.shape[0] * gathered.shape[1] > 1 and local > 1:  # chunks (source, expert) -> expert-major
            order = _expert_major(gathered.reshape(-1, local)).to(rows.device)
            rows = rows[order]
        out = experts(rows, gathered.sum(dim=(0, 1)), pad_to, record)
        if order is not None:
            out = torch.empty_like(out).index_copy(0, order, out)
        return _ReduceScatterV.apply(out, sizes, groups.etp_rank, groups.etp) if etp > 1 else out

    if ep > 1 and overlap is not None and torch.is_grad_enabled():
        out = ExpertExchange.apply(rows, send, recv, groups.ep, between, overlap, *expert_parameters(experts))
    elif ep > 1:
        out = _AllToAll.apply(between(_AllToAll.apply(rows, send, recv, groups.ep)), recv, send, groups.ep)
    else:
        out = between(rows)
    return _weighted_sum(out, probs[token_index, expert_index], token_index, num_tokens, acc_dtype)


def allgather(tokens: torch.Tensor, probs: torch.Tensor, kept: torch.Tensor, experts, groups: Groups,
              acc_dtype: torch.dtype, pad_to: int | None = None, pairs: int | None = None,
              overlap: Overlap | None = None) -> torch.Tensor:
    """The allgather dispatcher (see the module doc); ``overlap`` is the alltoall dispatcher's (validation refuses
    it here: ``moe_shared_expert_overlap`` needs alltoall, as in Megatron-LM)."""
    group = groups.ep_etp
    if _size(group) > 1:
        tokens = gather_from_sequence_region(tokens, group)
        probs = gather_from_sequence_region(probs, group)
        kept = gather_from_sequence_region(kept.to(torch.uint8), group).bool()  # gloo has no bool collectives
    first = experts.local_range.start
    mine = kept[:, first:first + len(experts.local_range)]
    expert_index, token_index = mine.t().nonzero(as_tuple=True)
    out = experts(tokens[token_index], mine.sum(dim=0), pad_to)
    combined = _weighted_sum(out, probs[token_index, expert_index + first], token_index, tokens.shape[0], acc_dtype)
    return reduce_scatter_to_sequence_region(combined, group) if _size(group) > 1 else combined


DISPATCHERS = {"alltoall": alltoall, "allgather": allgather}
