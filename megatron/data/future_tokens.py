"""The fields multi-token prediction reads (``megatron.model.mtp``): each token's successors, computed by the
loader from the whole sample (``loader.build_batch``) before a context-parallel split, so no rank needs another's
tokens."""

from __future__ import annotations

import torch

MTP_KEYS = ("mtp_tokens", "mtp_labels", "mtp_loss_mask", "mtp_position_ids")  # [b, s, D] each


def future_fields(fields: dict[str, torch.Tensor], depth: int,
                  document_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``MTP_KEYS`` from a whole batch's ``tokens``, ``labels``, ``loss_mask``, ``position_ids``
    ([b, s]), before any context-parallel split: each shifted left by k = 1..depth (0 past the end), stacked on a
    last dim; the shifted loss mask also 0 where ``document_ids`` (packed documents) differ across the shift."""
    out = {}
    for key, name in zip(("tokens", "labels", "loss_mask", "position_ids"), MTP_KEYS):
        value = fields[key]
        shifted = torch.zeros(*value.shape, depth, dtype=value.dtype)
        for k in range(1, depth + 1):
            shifted[:, :-k, k - 1] = value[:, k:]
            if key == "loss_mask" and document_ids is not None:
                shifted[:, :-k, k - 1] *= (document_ids[:, k:] == document_ids[:, :-k]).to(value.dtype)
        out[name] = shifted
    return out
