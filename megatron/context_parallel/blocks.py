"""Attention over blocks of queries and keys, with the log-sum-exp that lets partial results merge.

Context-parallel attention (ring or gathered keys) computes a rank's queries against one rank's keys
at a time. Each such pair is a list of ``Block``s: a range of query rows, a range of key rows, causal
(the two ranges are the same tokens: the lower triangle) or full (every key precedes every query),
over every sample of the micro-batch, or one sample (packed documents: one block per document present
in both ranges; a pair with none is skipped). A block's result is ``(out, lse)``; results over disjoint
key sets merge exactly by log-sum-exp rescaling (``merge``). The backward of a block needs only the
merged output and log-sum-exp of its rows (FlashAttention's backward), so nothing of a block is kept.

Kernels: on the CPU PyTorch's fused flash kernel (``_scaled_dot_product_flash_attention_for_cpu``, which
returns the log-sum-exp); elsewhere the same computation in plain operations in fp32, a tile of query rows
at a time so that the scores held at once stay under ``MATH_TILE_BYTES`` whatever the block's length
(``FUSED_ON_CPU["enabled"] = False`` runs it on the CPU too, for tests).

Widths: the values may be narrower or wider than the queries and keys (multi-latent attention: ``dn + dr``
against ``dv``), and the softmax scale is the caller's (``q k^T x scale``). The plain kernel takes any widths;
the fused CPU kernel wants one width for the three, so the narrower side is padded with zero channels (zero
value channels give zero output channels; zero query and key channels add nothing to the scores) and the
padding cut from its results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FUSED_ON_CPU = {"enabled": True}
MATH_TILE_BYTES = {"limit": 256 << 20}  # the fp32 scores (and probabilities) of one tile of query rows


def _fused(device: torch.device) -> bool:
    return device.type == "cpu" and FUSED_ON_CPU["enabled"]


@dataclass(frozen=True)
class Block:
    q: slice  # query rows (local order)
    k: slice  # key rows (local order of the keys' owner)
    causal: bool
    sample: int | None = None  # None: every sample of the micro-batch

    def rows(self, t: torch.Tensor, which: str) -> torch.Tensor:
        """``t`` [b, heads, L, d] (or [b, heads, L]) cut to this block's samples and rows."""
        batch = slice(None) if self.sample is None else slice(self.sample, self.sample + 1)
        return t[batch, :, self.q if which == "q" else self.k]


def dense_blocks(q_rows: slice, k_rows: slice, causal: bool) -> list[Block]:
    return [Block(q_rows, k_rows, causal)]


def document_blocks(q_docs: torch.Tensor, k_docs: torch.Tensor, q_rows: slice, k_rows: slice,
                    causal: bool) -> list[Block]:
    """The blocks of a pair of row ranges over packed documents: per sample, one block per document with
    tokens in both ranges (document ids never decrease along the rows). ``q_docs`` [b, Lq], ``k_docs``
    [b, Lk]: the document id of every query and key row (local order)."""
    blocks = []
    q_off, k_off = q_rows.start or 0, k_rows.start or 0
    for i, (qd, kd) in enumerate(zip(q_docs[:, q_rows].tolist(), k_docs[:, k_rows].tolist())):
        q_runs, k_runs = _runs(qd), _runs(kd)
        for doc, (qa, qe) in q_runs.items():
            if doc in k_runs:
                ka, ke = k_runs[doc]
                blocks.append(Block(slice(q_off + qa, q_off + qe), slice(k_off + ka, k_off + ke), causal, i))
    return blocks


def _runs(ids: list[int]) -> dict[int, tuple[int, int]]:
    """Each value's [first, last + 1) in a non-decreasing list."""
    runs: dict[int, tuple[int, int]] = {}
    for i, d in enumerate(ids):
        runs[d] = (runs[d][0], i + 1) if d in runs else (i, i + 1)
    return runs


def _expand_groups(k: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, g, L, d] -> [b, heads, L, d]: each key/value group repeated for its queries."""
    g = k.shape[1]
    return k if g == heads else k.repeat_interleave(heads // g, dim=1)


def _fold_groups(dk: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of ``_expand_groups``: [b, heads, L, d] summed back to [b, g, L, d]."""
    b, heads, length, d = dk.shape
    return dk if heads == groups else dk.view(b, groups, heads // groups, length, d).sum(2)


def _row_tiles(q: torch.Tensor, sk: int) -> list[slice]:
    """Query rows cut so that one tile's fp32 scores [b, h, rows, sk] take at most ``MATH_TILE_BYTES``."""
    b, h, sq, _ = q.shape
    rows = max(1, MATH_TILE_BYTES["limit"] // max(1, b * h * sk * 4))
    return [slice(a, min(a + rows, sq)) for a in range(0, sq, rows)]


def _scores(q_rows: torch.Tensor, k: torch.Tensor, rows: slice, causal: bool, scale: float) -> torch.Tensor:
    """fp32 ``q k^T scale`` of a tile of query rows; causal: key j is seen by query row i when j <= i."""
    scores = torch.matmul(q_rows.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(rows.start, rows.stop, device=q_rows.device).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(k.shape[2], device=q_rows.device) > i, float("-inf"))
    return scores


def _widened(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` with zero channels appended up to ``width`` (the fused CPU kernel's one width)."""
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


def kernel_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, h, sq, dv] in q's dtype, lse [b, h, sq] fp32) of one block; k, v may have fewer heads (groups),
    v another width than q and k."""
    k, v = _expand_groups(k, q.shape[1]), _expand_groups(v, q.shape[1])
    if _fused(q.device):
        width = max(q.shape[-1], v.shape[-1])
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _widened(q, width), _widened(k, width), _widened(v, width), 0.0, causal, scale=scale)
        return out[..., :v.shape[-1]], lse.float()
    out = torch.empty(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for rows in _row_tiles(q, k.shape[2]):
        scores = _scores(q[:, :, rows], k, rows, causal, scale)
        lse[:, :, rows] = torch.logsumexp(scores, dim=-1)
        out[:, :, rows] = torch.matmul(torch.exp(scores - lse[:, :, rows].unsqueeze(-1)), v.float()).to(q.dtype)
    return out, lse


def kernel_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) of one block given the rows' final ``out`` and ``lse`` (over every key, not only this
    block's); dk, dv summed over the queries of each group."""
    groups = k.shape[1]
    k, v = _expand_groups(k, q.shape[1]), _expand_groups(v, q.shape[1])
    if _fused(q.device):
        dqk, dv_width = q.shape[-1], v.shape[-1]
        width = max(dqk, dv_width)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _widened(dout, width), _widened(q, width), _widened(k, width), _widened(v, width), _widened(out, width),
            lse, 0.0, causal, scale=scale)
        dq, dk, dv = dq[..., :dqk], dk[..., :dqk], dv[..., :dv_width]
    else:
        kf, vf = k.float(), v.float()
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
        for rows in _row_tiles(q, k.shape[2]):
            qf, df = q[:, :, rows].float(), dout[:, :, rows].float()
            p = torch.exp(_scores(qf, kf, rows, causal, scale) - lse[:, :, rows].unsqueeze(-1))
            dv += torch.matmul(p.transpose(-1, -2), df)
            ds = p * (torch.matmul(df, vf.transpose(-1, -2)) - (df * out[:, :, rows].float()).sum(-1, keepdim=True))
            dq[:, :, rows] = torch.matmul(ds, kf) * scale
            dk += torch.matmul(ds.transpose(-1, -2), qf) * scale
    return dq, _fold_groups(dk, groups), _fold_groups(dv, groups)


def blocks_forward(q, k, v, blocks: list[Block], scale: float) -> tuple[slice, torch.Tensor, torch.Tensor]:
    """(query rows, out fp32 [b, h, rows, dv], lse fp32) of ``q`` against the keys of ``blocks`` (whose query rows
    are disjoint): the results over the span of rows the blocks cover (half of them in half of a ring's steps); rows
    of the span no block covers get out 0 and lse -inf."""
    rows = slice(min(block.q.start for block in blocks), max(block.q.stop for block in blocks))
    b, h, d = q.shape[0], q.shape[1], v.shape[-1]
    out = torch.zeros(b, h, rows.stop - rows.start, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, rows.stop - rows.start), float("-inf"), dtype=torch.float32, device=q.device)
    for block in blocks:
        out_block, lse_block = kernel_forward(block.rows(q, "q"), block.rows(k, "k"), block.rows(v, "k"), block.causal,
                                              scale)
        batch = slice(None) if block.sample is None else slice(block.sample, block.sample + 1)
        mine = slice(block.q.start - rows.start, block.q.stop - rows.start)
        out[batch, :, mine] = out_block
        lse[batch, :, mine] = lse_block
    return rows, out, lse


def blocks_backward(dout, q, k, v, out, lse, blocks: list[Block], scale: float, dq, dk, dv) -> None:
    """Add each block's gradients into ``dq``, ``dk``, ``dv`` (fp32 accumulators shaped as q, k, v)."""
    for block in blocks:
        gq, gk, gv = kernel_backward(block.rows(dout, "q"), block.rows(q, "q"), block.rows(k, "k"),
                                     block.rows(v, "k"), block.rows(out, "q"), block.rows(lse, "q"),
                                     block.causal, scale)
        block.rows(dq, "q").add_(gq)
        block.rows(dk, "k").add_(gk)
        block.rows(dv, "k").add_(gv)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a result over other keys into the running (out, lse), in place (fp32): softmax over the union."""
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows no key reached yet stay 0
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - safe).unsqueeze(-1))
    lse.copy_(new)
