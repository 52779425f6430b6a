"""A run that has gone wrong stops, says so and exits non-zero, and keeps its good checkpoint."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron.training.stopping import StopRequests
from tests.functional.launch import parity_layouts
from tests.functional.processes import popen
from tests.functional.test_pretrain_cli import REPO, TINY

pytestmark = pytest.mark.slow  # runs training processes end to end, as every functional module


def _steps_logged(output: str) -> list[int]:
    return [int(s) for s in re.findall(r" - global step (\d+),", output)]


_CKPT = ["--save", "{runs}/health-saved", "--load", "{runs}/health-saved", "--save-interval", "1",
         "--keep-last-checkpoints", "1"]
_FP16 = [*TINY, "--fp16", "--lr", "1e-3", "--max-consecutive-skipped-steps", "3", "--eval-iters", "0"]
parity_layouts({
    "health-saved": (1, [*TINY, "--max-steps", "3", "--lr", "1e-3", *_CKPT]),
    "health-diverged": (1, [*TINY, "--max-steps", "40", "--lr", "1e6", "--min-lr", "1e6",
                            "--max-consecutive-skipped-steps", "4", *_CKPT], ("health-saved",)),
    "fp16-static-1e30": (1, [*_FP16, "--max-steps", "30", "--no-dynamic-loss-scale", "--initial-loss-scale", "1e30"]),
    "fp16-dynamic-backs-off": (1, [*_FP16, "--max-steps", "24", "--initial-loss-scale", str(2.0 ** 36),
                                   "--hysteresis", "1"])})


@pytest.mark.parametrize("layout", ["health-diverged"])
def test_diverged_run_stops_and_keeps_the_good_checkpoint(parity, layout):
    """A run saves every step with keep-last 1; resumed at lr 1e6, step 4's loss is still finite (it uses
    step_3's weights, which confirms step_3) but its update explodes the weights that step_4 holds.
    The run stops after 4 bad steps in a row with exit 3, step_3 is never pruned, and 'latest' names
    it again, so a plain relaunch does not resume from the poisoned step_4."""
    out = parity.outcome("health-saved").check()
    diverged = parity.outcome(layout)
    assert diverged.returncode == 3, diverged.log[-3000:]
    output = diverged.log + diverged.stdout
    errors = [line for line in diverged.log.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1 and "training diverged: 4 steps in a row up to step 8" in errors[0], errors
    assert f"last good checkpoint: {out / 'step_3'}, which 'latest' now names again" in errors[0]
    assert _steps_logged(output) == [4, 5, 6, 7, 8]  # stopped at once, not at max_steps
    assert "not saving a checkpoint at step 5: the loss at step 5 is nan" in output
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step_")) == ["step_3", "step_4"]
    assert (out / "latest").read_text().strip() == "step_3"
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["split"] == "train"]
    assert all(math.isfinite(x) for x in losses[:4]) and not any(math.isfinite(x) for x in losses[4:])


parity_layouts({"health-nan-at-end": (1, [*TINY, "--max-steps", "5", "--lr", "1e6", "--min-lr", "1e6", "--eval-iters",
                                         "0", "--save-interval", "1", "--keep-last-checkpoints", "1"])})


@pytest.mark.parametrize("layout", ["health-nan-at-end"])
def test_a_run_that_ends_inside_non_finite_losses_exits_3_with_latest_on_a_good_checkpoint(parity, layout):
    """At lr 1e6 step 2 trains (its finite loss confirms step_1) and explodes the weights step_2 holds; steps 3-5
    are NaN, fewer than the 10 in a row that stop a run. The run still must not end with exit 0 and 'latest'
    on step_2: it exits 3 with one line, and 'latest' names step_1 again, so a relaunch resumes good weights."""
    result = parity.outcome(layout)
    assert result.returncode == 3, result.log[-3000:]
    out = result.out
    errors = [line for line in result.log.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1 and "steps 3-5 did not train (step 3's loss nan" in errors[0], errors
    assert f"last good checkpoint: {out / 'step_1'}, which 'latest' now names again" in errors[0]
    assert "Traceback" not in result.log
    assert (out / "latest").read_text().strip() == "step_1"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in records if r["split"] == "train"]
    assert all(math.isfinite(x) for x in train[:2]) and not any(math.isfinite(x) for x in train[2:])
    assert len(train) == 5


@pytest.mark.parametrize("layout, stops_at", [
    ("fp16-static-1e30", 3),  # static: every skip counts
    # dynamic from 2^36 with hysteresis 1: it halves on every overflow (~18 in a row), which is the
    # scaler's search, not divergence; it trains once the scale fits fp16 and the run ends normally
    ("fp16-dynamic-backs-off", None),
])
def test_fp16_overflow_policy(parity, layout, stops_at):
    result = parity.outcome(layout)
    output = result.log + result.stdout
    if stops_at is not None:
        assert result.returncode == 3, result.log[-3000:]
        assert f"training diverged: 3 steps in a row up to step {stops_at}" in result.log
        assert "loss scale 1e+30" in result.log
        assert _steps_logged(output)[-1] == stops_at
    else:
        out = result.check()
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        last = [r for r in records if r["split"] == "train"][-1]
        assert last["step"] == 24 and math.isfinite(last["loss"])
        # every skip halved the scale once (hysteresis 1), and far more skips came in a row than the 3 allowed
        assert last["skipped_steps"] == round(math.log2(2.0 ** 36 / last["loss_scale"]))
        assert 3 < last["skipped_steps"] < 24


def test_ctrl_c_saves_and_exits_and_a_second_stops_at_once(tmp_path):
    """A first Ctrl-C saves at the end of the step and exits 0, like SIGTERM; a second raises
    KeyboardInterrupt (pretrain_gpt.py prints one line and exits 130)."""
    argv = [sys.executable, "pretrain_gpt.py", *TINY, "--max-steps", "100000", "--save", str(tmp_path),
            "--save-interval", "100000"]
    proc = popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if " - global step 3," in line:
                break
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, output[-3000:]
    step = int(re.search(r"SIGINT received \(Ctrl-C again to stop at once, without saving\): saving at step (\d+)",
                         output)[1])
    assert (tmp_path / "latest").read_text().strip() == f"step_{step}"
    assert "Traceback" not in output
    stopping = SimpleNamespace(signal_name=None)
    StopRequests.on_signal(stopping, signal.SIGINT, None)
    assert stopping.signal_name == "SIGINT"
    with pytest.raises(KeyboardInterrupt):
        StopRequests.on_signal(stopping, signal.SIGINT, None)


_FINISHED = [*TINY, "--max-steps", "3", "--save", "{runs}/finished", "--load", "{runs}/finished",
             "--save-interval", "3"]
parity_layouts({"finished": (1, _FINISHED), "finished-again": (1, _FINISHED, ("finished",))})


@pytest.mark.parametrize("layout", ["finished-again"])
def test_a_finished_run_launched_again_trains_and_evaluates_nothing(parity, layout):
    out = parity.outcome("finished").check()
    again = parity.outcome(layout)
    again.check()
    assert "nothing to train: the run is at step 3 and stops at step 3" in again.log
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["split"], r["step"]) for r in records] == [("train", 1), ("train", 2), ("train", 3), ("save", 3),
                                                          ("valid", 3), ("test", 3)]
