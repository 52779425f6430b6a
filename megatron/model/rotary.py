"""Rotary position embeddings (RoPE, Su et al. 2021) in Megatron-LM's and Hugging Face Llama's
non-interleaved ("rotate half") convention.

With ``rot`` rotated channels of a head (``int(head_dim x rotary_percent)``, even) and base ``B``::

    inv_freq[j] = 1 / B^(2j / rot),                        j = 0 .. rot/2 - 1
    angle[p]    = p x [inv_freq, inv_freq]                 (length rot, position p)
    rope(t)[:rot] = t[:rot] cos(angle) + rotate_half(t[:rot]) sin(angle),
    rotate_half([x1, x2]) = [-x2, x1]                      (the two halves of the rotated channels)

and ``t[rot:]`` passes through unchanged. Interleaved (Megatron-LM's ``--rotary-interleaved``): channel
pairs ``(2j, 2j + 1)`` rotate by ``angle_j`` (``angle = p x repeat_interleave(inv_freq, 2)``, and
``rotate_pairs([.., x_2j, x_2j+1, ..]) = [.., -x_2j+1, x_2j, ..]``). Applied to queries and keys after
the QKV projection, at each token's own position id, so a left-padded row (inference) rotates exactly as
it would alone.
"""

from __future__ import annotations

import torch
from torch import nn


def rotary_channels(head_dim: int, rotary_percent: float) -> int:
    """The channels of a head that are rotated (Megatron-LM's ``int(kv_channels x rotary_percent)``)."""
    return int(head_dim * rotary_percent)


def inverse_frequencies(rot: int, base: float, device: torch.device | None = None) -> torch.Tensor:
    """``1 / base^(arange(0, rot, 2) / rot)`` [rot/2], fp32 (as Megatron-LM and Hugging Face compute it)."""
    return 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.int64, device=device).float() / rot))


def rotate_half(t: torch.Tensor) -> torch.Tensor:
    x1, x2 = t.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(t: torch.Tensor) -> torch.Tensor:
    x1, x2 = t[..., 0::2], t[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """``t`` [b, heads, s, hd] rotated by ``cos``/``sin`` [b, 1, s, rot] (rot <= hd): the first ``rot``
    channels rotated (their halves, or with ``interleaved`` their adjacent pairs: the table must be built
    the same way), the rest passed through. Computed in ``t``'s dtype (cos and sin cast to it)."""
    rot = cos.shape[-1]
    cos, sin = cos.to(t.dtype), sin.to(t.dtype)
    rotate = rotate_pairs if interleaved else rotate_half
    if rot == t.shape[-1]:
        return t * cos + rotate(t) * sin
    head, tail = t[..., :rot], t[..., rot:]
    return torch.cat((head * cos + rotate(head) * sin, tail), dim=-1)


class RotaryEmbedding(nn.Module):
    """``forward(position_ids [b, s]) -> (cos, sin)``, each [b, 1, s, rot], looked up in an fp32 table of
    every position below ``max_positions``.

    The table is computed once per device, at the first forward (not in ``__init__``: a model built on
    the meta device, ZeRO stage 3, has no values until then), and kept as a plain attribute so that
    casting the model to bf16 does not round the angles; it is never saved (it is not a parameter)."""

    def __init__(self, head_dim: int, rotary_percent: float, base: float, max_positions: int,
                 interleaved: bool = False):
        super().__init__()
        self.rot, self.interleaved = rotary_channels(head_dim, rotary_percent), interleaved
        self.base, self.max_positions = base, max_positions
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def extra_repr(self) -> str:
        return (f"rotary_channels={self.rot}, base={self.base:g}, max_positions={self.max_positions}, "
                f"interleaved={self.interleaved}")

    def table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [max_positions, rot] on ``device``."""
        if device not in self._tables:
            inv_freq = inverse_frequencies(self.rot, self.base, device)
            positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
            angles = torch.outer(positions, inv_freq)  # [max_positions, rot/2]
            angles = angles.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat((angles, angles), dim=-1)
            self._tables[device] = (angles.cos(), angles.sin())
        return self._tables[device]

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [b, 1, s, rot] of ``position_ids`` [b, s], in ``dtype`` (the activations': cast once
        per forward, not in every layer)."""
        cos, sin = self.table(position_ids.device)
        return cos[position_ids].unsqueeze(1).to(dtype), sin[position_ids].unsqueeze(1).to(dtype)
