"""Packed documents: where each document of a sample starts, as Megatron-LM's ``--reset-position-ids`` and
``--reset-attention-mask`` see it (its ``_get_ltor_masks_and_position_ids``).

A sample holds several documents, each ended by the end-of-document token. The token after an
end-of-document starts a new document (the end-of-document token belongs to the document it ends):

- ``document_ids``: the index of each token's document within its sample (the number of end-of-document
  tokens before it); attention never crosses from one id to another (``megatron.context_parallel``
  derives its blocks from these ids: no sequence x sequence mask is built);
- ``reset_positions``: each token's position within its document (0 at every document's first token).

The end-of-document token's own loss (predicting the next document's first token) is masked by
``--eod-mask-loss`` (``loader.build_batch``).
"""

from __future__ import annotations

import torch


def document_ids(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """[b, s] -> [b, s]: the number of end-of-document tokens before each token."""
    is_eod = (tokens == eod_id).long()
    return torch.cumsum(is_eod, dim=1) - is_eod


def reset_positions(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """[b, s] -> [b, s]: each token's position counted from the first token of its document."""
    s = tokens.shape[1]
    index = torch.arange(s, device=tokens.device).expand_as(tokens)
    last_eod = torch.where(tokens == eod_id, index, torch.full_like(index, -1)).cummax(dim=1).values
    start = torch.cat([torch.zeros_like(index[:, :1]), last_eod[:, :-1] + 1], dim=1)  # after the last eod before
    return index - start
