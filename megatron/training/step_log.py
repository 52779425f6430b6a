"""What a run says about its steps: the log line (every ``logging_freq`` steps, means over the steps since the
last line), ``metrics.jsonl`` / TensorBoard / W&B records, the evaluation results, elapsed time and ETA."""

from __future__ import annotations

import math
import time

import torch

from megatron import device as dev
from megatron.checkpoint import CheckpointError, on_every_rank
from megatron.config import Config
from megatron.config.batch_schedule import BatchSchedule
from megatron.metrics import (
    MetricsWriter,
    WandbError,
    format_duration,
    format_log_line,
    get_logger,
    model_flops_per_token,
)
from megatron.optimizer import MixedPrecisionOptimizer, StepResult
from megatron.parallel_state import ParallelState
from megatron.training.run_length import samples_per_epoch
from megatron.training.step import TrainState


def _open_metrics(config: Config, enabled: bool, resume_step: int | None) -> MetricsWriter:
    """This rank's MetricsWriter (W&B too, when configured). A WandbError is already one line saying what to
    do: raised as a CheckpointError, on_every_rank gives it to every rank unframed, and pretrain_gpt.py
    prints it and exits 2, before training."""
    sl = config.save_load
    try:
        return MetricsWriter(sl.output_dir, sl.tensorboard_dir, enabled, resume_step, config)
    except WandbError as err:
        raise CheckpointError(str(err)) from None


class StepLog:
    def __init__(self, config: Config, ps: ParallelState, device: torch.device, optimizer: MixedPrecisionOptimizer,
                 batches: BatchSchedule, train_ds, state: TrainState, resume_step: int | None):
        self.config, self.device, self.optimizer, self.batches = config, device, optimizer, batches
        self.train_ds, self.state, self.world_size = train_ds, state, ps.world_size
        self.logs = ps.rank == ps.world_size - 1  # last stage, last replica, as Megatron
        self.log = get_logger()
        sl = config.save_load
        self.writer = on_every_rank(  # drops an earlier run's records past resume_step from metrics.jsonl
            lambda: _open_metrics(config, self.logs, resume_step), device,
            f"cannot open the metrics of {sl.output_dir}", "fix the file or give --save another folder")
        self.flops_per_token = model_flops_per_token(config)
        self.peak_tflops = config.peak_tflops or dev.peak_tflops(device)
        self.started = time.perf_counter()
        self.first_step = self.last_step = 0

    def start(self, last_step: int) -> None:
        """The loop starts: the clock for elapsed time and ETA, the peak memory and the window reset."""
        dev.reset_peak_memory(self.device)
        self.started, self.first_step, self.last_step = time.perf_counter(), self.state.step, last_step
        self._reset_window()

    def _reset_window(self) -> None:
        self.reader_time = self.batch_time = 0.0
        self.window = self.window_samples = 0

    def step_started(self) -> None:
        self.step_start = time.perf_counter()

    def batch_ready(self) -> None:
        self.reader_time += time.perf_counter() - self.step_start

    def step_done(self, loss: float, lr: float, result: StepResult, global_batch: int) -> None:
        """``lr``: the one this step applied. Logs when the step is a logging step or the last."""
        dev.synchronize(self.device)
        self.batch_time += time.perf_counter() - self.step_start
        self.window, self.window_samples = self.window + 1, self.window_samples + global_batch
        step = self.state.step
        if step % self.config.logging_freq == 0 or step == self.last_step:
            if self.logs:
                self._log_step(loss, lr, result, self.reader_time / self.window, self.batch_time / self.window,
                               self.window_samples / self.window, global_batch)
            self._reset_window()

    def _epoch_and_batch(self, global_batch: int) -> tuple[int, int]:
        """(epoch, batch in it) of the step just taken: by whole global batches per epoch (FleetX's); when the
        global batch varies, the epoch its first sample is in and the steps since the first step of that epoch."""
        per_epoch, s = samples_per_epoch(self.train_ds), self.state
        if not self.batches.varies:
            return divmod(s.step - 1, max(per_epoch // global_batch, 1))
        epoch = (s.consumed_samples - global_batch) // max(per_epoch, 1)
        return epoch, s.step - 1 - self.batches.steps_to_reach(epoch * per_epoch)

    def _extras(self, result: StepResult, batch_cost: float, tokens_per_step: float) -> dict:
        tflops = self.flops_per_token * tokens_per_step / batch_cost / self.world_size / 1e12
        return {
            "loss_scale": self.optimizer.loss_scale if self.optimizer.grad_scaler else None,
            "grad_norm": result.grad_norm,
            "tflops": tflops,
            "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
            "max_memory_gb": dev.peak_memory_bytes(self.device) / 2**30,
            "skipped_steps": self.state.skipped_steps,
            **(result.moe or {}),  # a MoE model's load_balancing_loss, expert_load_max and tokens_per_expert
            **(result.mtp or {}),  # multi-token prediction's mtp_loss, one per depth
            **({} if result.max_attention_logit is None else {"max_attention_logit": result.max_attention_logit}),
        }

    def _log_step(self, loss: float, lr: float, result: StepResult, reader: float, batch_cost: float,
                  samples_per_step: float, global_batch: int) -> None:
        """``reader``, ``batch_cost``, ``samples_per_step``: means over the steps since the last line (tokens/s
        and TFLOP/s count the samples those steps really took)."""
        s, tokens_per_step = self.state, samples_per_step * self.config.dataset.max_seq_len
        epoch, batch_in_epoch = self._epoch_and_batch(global_batch)
        extras = self._extras(result, batch_cost, tokens_per_step)
        mtp_losses = (result.mtp or {}).get("mtp_loss", ())  # multi-token prediction: one per depth
        shown = {"global batch size": global_batch if self.batches.varies else None,
                 "loss scale": extras["loss_scale"],
                 "grad norm": None if result.grad_norm is None else f"{result.grad_norm:.5f}",
                 "TFLOP/s": f"{extras['tflops']:.2f}",
                 "MFU": None if extras["mfu"] is None else f"{100 * extras['mfu']:.2f}%",
                 dev.peak_memory_label(self.device): f"{extras['max_memory_gb']:.2f} GB",
                 "skipped steps": s.skipped_steps or None,
                 **{key.replace("_", " "): f"{value:.5f}" for key, value in (result.moe or {}).items()
                    if isinstance(value, float)},
                 **{f"mtp_{k} loss": f"{value:.5f}" for k, value in enumerate(mtp_losses, start=1)},
                 "max attention logit": (None if result.max_attention_logit is None else
                                         f"{result.max_attention_logit:.5f}"),
                 **self._progress()}
        self.log.info(format_log_line(s.step, epoch, batch_in_epoch, loss, reader, batch_cost, tokens_per_step,
                                      self.world_size, lr, shown))
        ips_total = tokens_per_step / batch_cost
        self.writer.write({"split": "train", "step": s.step, "epoch": epoch, "batch": batch_in_epoch, "loss": loss,
                           "learning_rate": lr, "ips_total": ips_total, "ips": ips_total / self.world_size,
                           "avg_reader_cost": reader, "avg_batch_cost": batch_cost,
                           "consumed_samples": s.consumed_samples, "global_batch_size": global_batch,
                           "elapsed_s": time.perf_counter() - self.started, **extras})

    def _progress(self) -> dict[str, str]:
        """Elapsed time since this process's first step, and the ETA of the last step at the pace so far
        (evaluations and saves included, as the rest of the run will have them)."""
        elapsed = time.perf_counter() - self.started
        done, left = self.state.step - self.first_step, self.last_step - self.state.step
        eta = elapsed / done * left if done else 0.0
        return {"elapsed": format_duration(elapsed), "ETA": format_duration(eta)}

    def evaluation(self, split: str, loss: float | None) -> None:
        """An evaluation's result: its line and record."""
        if loss is None or not self.logs:
            return
        ppl = math.exp(min(loss, 50.0))
        name = "validation" if split == "valid" else "test"
        self.log.info(f"{name} results at global step {self.state.step} | loss: {loss:.9f} | ppl: {ppl:.5f}")
        self.writer.write({"split": split, "step": self.state.step, "loss": loss, "perplexity": ppl})

    def save_done(self, save_step: int, blocked_s: float, total_s: float) -> None:
        """A checkpoint is sealed: its record (split ``save``), at the step the run is at (an asynchronous save
        is sealed steps after ``save_step``)."""
        if self.logs:
            self.writer.write({"split": "save", "step": self.state.step, "save_step": save_step,
                               "save_blocked_s": blocked_s, "save_total_s": total_s})

    def close(self, exit_code: int) -> None:
        self.writer.close(exit_code=exit_code)  # a run that raised: its W&B run is marked failed
