"""How many steps this run takes: max_steps (or train_samples' steps), unless the training data holds fewer
global batches. That is said at start, with the learning rate it leaves above min_lr, rather than discovered
when the loop stops early."""

from __future__ import annotations

from megatron.config import Config
from megatron.config.batch_schedule import BatchSchedule, train_steps
from megatron.metrics import get_logger
from megatron.optimizer.lr_schedule import OptimizerParamSchedule


def samples_per_epoch(dataset) -> int:
    return getattr(dataset, "samples_per_epoch", len(dataset))


def steps_of_run(config: Config, batches: BatchSchedule, schedule: OptimizerParamSchedule, train_ds,
                 warns: bool) -> tuple[int, int]:
    """(steps this run can take, steps asked for); ``warns``: this rank says why they differ."""
    c = config
    planned = train_steps(c, batches)
    steps = min(planned, batches.steps_within(len(train_ds)))
    if steps >= planned or not warns:
        return steps, planned
    log = get_logger()
    if c.num_train_epochs is None:
        held, fix = f"the training data holds {len(train_ds)} samples, which gives", "add data"
    else:
        held = (f"the training data holds {samples_per_epoch(train_ds)} samples per epoch: num_train_epochs "
                f"({c.num_train_epochs}) gives")
        fix = "raise num_train_epochs or add data"
    size = "the batch-size schedule" if batches.varies else f"global batch {batches.final}"
    asked = (f"max_steps ({c.max_steps})" if c.train_samples is None
             else f"the {planned} steps of train_samples ({c.train_samples})")
    log.warning(f"{held} {steps} steps of {size}, fewer than {asked}; training stops at step {steps} ({fix})")
    lr, reached = c.optimizer.lr, batches.consumed_after(steps)
    if reached < schedule.decay and lr.decay_style != "constant":
        decay, fix = ((f"decay_steps ({lr.decay_steps})", f"--decay-steps {steps}") if c.train_samples is None
                      else (f"decay_samples ({lr.decay_samples})", f"--lr-decay-samples {reached}"))
        log.warning(f"training stops at step {steps}, before {decay}: the learning rate will not reach "
                    f"min_lr ({lr.min_lr:g}); set {fix} to decay it fully")
    return steps, planned
