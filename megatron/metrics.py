"""What a run reports: the seed's log line, metrics.jsonl, TensorBoard, Weights & Biases, FLOPs and MFU."""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import string
import sys
import time

from megatron.config.cli import to_dict
from megatron.config.schema import Config
from megatron.config.validate_attention import layer_window
from megatron.config.validate_hybrid import hybrid_layer_kind, is_linear_attention_layer
from megatron.config.validate_moe import is_moe_layer

LOG_FORMAT = "[%(asctime)s] [%(levelname)8s] - %(message)s"
WANDB_RUN_ID_FILE = "wandb_run_id.txt"  # in output_dir: the W&B run that a resumed training run continues


class WandbError(RuntimeError):
    """Weights & Biases logging was asked for (``wandb_project``) but cannot start: wandb is not installed,
    or ``wandb.init`` failed. Raised at start-up, before training, as Megatron-LM does: a run that asked
    for W&B and trained without it would be a silent failure. The message is one line saying what to do."""


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (as logging's last-resort handler does),
    not the stream of the moment the logger was first asked for, which a caller may have replaced since."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def get_logger() -> logging.Logger:
    """The project's logger, printing the seeds' ``[date time,ms] [    INFO] - message`` lines."""
    logger = logging.getLogger("megatron")
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def model_flops_per_token(config: Config) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), counting matmuls only.

    Forward, per token, with h hidden, f ffn, s sequence, L layers, V padded vocab, nq query heads,
    ng key/value groups (nq without grouped-query attention), hd head width::

        L * (2*h*(nq + 2*ng)*hd  [QKV]  + 2*nq*hd*h [attention out]
             + 2*2*h*f [GELU MLP] or 3*2*h*f [SwiGLU: gate, up, down]
             + 2*s*nq*hd [Q K^T] + 2*s*nq*hd [attention x V])  +  2*h*V [LM head, tied or not]

    A MoE layer (``megatron.moe``) counts its active parameters in place of the MLP: the router (2*h*E), the
    ``topk`` experts each token goes through (each an MLP of ``moe_ffn_hidden_size``) and the shared expert
    (an MLP of ``moe_shared_expert_intermediate_size``); dropped tokens are counted as computed.

    Multi-latent attention (``megatron.model.mla``) counts its projections in place of QKV and the attention out,
    and ``2*s*a*(qk + dv)`` for the scores and the values (qk = qk_head_dim + qk_pos_emb_head_dim). Multi-token
    prediction (``megatron.model.mtp``) adds per module a layer, its projection (2*2h*h) and the LM head again.

    Gated DeltaNet layers (``megatron.hybrid``) count ``_linear_attention_flops`` in place of attention, and gated
    attention its gate's projection; a hybrid model's layer (``hybrid_override_pattern``) its one part, a Mamba-2
    mixer ``_mamba_flops`` (Megatron-LM's ``num_floating_point_operations``).

    (GPT-2: nq*hd = h, ng = nq, so QKV is 2*h*3h.) Attention is counted over the full s x s square,
    not the causal half, as Megatron-LM does and as torch's FLOP counter does for the math attention
    backend; a layer with a sliding window of w keys over s x min(s, w + 1). Norms, activations and rotary
    embeddings are not matmuls and are left out. Recompute is not counted: these are model FLOPs, the basis of MFU.
    """
    m, s, v = config.model, config.dataset.max_seq_len, config.padded_vocab_size
    h, f = m.hidden_size, m.ffn_hidden_size
    matmuls = 3 if m.swiglu or m.quick_geglu else 2
    total = 0
    for layer in range(m.num_layers + (m.mtp_num_layers or 0)):
        window = layer_window(m, layer)  # a sliding window: each query's keys at most window + 1
        per_layer = _linear_attention_flops(m) if is_linear_attention_layer(m, layer) else \
            _attention_flops(m, s if window is None else min(s, window + 1))
        kind = hybrid_layer_kind(m, layer)  # a hybrid model's layer: one part
        if kind in ("M", "*"):
            total += _mamba_flops(m) if kind == "M" else per_layer
            continue
        per_layer = 0 if kind else per_layer  # an MLP or MoE layer of a hybrid model
        if is_moe_layer(m, layer):  # the active parameters: the router, topk experts, the shared expert
            shared = m.moe_shared_expert_intermediate_size or 0
            expert = m.moe_ffn_hidden_size or f
            total += per_layer + 2 * h * m.num_experts + matmuls * 2 * h * (m.moe_router_topk * expert + shared)
        else:
            total += per_layer + matmuls * 2 * h * f
    mtp = (m.mtp_num_layers or 0) * (2 * 2 * h * h + 2 * h * v)  # each module's projection and its pass of the head
    return 3.0 * (total + 2 * h * v + mtp)


def _attention_flops(m, s: int) -> int:
    """One layer's attention matmuls per token (``model_flops_per_token``), ``s`` the keys each query is counted
    against."""
    h, nq = m.hidden_size, m.num_attention_heads
    if m.multi_latent_attention:
        qk, dv = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
        query = 2 * h * nq * qk if m.q_lora_rank is None else 2 * m.q_lora_rank * (h + nq * qk)
        latent = 2 * h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + 2 * m.kv_lora_rank * nq * (m.qk_head_dim + dv)
        return query + latent + 2 * nq * dv * h + 2 * s * nq * (qk + dv)
    ng = m.num_query_groups if m.group_query_attention else nq
    hd = m.kv_channels or h // nq
    queries = 2 * nq if m.attention_output_gate else nq  # the output gate: a second query-shaped projection
    return 2 * h * (queries + 2 * ng) * hd + 2 * nq * hd * h + 2 * 2 * s * nq * hd


def _mamba_flops(m) -> int:
    """A Mamba-2 mixer's per token (``megatron.hybrid.mamba``), as Megatron-LM counts it (its ``mamba_layer_flops``,
    with the mixer's width H x P for its ``d_in``): the input projection, the scan (``7 d_in N``), the output
    projection."""
    from megatron.hybrid.mamba import mamba_shape

    heads, width, groups, state = mamba_shape(m)
    inner, h = heads * width, m.hidden_size
    return 2 * h * (2 * inner + 2 * groups * state + heads) + 7 * inner * state + 2 * inner * h


def _linear_attention_flops(m) -> int:
    """A Gated DeltaNet layer's per token (``megatron.hybrid``), as Megatron-LM counts it: the input projection, the
    depthwise convolution, the delta rule's four products per value head (k k^T, v k^T, the state's update and its
    read by q: ``4 dk dv``) and the output projection; independent of the sequence length."""
    h, nk, nv = m.hidden_size, m.linear_num_key_heads, m.linear_num_value_heads
    qk, v = nk * m.linear_key_head_dim, nv * m.linear_value_head_dim
    return 2 * (h * (2 * qk + 2 * v + 2 * nv) + m.linear_conv_kernel_dim * (2 * qk + v)
                + 4 * nv * m.linear_key_head_dim * m.linear_value_head_dim + h * v)


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


def format_duration(seconds: float) -> str:
    """``1:02:03`` (hours unbounded), ``2:03`` under an hour."""
    total = int(round(max(seconds, 0.0)))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def scalars(record: dict) -> dict[str, float]:
    """``split/key`` -> value for the record's finite numbers, and ``split/key/name/i`` for each number of a
    ``{name: [numbers]}`` entry: what TensorBoard and W&B plot (metrics.jsonl keeps the whole record)."""
    split, out = record["split"], {}
    for key, value in record.items():
        if key in ("split", "step", "time"):
            continue
        if isinstance(value, dict):  # {name: [numbers]}: one curve per entry (a MoE layer's tokens per expert)
            out.update({f"{split}/{key}/{name}/{i}": v for name, values in value.items()
                        for i, v in enumerate(values) if isinstance(v, (int, float)) and math.isfinite(v)})
        elif isinstance(value, (int, float)) and math.isfinite(value):
            out[f"{split}/{key}"] = value
    return out


class MetricsWriter:
    """One JSON object per line in ``output_dir/metrics.jsonl``, mirrored to TensorBoard, and to Weights &
    Biases when ``config`` sets ``wandb_project`` (``start_wandb``). Only the rank that writes metrics is
    ``enabled``: the others open nothing, W&B included.

    ``resume_step``: the run continues from that step (a resume, or 0 for a fresh start in the
    folder of a run that never saved). Records of later steps left by an earlier run in the same
    folder are dropped first (``drop_records_after``), and TensorBoard hides that run's later events
    (``purge_step``), so no step appears twice. A resume from a saved step (``resume_step`` > 0) writes one
    ``{"split": "resume", "step": N, "dropped": D}`` record to metrics.jsonl only, before the continued run's first
    record (tools/plot_runs.py marks it).

    A sink that cannot be written once the run is going (a full disk: ENOSPC, or any OSError; any error of
    W&B's) is one warning and is then left alone for the rest of the run: the metrics are a report, and training goes
    on (a checkpoint that cannot be written still stops the run). TensorBoard writes from a thread of its
    own; its file errors are caught there (``_quiet_event_file``) and said at the next record."""

    def __init__(self, output_dir: str, tensorboard_dir: str | None, enabled: bool = True,
                 resume_step: int | None = None, config: Config | None = None):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._tb_error: list[OSError] = []  # what TensorBoard's writer thread could not write
        self._wandb = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, "metrics.jsonl")
        dropped = 0
        if resume_step is not None:
            dropped = drop_records_after(path, resume_step)
            if dropped:
                get_logger().info(f"{path}: dropped {dropped} record(s) of an earlier run past step {resume_step}, "
                                  f"where this run continues")
        if config is not None and config.save_load.wandb_project:  # first: if it cannot start, nothing is left open
            self._wandb = start_wandb(config, output_dir, resume_step, dropped)
        self._jsonl, self._jsonl_path = open(path, "a", buffering=1), path
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is a dependency, but do not die over an optional sink
            get_logger().warning("tensorboard is not installed; writing metrics.jsonl only.")
        else:
            self._tb_dir = tensorboard_dir or os.path.join(output_dir, "tensorboard")
            self._tb = SummaryWriter(log_dir=self._tb_dir, purge_step=None if resume_step is None else resume_step + 1)
            _quiet_event_file(self._tb, self._tb_error)
        # a resume from a saved step: where the curves continue (tools/plot_runs.py marks it), written before the
        # continued run's first record (a finished run launched again, which writes none, adds nothing); an
        # annotation of the file, not a metric: TensorBoard and W&B get none (W&B's resumed run starts after it)
        self._resume = ({"split": "resume", "step": resume_step, "dropped": dropped, "time": round(time.time(), 3)}
                        if resume_step else None)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {**record, "time": round(time.time(), 3)}  # when it was written: Unix seconds
        if self._resume is not None:
            self._write_line(self._resume)
            self._resume = None
        self._write_line(record)
        values = scalars(record)
        if self._tb is not None:
            try:
                for key, value in values.items():
                    self._tb.add_scalar(key, value, record["step"])
            except OSError as err:
                self._tb_error.append(err)
            if self._tb_error:
                self._tb = self._give_up(self._tb, f"the TensorBoard events in {self._tb_dir}", self._tb_error[0])
        if self._wandb is not None:
            try:
                self._wandb.log(values, step=record["step"])
            except Exception as err:  # noqa: BLE001 - wandb raises its own errors (a full disk, a dead service)
                self._wandb = self._give_up_wandb(err)

    def _write_line(self, record: dict) -> None:
        if self._jsonl is not None:
            try:
                self._jsonl.write(json.dumps(record) + "\n")
            except OSError as err:
                self._jsonl = self._give_up(self._jsonl, self._jsonl_path, err)

    @staticmethod
    def _give_up_wandb(err: Exception) -> None:
        """W&B that cannot log any more (its disk full, its service process gone): one warning, and the run's
        other sinks and training go on; the W&B run is left as it is (finishing it could fail the same way)."""
        get_logger().warning(f"cannot log to Weights & Biases ({type(err).__name__}: {' '.join(str(err).split())}): "
                             f"no more metrics go there this run; training goes on (metrics.jsonl keeps them)")
        return None

    @staticmethod
    def _give_up(sink, what: str, err: OSError) -> None:
        """One warning for a sink that cannot be written, closed as far as it goes; None, to stop writing it."""
        get_logger().warning(f"cannot write {what} ({err.strerror or err}): no more metrics are written there "
                             f"this run; training goes on (free space to have them again after a resume)")
        try:
            sink.close()
        except OSError:
            pass
        return None

    def close(self, exit_code: int = 0) -> None:
        """Close every sink; a non-zero ``exit_code`` (the run raised) marks the W&B run failed, not finished.
        W&B last: its finish uploads what is pending and is the one that may be slow or fail."""
        if self._jsonl is not None:
            try:
                self._jsonl.close()
            except OSError as err:  # the buffered last line
                self._give_up(self._jsonl, self._jsonl_path, err)
            self._jsonl = None
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError as err:
                self._tb_error.append(err)
            if self._tb_error:
                self._give_up(self._tb, f"the TensorBoard events in {self._tb_dir}", self._tb_error[0])
            self._tb = None
        if self._wandb is not None:
            run, self._wandb = self._wandb, None
            try:
                run.finish(exit_code=exit_code)
            except Exception as err:  # noqa: BLE001 - as in write: never a traceback at the end of a run
                self._give_up_wandb(err)


def _quiet_event_file(writer, errors: list[OSError]) -> None:
    """Make the record writer behind ``writer`` (a SummaryWriter), which TensorBoard's own thread calls, keep
    its first OSError in ``errors`` and write nothing more, instead of dying with a traceback on stderr and
    raising it at the next record. A TensorBoard whose writer is not where this looks is left as it is (its
    errors still reach ``MetricsWriter.write``, with the thread's traceback)."""
    try:
        record_writer = writer.file_writer.event_writer._async_writer._writer
    except AttributeError:
        return

    def guarded(method, after_an_error: bool):
        def call(*args, **kwargs):
            if errors and not after_an_error:
                return None
            try:
                return method(*args, **kwargs)
            except OSError as err:
                errors.append(err)
        return call

    for name, after_an_error in (("write", False), ("flush", False), ("close", True)):  # the file is closed anyway
        setattr(record_writer, name, guarded(getattr(record_writer, name), after_an_error))


def start_wandb(config: Config, output_dir: str, resume_step: int | None, earlier_records: int = 0):
    """``wandb.init`` with Megatron-LM's settings and the resolved configuration; returns the W&B run.

    The run's id is kept in ``output_dir/wandb_run_id.txt``. A resumed run (``resume_step`` not None, as
    for metrics.jsonl) takes the id found there and continues that W&B run (``resume="allow"``); a run
    without --load, or a --finetune, starts a new W&B run (and records its id), so that its steps, which
    start again from 1, never land in an earlier run. ``earlier_records``: how many metrics.jsonl records
    past ``resume_step`` the earlier run left; W&B keeps those steps (it ignores steps logged out of order),
    which is said once. WandbError (one line) when wandb is missing or cannot start."""
    try:
        import wandb
    except ImportError as err:
        raise WandbError(f"--wandb-project is set but wandb cannot be imported ({err}); pip install wandb, or drop "
                         f"--wandb-project.") from None
    sl, log = config.save_load, get_logger()
    save_dir = sl.wandb_save_dir or os.path.join(output_dir, "wandb")
    id_path = os.path.join(output_dir, WANDB_RUN_ID_FILE)
    stored = _read_run_id(id_path) if resume_step is not None else None
    try:
        os.makedirs(save_dir, exist_ok=True)
        run = wandb.init(project=sl.wandb_project, name=sl.wandb_exp_name, dir=save_dir, config=to_dict(config),
                         id=stored or _new_run_id(), resume="allow")
    except Exception as err:  # wandb's own errors (no API key, no network) have no common base class
        detail = " ".join(str(err).split())
        raise WandbError(f"cannot start Weights & Biases logging ({type(err).__name__}: {detail}); run wandb login "
                         f"or set WANDB_MODE=offline, or drop --wandb-project.") from None
    _write_run_id(id_path, run.id)
    log.info(f"Weights & Biases: {'continuing' if stored else 'new'} run {run.id} of project {sl.wandb_project}, "
             f"local files in {save_dir}")
    if stored and earlier_records:
        log.warning(f"W&B run {run.id} already holds the earlier run's steps past {resume_step}: W&B ignores steps "
                    f"logged again, so there they keep the earlier run's values (metrics.jsonl has this run's)")
    return run


def _new_run_id() -> str:
    """Eight base-36 characters, as W&B's own ids; from ``secrets``, not ``random``, which the run seeds:
    every run with the same seed would otherwise get the same id."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _read_run_id(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def _write_run_id(path: str, run_id: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(run_id + "\n")
    os.replace(tmp, path)


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
