"""Attention dropout whose masks are a function of global positions: the same masks under every layout.

Blockwise attention (the ring, the gathered keys, the cp-1 blocks of ``--attention-dropout-masks positional``)
cannot use a fused kernel's own dropout: its mask depends on the kernel's random stream and on how the sequence
is cut. Here the mask of a (query, key) entry is a hash of ``(seed, layer, sample, head, query position, key
position)``, positions global (in the whole sequence), the head global (its index over the tensor-parallel ranks),
the sample its index in the micro-batch: a block draws exactly the entries of the one-process mask it covers,
whatever the split, the ranks' timing or the order of the blocks, and the backward draws them again instead of
keeping them (only a tile of a block's mask exists at a time).

``seed`` is drawn once per micro-batch (``AttentionPlan.dropout``) from the tracker's ``positional-dropout``
stream (``tensor_parallel.random``), seeded alike on every rank (no tp or cp offset) and replayed by recompute;
``layer`` (the layer's global number) makes the layers' masks independent.

The hash is a 32-bit integer mixer (``_mix``: xor-shift / multiply twice, a bijection of 32-bit words) chained over
the fields, computed in int64 so that every product stays below 2^63; an entry is kept when its hash is at least
``p x 2^32``, and a kept probability is scaled by ``1 / (1 - p)``.

With dropout applied to the normalised probabilities, a block of keys ``K_b`` with its own log-sum-exp
``lse_b`` gives ``out_b = (exp(s - lse_b) * z) @ v`` (``z = keep / (1 - p)``), and the merge by log-sum-exp weights
``exp(lse_b - lse)`` is unchanged: ``sum_b exp(lse_b - lse) out_b = (exp(s - lse) * z) @ v``, the dropped softmax
over all keys. The backward (FlashAttention's with dropout): ``dv = (P z)^T dout``, ``dP = (dout v^T) z``,
``ds = P (dP - D)`` with ``D = rowsum(dout * out)``, since ``rowsum(P dP) = dout . (P z) v = dout . out``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
_M1, _M2 = 0x21F0AAAD, 0x735A2D97  # a two-round 32-bit mixer's multipliers (hash-prospector's), both below 2^31


def _mix(x):
    """A bijection of 32-bit words with good avalanche (xor-shift / multiply, twice): int64 tensors, in place (every
    product of a 32-bit word and a multiplier below 2^31 stays below 2^63), or ints."""
    if isinstance(x, int):
        x ^= x >> 16
        x = (x * _M1) & _MASK32
        x ^= x >> 15
        x = (x * _M2) & _MASK32
        return x ^ (x >> 15)
    x.bitwise_xor_(x >> 16).mul_(_M1).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15).mul_(_M2).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 15)


@dataclass(frozen=True)
class BlockDropout:
    """One layer's attention dropout for one micro-batch: ``p``, the micro-batch's ``seed``, the layer, the global
    index of this rank's first head."""

    p: float
    seed: int
    layer: int
    first_head: int = 0

    @property
    def base(self) -> int:
        """The 32-bit word the positions are chained onto."""
        x = _mix((self.seed & _MASK32) ^ _mix((self.seed >> 32) & _MASK32))
        return _mix(x ^ (self.layer & _MASK32))

    def keep(self, samples: range, heads: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """bool [len(samples), heads, len(q_pos), len(k_pos)]: the entries kept, of the micro-batch's ``samples``,
        this rank's ``heads`` and the global query and key positions given (int64, on the tensors' device)."""
        device = q_pos.device
        x = _mix(self.base ^ torch.arange(samples.start, samples.stop, device=device, dtype=torch.int64))
        x = _mix(x.view(-1, 1) ^ torch.arange(self.first_head, self.first_head + heads, device=device))
        x = _mix(x.unsqueeze(-1) ^ q_pos.view(1, 1, -1))
        x = _mix(x.unsqueeze(-1) ^ k_pos.view(1, 1, 1, -1))
        return x >= int(round(self.p * 2 ** 32))

    def scaled(self, samples: range, heads: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """fp32 ``keep / (1 - p)`` of those entries."""
        return self.keep(samples, heads, q_pos, k_pos).float().mul_(1.0 / (1.0 - self.p))
