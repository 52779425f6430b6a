"""End to end: training with a batch-size ramp-up (``--rampup-batch-size`` with ``--train-samples``) and a
step schedule (``--step-batch-size-schedule``): the batch of every step, the consumed samples, the log line,
and a save at step k + resume that takes the same batches and gives the same losses."""

from __future__ import annotations

import json
import re

import pytest

from tests.functional.launch import TINY, losses, parity_layouts

pytestmark = [pytest.mark.slow, pytest.mark.shared_runs("ramp-mbs2")]

LENGTHLESS = [a for i, a in enumerate(TINY) if a != "--max-steps" and TINY[i - 1] != "--max-steps"]
# global batch 16 reached from 4 by 4 over 24 samples: 4 below 8 samples, 8 below 16, 12 up to 24, then 16
RAMP = [*LENGTHLESS, "--rampup-batch-size", "4", "4", "24", "--train-samples", "120"]
RAMP_BATCHES = [4, 4, 8, 12, 16, 16, 16, 16, 16, 16]  # the 10th step starts at 108 < 120 samples and ends at 124


def _records(out, split="train"):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


def _logged_batches(stderr: str) -> list[int]:
    return [int(n) for n in re.findall(r" - global step \d+,.*, global batch size: (\d+)", stderr)]


parity_layouts({"ramp": (1, [*RAMP, "--save-interval", "3"]),
                "ramp-resumed": (1, [*RAMP, "--load", "{runs}/ramp/step_3"], ("ramp",)),
                "ramp-mbs2": (1, [*RAMP, "--micro-batch-size", "2"]),
                "ramp-dp2": (2, [*RAMP, "--micro-batch-size", "2"]),
                "step-schedule": (1, [*LENGTHLESS, "--train-iters", "6", "--step-batch-size-schedule", "0:8 512:16"])})


@pytest.mark.parametrize("layout", ["ramp-resumed"])
def test_rampup_batches_consumed_samples_and_an_exact_resume(parity, layout):
    full = parity.outcome("ramp")
    train = _records(full.check())
    assert [r["global_batch_size"] for r in train] == RAMP_BATCHES
    consumed = [sum(RAMP_BATCHES[:k + 1]) for k in range(10)]
    assert [r["consumed_samples"] for r in train] == consumed and consumed[-1] == 124
    assert _logged_batches(full.log) == RAMP_BATCHES
    # tokens/s counts the step's own batch: the 16-sample steps move ~4x the tokens of the 4-sample ones
    assert train[-1]["ips_total"] * train[-1]["avg_batch_cost"] == pytest.approx(16 * 32)
    assert train[0]["ips_total"] * train[0]["avg_batch_cost"] == pytest.approx(4 * 32)
    # saved at step 3 (16 samples, mid-ramp): the resumed run takes the same batches and reproduces every loss
    again = _records(parity.outcome(layout).check())
    assert [r["step"] for r in again] == list(range(4, 11))
    assert [r["global_batch_size"] for r in again] == RAMP_BATCHES[3:]
    assert [r["consumed_samples"] for r in again] == consumed[3:]
    assert [r["learning_rate"] for r in again] == [r["learning_rate"] for r in train[3:]]
    assert [r["loss"] for r in again] == [r["loss"] for r in train[3:]]


@pytest.mark.parametrize("layout", ["ramp-dp2"])
def test_rampup_under_data_parallelism_matches_one_process(parity, layout):
    """dp 2: each rank reads its half of every step's batch (1, 1, 2, 3, then 4 micro-batches of 2): the
    losses are those of one process (fp32 round-off of the summed gradients only)."""
    dp2 = parity.outcome(layout).check()
    assert [r["global_batch_size"] for r in _records(dp2)] == RAMP_BATCHES
    assert losses(dp2) == pytest.approx(losses(parity.outcome("ramp-mbs2").check()), rel=1e-5)


@pytest.mark.parametrize("layout", ["step-schedule"])
def test_step_schedule_by_consumed_tokens(parity, layout):
    """'0:8 512:16' with 32-token samples: 8 until 512 tokens (16 samples) are consumed, then 16 (the global
    batch, given equal to the last one as Megatron's 175B example does), for --train-iters 6."""
    result = parity.outcome(layout)
    train = _records(result.check())
    assert [r["global_batch_size"] for r in train] == [8, 8, 16, 16, 16, 16]
    assert [r["consumed_samples"] for r in train] == [8, 16, 32, 48, 64, 80]
    assert _logged_batches(result.log) == [8, 8, 16, 16, 16, 16]
