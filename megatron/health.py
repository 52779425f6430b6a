"""Run health: when a step that went wrong is tolerated, when the run must stop, what may be saved.

The policy, applied after every optimizer step to values every rank agrees on (the global loss,
and whether the step was applied: the gradient norm and the fp16 overflow check are global):

- A *bad* step is one that was skipped (non-finite gradients) or whose loss is not finite. A
  skip is what mixed precision is for, so one bad step is fine; ``max_consecutive_skipped_steps``
  bad steps in a row stop the run with :class:`TrainingDiverged` (exit status 3). A skip that
  lowered the dynamic fp16 loss scale is the scaler searching for its scale, not divergence, and
  is not counted; a static scale, or a dynamic one at its floor, counts every skip.
- A checkpoint is written only while the last step's loss is finite and no bad steps are
  pending, so a diverged state never replaces (or, through keep-last pruning, deletes) a good
  checkpoint.
- A *loss spike* (a finite loss above ``loss_spike_factor`` x the mean of the previous
  ``SPIKE_WINDOW`` finite losses, once ``SPIKE_MIN_HISTORY`` are known) is a warning with its step.
"""

from __future__ import annotations

import math
from collections import deque

SPIKE_WINDOW = 100
SPIKE_MIN_HISTORY = 10


class TrainingDiverged(RuntimeError):
    """The run has gone wrong beyond what skipping steps can mend; stop every rank, save nothing."""


class RunHealth:
    def __init__(self, max_consecutive_bad: int, spike_factor: float):
        self.max_consecutive_bad = max_consecutive_bad
        self.spike_factor = spike_factor
        self.consecutive_bad = 0
        self.last_loss = math.nan
        self.last_step = 0
        self._history: deque[float] = deque(maxlen=SPIKE_WINDOW)

    def observe(self, step: int, loss: float, applied: bool, scale_lowered: bool = False,
                loss_scale: float | None = None) -> str | None:
        """Record one step; return a warning to log (a loss spike, a bad step), or None.
        Raises TrainingDiverged once too many bad steps came in a row."""
        self.last_loss, self.last_step = loss, step
        finite = math.isfinite(loss)
        if applied and finite:
            self.consecutive_bad = 0
            return self._spike(step, loss)
        if not (scale_lowered and finite):  # a forward that overflowed is not mended by a lower scale
            self.consecutive_bad += 1
        why = "its loss is not finite" if not finite else "its gradients are not finite"
        scale = "" if loss_scale is None else f", loss scale {loss_scale:g}"
        if self.max_consecutive_bad and self.consecutive_bad >= self.max_consecutive_bad:
            raise TrainingDiverged(
                f"training diverged: {self.consecutive_bad} steps in a row up to step {step} were skipped or gave a "
                f"non-finite loss (last loss {loss:g}{scale}); lower the learning rate (or the fp16 loss scale), or "
                f"resume from the last good checkpoint")
        return (f"step {step} skipped: {why} (loss {loss:g}{scale}; {self.consecutive_bad} bad step(s) in a row, "
                f"the run stops at {self.max_consecutive_bad or 'never'})")

    def _spike(self, step: int, loss: float) -> str | None:
        warning = None
        if self.spike_factor and len(self._history) >= SPIKE_MIN_HISTORY:
            mean = sum(self._history) / len(self._history)
            if loss > self.spike_factor * mean:
                warning = (f"loss spike at step {step}: {loss:.6g} is {loss / mean:.1f}x the mean of the previous "
                           f"{len(self._history)} steps ({mean:.6g})")
        self._history.append(loss)
        return warning

    def why_not_save(self) -> str | None:
        """None when the current state may be checkpointed, else the reason it may not."""
        if self.last_step == 0:
            return None
        if not math.isfinite(self.last_loss):
            return f"the loss at step {self.last_step} is {self.last_loss:g}"
        if self.consecutive_bad:
            return f"the last {self.consecutive_bad} step(s) were skipped for non-finite gradients"
        return None
