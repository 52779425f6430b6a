"""The Trainer: the run as a recipe, read top to bottom. Each part has one job and its own module:

- ``step.py``          one optimizer step, one evaluation (the model made ready: ``megatron.parallelize_gpt``)
- ``checkpointing.py`` what is loaded at start, when a checkpoint is written, which is known good
- ``step_health.py``   a skipped step or a loss spike warned about; too many bad steps, or a run that ends
                       inside non-finite losses, stop it (exit 3)
- ``stopping.py``      SIGTERM / SIGUSR1 / Ctrl-C and the time limits, agreed by every rank
- ``step_log.py``      the log line, metrics.jsonl / TensorBoard / W&B, evaluation results, elapsed and ETA
- ``run_length.py``    how many steps the run takes (and why fewer than asked)
- ``profiler.py``      ``--profile``: PyTorch's profiler over a window of steps, its trace beside the run
- ``rerun.py``         ``--rerun-mode``: a step whose result fails a check re-run to diagnose it (exit 16 / 17)
"""

from __future__ import annotations

import torch

from megatron import parallel_state, watchdog
from megatron.config import Config
from megatron.config.batch_schedule import build_batch_schedule
from megatron.data.token_check import check_batch
from megatron.distributed.parallelize import ShardingPlan
from megatron.metrics import get_logger
from megatron.optimizer import StepResult, build_param_schedule, decoupled_schedule, mup_schedule
from megatron.optimizer.qk_clip import QKClip
from megatron.parallelize_gpt import parallelize_gpt
from megatron.pipeline_parallel.schedules import ForwardStep
from megatron.training.checkpointing import CheckpointCadence
from megatron.training.profiler import StepProfiler
from megatron.training.rerun import RerunExit, State, build_rerun_machine, gather_json
from megatron.training.run_length import steps_of_run
from megatron.training.step import TrainState, data_loader, evaluate, to_device, train_step
from megatron.training.step_health import StepHealth
from megatron.training.step_log import StepLog
from megatron.training.stopping import StopRequests


class Trainer:
    """Holds what the loop needs; ``run()`` trains, evaluates and tests."""

    def __init__(self, config: Config, model: torch.nn.Module, forward_step: ForwardStep, datasets: tuple,
                 device: torch.device, plan: ShardingPlan | None = None):
        self.config, self.forward_step, self.device = config, forward_step, device
        self.train_ds, self.valid_ds, self.test_ds = datasets
        self.ps = parallel_state.get()
        self.parallel = parallelize_gpt(config, device, plan, model)  # buffer, hooks, optimizer, schedule
        self.optimizer = self.parallel.optimizer
        self.schedule = build_param_schedule(config)  # lr and weight decay by samples of applied steps
        self.decoupled = decoupled_schedule(config, self.schedule)  # the embedding's and head's (--decoupled-lr)
        self.mup = mup_schedule(config, self.schedule)  # muP's scaled parameters' (--use-mup)
        self.batches = build_batch_schedule(config)  # the global batch by consumed samples
        self.qk_clip = QKClip.of(config)  # --qk-clip / --log-max-attention-logit: after each update
        self.state = TrainState()
        self.health = StepHealth(config, self.optimizer, logs=self.ps.rank == self.ps.world_size - 1)
        self.checkpoints = CheckpointCadence(config, self.parallel, self.ps, device, self.state, self.health, datasets)
        self.rerun = build_rerun_machine(config.rerun, self.ps.rank, device)
        resume_step = self.checkpoints.load()
        self._resume_rerun()
        self.step_log = StepLog(config, self.ps, device, self.optimizer, self.batches, self.train_ds, self.state,
                                resume_step)
        self.checkpoints.report = self.step_log.save_done  # each save's cost: metrics.jsonl, TensorBoard, W&B
        self.stops = StopRequests(config, device, self.ps.world_size)
        self.profiler = StepProfiler(config, self.ps.rank, device)
        self.log = get_logger()

    def run(self) -> TrainState:
        """Train, evaluate and test with this rank's hang watchdog armed (megatron/watchdog.py) and the stop
        signals handled, both undone however the loop ends, so that neither outlives it in an in-process
        caller."""
        watchdog.start(self.config.watchdog_timeout_minutes, self.config.save_load.output_dir, self.ps.rank,
                       f"training step {self.state.step + 1}")
        finished = False
        try:
            with self.stops.handled():
                state, finished = self._train(), True
            return state
        finally:
            self.profiler.close()  # a run that raised inside the profiled steps: their trace still written
            self.checkpoints.close()  # a save still pending when the run raised is never sealed
            watchdog.stop()
            self.step_log.close(exit_code=0 if finished else 1)  # a run that raised: its W&B run is marked failed

    def _train(self) -> TrainState:
        c, s = self.config, self.state
        last_step, planned_steps = steps_of_run(c, self.batches, self.schedule, self.train_ds, self.ps.rank == 0)
        asked = f"max_steps {c.max_steps}" if c.train_samples is None else f"train_samples {c.train_samples}"
        if s.step >= last_step:  # a finished run launched again: evaluating again would log its results twice
            if self.ps.rank == 0:
                self.log.warning(f"nothing to train: the run is at step {s.step} and stops at step {last_step}; "
                                 f"raise {asked.split()[0]} to train further")
            return s
        loader = iter(data_loader(c, self.ps, self.train_ds, s.consumed_samples, c.dataset.num_workers, self.batches))
        self.step_log.start(last_step)
        while s.step < last_step:
            watchdog.beat(f"training step {s.step + 1}")
            self.profiler.before_step(s.step)
            self.step_log.step_started()
            batch = next(loader)
            if c.model.vocab_size:
                check_batch(batch, c.model.vocab_size)  # on the CPU tensors: no synchronisation with the device
            batch = to_device(batch, self.device)
            self.step_log.batch_ready()
            loss, result = self._step(batch)
            self.health.after_step(s.step, loss, result, self.checkpoints.after_divergence)
            self.checkpoints.after_step(loss, result.applied)
            stop = self.stops.agreed(s.step)
            if stop:
                self.profiler.close()
                self.health.at_end(self.checkpoints.after_divergence)  # a stop inside non-finite losses: exit 3
                self.checkpoints.on_stop(stop)
                break
            if s.step % c.eval_freq == 0 and s.step < last_step:
                self.evaluate("valid", self.valid_ds)
        else:
            self.profiler.close()  # a window past the run's last step ends with it (not the final save)
            if last_step < planned_steps and self.ps.rank == 0:
                epochs = "" if c.num_train_epochs is None else f" (num_train_epochs {c.num_train_epochs})"
                self.log.warning(f"stopped at step {s.step} of {asked}: the training data ran out{epochs}")
            self.health.at_end(self.checkpoints.after_divergence)  # never exit 0 inside non-finite losses
            self.checkpoints.at_end()
            self.evaluate("valid", self.valid_ds)
            self.evaluate("test", self.test_ds)
        return s

    def _step(self, batch: dict) -> tuple[float, StepResult]:
        """One optimizer step on the global batch the schedule gives at this point, and its bookkeeping."""
        c, s, p = self.config, self.state, self.parallel
        global_batch = self.batches(s.consumed_samples)  # the loader's size for this step
        s.step += 1
        lr, wd = self.schedule.lr(s.schedule_samples), self.schedule.weight_decay(s.schedule_samples)
        if self.decoupled is not None:
            self.optimizer.decoupled_lr = self.decoupled.lr(s.schedule_samples)
        if self.mup is not None:
            self.optimizer.mup_lr = self.mup.lr(s.schedule_samples)
        self.health.before_step()
        try:
            loss, result = train_step(self.forward_step, batch, p.model, p.buffer, self.optimizer, lr,
                                      c.batch_size.micro_batch_size, p.dp_group, p.forward_backward, p.pp_group,
                                      weight_decay=wd, rerun=self.rerun, step=s.step, qk_clip=self.qk_clip)
        except RerunExit as leave:
            s.step -= 1  # not applied: the state is the one before this step
            if leave.checkpoint:  # the marker when the step is to be re-run from it (every rank's state)
                marked = self.rerun.state == State.WILL_RERUN_FROM_CHECKPOINT
                self.checkpoints.before_rerun_exit(gather_json(self.rerun.state_dict()) if marked else None)
            raise
        s.consumed_samples += global_batch
        s.schedule_samples += global_batch if result.applied else 0  # Megatron: only a successful update
        s.skipped_steps += 0 if result.applied else 1
        s.losses.append(loss)
        self.step_log.step_done(loss, lr, result, global_batch)
        return loss, result

    def _resume_rerun(self) -> None:
        """A checkpoint saved for a re-run (exit 16): the first step re-runs the one it was saved before, under the
        same layout only (the state is each rank's)."""
        saved = self.checkpoints.rerun_state
        if saved is None:
            return
        if not self.checkpoints.rerun_same_layout or len(saved) != self.ps.world_size:
            if self.ps.rank == 0:
                self.log.warning("Job sharding has changed: Rerun state will be ignored")
            return
        try:
            self.rerun.load_state_dict(saved[self.ps.rank])
        except (KeyError, TypeError, ValueError, IndexError) as err:
            self.log.warning(f"Unable to restore RerunMachine from checkpoint: {err!r}. Skipping.")

    def evaluate(self, split: str, dataset) -> None:
        """``eval_iters`` global batches of ``dataset`` (``eval_global_batch_size`` samples each; none when it holds
        fewer than one)."""
        c, p = self.config, self.parallel
        batch = c.eval_global_batch_size or c.batch_size.global_batch_size
        if dataset is None or len(dataset) < batch or c.eval_iters == 0:
            return
        loss = evaluate(self.forward_step, data_loader(c, self.ps, dataset, batches=batch), p.model,
                        c.batch_size.micro_batch_size,
                        c.eval_iters, self.device, p.dp_group, p.forward_backward, p.pp_group, c.model.vocab_size)
        self.step_log.evaluation(split, loss)
