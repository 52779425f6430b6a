"""A run that has gone wrong stops, says so and exits non-zero, and keeps its good checkpoint."""

from __future__ import annotations

import json
import math
import re
import time

import pytest

from tests.functional.test_pretrain_cli import TINY, run_cli


def _steps_logged(output: str) -> list[int]:
    return [int(s) for s in re.findall(r" - global step (\d+),", output)]


def test_diverged_run_stops_and_keeps_the_good_checkpoint(tmp_path):
    """lr 1e6: step 1 is finite and saved, every later step NaN. The run stops after 4 bad steps in a
    row with exit 3; the NaN states are never saved, so keep-last 1 never prunes step_1."""
    out = tmp_path / "out"
    start = time.monotonic()
    proc = run_cli(*TINY, "--max-steps", "40", "--lr", "1e6", "--min-lr", "1", "--save", str(out),
                   "--save-interval", "1", "--keep-last-checkpoints", "1", "--max-consecutive-skipped-steps", "4")
    assert time.monotonic() - start < 100
    assert proc.returncode == 3, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1 and "training diverged: 4 steps in a row up to step 5" in errors[0], errors
    assert f"last checkpoint: {out / 'step_1'}" in errors[0]
    assert _steps_logged(output) == [1, 2, 3, 4, 5]  # stopped at once, not at max_steps
    assert "not saving a checkpoint at step 2: the loss at step 2 is nan" in output
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step_")) == ["step_1"]
    assert (out / "latest").read_text().strip() == "step_1"
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert math.isfinite(losses[0]) and not any(math.isfinite(x) for x in losses[1:])


@pytest.mark.parametrize("scale_flags, stops_at", [
    (["--no-dynamic-loss-scale", "--initial-loss-scale", "1e30"], 3),  # static: every skip counts
    # dynamic from 2^60 with hysteresis 1: it halves on every overflow (~40 in a row), which is the
    # scaler's search, not divergence; it trains once the scale fits fp16 and the run ends normally
    (["--initial-loss-scale", str(2.0 ** 60), "--hysteresis", "1"], None),
], ids=["static-1e30", "dynamic-backs-off"])
def test_fp16_overflow_policy(tmp_path, scale_flags, stops_at):
    proc = run_cli(*TINY, "--fp16", "--max-steps", "50" if stops_at is None else "30", "--lr", "1e-3",
                   "--max-consecutive-skipped-steps", "3", "--eval-iters", "0", "--output-dir", str(tmp_path),
                   *scale_flags, timeout=300)
    output = proc.stdout + proc.stderr
    if stops_at is not None:
        assert proc.returncode == 3, proc.stderr[-3000:]
        assert f"training diverged: 3 steps in a row up to step {stops_at}" in proc.stderr
        assert "loss scale 1e+30" in proc.stderr
        assert _steps_logged(output)[-1] == stops_at
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        last = records[-1]
        assert last["step"] == 50 and math.isfinite(last["loss"])
        # every skip halved the scale once (hysteresis 1), and far more skips came in a row than the 3 allowed
        assert last["skipped_steps"] == round(math.log2(2.0 ** 60 / last["loss_scale"]))
        assert 3 < last["skipped_steps"] < 50
