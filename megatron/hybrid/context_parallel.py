"""Gated DeltaNet and Mamba-2 under context parallelism: each rank holds two chunks of the sequence (chunks r and
2cp-1-r of 2cp, ``attention.plan.chunk_ids``), and a linear-attention layer needs, for each chunk, what came before
it:

- **the convolution's halo**: the last ``kernel - 1`` (pre-convolution) rows of the previous chunk. Every rank's
  chunk tails are all-gathered over the cp group; each chunk takes its predecessor's (zeros before the first).
- **the recurrent state entering the chunk**: a chunk maps the state entering it affinely, ``S -> M S + F``
  (``delta_rule.transition`` gives ``M``, the chunked form from no state ``F``). Every rank computes its chunks'
  ``(M, F)``; they are all-gathered, composed in sequence order (``delta_rule.compose``) into every chunk's entering
  state, and each rank runs its chunks again from theirs.

The all-gathers are differentiable (the backward reduce-scatters: every rank's gradients of a chunk's tail, map
and final state are summed back to the rank that holds it), so the gradients are the one-process run's. Document
starts (packed samples) are read off the plan's document ids over the whole sequence, at global positions: a
chunk's first token starting a document drops its entering state, and the convolution does not reach back across
it. The exchanges carry ``(kernel - 1) x channels`` rows and ``dk x (dk + dv)`` per head and chunk: independent of
the sequence length.
"""

from __future__ import annotations

import torch

from megatron.attention.plan import chunk_ids
from megatron.hybrid import delta_rule
from megatron.tensor_parallel.mappings import gather_from_sequence_region


def _owner(chunk: int, cp: int) -> tuple[int, int]:
    """(cp rank, local slot 0 or 1) of global chunk ``chunk``."""
    return (chunk, 0) if chunk < cp else (2 * cp - 1 - chunk, 1)


def _gathered(t: torch.Tensor, plan) -> list[torch.Tensor]:
    """Every cp rank's ``t`` (a stack over this rank's two chunks), differentiably (the backward sums every rank's
    gradients of each rank's part back to it), indexed by global chunk."""
    cp = plan.cp_size
    ranks = gather_from_sequence_region(t.contiguous(), plan.group).view(cp, *t.shape)
    return [ranks[_owner(c, cp)[0]][_owner(c, cp)[1]] for c in range(2 * cp)]


def halos(qkv: torch.Tensor, width: int, plan) -> list[torch.Tensor]:
    """``qkv [b, s_local, C]`` (this rank's two chunks, in local order) -> for each local chunk the ``width`` rows
    before it in the sequence ``[b, width, C]`` (zeros before the first chunk)."""
    b, s, c = qkv.shape
    chunks = qkv.view(b, 2, s // 2, c).transpose(0, 1)  # [2, b, L, C]
    tails = _gathered(chunks[:, :, -width:], plan) if width else None
    out = []
    for g in chunk_ids(plan.cp_rank, plan.cp_size):
        out.append(qkv.new_zeros(b, width, c) if g == 0 or not width else tails[g - 1])
    return out


def entering_states(q, k, v, g, beta, resets, plan, chunk_size: int) -> list[torch.Tensor]:
    """This rank's two chunks (each ``[b, L, h, d]``, in local order; ``resets`` per chunk or None) -> the state
    entering each, composed from every chunk's map over the cp group."""
    maps = torch.stack([delta_rule.transition(k[i], g[i], beta[i], resets[i], chunk_size) for i in range(2)])
    finals = torch.stack([delta_rule.chunked(q[i], k[i], v[i], g[i], beta[i], None, resets[i], chunk_size)[1]
                          for i in range(2)])
    entering, _ = delta_rule.compose(_gathered(maps, plan), _gathered(finals, plan))
    return [entering[c] for c in chunk_ids(plan.cp_rank, plan.cp_size)]


def scan_entering_states(x, dt, A, B, C, resets, plan, chunk_size: int) -> list[torch.Tensor]:
    """Mamba-2's scan (``megatron.hybrid.ssd``) as ``entering_states``: each chunk maps the state by a decay per head
    (``ssd.transition``) and its final state from zero; composed over the cp group in sequence order."""
    from megatron.hybrid import ssd

    decays = torch.stack([ssd.transition(dt[i], A, resets[i]) for i in range(2)])
    finals = torch.stack([ssd.chunked(x[i], dt[i], A, B[i], C[i], None, None, resets[i], chunk_size)[1]
                          for i in range(2)])
    state, entering = torch.zeros_like(finals[0]), []
    for decay, final in zip(_gathered(decays, plan), _gathered(finals, plan)):
        entering.append(state)
        state = decay[..., None, None] * state + final
    return [entering[c] for c in chunk_ids(plan.cp_rank, plan.cp_size)]
