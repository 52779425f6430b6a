"""Cross entropy over the vocabulary split across the tensor-parallel ranks (the one-device form, fused and
chunked, is ``megatron.ops.cross_entropy.token_cross_entropy``).

``vocab_parallel_cross_entropy``: rank ``i`` of ``t`` holds the logits ``z[:, i V/t : (i+1) V/t]``
(``V`` the padded vocabulary). For each token with target ``y``, with padded columns (global id
>= ``vocab_size``) set to ``-inf`` so they drop out of the softmax::

    m    = max_j z_j                          all-reduce MAX of the local maxima
    S    = sum_j exp(z_j - m)                 all-reduce SUM of the local sums
    z_y  = the target logit                   all-reduce SUM of the masked local pick (one rank has it)
    loss = log S + m - z_y

The local sum is taken relative to the local max ``m_i`` (one pass over the logits) and
rescaled by ``exp(m_i - m)`` after the MAX all-reduce; the two SUMs travel as one tensor.
Full logits are never materialised. Gradient on the local shard:
``dL/dz_j = (softmax_j - [j == y]) * dL/dloss`` (zero for padded columns), computed in fp32
chunk by chunk in the forward and stored in the logits' dtype; the backward scales it in
place, as on one rank. With one rank (or no group) it is ``token_cross_entropy``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.ops.cross_entropy import _rows_per_chunk, _scale_saved_logit_grad, token_cross_entropy
from megatron.tensor_parallel.mappings import resolve_group


class _Shard:
    """This rank's logits ``[n, V/t]``, read in fp32 row chunks with the padded columns at ``-inf``,
    and its targets: the labels in its column range, as local column indices."""

    def __init__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, rank: int):
        self.logits = logits
        n, self.part = logits.shape
        start = rank * self.part
        self.valid = min(self.part, max(0, vocab_size - start))  # local columns below vocab_size
        self.rows = _rows_per_chunk(logits)
        self.starts = range(0, n, self.rows)
        self.in_shard = (labels >= start) & (labels < start + self.part)
        self.local_labels = (labels - start).masked_fill(~self.in_shard, 0)

    def chunk(self, begin: int) -> torch.Tensor:
        x = self.logits[begin:begin + self.rows].to(torch.float32, copy=True)  # never write into the input
        if self.valid < self.part:
            x[:, self.valid:] = float("-inf")
        return x

    def local_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``m_i`` per row, and ``[sum_j exp(z_j - m_i), z_y (0 when y is not in this shard)]``."""
        n, device = self.logits.shape[0], self.logits.device
        local_max = torch.empty(n, dtype=torch.float32, device=device)
        stats = torch.zeros(2, n, dtype=torch.float32, device=device)
        for begin in self.starts:
            end = min(n, begin + self.rows)
            x = self.chunk(begin)
            if self.valid == 0:  # this shard is all padding: contributes nothing
                local_max[begin:end] = float("-inf")
                continue
            m = x.amax(dim=1)
            local_max[begin:end] = m
            stats[0, begin:end] = (x - m.unsqueeze(1)).exp_().sum(dim=1)
            pick = x.gather(1, self.local_labels[begin:end, None]).squeeze(1)
            stats[1, begin:end] = pick.masked_fill(~self.in_shard[begin:end], 0.0)
        return local_max, stats

    def grad(self, log_sum_exp: torch.Tensor) -> torch.Tensor:
        """``softmax_j - [j == y]`` on this shard, in the logits' dtype."""
        grad = torch.empty_like(self.logits)
        for begin in self.starts:
            end = min(self.logits.shape[0], begin + self.rows)
            x = self.chunk(begin)
            x.sub_(log_sum_exp[begin:end, None]).exp_()  # softmax (0 on padded columns)
            hit = self.in_shard[begin:end, None].float().neg_()
            x.scatter_add_(1, self.local_labels[begin:end, None], hit)
            grad[begin:end].copy_(x)
        return grad


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """``loss = log S + m - z_y`` from the shards' statistics: one MAX and one SUM all-reduce over ``group``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, group) -> torch.Tensor:
        shard = _Shard(logits, labels, vocab_size, dist.get_rank(group))
        local_max, stats = shard.local_stats()
        global_max = local_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        # rescale each local sum from its local max to the global max (exp(-inf) = 0 for an all-padding shard)
        stats[0].mul_((local_max - global_max).exp_())
        dist.all_reduce(stats, group=group)
        sum_exp, target = stats[0], stats[1]
        log_sum_exp = sum_exp.log() + global_max
        losses = log_sum_exp - target
        ctx.save_for_backward(shard.grad(log_sum_exp) if ctx.needs_input_grad[0] else None)
        return losses

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor):
        return _scale_saved_logit_grad(ctx, grad_losses), None, None, None


def vocab_parallel_cross_entropy(logits_parallel: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                                 group=None) -> torch.Tensor:
    """Per-token losses (fp32, shape of ``labels``) of this rank's vocabulary shard
    ``logits_parallel [..., V_padded / t]`` against global ``labels [...]`` (all < ``vocab_size``)."""
    group = resolve_group(group)
    if group is None:
        return token_cross_entropy(logits_parallel, labels, vocab_size)
    shape = labels.shape
    losses = _VocabParallelCrossEntropy.apply(logits_parallel.reshape(-1, logits_parallel.shape[-1]),
                                              labels.reshape(-1), vocab_size, group)
    return losses.view(shape)
