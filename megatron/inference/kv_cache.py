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

A layer with a sliding window of ``w`` keys (gpt-oss) keeps a rolling cache: after each forward only its last ``w``
slots, all a later query can reach, so its memory is ``w`` slots however long the generation. A forward attends
over those and its own new keys (``store`` returns them in slot order), under the layer's mask (``mask_for``:
causal, within the window, not padding); slot distances are position distances (a row's positions count from its
first real slot), so the window is the same one training used.

A layer without attention (Gated DeltaNet, ``megatron.hybrid``) keeps a state of fixed size per row instead: the last
``width`` rows its convolution reads and the recurrent state (``state_shapes``), whatever the generation's length.
Its slots before ``pad[i]`` are padding: the layer drops the state at each row's first real slot (``slot_documents``),
so a padded row computes what it would alone.
"""

from __future__ import annotations

import torch


class KVCache:
    """The cache of one batch. Usage, per forward of the model: ``begin(s)`` (``s`` new slots),
    then each layer calls ``store`` (through its attention's ``forward``); ``mask`` and ``causal`` say
    how the queries attend."""

    def __init__(self, layers: dict[int, tuple[int, int, int]], batch: int, max_len: int, pad: torch.Tensor,
                 dtype: torch.dtype, device: torch.device, windows: dict[int, int | None] | None = None,
                 states: dict[int, dict[str, tuple[int, ...]]] | None = None):
        """``layers``: per layer number, the (heads, key width, value width) its attention stores
        (``cache_shape``); ``windows``: per layer number, its sliding window (None or absent: full attention);
        ``states``: per layer number of a recurrent layer, each state's shape per row (``state_shapes``: the
        convolution's rows in ``dtype``, the recurrent state in fp32), zero at the start."""
        self.states = {i: {name: torch.zeros(batch, *shape, dtype=dtype if name == "conv" else torch.float32,
                                             device=device) for name, shape in shapes.items()}
                       for i, shapes in (states or {}).items()}
        self.max_len, self.length, self.new = max_len, 0, 0
        # layers whose window is shorter than the generation: a rolling cache of the last ``window`` slots
        self.windows = {i: w for i, w in (windows or {}).items() if w is not None and w + 1 < max_len}
        slots = {i: self.windows.get(i, max_len) for i in layers}
        self.keys = {i: torch.empty(batch, heads, slots[i], kd, dtype=dtype, device=device)
                     for i, (heads, kd, _) in layers.items()}
        self.values = {i: torch.empty(batch, heads, slots[i], vd, dtype=dtype, device=device)
                       for i, (heads, _, vd) in layers.items()}
        self._masks: dict[tuple[int, int | None], torch.Tensor] = {}
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
        self._masks = {}
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
        if layer in self.windows:
            return self._roll(layer, k, v)
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def _kept(self, layer: int) -> int:
        """Slots a rolling layer holds from the forwards before this one."""
        return min(self.length, self.windows[layer])

    def _roll(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A rolling layer: its kept slots and this forward's, in slot order; then only the last ``window`` kept."""
        kept, window = self._kept(layer), self.windows[layer]
        keys = torch.cat([self.keys[layer][:, :, :kept], k], dim=2)
        values = torch.cat([self.values[layer][:, :, :kept], v], dim=2)
        tail = min(window, keys.shape[2])
        self.keys[layer][:, :, :tail] = keys[:, :, -tail:]
        self.values[layer][:, :, :tail] = values[:, :, -tail:]
        return keys, values

    def mask_for(self, layer: int, window: int | None, sinks: bool = False) -> torch.Tensor | None:
        """The mask of ``layer``'s attention in this forward: ``mask`` without a window or sinks, else one built
        for its keys (the rolling ones of a window layer) and window (causal, within the window, not padding; a
        padding query sees itself)."""
        if window is None and not sinks:
            return self.mask
        first = self.length - self._kept(layer) if layer in self.windows else 0
        key = (first, window)
        if key not in self._masks:
            start, end = self.length, self.length + self.new
            query = torch.arange(start, end, device=self.pad.device).view(1, -1, 1)
            slot = torch.arange(first, end, device=self.pad.device).view(1, 1, -1)
            seen = (slot <= query) & (slot >= self.pad.view(-1, 1, 1))
            if window is not None:
                seen &= slot >= query - window
            self._masks[key] = (seen | (slot == query)).unsqueeze(1)  # [b, 1, count, keys]
        return self._masks[key]

    def slot_documents(self, before: int) -> torch.Tensor:
        """[b, before + new]: 1 at the real slots of this forward and the ``before`` slots ahead of it, 0 at
        padding, -1 before slot 0 (a recurrent layer's documents: it drops its state where a row's 0s turn 1)."""
        slots = torch.arange(self.length - before, self.length + self.new, device=self.pad.device).unsqueeze(0)
        return torch.where(slots < 0, -1, (slots >= self.pad.unsqueeze(1)).long())

    def commit(self) -> None:
        """The forward is done: its slots are now part of the sequence."""
        self.length += self.new
        self.new = 0

    def keep(self, rows: torch.Tensor) -> None:
        """Drop every row not in ``rows`` (finished sequences stop costing work)."""
        self.keys = {i: t.index_select(0, rows) for i, t in self.keys.items()}
        self.values = {i: t.index_select(0, rows) for i, t in self.values.items()}
        self.states = {i: {name: t.index_select(0, rows) for name, t in states.items()}
                       for i, states in self.states.items()}
        self.pad = self.pad.index_select(0, rows)
