"""End to end: training with a batch-size ramp-up (``--rampup-batch-size`` with ``--train-samples``) and a
step schedule (``--step-batch-size-schedule``): the batch of every step, the consumed samples, the log line,
and a save at step k + resume that takes the same batches and gives the same losses."""

from __future__ import annotations

import json
import re

import pytest

from tests.functional.launch import TINY, losses, run

pytestmark = pytest.mark.slow

LENGTHLESS = [a for i, a in enumerate(TINY) if a != "--max-steps" and TINY[i - 1] != "--max-steps"]
# global batch 16 reached from 4 by 4 over 24 samples: 4 below 8 samples, 8 below 16, 12 up to 24, then 16
RAMP = [*LENGTHLESS, "--rampup-batch-size", "4", "4", "24", "--train-samples", "120"]
RAMP_BATCHES = [4, 4, 8, 12, 16, 16, 16, 16, 16, 16]  # the 10th step starts at 108 < 120 samples and ends at 124


def _records(out, split="train"):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


def _logged_batches(stderr: str) -> list[int]:
    return [int(n) for n in re.findall(r" - global step \d+,.*, global batch size: (\d+)", stderr)]


def test_rampup_batches_consumed_samples_and_an_exact_resume(tmp_path):
    full = run(tmp_path / "full", *RAMP, "--save-interval", "3")
    assert full.returncode == 0, full.stderr[-3000:]
    train = _records(tmp_path / "full")
    assert [r["global_batch_size"] for r in train] == RAMP_BATCHES
    consumed = [sum(RAMP_BATCHES[:k + 1]) for k in range(10)]
    assert [r["consumed_samples"] for r in train] == consumed and consumed[-1] == 124
    assert _logged_batches(full.stderr) == RAMP_BATCHES
    # tokens/s counts the step's own batch: the 16-sample steps move ~4x the tokens of the 4-sample ones
    assert train[-1]["ips_total"] * train[-1]["avg_batch_cost"] == pytest.approx(16 * 32)
    assert train[0]["ips_total"] * train[0]["avg_batch_cost"] == pytest.approx(4 * 32)
    # saved at step 3 (16 samples, mid-ramp): the resumed run takes the same batches and reproduces every loss
    resumed = run(tmp_path / "resumed", *RAMP, "--load", str(tmp_path / "full" / "step_3"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = _records(tmp_path / "resumed")
    assert [r["step"] for r in again] == list(range(4, 11))
    assert [r["global_batch_size"] for r in again] == RAMP_BATCHES[3:]
    assert [r["consumed_samples"] for r in again] == consumed[3:]
    assert [r["learning_rate"] for r in again] == [r["learning_rate"] for r in train[3:]]
    assert losses(tmp_path / "resumed") == losses(tmp_path / "full")[3:]


def test_rampup_under_data_parallelism_matches_one_process(tmp_path):
    """dp 2: each rank reads its half of every step's batch (1, 1, 2, 3, then 4 micro-batches of 2): the
    losses are those of one process (fp32 round-off of the summed gradients only)."""
    flags = [*RAMP, "--micro-batch-size", "2"]
    single = run(tmp_path / "single", *flags)
    assert single.returncode == 0, single.stderr[-3000:]
    dp2 = run(tmp_path / "dp2", *flags, nproc=2)
    assert dp2.returncode == 0, dp2.stderr[-3000:]
    assert [r["global_batch_size"] for r in _records(tmp_path / "dp2")] == RAMP_BATCHES
    assert losses(tmp_path / "dp2") == pytest.approx(losses(tmp_path / "single"), rel=1e-5)


def test_step_schedule_by_consumed_tokens(tmp_path):
    """'0:8 512:16' with 32-token samples: 8 until 512 tokens (16 samples) are consumed, then 16 (the global
    batch, given equal to the last one as Megatron's 175B example does), for --train-iters 6."""
    out = tmp_path / "out"
    result = run(out, *LENGTHLESS, "--train-iters", "6", "--step-batch-size-schedule", "0:8 512:16")
    assert result.returncode == 0, result.stderr[-3000:]
    train = _records(out)
    assert [r["global_batch_size"] for r in train] == [8, 8, 16, 16, 16, 16]
    assert [r["consumed_samples"] for r in train] == [8, 16, 32, 48, 64, 80]
    assert _logged_batches(result.stderr) == [8, 8, 16, 16, 16, 16]
