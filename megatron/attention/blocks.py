"""Attention over blocks of queries and keys, with the log-sum-exp that lets partial results merge.

Context-parallel attention (ring or gathered keys), attention over packed documents and sliding-window attention
compute a rank's queries against some keys at a time. Each such piece is a ``Block``: a range of query rows and a
range of key rows of one sample or of every sample, and what the queries see of the keys, from their global
positions: key j is seen by query i when ``0 <= pos(i) - pos(j) <= window`` (no upper bound without a window).
A block is planned (``plan.py``) so that every query row of it sees at least one key. A block's result is
``(out, lse)``; results over disjoint key sets merge exactly by log-sum-exp rescaling (``merge``). The backward of
a block needs only the merged output and log-sum-exp of its rows (FlashAttention's backward), so nothing of a block
is kept.

Attention sinks (``softmax_type`` off-by-one / learnable, gpt-oss): each head's logit ``s_h`` joins every row's
softmax as a key whose value is zero. After the merge over the keys, ``apply_sinks`` folds it in (``lse' =
logaddexp(lse, s_h)``, ``out' = out exp(lse - lse')``); the blocks' backward with ``out'`` and ``lse'`` is then the
exact gradient of the queries, keys and values, and ``sinks_grad`` gives the sinks' own: ``-sum_i exp(s_h -
lse'_i) (dout_i . out'_i)``.

Kernels: on the CPU PyTorch's fused flash kernel (``_scaled_dot_product_flash_attention_for_cpu``, which
returns the log-sum-exp; a block the window cuts gets an additive mask); on a CUDA GPU, for a block without a mask
in bf16 or fp16, PyTorch's FlashAttention-2 kernel (``_scaled_dot_product_flash_attention`` and its backward, which
take the merged output and log-sum-exp as the CPU's does) once a probe on the device has found it equal to the
plain kernel (``gpu_flash``); otherwise the same computation in plain operations in fp32, a tile of query rows at
a time so that the scores held at once stay under ``MATH_TILE_BYTES`` (``tiling.py``) whatever the block's length
(``FUSED_ON_CPU["enabled"] = False`` / ``FUSED_ON_GPU`` run it everywhere, for tests).

Widths: the values may be narrower or wider than the queries and keys (multi-latent attention: ``dn + dr``
against ``dv``), and the softmax scale is the caller's (``q k^T x scale``). The plain kernel takes any widths;
the fused CPU kernel wants one width for the three, so the narrower side is padded with zero channels (zero
value channels give zero output channels; zero query and key channels add nothing to the scores) and the
padding cut from its results.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.attention.dropout import BlockDropout
from megatron.attention.tiling import tile_rows
from megatron.device import first_line

FUSED_ON_CPU = {"enabled": True}
FUSED_ON_GPU = {"enabled": True}
_FLASH_PROBES: dict[tuple, str | None] = {}  # (device, dtype, width) -> None: the flash kernel agrees; else why not


def _fused(device: torch.device) -> bool:
    return device.type == "cpu" and FUSED_ON_CPU["enabled"]


def _flash_on_gpu(q: torch.Tensor, v: torch.Tensor, block: Block) -> bool:
    """Whether this block runs on the GPU's flash kernel: no mask, bf16 or fp16, a width it takes, a probe passed."""
    if q.device.type != "cuda" or not FUSED_ON_GPU["enabled"] or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    width = max(q.shape[-1], v.shape[-1])
    return block.kind != "masked" and width <= 256 and width % 8 == 0 and gpu_flash(q.device, q.dtype, width) is None


def gpu_flash(device: torch.device, dtype: torch.dtype, width: int) -> str | None:
    """None when the GPU's flash kernel runs here and its forward and backward equal the plain kernel's on a small
    causal block and a full one (``_probe_flash``); else why not, said once in a warning (the plain kernel runs)."""
    key = (device, dtype, width)
    if key not in _FLASH_PROBES:
        _FLASH_PROBES[key] = _probe_flash(device, dtype, width)
        if _FLASH_PROBES[key] is not None:
            logging.getLogger(__name__).warning(
                f"context-parallel blocks: the GPU's flash kernel is not used ({_FLASH_PROBES[key]}); the plain fp32 "
                f"kernel runs instead (slower)")
    return _FLASH_PROBES[key]


def _probe_flash(device: torch.device, dtype: torch.dtype, width: int) -> str | None:
    """Both kinds of block the flash kernel takes: a causal square one, and a full one of more keys than queries."""
    generator = torch.Generator(device=device).manual_seed(0)
    for block in (Block(slice(0, 128), slice(0, 128), 0), Block(slice(0, 64), slice(0, 192), 192)):
        q, dout = (torch.randn(1, 2, 64 if block.kind == "full" else 128, width, device=device, dtype=dtype,
                               generator=generator) for _ in range(2))
        k, v = (torch.randn(1, 2, block.k.stop, width, device=device, dtype=dtype, generator=generator)
                for _ in range(2))
        try:
            out, lse = _flash_forward(q, k, v, block.kind == "causal", width ** -0.5)
            grads = _flash_backward(dout, q, k, v, out, lse, block.kind == "causal", width ** -0.5)
        except Exception as err:  # a kernel this build or device lacks: the plain kernel runs
            return first_line(err)
        plain_out, plain_lse = _plain_forward(q, k, v, block, width ** -0.5, None)
        plain = _plain_backward(dout, q, k, v, plain_out, plain_lse, block, width ** -0.5, None)
        if not (lse - plain_lse).abs().max().item() <= 1e-2:  # both fp32: the merge's weights are exp(lse)
            return f"its log-sum-exp differs from the plain kernel's by {(lse - plain_lse).abs().max().item():.2e}"
        for name, got, want in (("out", out, plain_out), ("dq", grads[0], plain[0]), ("dk", grads[1], plain[1]),
                                ("dv", grads[2], plain[2])):
            error = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6)).item()
            if not error <= 8 * torch.finfo(dtype).eps:
                return f"its {name} differs from the plain kernel's by {error:.2e} of its largest value ({block.kind})"
    return None


def kernel_name(device: torch.device, dtype: torch.dtype = torch.bfloat16, width: int = 128) -> str:
    """The kernel a block without dropout or mask runs on ``device`` (benchmarks/gpu.py reports it)."""
    if _fused(device):
        return "the CPU's fused flash kernel"
    if device.type == "cuda" and FUSED_ON_GPU["enabled"] and gpu_flash(device, dtype, width) is None:
        return "the GPU's flash kernel"
    return "the plain fp32 kernel"


@dataclass(frozen=True)
class Block:
    q: slice  # query rows (local order)
    k: slice  # key rows (local order of the keys' owner)
    offset: int  # pos(first query row) - pos(first key row): global positions, contiguous within the block
    window: int | None = None  # keys before each query it sees; None: all earlier keys
    sample: int | None = None  # None: every sample of the micro-batch
    q_pos: int = 0  # the global position of the first query row (the keys' first: q_pos - offset)

    def rows(self, t: torch.Tensor, which: str) -> torch.Tensor:
        """``t`` [b, heads, L, d] (or [b, heads, L]) cut to this block's samples and rows."""
        batch = slice(None) if self.sample is None else slice(self.sample, self.sample + 1)
        return t[batch, :, self.q if which == "q" else self.k]

    @property
    def kind(self) -> str:
        """``full`` (every query sees every key), ``causal`` (the lower triangle: the same positions) or ``masked``."""
        nq, nk = self.q.stop - self.q.start, self.k.stop - self.k.start
        near, far = self.offset - (nk - 1), self.offset + nq - 1  # the smallest and largest pos(i) - pos(j)
        within = self.window is None or far <= self.window
        if near >= 0 and within:
            return "full"
        if self.offset == 0 and nq == nk and within:
            return "causal"
        return "masked"

    def visible(self, device: torch.device) -> torch.Tensor:
        """[q rows, k rows] bool: which keys each query sees."""
        d = (self.offset + torch.arange(self.q.stop - self.q.start, device=device).unsqueeze(1)
             - torch.arange(self.k.stop - self.k.start, device=device))
        return (d >= 0) & (d <= self.window) if self.window is not None else d >= 0


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
    rows = tile_rows(b * h * sk * 4)
    return [slice(a, min(a + rows, sq)) for a in range(0, sq, rows)]


def _scores(q_rows: torch.Tensor, k: torch.Tensor, rows: slice, visible: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """fp32 ``q k^T scale`` of a tile of query rows, -inf where ``visible`` [q rows, k rows] (None: all) is False."""
    scores = torch.matmul(q_rows.float(), k.float().transpose(-1, -2)) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible[rows], float("-inf"))
    return scores


def _widened(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` with zero channels appended up to ``width`` (the fused CPU kernel's one width)."""
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


def _fused_mask(block: Block, dtype: torch.dtype, device: torch.device) -> tuple[bool, torch.Tensor | None]:
    """(is_causal, additive mask or None) of the fused kernel for ``block``."""
    kind = block.kind
    if kind != "masked":
        return kind == "causal", None
    mask = torch.zeros(block.q.stop - block.q.start, block.k.stop - block.k.start, dtype=dtype, device=device)
    return False, mask.masked_fill_(~block.visible(device), float("-inf"))


def _plain_mask(block: Block, device: torch.device) -> torch.Tensor | None:
    return None if block.kind == "full" else block.visible(device)


def _dropped(dropout: BlockDropout, block: Block, q: torch.Tensor, rows: slice, keys: int) -> torch.Tensor:
    """fp32 ``keep / (1 - p)`` [b, h, rows, keys] of a tile of the block's query rows (q cut to the block)."""
    samples = range(q.shape[0]) if block.sample is None else range(block.sample, block.sample + 1)
    q_pos = torch.arange(block.q_pos + rows.start, block.q_pos + rows.stop, device=q.device)
    k_pos = torch.arange(block.q_pos - block.offset, block.q_pos - block.offset + keys, device=q.device)
    return dropout.scaled(samples, q.shape[1], q_pos, k_pos)


def kernel_forward(q, k, v, block: Block, scale: float,
                   dropout: BlockDropout | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, h, sq, dv] in q's dtype, lse [b, h, sq] fp32) of one block (q, k, v already cut to it); k, v may
    have fewer heads (groups), v another width than q and k. ``dropout``: the probabilities (normalised over the
    block's keys) dropped by the positional masks (``dropout.py``), in the plain kernel; ``lse`` is the undropped
    one."""
    k, v = _expand_groups(k, q.shape[1]), _expand_groups(v, q.shape[1])
    if _fused(q.device) and dropout is None:
        width = max(q.shape[-1], v.shape[-1])
        causal, mask = _fused_mask(block, q.dtype, q.device)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _widened(q, width), _widened(k, width), _widened(v, width), 0.0, causal, attn_mask=mask, scale=scale)
        return out[..., :v.shape[-1]], lse.float()
    if dropout is None and _flash_on_gpu(q, v, block):
        return _flash_forward(q, k, v, block.kind == "causal", scale)
    return _plain_forward(q, k, v, block, scale, dropout)


def _plain_forward(q, k, v, block: Block, scale: float, dropout: BlockDropout | None):
    visible = _plain_mask(block, q.device)
    out = torch.empty(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for rows in _row_tiles(q, k.shape[2]):
        scores = _scores(q[:, :, rows], k, rows, visible, scale)
        lse[:, :, rows] = torch.logsumexp(scores, dim=-1)
        p = torch.exp(scores - lse[:, :, rows].unsqueeze(-1))
        if dropout is not None:
            p.mul_(_dropped(dropout, block, q, rows, k.shape[2]))
        out[:, :, rows] = torch.matmul(p, v.float()).to(q.dtype)
    return out, lse


def _flash_forward(q, k, v, causal: bool, scale: float):
    """The GPU's FlashAttention-2 forward of a block without a mask (k, v with q's heads): (out, lse fp32)."""
    width = max(q.shape[-1], v.shape[-1])
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        _widened(q, width), _widened(k, width), _widened(v, width), 0.0, causal, False, scale=scale)
    return out[..., :v.shape[-1]], lse.float()


def _flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """Its backward from the rows' final ``out`` and ``lse``: (dq, dk, dv) with q's heads (no dropout: the random
    state the kernel would read is not)."""
    width = max(q.shape[-1], v.shape[-1])
    unused = torch.empty(2, dtype=torch.uint64, device=q.device), torch.empty((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        _widened(dout, width), _widened(q, width), _widened(k, width), _widened(v, width), _widened(out, width),
        lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, *unused, scale=scale)
    return dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]]


def kernel_backward(dout, q, k, v, out, lse, block: Block, scale: float, dropout: BlockDropout | None = None):
    """(dq, dk, dv) of one block given the rows' final ``out`` and ``lse`` (over every key and the sink, not only
    this block's); dk, dv summed over the queries of each group. ``dropout``: the forward's, its masks drawn
    again."""
    groups = k.shape[1]
    k, v = _expand_groups(k, q.shape[1]), _expand_groups(v, q.shape[1])
    if _fused(q.device) and dropout is None:
        dqk, dv_width = q.shape[-1], v.shape[-1]
        width = max(dqk, dv_width)
        causal, mask = _fused_mask(block, q.dtype, q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _widened(dout, width), _widened(q, width), _widened(k, width), _widened(v, width), _widened(out, width),
            lse, 0.0, causal, attn_mask=mask, scale=scale)
        dq, dk, dv = dq[..., :dqk], dk[..., :dqk], dv[..., :dv_width]
    elif dropout is None and _flash_on_gpu(q, v, block):
        dq, dk, dv = _flash_backward(dout, q, k, v, out, lse, block.kind == "causal", scale)
    else:
        dq, dk, dv = _plain_backward(dout, q, k, v, out, lse, block, scale, dropout)
    return dq, _fold_groups(dk, groups), _fold_groups(dv, groups)


def _plain_backward(dout, q, k, v, out, lse, block: Block, scale: float, dropout: BlockDropout | None):
    visible = _plain_mask(block, q.device)
    kf, vf = k.float(), v.float()
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
    for rows in _row_tiles(q, k.shape[2]):
        qf, df = q[:, :, rows].float(), dout[:, :, rows].float()
        p = torch.exp(_scores(qf, kf, rows, visible, scale) - lse[:, :, rows].unsqueeze(-1))
        dp = torch.matmul(df, vf.transpose(-1, -2))
        if dropout is None:
            dv += torch.matmul(p.transpose(-1, -2), df)
        else:  # out = (p z) v: dv from the dropped probabilities, dp through the mask
            z = _dropped(dropout, block, q, rows, k.shape[2])
            dv += torch.matmul((p * z).transpose(-1, -2), df)
            dp.mul_(z)
        ds = p * (dp - (df * out[:, :, rows].float()).sum(-1, keepdim=True))
        dq[:, :, rows] = torch.matmul(ds, kf) * scale
        dk += torch.matmul(ds.transpose(-1, -2), qf) * scale
    return dq, dk, dv


def blocks_forward(q, k, v, blocks: list[Block], scale: float, out: torch.Tensor, lse: torch.Tensor,
                   dropout: BlockDropout | None = None) -> None:
    """Merge the result of ``q`` against the keys of each of ``blocks`` into the running fp32 ``out`` [b, h, L,
    dv] and ``lse`` [b, h, L] (rows no key reached yet: out 0, lse -inf); ``dropout``: see ``kernel_forward``."""
    for block in blocks:
        out_block, lse_block = kernel_forward(block.rows(q, "q"), block.rows(k, "k"), block.rows(v, "k"), block,
                                              scale, dropout)
        merge(block.rows(out, "q"), block.rows(lse, "q"), out_block, lse_block)


def blocks_backward(dout, q, k, v, out, lse, blocks: list[Block], scale: float, dq, dk, dv,
                    dropout: BlockDropout | None = None) -> None:
    """Add each block's gradients into ``dq``, ``dk``, ``dv`` (fp32 accumulators shaped as q, k, v)."""
    for block in blocks:
        gq, gk, gv = kernel_backward(block.rows(dout, "q"), block.rows(q, "q"), block.rows(k, "k"),
                                     block.rows(v, "k"), block.rows(out, "q"), block.rows(lse, "q"), block, scale,
                                     dropout)
        block.rows(dq, "q").add_(gq)
        block.rows(dk, "k").add_(gk)
        block.rows(dv, "k").add_(gv)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a result over other keys into the running (out, lse), in place (fp32): softmax over the union."""
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows no key reached yet stay 0
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - safe).unsqueeze(-1))
    lse.copy_(new)


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Fold each head's sink logit (``sinks`` [h]) into the merged fp32 ``out`` [b, h, L, dv] and ``lse`` [b, h, L],
    in place: the softmax over the keys and the sink, whose value is zero."""
    new = torch.logaddexp(lse, sinks.float().view(1, -1, 1))
    out.mul_(torch.exp(lse - new).unsqueeze(-1))
    lse.copy_(new)


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The gradient of the sinks [h] given the final ``out`` and ``lse`` (after ``apply_sinks``) of these rows."""
    rowdot = (dout.float() * out.float()).sum(-1)  # [b, h, L]
    return -(torch.exp(sinks.float().view(1, -1, 1) - lse) * rowdot).sum((0, 2)).to(sinks.dtype)
