"""Cross entropy over the vocabulary on one device, fused and chunked.

``token_cross_entropy(logits [n, V], labels [n], vocab_size) -> losses [n]`` (fp32): equal to
``F.cross_entropy(logits.float(), labels, reduction='none')`` with the padded vocabulary entries (ids >=
vocab_size) excluded from the softmax, so the loss does not depend on how much padding a layout needs. Why not
F.cross_entropy: it needs an fp32 copy of the whole logits tensor (for a 32k vocab and 2k tokens, 256 MiB) and
separate passes for log-softmax, its backward and the dtype casts. Here the logits are processed in row chunks
that stay in cache: each chunk is converted to fp32 once, and the gradient ``softmax - onehot`` is computed in the
same pass and stored in the logits' dtype. The backward only scales it by the incoming per-token gradient (in
place: the graph must not be backpropagated twice). The vocabulary-parallel form, over the tensor-parallel ranks,
is ``megatron.tensor_parallel.cross_entropy``'s, on the same chunks.
"""

from __future__ import annotations

import torch

# fp32 elements per chunk: cache-sized on the CPU; large on GPUs, where each chunk costs kernel launches.
_CHUNK_ELEMENTS = 1 << 20
_CHUNK_ELEMENTS_GPU = 1 << 25


def _rows_per_chunk(logits: torch.Tensor) -> int:
    budget = _CHUNK_ELEMENTS if logits.device.type == "cpu" else _CHUNK_ELEMENTS_GPU
    return max(1, budget // max(1, logits.shape[1]))


def _scale_saved_logit_grad(ctx, grad_losses: torch.Tensor) -> torch.Tensor:
    """The backward of a fused cross entropy: the forward saved ``softmax - onehot`` per row; scale it
    by the incoming per-token gradient, in place (computed in fp32, stored in the logits' dtype)."""
    (grad,) = ctx.saved_tensors
    return grad.mul_(grad_losses.unsqueeze(1))


class _FusedCrossEntropy(torch.autograd.Function):
    """One rank: ``loss = logsumexp(z) - z_y`` per row; saves ``softmax(z) - onehot(y)``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
        n, padded = logits.shape
        rows = _rows_per_chunk(logits)
        losses = torch.empty(n, dtype=torch.float32, device=logits.device)
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None
        for start in range(0, n, rows):
            x = logits[start:start + rows].to(torch.float32, copy=True)  # never write into the caller's logits
            target = labels[start:start + rows, None]
            if padded > vocab_size:
                x[:, vocab_size:] = float("-inf")
            lse = torch.logsumexp(x, dim=-1, keepdim=True)
            losses[start:start + rows] = (lse - x.gather(1, target)).squeeze(1)
            if grad is not None:
                x.sub_(lse).exp_()  # softmax
                x.scatter_add_(1, target, torch.full(target.shape, -1.0, device=x.device))
                grad[start:start + rows].copy_(x)
        ctx.save_for_backward(grad)
        return losses

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor):
        return _scale_saved_logit_grad(ctx, grad_losses), None, None


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-token losses (fp32) of ``logits [..., V_padded]`` against ``labels [...]``, on one rank."""
    shape = labels.shape
    losses = _FusedCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), vocab_size)
    return losses.view(shape)
