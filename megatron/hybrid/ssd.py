"""Mamba-2's state-space scan (SSD, Dao and Gu 2024), in plain PyTorch.

Per head, with a state ``S`` of ``[n, p]`` (``n`` the state size, ``p`` the head width), each token ``t`` (input
``x_t [p]``, step ``dt_t > 0``, the group's ``B_t, C_t [n]``, the head's ``A < 0`` and skip ``D``) does::

    S <- exp(dt_t A) S + B_t (dt_t x_t)^T
    y_t = S^T C_t + D x_t

A token that starts a document (``resets``) first drops the state. This is linear attention with a scalar decay per
token: queries ``C``, keys ``B``, values ``dt x``, log-decays ``dt A``. Three forms, equal to round-off:

- ``naive``: the loop above (the reference of the tests);
- ``recurrent``: the same from a given state, returning the final state (generation);
- ``chunked`` (training): within a chunk the outputs are one masked matmul (``(C B^T) * pair``, the decays of
  ``megatron.hybrid.chunks``), between chunks the state passes on.

All take ``x [b, s, h, p]``, ``dt [b, s, h]`` (after Mamba's softplus, bias and limits), ``A [h]``, ``B, C [b, s, g,
n]`` (``g`` groups, each shared by ``h / g`` consecutive heads), ``D [h]`` or None, and compute in fp32 (fp64 if
given fp64); they return ``y [b, s, h, p]`` in x's dtype and the state ``[b, h, n, p]``. (transformers' and Megatron's
kernels hold the state as ``[b, h, p, n]``: ``state.transpose(-1, -2)``.)
"""

from __future__ import annotations

import torch

from megatron.hybrid.chunks import chunk_decays


def _prepare(x, dt, A, B, C):
    """In the working dtype: the values ``dt x``, the log-decays ``dt A``, ``B`` and ``C`` repeated to the heads."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    heads, groups = x.shape[2], B.shape[2]
    B, C = (y.to(dtype).repeat_interleave(heads // groups, dim=2) for y in (B, C))
    dt = dt.to(dtype)
    return x.to(dtype) * dt[..., None], dt * A.to(dtype), B, C


def _skip(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None) -> torch.Tensor:
    return y if D is None else y + x.to(y.dtype) * D.to(y.dtype)[:, None]


def naive(x, dt, A, B, C, D=None, initial_state=None, resets=None):
    """The token-by-token loop (the definition); returns (y, final state)."""
    return recurrent(x, dt, A, B, C, D, initial_state, resets)


def recurrent(x, dt, A, B, C, D=None, initial_state=None, resets=None):
    """From ``initial_state [b, h, n, p]``, token by token; returns (y, final state). ``resets [b, s]`` bool."""
    b, s, h, p = x.shape
    v, g, B, C = _prepare(x, dt, A, B, C)
    state = v.new_zeros(b, h, B.shape[-1], p) if initial_state is None else initial_state.to(v.dtype)
    out = []
    for t in range(s):
        if resets is not None:
            state = state * (~resets[:, t]).to(v.dtype)[:, None, None, None]
        state = state * g[:, t].exp()[..., None, None] + B[:, t, :, :, None] * v[:, t, :, None, :]
        out.append(torch.einsum("bhnp,bhn->bhp", state, C[:, t]))
    return _skip(torch.stack(out, dim=1), x, D).to(x.dtype), state


def chunked(x, dt, A, B, C, D=None, initial_state=None, resets=None, chunk_size: int = 128):
    """The chunked form (see the module doc); returns (y, final state)."""
    b, s, h, p = x.shape
    v, g, B, C = _prepare(x, dt, A, B, C)
    ch = chunk_decays(g, resets, chunk_size)
    v, k, q = ch.split(v), ch.split(B), ch.split(C)  # [b, h, n, C, d]
    attn = (q @ k.transpose(-1, -2)) * ch.pair
    q_start, k_end = q * ch.from_start[..., None], k * ch.to_end[..., None]
    state = v.new_zeros(b, h, B.shape[-1], p) if initial_state is None else initial_state.to(v.dtype)
    out = []
    for i in range(ch.n):
        out.append(q_start[:, :, i] @ state + attn[:, :, i] @ v[:, :, i])
        state = state * ch.keeps[:, :, i, None, None] + k_end[:, :, i].transpose(-1, -2) @ v[:, :, i]
    return _skip(ch.merge(torch.stack(out, dim=2), s), x, D).to(x.dtype), state


def transition(dt, A, resets=None) -> torch.Tensor:
    """The linear part of a piece of sequence's map on the state: ``final(S) = a S + final(0)``, ``a [b, h]`` the
    product of the piece's decays, 0 where a document starts in it (context parallelism composes the pieces)."""
    dtype = torch.float64 if dt.dtype == torch.float64 else torch.float32
    a = (dt.to(dtype) * A.to(dtype)).sum(1).exp()  # [b, h]
    if resets is not None:
        a = a * (~resets.any(1)).to(dtype)[:, None]
    return a
