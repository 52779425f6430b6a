"""The key/value cache of a batch of sequences being generated, and the attention mask that goes
with it.

One pair of tensors per layer, keys ``[b, heads, max_len, key_width]`` and values ``[b, heads, max_len,
value_width]`` (the layout ``scaled_dot_product_attention`` reads without a copy), allocated once for the batch
and the longest sequence. The shapes are each layer's attention's (its ``cache_shape``): ``SelfAttention``'s
key/value heads on this tensor-parallel rank (num_query_groups under grouped-query attention, whose query heads
share them, else the attention heads) of ``head_dim`` both; multi-latent attention's heads with keys of
``qk_head_dim + qk_pos_emb_head_dim`` and values of ``v_head_dim`` channels. Keys are stored after the rotary
embedding. Slot ``t`` of
every row holds the same step of the generation: prompts are **left-padded** to the longest, so
the prompts end together and every step writes one slot for all rows. Row ``i`` starts at slot
``pad[i]``; its position ids count from there, so a padded row sees exactly what it would see alone.

The attention mask lets query slot ``q`` see key slots ``<= q`` that are not padding; a padding
query sees itself only (a row with nothing to attend to would give NaN, and NaN in a padding slot's
value would reach the real tokens through the masked-out product ``0 * NaN``). Without padding the
mask is not built: the prompt uses the causal kernel and a one-token step sees every key.
"""

from __future__ import annotations

import torch


class KVCache:
    """The cache of one batch. Usage, per forward of the model: ``begin(s)`` (``s`` new slots),
    then each layer calls ``store`` (through its attention's ``forward``); ``mask`` and ``causal`` say
    how the queries attend."""

    def __init__(self, layers: dict[int, tuple[int, int, int]], batch: int, max_len: int, pad: torch.Tensor,
                 dtype: torch.dtype, device: torch.device):
        """``layers``: per layer number, the (heads, key width, value width) its attention stores
        (``cache_shape``)."""
        self.max_len, self.length, self.new = max_len, 0, 0
        self.keys = {i: torch.empty(batch, heads, max_len, kd, dtype=dtype, device=device)
                     for i, (heads, kd, _) in layers.items()}
        self.values = {i: torch.empty(batch, heads, max_len, vd, dtype=dtype, device=device)
                       for i, (heads, _, vd) in layers.items()}
        self.pad = pad.to(device=device, dtype=torch.long)  # [b] left-padding slots per row
        self.mask: torch.Tensor | None = None
        self.causal = True

    @property
    def batch(self) -> int:
        return int(self.pad.numel())

    def positions(self, start: int, count: int) -> torch.Tensor:
        """Position ids [b, count] of slots ``start .. start+count-1`` (0 on padding)."""
        slots = torch.arange(start, start + count, device=self.pad.device)
        return (slots.unsqueeze(0) - self.pad.unsqueeze(1)).clamp_(min=0)

    def begin(self, count: int) -> None:
        """The next forward writes ``count`` slots after those already filled."""
        if self.length + count > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} positions; {self.length} are used and {count} "
                             f"more were asked for.")
        self.new = count
        start, end = self.length, self.length + count
        if not bool((self.pad > 0).any()):  # no padding among the keys: the kernels' own rules suffice
            self.mask, self.causal = None, count > 1
            return
        query = torch.arange(start, end, device=self.pad.device).view(1, -1, 1)
        key = torch.arange(end, device=self.pad.device).view(1, 1, -1)
        real_key = key >= self.pad.view(-1, 1, 1)
        self.mask = ((key <= query) & real_key | (key == query)).unsqueeze(1)  # [b, 1, count, end]
        self.causal = False

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's keys [b, heads, count, key_width] and values [b, heads, count, value_width] of
        ``layer``; returns every key and value so far [b, heads, length + count, width] (views of the cache)."""
        start, end = self.length, self.length + self.new
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def commit(self) -> None:
        """The forward is done: its slots are now part of the sequence."""
        self.length += self.new
        self.new = 0

    def keep(self, rows: torch.Tensor) -> None:
        """Drop every row not in ``rows`` (finished sequences stop costing work)."""
        self.keys = {i: t.index_select(0, rows) for i, t in self.keys.items()}
        self.values = {i: t.index_select(0, rows) for i, t in self.values.items()}
        self.pad = self.pad.index_select(0, rows)
