"""The run's checkpoints: what it loads at start, when it saves (every ``save_steps``, on a stop, at the end),
and never a state the run's health forbids. With ``async_save`` a save's files are written by a background
thread (``megatron/checkpoint/async_save.py``) and the save is sealed at a later step boundary; the next save,
a stop, a divergence stop and the end of training wait for it. Each save's cost (how long training was
blocked, how long until the checkpoint was sealed) is logged and handed to ``report``."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from megatron import moe, watchdog
from megatron.checkpoint import (
    CheckpointError,
    check_output_dir,
    claim_output_dir,
    load_checkpoint,
    same_folder,
    save_checkpoint,
)
from megatron.checkpoint.async_save import AsyncSaver
from megatron.checkpoint.ownership import Start
from megatron.config import Config
from megatron.data import fingerprint
from megatron.health import GoodCheckpoints
from megatron.metrics import get_logger
from megatron.parallel_state import ParallelState
from megatron.parallelize_gpt import ParallelModel
from megatron.training.step import TrainState
from megatron.training.step_health import StepHealth


class CheckpointCadence:
    def __init__(self, config: Config, run: ParallelModel, ps: ParallelState, device: torch.device,
                 state: TrainState, health: StepHealth, datasets: tuple = ()):
        self.config, self.run, self.ps, self.state, self.health, self.device = config, run, ps, state, health, device
        self.datasets = datasets  # (train, valid, test): their content is recorded with each checkpoint
        sl = config.save_load
        self.good = GoodCheckpoints(sl.output_dir, sl.keep_last_checkpoints, ps.rank == 0)
        self.saved_at = 0  # the step of the last checkpoint saved (or refused) or loaded
        self.run_id = None  # the run's id (rank 0, which writes it into every checkpoint), set by load()
        self.log = get_logger()
        self.saver = AsyncSaver(device) if sl.async_save else None
        self.since_save: list[tuple[float, bool]] = []  # the steps after a pending save: they confirm it once sealed
        self.report: Callable[[int, float, float], None] | None = None  # (save step, blocked s, total s): StepLog's
        self.rerun_state: list | None = None  # the loaded checkpoint's rerun marker (every rank's), if any
        self.rerun_same_layout = True  # whether that checkpoint was saved under this run's layout
        saves = bool(sl.save_at_end or sl.save_steps or sl.exit_interval or sl.exit_duration_in_mins)
        check_output_dir(sl.output_dir, ps.rank, device, saves)  # a bad --save stops every rank now, in one line

    def load(self) -> int | None:
        """Load ``--load`` on every rank, if given; the step the run continues from (None: it starts afresh or
        fine-tunes). A run whose --load is its own --save folder and holds no checkpoint yet starts from scratch
        (0). Then the output folder is claimed for this run (refused if it holds another one). Writes nothing
        before that claim: a failure leaves no trace."""
        sl = self.config.save_load
        loaded = self._load()
        start = Start(sl.output_dir, sl.ckpt_dir, loaded and loaded["path"], loaded and loaded.get("run_id"),
                      sl.finetune)
        self.run_id = claim_output_dir(start, self.ps.rank, self.device, sl.overwrite_output_dir, sl.tensorboard_dir)
        if not sl.ckpt_dir or sl.finetune:
            return None
        return self.state.step

    def _load(self) -> dict | None:
        sl, s = self.config.save_load, self.state
        if not sl.ckpt_dir:
            return None
        loaded = load_checkpoint(sl.ckpt_dir, self.run.model, self.run.optimizer, self.ps, self.config,
                                 load_optim=sl.load_optim and not sl.finetune, load_rng=sl.load_rng and not sl.finetune,
                                 fresh_if_empty=same_folder(sl.ckpt_dir, sl.output_dir))
        if loaded is None:
            if self.ps.rank == 0:
                self.log.info(f"no checkpoint in {sl.ckpt_dir}: starting from scratch")
            return None
        if loaded.get("moe_expert_bias"):  # a MoE router's expert bias: no parameter, kept in the train state
            moe.set_expert_biases(self.run.model, loaded["moe_expert_bias"])
        if not sl.finetune:
            self._check_same_data(loaded)
            s.step, s.consumed_samples, s.skipped_steps = (loaded["step"], loaded["consumed_samples"],
                                                           loaded["skipped_steps"])
            gbs = self.config.batch_size.global_batch_size  # a checkpoint from before batch-size schedules: its
            s.schedule_samples = loaded.get("schedule_samples", (s.step - s.skipped_steps) * gbs)  # applied steps
            self.saved_at = s.step
        self.good.loaded(loaded["step"], loaded["path"])
        self.rerun_state, self.rerun_same_layout = loaded.get("rerun_state"), loaded["same_layout"]
        if self.ps.rank == 0:
            how = "weights only (finetune)" if sl.finetune else f"resuming at step {s.step}"
            layout = "" if loaded["same_layout"] else ", resharded from another parallel layout"
            self.log.info(f"loaded checkpoint {loaded['path']}: {how}{layout}")
        return loaded

    def _check_same_data(self, loaded: dict) -> None:
        """A resume continues the saved run's data position: on other data (by content: a copy elsewhere is the
        same data) that position means nothing, so it is one line on every rank (the fingerprints are agreed at
        start), unless ``override_data_order`` says so on purpose."""
        if self.config.save_load.override_data_order or not loaded["step"]:
            return
        differs = fingerprint.compare(loaded.get("data_fingerprint"), fingerprint.of_datasets(self.datasets))
        if differs is not None:
            raise CheckpointError(f"cannot resume {loaded['path']}: {differs}; or pass --override-data-order to "
                                  f"train on this data from step {loaded['step']} on.")

    def save(self, rerun_state: list | None = None) -> None:
        """Checkpoint the current state, unless the run's health forbids it (a non-finite loss, or skips
        pending): a diverged state must never replace, or through pruning delete, a good checkpoint.
        ``rerun_state``: every rank's rerun state machine, the marker of a step to re-run from this checkpoint."""
        s = self.state
        self.saved_at = s.step  # attempted: a refused save is not tried again at this step
        refused = self.health.why_not_save()
        if refused is not None:
            if self.ps.rank == 0:
                self.log.warning(f"not saving a checkpoint at step {s.step}: {refused}")
            return
        watchdog.beat(f"saving the checkpoint of step {s.step}")
        fingerprint.verify_unchanged(self.datasets)  # every rank: never record data the run did not train on
        train_state = {"consumed_samples": s.consumed_samples, "skipped_steps": s.skipped_steps,
                       "schedule_samples": s.schedule_samples, "run_id": self.run_id,
                       "data_fingerprint": fingerprint.of_datasets(self.datasets)}
        if rerun_state is not None:
            train_state["rerun_state"] = rerun_state
        biases = moe.expert_biases(self.run.model, self.run.pp_group)  # collective over the pipeline stages
        if biases is not None:
            train_state["moe_expert_bias"] = biases
        began = time.perf_counter()
        if self.saver is None:
            path = save_checkpoint(self.config.save_load.output_dir, s.step, self.run.model, self.run.optimizer,
                                   self.ps, self.config, train_state)
            self._saved(s.step, path, *[time.perf_counter() - began] * 2)
        else:
            self.finish_pending()  # the next save waits for the previous one
            self.saver.begin(self.config.save_load.output_dir, s.step, self.run.model, self.run.optimizer, self.ps,
                             self.config, train_state)
            self.since_save = []
        watchdog.beat(f"after saving the checkpoint of step {s.step}")

    def finish_pending(self) -> None:
        """Wait for a pending asynchronous save and seal it (collective; nothing when none is pending)."""
        if self.saver is not None and self.saver.pending is not None:
            watchdog.beat(f"finishing the checkpoint of step {self.saver.pending.save.step}")
            self._saved(*self.saver.finish())

    def _saved(self, step: int, path: str, blocked_s: float, total_s: float) -> None:
        """A checkpoint is sealed: it awaits confirmation by the steps trained since it (pruned here, and again
        once confirmed), and its cost is said."""
        self.good.saved(step, path)
        for loss, applied in self.since_save if self.saver is not None else ():
            self.good.step_done(loss, applied)
        self.since_save = []
        if self.ps.rank == 0:
            self.log.info(f"saved checkpoint {path} (training blocked {blocked_s:.3f} s; sealed after "
                          f"{total_s:.3f} s)")
        if self.report is not None:
            self.report(step, blocked_s, total_s)

    def after_step(self, loss: float, applied: bool) -> None:
        """A step is done: it confirms the checkpoint before it (when it trained), and one is due every
        ``save_steps``."""
        self.good.step_done(loss, applied)
        if self.saver is not None and self.saver.pending is not None:
            self.since_save.append((loss, applied))
            if self.saver.poll():  # every rank's write is done: seal it now
                self.finish_pending()
        every = self.config.save_load.save_steps
        if every and self.state.step % every == 0:
            self.save()

    def on_stop(self, reason: str) -> None:
        """The run stops early (a signal or a limit): keep this step, unless it was just saved."""
        if self.ps.rank == 0:
            self.log.warning(f"{reason}: saving at step {self.state.step} and exiting")
        if self.saved_at != self.state.step:
            self.save()
        self.finish_pending()

    def at_end(self) -> None:
        """Training is over: keep the trained model (Megatron-LM's --save), unless this step was just saved."""
        if self.config.save_load.save_at_end and self.saved_at != self.state.step:
            self.save()
        self.finish_pending()

    def before_rerun_exit(self, rerun_state: list | None) -> None:
        """The rerun state machine stops the run before a step's update: save the state before that step (with the
        machine's marker when the step is to be re-run from it), sealed before the exit."""
        if self.ps.rank == 0:
            self.log.warning(f"saving the checkpoint of step {self.state.step} for the rerun state machine")
        self.save(rerun_state)
        self.finish_pending()

    def after_divergence(self) -> str:
        self.finish_pending()  # sealed, then 'latest' is pointed back at the last good one if it is unconfirmed
        return self.good.after_divergence()

    def close(self) -> None:
        """The run ends, however: a save still pending (the run raised) is dropped, unsealed."""
        if self.saver is not None:
            self.saver.close()
