"""Cross entropy over a vocabulary split across the tensor-parallel ranks.

Rank ``i`` of ``t`` holds the logits ``z[:, i V/t : (i+1) V/t]`` (``V`` the padded vocabulary).
For each token with target ``y``, with padded columns (global id >= ``vocab_size``) set to
``-inf`` so they drop out of the softmax::

    m    = max_j z_j                          all-reduce MAX of the local maxima
    S    = sum_j exp(z_j - m)                 all-reduce SUM of the local sums
    z_y  = the target logit                   all-reduce SUM of the masked local pick (one rank has it)
    loss = log S + m - z_y

The local sum is taken relative to the local max ``m_i`` (one pass over the logits) and
rescaled by ``exp(m_i - m)`` after the MAX all-reduce; the two SUMs travel as one tensor.
Full logits are never materialised. Gradient on the local shard:
``dL/dz_j = (softmax_j - [j == y]) * dL/dloss`` (zero for padded columns), computed in fp32
chunk by chunk in the forward and stored in the logits' dtype; the backward scales it in
place (so, as ``megatron.model.cross_entropy``, the graph must not be backpropagated twice).

With one rank (or no group) this is ``megatron.model.cross_entropy.token_cross_entropy``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.model.cross_entropy import scale_saved_logit_grad, token_cross_entropy
from megatron.tensor_parallel.mappings import resolve_group

_CHUNK_ELEMENTS = 1 << 20  # fp32 elements per chunk on the CPU (cache-sized)
_CHUNK_ELEMENTS_GPU = 1 << 25


def _rows_per_chunk(logits: torch.Tensor) -> int:
    budget = _CHUNK_ELEMENTS if logits.device.type == "cpu" else _CHUNK_ELEMENTS_GPU
    return max(1, budget // max(1, logits.shape[1]))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, group) -> torch.Tensor:
        n, part = logits.shape
        start = dist.get_rank(group) * part
        valid = min(part, max(0, vocab_size - start))  # local columns below vocab_size
        rows = _rows_per_chunk(logits)
        local_max = torch.empty(n, dtype=torch.float32, device=logits.device)
        stats = torch.zeros(2, n, dtype=torch.float32, device=logits.device)  # [sum exp(z - local_max), z_y]
        in_shard = (labels >= start) & (labels < start + part)
        local_labels = (labels - start).masked_fill(~in_shard, 0)

        def chunk(begin: int) -> torch.Tensor:
            x = logits[begin:begin + rows].to(torch.float32, copy=True)  # never write into the input
            if valid < part:
                x[:, valid:] = float("-inf")
            return x

        for begin in range(0, n, rows):
            end = min(n, begin + rows)
            x = chunk(begin)
            if valid == 0:  # this shard is all padding: contributes nothing
                local_max[begin:end] = float("-inf")
                continue
            m = x.amax(dim=1)
            local_max[begin:end] = m
            stats[0, begin:end] = (x - m.unsqueeze(1)).exp_().sum(dim=1)
            pick = x.gather(1, local_labels[begin:end, None]).squeeze(1)
            stats[1, begin:end] = pick.masked_fill(~in_shard[begin:end], 0.0)

        global_max = local_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        # rescale each local sum from its local max to the global max (exp(-inf) = 0 for an all-padding shard)
        stats[0].mul_((local_max - global_max).exp_())
        dist.all_reduce(stats, group=group)
        sum_exp, target = stats[0], stats[1]
        log_sum_exp = sum_exp.log() + global_max
        losses = log_sum_exp - target

        grad = None
        if ctx.needs_input_grad[0]:
            grad = torch.empty_like(logits)
            for begin in range(0, n, rows):
                end = min(n, begin + rows)
                x = chunk(begin)
                x.sub_(log_sum_exp[begin:end, None]).exp_()  # softmax (0 on padded columns)
                hit = in_shard[begin:end, None].float().neg_()
                x.scatter_add_(1, local_labels[begin:end, None], hit)
                grad[begin:end].copy_(x)
        ctx.save_for_backward(grad)
        return losses

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor):
        return scale_saved_logit_grad(ctx, grad_losses), None, None, None


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
