"""The largest attention logit of each head, for QK-clip (MuonClip, ``megatron.optimizer.qk_clip``): what Megatron
Core reads from Transformer Engine's kernels (``return_max_logit``), computed here in a separate pass over the same
blocks the softmax covers, only for a layer that tracks it (``--qk-clip`` / ``--log-max-attention-logit``).

The logit of query i and key j is ``q_i . k_j x scale``, with the softmax's own scale (``1 / sqrt(dk)``, or
multi-latent attention's with YaRN's mscale), before anything is added or masked; a head's maximum is taken over
the keys its queries see: causal, within the sliding window and within each packed document, as the plan's
blocks say (``plan.py``). Masked positions never count (Transformer Engine fills them with -10000 or skips them
before its maximum), nor do attention sinks (a sink's logit is a parameter, not a q.k). Per head ``h`` of this
rank::

    max_logits[h] = max over (sample, query i, key j seen by i) of fp32(q[h, i] . k[g(h), j]) x scale

``g(h) = h // (nq / ng)``: the key group a query head reads (grouped-query attention). The products accumulate in
fp32 (on a GPU in bf16 / fp16 through the kernel's fp32 output, ``torch.bmm(out_dtype=)``); a tile of query rows at
a time, so that the scores held at once stay under ``tiling.MATH_TILE_BYTES`` whatever the length. Nothing is kept
for the backward; the fused attention kernels are not touched.

A layer's running maximum (``observe``) is a [heads on this rank] fp32 tensor, -inf where nothing was seen, kept
over the micro-batches of a step and over the context-parallel exchange's steps (each rank: its queries against
every key they see; the maximum over the sequence is the maximum over the cp ranks, taken with the data-parallel
one after the step).
"""

from __future__ import annotations

import torch

from megatron.attention.blocks import Block
from megatron.attention.tiling import tile_rows


def block_max_logits(q: torch.Tensor, k: torch.Tensor, blocks: list[Block], scale: float) -> torch.Tensor:
    """q [b, nq, Lq, dk], k [b, ng, Lk, dk] (ng divides nq) -> [nq] fp32: each head's largest ``q . k x scale`` over
    the query-key pairs ``blocks`` make visible (-inf for a head no block reaches)."""
    b, heads, _, width = q.shape
    groups = k.shape[1]
    per_group = heads // groups
    best = torch.full((heads,), float("-inf"), dtype=torch.float32, device=q.device)
    with torch.no_grad():
        for block in blocks:
            qb, kb = block.rows(q, "q"), block.rows(k, "k")
            samples, keys = qb.shape[0], kb.shape[2]
            visible = None if block.kind == "full" else block.visible(q.device)
            k3 = kb.reshape(samples * groups, keys, width).transpose(1, 2)  # [b g, dk, Lk]
            rows_per_tile = tile_rows(samples * heads * keys * 4)
            for start in range(0, qb.shape[2], rows_per_tile):
                rows = slice(start, min(start + rows_per_tile, qb.shape[2]))
                tile = qb[:, :, rows]
                n = tile.shape[2]
                scores = _fp32_bmm(tile.reshape(samples * groups, per_group * n, width), k3)
                scores = scores.view(samples, groups, per_group, n, keys)
                if visible is not None:
                    scores.masked_fill_(~visible[rows], float("-inf"))
                torch.maximum(best, scores.amax(dim=(0, 3, 4)).reshape(heads), out=best)
    # fl(x scale) is monotonic in x: the scale applied to the maxima equals the maximum of the scaled logits
    return best * scale


def _fp32_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` accumulated and returned in fp32; bf16 / fp16 on a GPU through the kernel's fp32 output (its speed,
    no rounding of the products to the inputs' dtype)."""
    if a.device.type == "cuda" and a.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def observe(running: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, blocks: list[Block],
            scale: float) -> None:
    """Fold the maxima of ``blocks`` (``block_max_logits``) into ``running`` [nq] in place (None: not tracked)."""
    if running is not None and blocks:
        torch.maximum(running, block_max_logits(q, k, blocks, scale), out=running)


def running_max_logits(module, q: torch.Tensor) -> torch.Tensor | None:
    """An attention layer's running maximum for this forward: ``module.max_logits`` ([module.num_heads] fp32 on q's
    device, created at -inf when the step's first forward comes), or None when the layer does not track it
    (``module.tracks_max_logits`` False) or is not training (evaluation and generation are not counted)."""
    if not (module.tracks_max_logits and module.training):
        return None
    if module.max_logits is None:
        module.max_logits = torch.full((module.num_heads,), float("-inf"), dtype=torch.float32, device=q.device)
    return module.max_logits
