"""The gated delta rule (Gated DeltaNet, Yang et al. 2024; Qwen3-Next's linear attention), in plain PyTorch.

Per head, with a state ``S`` of ``[dk, dv]``, each token ``t`` (query ``q_t``, key ``k_t``, value ``v_t``, log-decay
``g_t <= 0``, write strength ``beta_t`` in (0, 1)) does::

    S <- exp(g_t) S                                  (decay)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T          (the delta rule: write the part of v_t that S does not predict)
    o_t = S^T q_t

A token that starts a document (``resets``) first drops the state (packed documents do not see each other).

Three forms, equal to round-off:

- ``naive``: the loop above, token by token (the reference of the tests);
- ``recurrent``: the same loop from a given state, returning the final state (generation, one token at a time);
- ``chunked`` (training): the sequence cut into chunks of ``chunk_size``; within a chunk the writes are found at
  once by solving a unit lower-triangular system (the "UT transform": ``(I + A) U = beta V - ...`` with
  ``A[i, j] = beta_i k_i^T k_j exp(cum_i - cum_j)``, ``cum`` the chunk's cumulative log-decay), and the state passes
  from chunk to chunk. Document starts inside a chunk mask every term between two documents (pairs of positions,
  the chunk's incoming state, the state it hands on), so the masked decays never underflow a cumulative sum.

All three take ``q, k [b, s, h, dk]``, ``v [b, s, h, dv]``, ``g, beta [b, s, h]`` (the caller has repeated the key
heads over grouped value heads, L2-normalised q and k, and scaled q) and compute in fp32 (fp64 if given fp64),
returning the output ``[b, s, h, dv]`` in v's dtype and the state ``[b, h, dk, dv]``.
"""

from __future__ import annotations

import torch

from megatron.hybrid.chunks import chunk_decays


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _start_state(initial: torch.Tensor | None, b: int, h: int, dk: int, dv: int, like: torch.Tensor) -> torch.Tensor:
    if initial is None:
        return like.new_zeros(b, h, dk, dv)
    return initial.to(like.dtype)


def naive(q, k, v, g, beta, initial_state=None, resets=None):
    """The token-by-token loop (the definition); returns (output, final state)."""
    return recurrent(q, k, v, g, beta, initial_state, resets)


def recurrent(q, k, v, g, beta, initial_state=None, resets=None):
    """From ``initial_state``, token by token; returns (output, final state). ``resets [b, s]`` bool."""
    b, s, h, dk = k.shape
    dv, dtype, in_dtype = v.shape[-1], _work_dtype(v), v.dtype
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    state = _start_state(initial_state, b, h, dk, dv, v)
    out = []
    for t in range(s):
        if resets is not None:
            state = state * (~resets[:, t]).to(dtype)[:, None, None, None]
        state = state * g[:, t].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        write = (v[:, t] - predicted) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * write[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(out, dim=1).to(in_dtype), state


def chunked(q, k, v, g, beta, initial_state=None, resets=None, chunk_size: int = 64):
    """The chunked form (see the module doc); returns (output, final state)."""
    b, s, h, dk = k.shape
    dv, dtype, in_dtype = v.shape[-1], _work_dtype(v), v.dtype
    ch = chunk_decays(g.to(dtype), resets, chunk_size)
    q, k, v = (ch.split(x.to(dtype)) for x in (q, k, v))  # [b, h, n, C, d]
    beta = ch.split(beta.to(dtype)[..., None])[..., 0]
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * ch.pair  # its strict lower part is A; the solve takes a unit diagonal
    writes = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    start_part = torch.linalg.solve_triangular(system, k_beta * ch.from_start[..., None], upper=False,
                                               unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * ch.pair
    q_start, k_end = q * ch.from_start[..., None], k * ch.to_end[..., None]
    state = _start_state(initial_state, b, h, dk, dv, v)
    out = []
    for i in range(ch.n):
        u = writes[:, :, i] - start_part[:, :, i] @ state  # the writes, corrected for what the state predicts
        out.append(q_start[:, :, i] @ state + attn[:, :, i] @ u)
        state = state * ch.keeps[:, :, i, None, None] + k_end[:, :, i].transpose(-1, -2) @ u
    return ch.merge(torch.stack(out, dim=2), s).to(in_dtype), state


def transition(k, g, beta, resets=None, chunk_size: int = 64) -> torch.Tensor:
    """The linear part of a piece of sequence's map on the state: ``final(S) = M S + final(0)``, ``M [b, h, dk, dk]``
    (what context parallelism composes over the ranks' pieces: ``compose``). The chunked form run on ``S = I`` with
    no values."""
    b, s, h, dk = k.shape
    eye = torch.eye(dk, dtype=_work_dtype(k), device=k.device).expand(b, h, dk, dk)
    zeros = k.new_zeros(b, s, h, dk)
    return chunked(zeros, k, zeros, g, beta, eye, resets, chunk_size)[1]


def compose(maps: list[torch.Tensor], finals: list[torch.Tensor], initial: torch.Tensor | None = None):
    """The state entering each piece of a sequence cut in pieces, in order: piece ``i`` maps a state ``S`` to
    ``maps[i] @ S + finals[i]`` (``transition`` and the final state from zero); returns the entering states and the
    state after the last piece."""
    state = torch.zeros_like(finals[0]) if initial is None else initial.to(finals[0].dtype)
    entering = []
    for m, f in zip(maps, finals):
        entering.append(state)
        state = m @ state + f
    return entering, state
