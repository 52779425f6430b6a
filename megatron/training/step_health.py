"""Run health after each step (the policy is ``megatron.health``): a skipped step or a loss spike is a
warning; too many bad steps in a row stop the run, and so does a run that ends inside non-finite losses."""

from __future__ import annotations

from collections.abc import Callable

from megatron.config import Config
from megatron.health import RunHealth, TrainingDiverged
from megatron.metrics import get_logger
from megatron.optimizer import MixedPrecisionOptimizer, StepResult


class StepHealth:
    def __init__(self, config: Config, optimizer: MixedPrecisionOptimizer, logs: bool):
        self.policy = RunHealth(config.max_consecutive_skipped_steps, config.loss_spike_factor)
        self.optimizer, self.logs = optimizer, logs
        self.scale_before = optimizer.loss_scale

    def before_step(self) -> None:
        self.scale_before = self.optimizer.loss_scale

    def after_step(self, step: int, loss: float, result: StepResult, last_good: Callable[[], str]) -> None:
        """Raise TrainingDiverged (the same on every rank: the loss and the skip are global) after too many bad
        steps in a row, naming the last good checkpoint (``last_good()``)."""
        scale = self.optimizer.loss_scale if self.optimizer.grad_scaler else None
        lowered = scale is not None and scale < self.scale_before
        try:
            warning = self.policy.observe(step, loss, result.applied, lowered, scale, result.grad_norm)
        except TrainingDiverged as err:
            raise TrainingDiverged(f"{err} ({last_good()})") from None
        if warning and self.logs:
            get_logger().warning(warning)

    def at_end(self, last_good: Callable[[], str]) -> None:
        """The run ends here (its last step, or a stop): raise TrainingDiverged, on every rank, when it did not
        recover from a non-finite loss (``RunHealth.why_not_finished``), naming the last good checkpoint."""
        why = self.policy.why_not_finished()
        if why is not None:
            raise TrainingDiverged(f"{why} ({last_good()})")

    def why_not_save(self) -> str | None:
        return self.policy.why_not_save()
