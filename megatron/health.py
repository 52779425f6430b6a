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
- A run that *ends* (its last step, a stop on a signal or a time limit, data that ran out) with a
  non-finite loss since its last step that trained (applied, finite loss) did not recover from it:
  it stops as a diverged run does (:class:`TrainingDiverged`, exit status 3, ``latest`` back on the
  last good checkpoint), never with exit 0 and a final state that could not be saved. Skips with
  finite losses alone (an fp16 overflow) leave the weights as they were and may end a run.
- A *loss spike* (a finite loss above ``loss_spike_factor`` x the mean of the previous
  ``SPIKE_WINDOW`` finite losses, once ``SPIKE_MIN_HISTORY`` are known) is a warning with its step.
- ``ZERO_GRADIENT_STEPS`` applied steps in a row whose gradient norm is exactly 0 train nothing: one
  warning for the streak (under fp16, a loss scale so small that the scaled gradients underflow,
  a static one above all: it names the scale and how to raise it). A static scale that overflows
  every step is counted as bad steps above and stops the run.
"""

from __future__ import annotations

import math
from collections import deque

SPIKE_WINDOW = 100
SPIKE_MIN_HISTORY = 10
ZERO_GRADIENT_STEPS = 10


class TrainingDiverged(RuntimeError):
    """The run has gone wrong beyond what skipping steps can mend; stop every rank, save nothing."""


class RunHealth:
    def __init__(self, max_consecutive_bad: int, spike_factor: float):
        self.max_consecutive_bad = max_consecutive_bad
        self.spike_factor = spike_factor
        self.consecutive_bad = 0
        self.unrecovered: tuple[int, float] | None = None  # (step, loss): the first non-finite one since a step trained
        self.zero_gradients = 0  # applied steps in a row with a gradient norm of exactly 0
        self.last_loss = math.nan
        self.last_step = 0
        self._history: deque[float] = deque(maxlen=SPIKE_WINDOW)

    def observe(self, step: int, loss: float, applied: bool, scale_lowered: bool = False,
                loss_scale: float | None = None, grad_norm: float | None = None) -> str | None:
        """Record one step; return a warning to log (a loss spike, a bad step, gradients that are all zero), or
        None. Raises TrainingDiverged once too many bad steps came in a row."""
        self.last_loss, self.last_step = loss, step
        finite = math.isfinite(loss)
        if applied and finite:
            self.consecutive_bad, self.unrecovered = 0, None
            spike = self._spike(step, loss)
            self.zero_gradients = self.zero_gradients + 1 if grad_norm == 0 else 0
            return self._zero_gradients(step, loss_scale) if self.zero_gradients == ZERO_GRADIENT_STEPS else spike
        if not finite and self.unrecovered is None:
            self.unrecovered = (step, loss)
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

    @staticmethod
    def _zero_gradients(step: int, loss_scale: float | None) -> str:
        said = f"steps {step - ZERO_GRADIENT_STEPS + 1}-{step} had a gradient norm of 0: nothing trains"
        if loss_scale is None:
            return f"{said}; check that the loss reaches the parameters (is every target masked out?)"
        return (f"{said}; the fp16 loss scale {loss_scale:g} is too small: the scaled gradients underflow to zero in "
                f"fp16; raise it (static: --initial-loss-scale, or drop --no-dynamic-loss-scale; dynamic: "
                f"--min-loss-scale)")

    def _spike(self, step: int, loss: float) -> str | None:
        warning = None
        if self.spike_factor and len(self._history) >= SPIKE_MIN_HISTORY:
            mean = sum(self._history) / len(self._history)
            if loss > self.spike_factor * mean:
                warning = (f"loss spike at step {step}: {loss:.6g} is {loss / mean:.1f}x the mean of the previous "
                           f"{len(self._history)} steps ({mean:.6g})")
        self._history.append(loss)
        return warning

    def why_not_finished(self) -> str | None:
        """None when the run may end here (after its last step, or on a stop), else why: a non-finite loss since
        the last step that trained. (Skips with finite losses alone leave the weights as a finite step left
        them: the run may end, its final save refused while they are pending.)"""
        if self.unrecovered is None:
            return None
        first, loss = self.unrecovered
        steps = f"step {first} did not train (loss {loss:g})" if first == self.last_step else (
            f"steps {first}-{self.last_step} did not train (step {first}'s loss {loss:g}, the last one's "
            f"{self.last_loss:g})")
        return (f"training ended without recovering from a non-finite loss: {steps}; lower the learning rate "
                f"(or the fp16 loss scale), or resume from the last good checkpoint")

    def why_not_save(self) -> str | None:
        """None when the current state may be checkpointed, else the reason it may not."""
        if self.last_step == 0:
            return None
        if not math.isfinite(self.last_loss):
            return f"the loss at step {self.last_step} is {self.last_loss:g}"
        if self.consecutive_bad:
            return f"the last {self.consecutive_bad} step(s) were skipped for non-finite gradients"
        return None


class GoodCheckpoints:
    """Which checkpoint is known good, and keep-last pruning that never deletes it.

    A checkpoint holds the weights *after* its step's update, so the loss logged at that step says
    nothing about it; it is confirmed good once the next step's loss, computed with exactly those
    weights, is finite and that step applied. Pruning keeps the ``keep_last`` newest checkpoints plus
    the newest confirmed one; when the run diverges, ``latest`` is pointed back at the confirmed one,
    so that a plain ``--load`` of the run resumes from weights that trained. Rank 0 acts on disk."""

    def __init__(self, output_dir: str, keep_last: int | None, acts: bool):
        self.output_dir, self.keep_last, self.acts = output_dir, keep_last, acts
        self.good: str | None = None  # the newest checkpoint confirmed good
        self.pending: tuple[int, str] | None = None  # (step, path) saved or loaded, not yet confirmed

    def saved(self, step: int, path: str) -> None:
        self.pending = (step, path)
        self._prune(step)

    def loaded(self, step: int, path: str) -> None:
        self.pending = (step, path)

    def step_done(self, loss: float, applied: bool) -> None:
        if self.pending is not None and applied and math.isfinite(loss):
            step, self.good = self.pending
            self.pending = None
            self._prune(step)

    def _prune(self, step: int) -> None:
        from megatron.checkpoint import prune_checkpoints

        if self.acts and self.keep_last:
            prune_checkpoints(self.output_dir, step, self.keep_last, protect=self.good)

    def after_divergence(self) -> str:
        """Point ``latest`` at the newest good checkpoint when it names an unconfirmed one; say which."""
        from megatron.checkpoint import find_checkpoint, point_latest, same_folder

        if self.good is None:
            return "no checkpoint of this run is known good"
        try:
            latest = find_checkpoint(self.output_dir) if self.acts else None
        except Exception:  # a damaged 'latest' is replaced below
            latest = ""
        if self.acts and latest is not None and not (latest and same_folder(latest, self.good)):
            point_latest(self.output_dir, self.good)
            return f"last good checkpoint: {self.good}, which 'latest' now names again"
        return f"last good checkpoint: {self.good}"
