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

import math
from dataclasses import dataclass

import torch
from torch import nn


def rotary_channels(head_dim: int, rotary_percent: float) -> int:
    """The channels of a head that are rotated (Megatron-LM's ``int(kv_channels x rotary_percent)``)."""
    return int(head_dim * rotary_percent)


def inverse_frequencies(rot: int, base: float, device: torch.device | None = None) -> torch.Tensor:
    """``1 / base^(arange(0, rot, 2) / rot)`` [rot/2], fp32 (as Megatron-LM and Hugging Face compute it)."""
    return 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.int64, device=device).float() / rot))


@dataclass(frozen=True)
class Yarn:
    """YaRN's context extension (Peng et al. 2023) as Megatron Core's ``YarnRotaryEmbedding`` and transformers'
    ``rope_type: yarn`` compute it: each frequency blended between the original (high frequencies, fast rotating
    channels) and the original divided by ``factor`` (low frequencies) over a linear ramp between the channels
    that turn ``beta_fast`` and ``beta_slow`` times over ``original_max_positions``; cos and sin multiplied by the
    concentration factor ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``, ``mscale(f, m) = 0.1 m ln f
    + 1`` (1 for f <= 1)."""

    factor: float
    original_max_positions: int
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    round_to_int: bool = True  # the ramp's ends rounded out to whole channels (transformers' truncate)

    def inverse_frequencies(self, rot: int, base: float, device: torch.device | None = None) -> torch.Tensor:
        extrapolated = inverse_frequencies(rot, base, device)
        interpolated = extrapolated / self.factor

        def dim_of(rotations: float) -> float:  # the channel pair that turns ``rotations`` times
            return rot * math.log(self.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.round_to_int:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rot - 1)
        high = high + 0.001 if low == high else high
        ramp = ((torch.arange(rot // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        keep = 1.0 - ramp  # 1: the original frequency, 0: interpolated
        return interpolated * (1 - keep) + extrapolated * keep

    @property
    def concentration(self) -> float:
        return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)


def yarn_of(cfg) -> Yarn:
    """The YaRN settings of a model configuration (``ModelConfig``: rotary_scaling_factor,
    original_max_position_embeddings, mscale, mscale_all_dim, yarn_beta_fast / slow,
    yarn_correction_range_round_to_int)."""
    return Yarn(cfg.rotary_scaling_factor, cfg.original_max_position_embeddings, cfg.mscale, cfg.mscale_all_dim,
                cfg.yarn_beta_fast, cfg.yarn_beta_slow, cfg.yarn_correction_range_round_to_int)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 mscale ln(factor) + 1`` (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


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
                 interleaved: bool = False, yarn: Yarn | None = None):
        super().__init__()
        self.rot, self.interleaved = rotary_channels(head_dim, rotary_percent), interleaved
        self.base, self.max_positions, self.yarn = base, max_positions, yarn
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def extra_repr(self) -> str:
        yarn = "" if self.yarn is None else f", yarn={self.yarn}"
        return (f"rotary_channels={self.rot}, base={self.base:g}, max_positions={self.max_positions}, "
                f"interleaved={self.interleaved}{yarn}")

    def table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [max_positions, rot] on ``device``."""
        if device not in self._tables:
            inv_freq = (inverse_frequencies(self.rot, self.base, device) if self.yarn is None
                        else self.yarn.inverse_frequencies(self.rot, self.base, device))
            positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
            angles = torch.outer(positions, inv_freq)  # [max_positions, rot/2]
            angles = angles.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat((angles, angles), dim=-1)
            scale = 1.0 if self.yarn is None else self.yarn.concentration
            self._tables[device] = (angles.cos() * scale, angles.sin() * scale)
        return self._tables[device]

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [b, 1, s, rot] of ``position_ids`` [b, s], in ``dtype`` (the activations': cast once
        per forward, not in every layer)."""
        cos, sin = self.table(position_ids.device)
        return cos[position_ids].unsqueeze(1).to(dtype), sin[position_ids].unsqueeze(1).to(dtype)
