"""The experts of a mixture-of-experts layer: E MLPs shaped like the model's (GELU or SwiGLU, with the MLP's
interleaved gate/up rows, biases or not), of width ``moe_ffn_hidden_size``, each its own parameters
(``experts.{i}.dense_h_to_4h.weight``, ``experts.{i}.dense_4h_to_h.weight``).

They run one after another on the tokens sorted by expert (``--moe-grouped-gemm`` is accepted: on the CPU a
grouped matmul is this loop). Every expert runs, on no tokens when none reached it, so every expert's
parameters get a gradient every step (zero when idle), as the data-parallel buffers expect.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class Experts(nn.ModuleList):
    """``forward(tokens [N, h] sorted by expert, counts [E] (ints summing to N), capacity)`` -> [N, h]: expert i's
    output on its ``counts[i]`` rows. ``capacity`` (``moe_pad_expert_input_to_capacity``): each expert computes
    on exactly that many rows, its tokens padded with zero rows (their outputs discarded)."""

    def __init__(self, num_experts: int, make_expert: Callable[[], nn.Module]):
        super().__init__(make_expert() for _ in range(num_experts))

    def forward(self, tokens: torch.Tensor, counts: list[int], capacity: int | None = None) -> torch.Tensor:
        outputs = []
        for expert, rows in zip(self, tokens.split(counts)):
            if capacity is not None and rows.shape[0] < capacity:
                padded = torch.cat([rows, rows.new_zeros(capacity - rows.shape[0], rows.shape[1])])
                outputs.append(expert(padded)[: rows.shape[0]])
            else:
                outputs.append(expert(rows))
        return torch.cat(outputs) if outputs else tokens
