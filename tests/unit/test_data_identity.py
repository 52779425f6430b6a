"""The data a checkpoint was trained on is part of the run: recorded with each checkpoint (its content
fingerprint, not its path), re-checked before each save (a ``.bin`` rewritten under a running job is one line,
never a checkpoint that records data the run did not train on) and compared at resume (another corpus under
the same name is one line; ``--override-data-order`` says it is meant)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDatasetWriter
from tests.functional.launch import TINY, run_here

MODEL = [a for a in TINY if a != "--mock-data"]


def _write(prefix, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(str(prefix), np.int32) as writer:  # token ids within TINY's vocabulary of 256
        for _ in range(30):
            writer.add_document(rng.integers(1, 256, size=20))


@pytest.fixture
def data(tmp_path):
    prefix = tmp_path / "data" / "ds"
    prefix.parent.mkdir()
    _write(prefix, 0)
    return prefix


def _args(prefix, out, *extra):
    return [*MODEL, "--data-path", str(prefix), "--tokenizer-type", "NullTokenizer", "--eval-iters", "0",
            "--save", str(out), *extra]


def test_a_resume_on_other_data_under_the_same_name_is_one_line(data, tmp_path):
    out = tmp_path / "run"
    first = run_here(*_args(data, out, "--max-steps", "2"))
    assert first.returncode == 0, first.stderr[-2000:]
    saved = json.loads((out / "step_2" / "common.json").read_text())["train_state"]["data_fingerprint"]
    assert [d["path"] for d in saved["datasets"]] == [str(data)]
    _write(data, 1)  # another corpus of the same size, in place
    again = run_here(*_args(data, out, "--max-steps", "3", "--load", str(out)))
    assert again.returncode == 2 and again.stderr.count("error:") == 1, again.stderr[-2000:]
    assert f"cannot resume {out / 'step_2'}: the data differs from the checkpoint's run" in again.stderr
    assert "--override-data-order" in again.stderr and (out / "latest").read_text() == "step_2"
    meant = run_here(*_args(data, out, "--max-steps", "3", "--load", str(out), "--override-data-order"))
    assert meant.returncode == 0, meant.stderr[-2000:]
    assert (out / "latest").read_text() == "step_3"


def test_a_copy_of_the_data_elsewhere_resumes(data, tmp_path):
    out = tmp_path / "run"
    assert run_here(*_args(data, out, "--max-steps", "1")).returncode == 0
    moved = tmp_path / "node-local" / "ds"
    moved.parent.mkdir()
    for suffix in (".bin", ".idx"):
        moved.with_suffix(suffix).write_bytes(data.with_suffix(suffix).read_bytes())
    again = run_here(*_args(moved, out, "--max-steps", "2", "--load", str(out)))
    assert again.returncode == 0, again.stderr[-2000:]


def test_a_bin_rewritten_under_the_run_stops_it_before_the_next_save(data, tmp_path, monkeypatch):
    from megatron.training.trainer import Trainer

    real_step = Trainer._step

    def step_then_rewrite(self, batch):
        result = real_step(self, batch)
        if self.state.step == 1:
            _write(data, 1)  # someone regenerates the corpus while the job runs
        return result

    monkeypatch.setattr(Trainer, "_step", step_then_rewrite)
    out = tmp_path / "run"
    result = run_here(*_args(data, out, "--max-steps", "4", "--save-interval", "2"))
    assert result.returncode == 2 and result.stderr.count("error:") == 1, result.stderr[-2000:]
    assert f"{data}.bin (or its .idx) changed since the run opened it" in result.stderr
    assert not (out / "latest").exists() and not (out / "step_2").exists()
