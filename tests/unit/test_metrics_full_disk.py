"""Metrics on a full disk: metrics.jsonl or the TensorBoard events cannot be written (ENOSPC) once the run is
going. One warning per sink, that sink left alone after it, and training goes on: no exception, no
traceback (TensorBoard's writer thread included)."""

from __future__ import annotations

import errno
import io
import json
import logging
import threading

import pytest

from megatron.metrics import MetricsWriter, get_logger

pytest.importorskip("tensorboard")


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture
def warnings():
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    get_logger().addHandler(handler)
    yield messages
    get_logger().removeHandler(handler)


@pytest.fixture
def thread_tracebacks(monkeypatch):
    """What threading would print for a thread that died (TensorBoard's writer)."""
    died: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda hook_args: died.append(hook_args.thread.name))
    return died


def _record(step: int) -> dict:
    return {"split": "train", "step": step, "loss": 5.0 - step / 10}


def test_a_full_disk_under_metrics_jsonl_is_one_warning_and_training_goes_on(tmp_path, warnings):
    writer = MetricsWriter(str(tmp_path), None)
    writer.write(_record(1))
    good = writer._jsonl
    full = io.StringIO()
    full.write = _full  # the disk fills up: every write from now on fails
    writer._jsonl = full
    for step in range(2, 6):
        writer.write(_record(step))  # no exception
    writer.close()
    good.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
    said = [m for m in warnings if "metrics.jsonl" in m]
    assert len(said) == 1 and said[0].startswith(f"cannot write {tmp_path / 'metrics.jsonl'} (No space left on "
                                                 f"device): no more metrics are written there this run")


def test_a_full_disk_under_the_tensorboard_events_is_one_warning_and_no_traceback(tmp_path, warnings,
                                                                                  thread_tracebacks, monkeypatch):
    from tensorboard.compat.tensorflow_stub.io import gfile

    writer = MetricsWriter(str(tmp_path), None)
    monkeypatch.setattr(gfile.LocalFileSystem, "append", _full)  # TensorBoard's thread flushes its events here
    for step in range(1, 6):
        writer.write(_record(step))
    writer.close()  # flushes: the error is met here at the latest
    said = [m for m in warnings if "TensorBoard" in m]
    assert len(said) == 1 and said[0].startswith(f"cannot write the TensorBoard events in {tmp_path / 'tensorboard'} "
                                                 f"(No space left on device)"), warnings
    assert thread_tracebacks == []
    # metrics.jsonl, on another disk here, has every record
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == \
        [1, 2, 3, 4, 5]


class _FailingWandbRun:
    """A W&B run whose service died after the first record (wandb raises its own errors, or OSError)."""

    def __init__(self):
        self.logged, self.finished = [], False

    def log(self, values, step):
        if self.logged:
            raise RuntimeError("wandb service process exited\nwith code 1")
        self.logged.append(step)

    def finish(self, exit_code=0):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_weights_and_biases_failing_is_one_warning_and_training_goes_on(tmp_path, warnings):
    writer = MetricsWriter(str(tmp_path), None)
    run = writer._wandb = _FailingWandbRun()
    for step in range(1, 5):
        writer.write(_record(step))  # no exception
    writer.close()  # neither at the end
    assert run.logged == [1]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    said = [m for m in warnings if "Weights & Biases" in m]
    assert said == ["cannot log to Weights & Biases (RuntimeError: wandb service process exited with code 1): no more "
                    "metrics go there this run; training goes on (metrics.jsonl keeps them)"]


def test_weights_and_biases_failing_to_finish_is_one_warning(tmp_path, warnings):
    writer = MetricsWriter(str(tmp_path), None)
    writer._wandb = _FailingWandbRun()
    writer.write(_record(1))
    writer.close()  # finish fails: said, not raised
    assert [m for m in warnings if "Weights & Biases" in m] == [
        "cannot log to Weights & Biases (OSError: [Errno 28] No space left on device): no more metrics go there this "
        "run; training goes on (metrics.jsonl keeps them)"]
