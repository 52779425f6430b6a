"""The training loop: train step, evaluation, the log line and metrics. No model code here.

``pretrain()`` is the whole run; ``pretrain_gpt.py`` supplies what is GPT-specific (the model
provider, the datasets provider and ``forward_step``), as in Megatron-LM.
"""

from __future__ import annotations

import math
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from megatron import device as dev
from megatron import parallel_state, watchdog
from megatron.checkpoint import (
    CheckpointError,
    check_output_dir,
    load_checkpoint,
    on_every_rank,
    same_folder,
    save_checkpoint,
)
from megatron.config import Config
from megatron.config.batch_schedule import build_batch_schedule, train_steps
from megatron.data.loader import build_loader, split_micro_batches
from megatron.distributed.data_parallel import DataParallel
from megatron.distributed.finalize_grads import finalize_model_grads
from megatron.distributed.parallelize import ShardingPlan, parallelize, plan_sharding
from megatron.distributed.param_and_grad_buffer import ParamAndGradBuffer
from megatron.health import GoodCheckpoints, RunHealth, TrainingDiverged
from megatron.metrics import (
    MetricsWriter,
    WandbError,
    format_duration,
    format_log_line,
    get_logger,
    model_flops_per_token,
)
from megatron.optimizer import MixedPrecisionOptimizer, StepResult, build_optimizer, build_param_schedule
from megatron.pipeline_parallel.schedules import (
    ForwardStep,
    forward_backward_no_pipelining,
    forward_backward_pipelining,
)

ModelProvider = Callable[..., torch.nn.Module]  # (config, device, meta_init=...) -> this rank's model
DatasetsProvider = Callable[[Config], tuple]  # -> (train, valid, test); each has __len__, __getitem__, eod_id


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken (applied or skipped)
    consumed_samples: int = 0  # by every step, skipped ones too: the data position and the batch-size schedule's
    skipped_steps: int = 0
    schedule_samples: int = 0  # the samples of the applied steps: the learning-rate / weight-decay position
    losses: list = field(default_factory=list)  # every step's global-batch loss


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _all_reduce_sum(value: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(value, group=group)
    return value


def train_step(forward_step: ForwardStep, batch: dict, model: torch.nn.Module, buffer: ParamAndGradBuffer,
               optimizer: MixedPrecisionOptimizer, lr: float, micro_batch_size: int, dp_group=None,
               forward_backward: Callable = None, pp_group=None,
               weight_decay: float | None = None) -> tuple[float, StepResult]:
    """One optimizer step over this rank's share of the global batch (any size: it is cut into as many
    micro-batches as it holds); returns (token-mean loss of the global batch, step result). ``model``,
    ``buffer``: as ``parallelize`` returns them; ``dp_group``: the data-parallel group (None: one replica);
    ``forward_backward``: the schedule (default: no pipelining); ``pp_group``: the pipeline group, over
    which the last stage's loss is shared; ``weight_decay``: this step's (None: the configured one)."""
    forward_backward = forward_backward or forward_backward_no_pipelining
    num_tokens = float(_all_reduce_sum(batch["loss_mask"].sum().float(), dp_group).clamp(min=1.0))
    optimizer.zero_grad()
    model.train()
    loss_sum = forward_backward(forward_step, split_micro_batches(batch, micro_batch_size), model, num_tokens,
                                optimizer.loss_scale)
    loss_sum = _all_reduce_sum(loss_sum, pp_group)  # only the last stage holds it
    if isinstance(model, DataParallel):
        model.finish_grad_sync()
    finalize_model_grads(model, parallel_state.get(), buffer)
    result = optimizer.step(lr, weight_decay)
    return float(_all_reduce_sum(loss_sum, dp_group)) / num_tokens, result


@torch.no_grad()
def evaluate(forward_step: ForwardStep, loader, model: torch.nn.Module, micro_batch_size: int,
             max_batches: int, device: torch.device, dp_group=None, forward_backward: Callable = None,
             pp_group=None) -> float | None:
    """Token-mean loss over the first ``max_batches`` global batches (None if there are none)."""
    forward_backward = forward_backward or forward_backward_no_pipelining
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, tokens)
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        watchdog.beat(f"evaluation batch {i + 1}")
        batch = _to_device(batch, device)
        loss = forward_backward(forward_step, split_micro_batches(batch, micro_batch_size), model, 1.0,
                                forward_only=True)
        sums += torch.stack([_all_reduce_sum(loss, pp_group).double(), batch["loss_mask"].sum().double()])
    model.train()
    total, tokens = _all_reduce_sum(sums, dp_group).tolist()
    return total / tokens if tokens else None


@dataclass
class ParallelModel:
    """A model made ready to run under the launch's layout (training, or evaluation through the same
    forward): its parameter buffer and hooks (``parallelize``), the optimizer whose masters a checkpoint
    loads into, the groups its sums are reduced over, and the schedule that runs micro-batches through
    it (pipelined when pp > 1)."""

    model: torch.nn.Module
    buffer: object
    fully_sharded: bool
    optimizer: object
    plan: ShardingPlan
    dp_group: object
    pp_group: object
    forward_backward: Callable


def parallel_model(config: Config, model: torch.nn.Module, device: torch.device,
                   plan: ShardingPlan | None = None) -> ParallelModel:
    ps = parallel_state.get()
    plan = plan or plan_sharding(config, ps)  # what is sharded, over which ranks: decided once
    model, buffer, fully_sharded = parallelize(model, plan)
    optimizer = build_optimizer(buffer, plan, config)
    pp_group, forward_backward = None, forward_backward_no_pipelining
    if ps.pp_size > 1:
        d, b = config.distributed, config.batch_size
        seq = config.dataset.max_seq_len // (ps.tp_size if d.sequence_parallel else 1)
        pp_group = ps.group("pp")
        forward_backward = partial(forward_backward_pipelining, ps=ps, schedule=d.pipeline_schedule,
                                   shape=(seq, b.micro_batch_size, config.model.hidden_size),
                                   dtype=getattr(torch, config.params_dtype_name), device=device)
    return ParallelModel(model, buffer, fully_sharded, optimizer, plan, plan.data_parallel_group, pp_group,
                         forward_backward)


def _open_metrics(config: Config, enabled: bool, resume_step: int | None) -> MetricsWriter:
    """This rank's MetricsWriter (W&B too, when configured). A WandbError is already one line saying what to
    do: raised as a CheckpointError, on_every_rank gives it to every rank unframed, and pretrain_gpt.py
    prints it and exits 2, before training."""
    sl = config.save_load
    try:
        return MetricsWriter(sl.output_dir, sl.tensorboard_dir, enabled, resume_step, config)
    except WandbError as err:
        raise CheckpointError(str(err)) from None


class Trainer:
    """Holds what the loop needs; ``run()`` trains, evaluates and tests."""

    def __init__(self, config: Config, model: torch.nn.Module, forward_step: ForwardStep, datasets: tuple,
                 device: torch.device, plan: ShardingPlan | None = None):
        self.config, self.forward_step, self.device = config, forward_step, device
        self.train_ds, self.valid_ds, self.test_ds = datasets
        self.ps = parallel_state.get()
        self.world_size = self.ps.world_size
        run = parallel_model(config, model, device, plan)
        self.plan, self.model, self.buffer, self.fully_sharded = run.plan, run.model, run.buffer, run.fully_sharded
        self.optimizer, self.dp_group, self.pp_group = run.optimizer, run.dp_group, run.pp_group
        self.forward_backward = run.forward_backward
        self.schedule = build_param_schedule(config)  # lr and weight decay by samples of applied steps
        self.batches = build_batch_schedule(config)  # the global batch by consumed samples
        self.state = TrainState()
        self.health = RunHealth(config.max_consecutive_skipped_steps, config.loss_spike_factor)
        self.checkpoints = GoodCheckpoints(config.save_load.output_dir, config.save_load.keep_last_checkpoints,
                                           self.ps.rank == 0)
        self._stop_signal: str | None = None  # the name of the signal that asked the run to stop
        self.log = get_logger()
        self.is_logging_rank = self.ps.rank == self.ps.world_size - 1  # last stage, last replica, as Megatron
        sl = config.save_load
        saves = bool(sl.save_at_end or sl.save_steps or sl.exit_interval or sl.exit_duration_in_mins)
        check_output_dir(sl.output_dir, self.ps.rank, device, saves)  # a bad --save stops every rank now, in one line
        resume_step = self._load(sl.ckpt_dir) if sl.ckpt_dir else None  # writes nothing: a failure leaves no trace
        self.writer = on_every_rank(  # drops an earlier run's records past resume_step from metrics.jsonl
            lambda: _open_metrics(config, self.is_logging_rank, resume_step), device,
            f"cannot open the metrics of {sl.output_dir}", "fix the file or give --save another folder")
        self.flops_per_token = model_flops_per_token(config)
        self.peak_tflops = config.peak_tflops or dev.peak_tflops(device)

    def _load(self, path: str) -> int | None:
        """Load ``path`` on every rank; returns the step the run continues from (None for --finetune). A
        run whose --load is its own --save folder and holds no checkpoint yet starts from scratch (0)."""
        sl = self.config.save_load
        loaded = load_checkpoint(path, self.model, self.optimizer, self.ps, self.config,
                                 load_optim=sl.load_optim and not sl.finetune, load_rng=sl.load_rng and not sl.finetune,
                                 fresh_if_empty=same_folder(path, sl.output_dir))
        if loaded is None:
            if self.ps.rank == 0:
                self.log.info(f"no checkpoint in {path}: starting from scratch")
            return 0
        if not sl.finetune:
            self.state.step = loaded["step"]
            self.state.consumed_samples = loaded["consumed_samples"]
            self.state.skipped_steps = loaded["skipped_steps"]
            gbs = self.config.batch_size.global_batch_size  # a checkpoint from before batch-size schedules:
            self.state.schedule_samples = loaded.get(  # its applied steps, all of that constant batch
                "schedule_samples", (self.state.step - self.state.skipped_steps) * gbs)
        self.checkpoints.loaded(loaded["step"], loaded["path"])
        if self.ps.rank == 0:
            how = "weights only (finetune)" if sl.finetune else f"resuming at step {self.state.step}"
            layout = "" if loaded["same_layout"] else ", resharded from another parallel layout"
            self.log.info(f"loaded checkpoint {loaded['path']}: {how}{layout}")
        return None if sl.finetune else self.state.step

    def save(self) -> None:
        """Checkpoint the current state, unless the run's health forbids it (a non-finite loss, or skips
        pending): a diverged state must never replace, or through pruning delete, a good checkpoint."""
        s = self.state
        refused = self.health.why_not_save()
        if refused is not None:
            if self.ps.rank == 0:
                self.log.warning(f"not saving a checkpoint at step {s.step}: {refused}")
            return
        watchdog.beat(f"saving the checkpoint of step {s.step}")
        path = save_checkpoint(self.config.save_load.output_dir, s.step, self.model, self.optimizer, self.ps,
                               self.config, {"consumed_samples": s.consumed_samples, "skipped_steps": s.skipped_steps,
                                             "schedule_samples": s.schedule_samples})
        watchdog.beat(f"after saving the checkpoint of step {s.step}")
        self.checkpoints.saved(s.step, path)  # pruned here, and again once the next step confirms it
        if self.ps.rank == 0:
            self.log.info(f"saved checkpoint {path}")

    def _on_signal(self, signum, frame) -> None:
        """SIGTERM, SIGUSR1, and a first SIGINT (Ctrl-C): save at the end of this step and exit 0. A second
        Ctrl-C stops at once (KeyboardInterrupt: one line, exit 130, nothing saved)."""
        if signum == signal.SIGINT and self._stop_signal:
            raise KeyboardInterrupt
        self._stop_signal = signal.Signals(signum).name

    def _stop_reason(self) -> str | None:
        if self._stop_signal:
            hint = " (Ctrl-C again to stop at once, without saving)" if self._stop_signal == "SIGINT" else ""
            return f"{self._stop_signal} received{hint}"
        limit = self.config.save_load.exit_duration_in_mins
        if limit is not None and time.perf_counter() - self._started >= 60 * limit:
            return f"exit_duration_in_mins ({limit:g}) reached"
        interval = self.config.save_load.exit_interval
        if interval and self.state.step % interval == 0:
            return f"exit_interval ({interval}) reached"
        return None

    def _stop_requested(self) -> bool:
        """True on every rank once any rank has received SIGTERM or SIGUSR1 or run out of time (agreed by
        an all-reduce, so that all ranks save at the same step)."""
        flag = torch.tensor([0.0 if self._stop_reason() is None else 1.0], device=self.device)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _loader(self, dataset, consumed: int = 0, num_workers: int = 0, batches=None):
        """Batches of ``batches`` (a global batch, or consumed -> global batch; default: global_batch_size)."""
        return build_loader(dataset, consumed, batches or self.config.batch_size.global_batch_size, dataset.eod_id,
                            self.config.dataset.eod_mask_loss, self.ps.data_parallel_rank,
                            self.ps.data_parallel_size, num_workers=num_workers)

    def _samples_per_epoch(self) -> int:
        return getattr(self.train_ds, "samples_per_epoch", len(self.train_ds))

    def _epoch_and_batch(self, global_batch: int) -> tuple[int, int]:
        """(epoch, batch in it) of the step just taken: by whole global batches per epoch (FleetX's); when the
        global batch varies, the epoch its first sample is in and the steps since the first step of that epoch."""
        per_epoch = self._samples_per_epoch()
        if not self.batches.varies:
            return divmod(self.state.step - 1, max(per_epoch // global_batch, 1))
        epoch = (self.state.consumed_samples - global_batch) // max(per_epoch, 1)
        return epoch, self.state.step - 1 - self.batches.steps_to_reach(epoch * per_epoch)

    def _extras(self, result: StepResult, batch_cost: float, tokens_per_step: float) -> dict:
        tflops = self.flops_per_token * tokens_per_step / batch_cost / self.world_size / 1e12
        return {
            "loss_scale": self.optimizer.loss_scale if self.optimizer.grad_scaler else None,
            "grad_norm": result.grad_norm,
            "tflops": tflops,
            "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
            "max_memory_gb": dev.peak_memory_bytes(self.device) / 2**30,
            "skipped_steps": self.state.skipped_steps,
        }

    def _log_step(self, loss: float, lr: float, result: StepResult, reader: float, batch_cost: float,
                  samples_per_step: float, global_batch: int) -> None:
        """``lr``: the one this step applied; ``reader``, ``batch_cost``, ``samples_per_step``: means over the
        steps since the last line (tokens/s and TFLOP/s count the samples those steps really took)."""
        if not self.is_logging_rank:
            return
        s, tokens_per_step = self.state, samples_per_step * self.config.dataset.max_seq_len
        epoch, batch_in_epoch = self._epoch_and_batch(global_batch)
        extras = self._extras(result, batch_cost, tokens_per_step)
        shown = {"global batch size": global_batch if self.batches.varies else None,
                 "loss scale": extras["loss_scale"],
                 "grad norm": None if result.grad_norm is None else f"{result.grad_norm:.5f}",
                 "TFLOP/s": f"{extras['tflops']:.2f}",
                 "MFU": None if extras["mfu"] is None else f"{100 * extras['mfu']:.2f}%",
                 dev.peak_memory_label(self.device): f"{extras['max_memory_gb']:.2f} GB",
                 "skipped steps": s.skipped_steps or None,
                 **self._progress()}
        self.log.info(format_log_line(s.step, epoch, batch_in_epoch, loss, reader, batch_cost, tokens_per_step,
                                      self.world_size, lr, shown))
        ips_total = tokens_per_step / batch_cost
        self.writer.write({"split": "train", "step": s.step, "epoch": epoch, "batch": batch_in_epoch, "loss": loss,
                           "learning_rate": lr, "ips_total": ips_total, "ips": ips_total / self.world_size,
                           "avg_reader_cost": reader, "avg_batch_cost": batch_cost,
                           "consumed_samples": s.consumed_samples, "global_batch_size": global_batch,
                           "elapsed_s": time.perf_counter() - self._started, **extras})

    def _progress(self) -> dict[str, str]:
        """Elapsed time since this process's first step, and the ETA of the last step at the pace so far
        (evaluations and saves included, as the rest of the run will have them)."""
        elapsed = time.perf_counter() - self._started
        done, left = self.state.step - self._first_step, self._last_step - self.state.step
        eta = elapsed / done * left if done else 0.0
        return {"elapsed": format_duration(elapsed), "ETA": format_duration(eta)}

    def _evaluate(self, split: str, dataset) -> None:
        c = self.config
        if dataset is None or len(dataset) < c.batch_size.global_batch_size or c.eval_iters == 0:
            return
        loss = evaluate(self.forward_step, self._loader(dataset), self.model, c.batch_size.micro_batch_size,
                        c.eval_iters, self.device, self.dp_group, self.forward_backward, self.pp_group)
        if loss is None or not self.is_logging_rank:
            return
        ppl = math.exp(min(loss, 50.0))
        name = "validation" if split == "valid" else "test"
        self.log.info(f"{name} results at global step {self.state.step} | loss: {loss:.9f} | ppl: {ppl:.5f}")
        self.writer.write({"split": split, "step": self.state.step, "loss": loss, "perplexity": ppl})

    def _train_steps(self) -> int:
        """Steps this run can take: max_steps, or the steps train_samples gives (``train_steps``), unless the
        training set holds fewer global batches (the datasets provider builds it for at most num_train_epochs
        passes, when set). That is said at start rather than discovered when the loop stops early, with the
        learning rate it leaves above min_lr."""
        c, batches = self.config, self.batches
        self.planned_steps = train_steps(c, batches)
        steps = min(self.planned_steps, batches.steps_within(len(self.train_ds)))
        if steps >= self.planned_steps or self.ps.rank != 0:
            return steps
        if c.num_train_epochs is None:
            held, fix = f"the training data holds {len(self.train_ds)} samples, which gives", "add data"
        else:
            held = (f"the training data holds {self._samples_per_epoch()} samples per epoch: num_train_epochs "
                    f"({c.num_train_epochs}) gives")
            fix = "raise num_train_epochs or add data"
        size = "the batch-size schedule" if batches.varies else f"global batch {batches.final}"
        asked = (f"max_steps ({c.max_steps})" if c.train_samples is None
                 else f"the {self.planned_steps} steps of train_samples ({c.train_samples})")
        self.log.warning(f"{held} {steps} steps of {size}, fewer than {asked}; training stops at step {steps} ({fix})")
        lr, reached = c.optimizer.lr, batches.consumed_after(steps)
        if reached < self.schedule.decay and lr.decay_style != "constant":
            decay, fix = ((f"decay_steps ({lr.decay_steps})", f"--decay-steps {steps}") if c.train_samples is None
                          else (f"decay_samples ({lr.decay_samples})", f"--lr-decay-samples {reached}"))
            self.log.warning(f"training stops at step {steps}, before {decay}: the learning rate will not reach "
                             f"min_lr ({lr.min_lr:g}); set {fix} to decay it fully")
        return steps

    def _after_step(self, loss: float, result: StepResult, scale_before: float) -> None:
        """Run health: warn on a skipped step or a loss spike; raise TrainingDiverged (the same on every
        rank: the loss and the skip are global) after too many bad steps in a row."""
        scale = self.optimizer.loss_scale if self.optimizer.grad_scaler else None
        lowered = scale is not None and scale < scale_before
        try:
            warning = self.health.observe(self.state.step, loss, result.applied, lowered, scale)
        except TrainingDiverged as err:
            raise TrainingDiverged(f"{err} ({self.checkpoints.after_divergence()})") from None
        self.checkpoints.step_done(loss, result.applied)
        if warning and self.is_logging_rank:
            self.log.warning(warning)

    def run(self) -> TrainState:
        """Train, evaluate and test with this rank's hang watchdog armed (megatron/watchdog.py) and the stop
        signals handled, both undone however the loop ends, so that neither outlives it in an in-process
        caller."""
        watchdog.start(self.config.watchdog_timeout_minutes, self.config.save_load.output_dir, self.ps.rank,
                       f"training step {self.state.step + 1}")
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
        finished = False
        try:
            state, finished = self._run_loop(), True
            return state
        finally:
            watchdog.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.writer.close(exit_code=0 if finished else 1)  # a run that raised: its W&B run is marked failed

    def _run_loop(self) -> TrainState:
        c, s = self.config, self.state
        last_step = self._train_steps()
        asked = f"max_steps {c.max_steps}" if c.train_samples is None else f"train_samples {c.train_samples}"
        if s.step >= last_step:  # a finished run launched again: evaluating again would log its results twice
            if self.ps.rank == 0:
                self.log.warning(f"nothing to train: the run is at step {s.step} and stops at step {last_step}; "
                                 f"raise {asked.split()[0]} to train further")
            return s
        loader = iter(self._loader(self.train_ds, s.consumed_samples, c.dataset.num_workers, self.batches))
        reader_time = batch_time = 0.0
        window = window_samples = 0
        dev.reset_peak_memory(self.device)
        self._started, self._first_step, self._last_step = time.perf_counter(), s.step, last_step
        save_steps = c.save_load.save_steps
        saved_at = s.step
        while s.step < last_step:
            watchdog.beat(f"training step {s.step + 1}")
            start = time.perf_counter()
            batch = _to_device(next(loader), self.device)
            reader_time += time.perf_counter() - start
            global_batch = self.batches(s.consumed_samples)  # the loader's size for this step
            s.step += 1
            lr, wd = self.schedule.lr(s.schedule_samples), self.schedule.weight_decay(s.schedule_samples)
            scale_before = self.optimizer.loss_scale
            loss, result = train_step(self.forward_step, batch, self.model, self.buffer, self.optimizer, lr,
                                      c.batch_size.micro_batch_size, self.dp_group, self.forward_backward,
                                      self.pp_group, weight_decay=wd)
            s.consumed_samples += global_batch
            s.schedule_samples += global_batch if result.applied else 0  # Megatron: only a successful update
            s.skipped_steps += 0 if result.applied else 1
            dev.synchronize(self.device)
            batch_time += time.perf_counter() - start
            window, window_samples = window + 1, window_samples + global_batch
            s.losses.append(loss)
            if s.step % c.logging_freq == 0 or s.step == last_step:
                self._log_step(loss, lr, result, reader_time / window, batch_time / window, window_samples / window,
                               global_batch)
                reader_time = batch_time = 0.0
                window = window_samples = 0
            self._after_step(loss, result, scale_before)
            if save_steps and s.step % save_steps == 0:
                self.save()
                saved_at = s.step
            if self._stop_requested():
                if self.ps.rank == 0:
                    reason = self._stop_reason() or "another rank received a stop signal"
                    self.log.warning(f"{reason}: saving at step {s.step} and exiting")
                if saved_at != s.step:
                    self.save()
                break
            if s.step % c.eval_freq == 0 and s.step < last_step:
                self._evaluate("valid", self.valid_ds)
        else:
            if last_step < self.planned_steps and self.ps.rank == 0:
                epochs = "" if c.num_train_epochs is None else f" (num_train_epochs {c.num_train_epochs})"
                self.log.warning(f"stopped at step {s.step} of {asked}: the training data ran out{epochs}")
            if c.save_load.save_at_end and saved_at != s.step:  # Megatron-LM: --save keeps the trained model
                self.save()
            self._evaluate("valid", self.valid_ds)
            self._evaluate("test", self.test_ds)
        return s
