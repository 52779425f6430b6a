"""Linear warm-up to ``max_lr``, then decay to ``min_lr`` at ``decay_steps``.

With steps numbered from 1 (the first optimizer step is step 1)::

    lr(s) = max_lr * s / warmup_steps                       s <= warmup_steps
    lr(s) = min_lr + (max_lr - min_lr) * f(p),
            p = (s - warmup_steps) / (decay_steps - warmup_steps)   warmup_steps < s < decay_steps
    lr(s) = min_lr                                          s >= decay_steps

with ``f(p) = (1 + cos(pi p)) / 2`` for ``cosine`` (the default), ``1 - p`` for ``linear``,
and ``lr = max_lr`` after warm-up for ``constant``. A pure function of the step, so
resuming needs only the step count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class WarmupDecaySchedule:
    """``lr(step)``: linear warm-up, then ``decay_style`` decay (cosine, linear or constant), as above."""

    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    decay_style: str = "cosine"

    def __post_init__(self) -> None:
        if self.decay_style not in ("cosine", "linear", "constant"):
            raise ValueError(f"unknown decay_style {self.decay_style!r}")

    def __call__(self, step: int) -> float:
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.max_lr * step / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if step >= self.decay_steps:
            return self.min_lr
        progress = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            return self.min_lr + (self.max_lr - self.min_lr) * (1.0 - progress)
        return self.min_lr + (self.max_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
