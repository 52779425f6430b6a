"""What the chunked forms of the linear recurrences share (``delta_rule.chunked``, ``ssd.chunked``): the sequence cut
into chunks and each chunk's decays between positions, masked at document starts.

Within a chunk, with ``cum`` the cumulative log-decay (``cum_i = g_1 + ... + g_i``, every ``g <= 0``):

- ``pair[i, j] = exp(cum_i - cum_j)`` for ``j <= i`` in the same document, else 0: what a write at ``j`` keeps at
  ``i``;
- ``from_start[i] = exp(cum_i)`` where the chunk's incoming state still counts at ``i`` (no document starts at or
  before ``i`` in the chunk), else 0;
- ``to_end[j] = exp(cum_last - cum_j)`` for ``j`` in the chunk's last document, else 0: what a write at ``j`` keeps
  in the state handed to the next chunk;
- ``keeps = exp(cum_last)`` if no document starts in the chunk, else 0: what the incoming state keeps there.

The masks are applied to the decays, never added to the log-decays, so a document start costs no precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Chunks:
    n: int  # chunks
    size: int  # positions per chunk
    pad: int  # positions added at the end (no-op tokens)
    pair: torch.Tensor  # [b, h, n, C, C]
    from_start: torch.Tensor  # [b, h, n, C]
    to_end: torch.Tensor  # [b, h, n, C]
    keeps: torch.Tensor  # [b, h, n]

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, s, h, d]`` -> ``[b, h, n, C, d]`` (padded with zeros)."""
        b, _, h, d = x.shape
        return F.pad(x.transpose(1, 2), (0, 0, 0, self.pad)).reshape(b, h, self.n, self.size, d)

    def merge(self, y: torch.Tensor, length: int) -> torch.Tensor:
        """``[b, h, n, C, d]`` -> ``[b, length, h, d]``."""
        b, h = y.shape[:2]
        return y.reshape(b, h, self.n * self.size, y.shape[-1])[:, :, :length].transpose(1, 2)


def chunk_decays(g: torch.Tensor, resets: torch.Tensor | None, chunk_size: int) -> Chunks:
    """``g [b, s, h]`` (log-decays, in the working dtype), ``resets [b, s]`` bool (a document starts there: the state
    is dropped before the token) or None."""
    b, s, h = g.shape
    pad = -s % chunk_size
    n, c = (s + pad) // chunk_size, chunk_size
    cum = F.pad(g.transpose(1, 2), (0, pad)).reshape(b, h, n, c).cumsum(-1)
    lower = torch.ones(c, c, dtype=torch.bool, device=g.device).tril()
    pair = cum[..., :, None] - cum[..., None, :]
    from_start, to_end, keeps = cum.exp(), (cum[..., -1:] - cum).exp(), cum[..., -1].exp()
    if resets is None:
        pair = pair.masked_fill(~lower, float("-inf")).exp()
        return Chunks(n, c, pad, pair, from_start, to_end, keeps)
    doc = F.pad(resets.long(), (0, pad)).cumsum(-1).view(b, 1, n, c)  # each position's document
    before = torch.cat([doc.new_zeros(b, 1, 1), doc[..., -1]], dim=-1)[..., :n]  # the previous chunk's last one's
    same_doc = (doc[..., :, None] == doc[..., None, :]) & lower
    alive = (doc == before[..., None]).to(g.dtype)
    pair = pair.masked_fill(~same_doc, float("-inf")).exp()
    return Chunks(n, c, pad, pair, from_start * alive, to_end * same_doc[..., -1, :].to(g.dtype),
                  keeps * alive[..., -1])
