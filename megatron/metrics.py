"""What a run reports: the seed's log line, metrics.jsonl, TensorBoard, FLOPs and MFU."""

from __future__ import annotations

import json
import logging
import math
import os

from megatron.config.schema import Config

LOG_FORMAT = "[%(asctime)s] [%(levelname)8s] - %(message)s"


def get_logger() -> logging.Logger:
    """The project's logger, printing the seeds' ``[date time,ms] [    INFO] - message`` lines."""
    logger = logging.getLogger("megatron")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def model_flops_per_token(config: Config) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), counting matmuls only.

    Forward, per token, with h hidden, f ffn, s sequence, L layers, V padded vocab::

        L * (2*h*3h  [QKV]  + 2*h*h [attention out] + 2*2*h*f [MLP]
             + 2*s*h [Q K^T] + 2*s*h [attention x V])  +  2*h*V [LM head]

    Attention is counted over the full s x s square, not the causal half, as Megatron-LM does
    and as torch's FLOP counter does for the math attention backend. Recompute is not counted:
    these are model FLOPs, the basis of MFU.
    """
    m, s, v = config.model, config.dataset.max_seq_len, config.padded_vocab_size
    h, f = m.hidden_size, m.ffn_hidden_size
    per_layer = 2 * h * 3 * h + 2 * h * h + 2 * 2 * h * f + 2 * 2 * s * h
    return 3.0 * (m.num_layers * per_layer + 2 * h * v)


def format_log_line(step: int, epoch: int, batch: int, loss: float, reader_cost: float, batch_cost: float,
                    tokens_per_step: int, world_size: int, lr: float, extras: dict) -> str:
    """The seed's line, then the extra fields (never before the seed's ones)."""
    ips_total = tokens_per_step / batch_cost
    line = (f"global step {step}, epoch: {epoch}, batch: {batch}, loss: {loss:.9f}, "
            f"avg_reader_cost: {reader_cost:.5f} sec, avg_batch_cost: {batch_cost:.5f} sec, "
            f"speed: {1.0 / batch_cost:.2f} step/s, ips_total: {ips_total:.0f} tokens/s, "
            f"ips: {ips_total / world_size:.0f} tokens/s, learning rate: {lr:.5e}")
    for key, value in extras.items():
        if value is None:
            continue
        line += f", {key}: {value}"
    return line


class MetricsWriter:
    """One JSON object per line in ``output_dir/metrics.jsonl``, mirrored to TensorBoard.

    ``resume_step``: the run continues from that step (a resume, or 0 for a fresh start in the
    folder of a run that never saved). Records of later steps left by an earlier run in the same
    folder are dropped first (``drop_records_after``), and TensorBoard hides that run's later events
    (``purge_step``), so no step appears twice."""

    def __init__(self, output_dir: str, tensorboard_dir: str | None, enabled: bool = True,
                 resume_step: int | None = None):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, "metrics.jsonl")
        if resume_step is not None:
            dropped = drop_records_after(path, resume_step)
            if dropped:
                get_logger().info(f"{path}: dropped {dropped} record(s) of an earlier run past step {resume_step}, "
                                  f"where this run continues")
        self._jsonl = open(path, "a", buffering=1)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is a dependency, but do not die over an optional sink
            get_logger().warning("tensorboard is not installed; writing metrics.jsonl only.")
        else:
            self._tb = SummaryWriter(log_dir=tensorboard_dir or os.path.join(output_dir, "tensorboard"),
                                     purge_step=None if resume_step is None else resume_step + 1)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            split, step = record["split"], record["step"]
            for key, value in record.items():
                if key not in ("split", "step") and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"{split}/{key}", value, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def drop_records_after(path: str, step: int) -> int:
    """Rewrite ``path`` (metrics.jsonl) atomically without the records of steps above ``step`` (train,
    valid and test records alike) and without unreadable lines (the partial last line of a killed
    run); returns how many lines were dropped. The file is left untouched when nothing is dropped."""
    if not os.path.isfile(path):
        return 0
    dropped, tmp = 0, path + ".tmp"
    with open(path) as src, open(tmp, "w") as dst:
        for line in src:
            try:
                record = json.loads(line)
                keep = line.endswith("\n") and (not isinstance(record, dict) or record.get("step", 0) <= step)
            except (ValueError, TypeError):
                keep = False
            if keep:
                dst.write(line)
            else:
                dropped += 1
        dst.flush()
        os.fsync(dst.fileno())
    if dropped:
        os.replace(tmp, path)
    else:
        os.remove(tmp)
    return dropped
