"""Run health: when skipped steps stop a run, what may be checkpointed, loss spikes."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest

from megatron.health import SPIKE_MIN_HISTORY, RunHealth, TrainingDiverged
from megatron.metrics import get_logger
from megatron.optimizer import StepResult
from megatron.training.step_health import StepHealth


def test_consecutive_bad_steps_stop_the_run():
    health = RunHealth(max_consecutive_bad=3, spike_factor=0)
    assert health.observe(1, 2.0, applied=True) is None
    assert "1 bad step(s) in a row" in health.observe(2, math.nan, applied=False)
    assert "2 bad step(s) in a row" in health.observe(3, math.inf, applied=False)
    with pytest.raises(TrainingDiverged, match="3 steps in a row up to step 4"):
        health.observe(4, math.nan, applied=False)


def test_a_good_step_resets_the_count():
    health = RunHealth(max_consecutive_bad=2, spike_factor=0)
    for step in range(1, 20):  # every other step skipped: never two in a row
        health.observe(step, 2.0, applied=step % 2 == 0)
    assert health.consecutive_bad == 1


def test_skips_that_lower_the_loss_scale_are_not_counted():
    """A dynamic fp16 scaler searching down from 2^15 skips ~2 steps per halving: that is not divergence.
    At its floor (or with a static scale) every skip counts; a non-finite loss counts whatever the scale."""
    health = RunHealth(max_consecutive_bad=2, spike_factor=0)
    for step in range(1, 31):
        health.observe(step, 5.0, applied=False, scale_lowered=True, loss_scale=2.0 ** (15 - step))
    assert health.consecutive_bad == 0
    health.observe(31, 5.0, applied=False, scale_lowered=False, loss_scale=1.0)
    with pytest.raises(TrainingDiverged, match="loss scale 1"):
        health.observe(32, 5.0, applied=False, scale_lowered=False, loss_scale=1.0)
    health = RunHealth(max_consecutive_bad=2, spike_factor=0)
    health.observe(1, math.inf, applied=False, scale_lowered=True)
    with pytest.raises(TrainingDiverged):
        health.observe(2, math.inf, applied=False, scale_lowered=True)


def test_zero_never_stops():
    health = RunHealth(max_consecutive_bad=0, spike_factor=0)
    for step in range(1, 200):
        health.observe(step, math.nan, applied=False)
    assert health.consecutive_bad == 199


def test_what_may_be_saved():
    health = RunHealth(max_consecutive_bad=10, spike_factor=0)
    assert health.why_not_save() is None  # nothing trained yet (a resumed run stopped at once)
    health.observe(1, 3.0, applied=True)
    assert health.why_not_save() is None
    health.observe(2, math.nan, applied=False)
    assert health.why_not_save() == "the loss at step 2 is nan"
    health.observe(3, 3.0, applied=False)  # a finite loss, but its gradients were not finite
    assert "skipped" in health.why_not_save()
    health.observe(4, 3.0, applied=True)
    assert health.why_not_save() is None


def test_a_run_may_not_end_inside_non_finite_losses():
    health = RunHealth(max_consecutive_bad=10, spike_factor=0)
    assert health.why_not_finished() is None  # nothing trained (a finished run launched again)
    health.observe(1, 3.0, applied=True)
    health.observe(2, 3.0, applied=False)  # an overflow skip (fp16 hysteresis): the weights are step 1's
    assert health.why_not_finished() is None
    health.observe(3, math.nan, applied=False)
    assert "step 3 did not train (loss nan)" in health.why_not_finished()
    health.observe(4, 3.0, applied=False)  # a finite loss whose gradients were not: still not recovered
    assert "steps 3-4 did not train (step 3's loss nan, the last one's 3)" in health.why_not_finished()
    health.observe(5, 3.0, applied=True)
    assert health.why_not_finished() is None
    health.observe(6, math.inf, applied=False, scale_lowered=True)  # a lower scale does not mend a forward
    assert "step 6 did not train (loss inf)" in health.why_not_finished()


def test_loss_spike_warns_with_the_step():
    health = RunHealth(max_consecutive_bad=10, spike_factor=3.0)
    for step in range(1, SPIKE_MIN_HISTORY):  # too little history: no judgement yet
        assert health.observe(step, 1.0 if step > 1 else 50.0, applied=True) is None
    for step in range(SPIKE_MIN_HISTORY, 40):
        assert health.observe(step, 2.0, applied=True) is None
    warning = health.observe(40, 12.0, applied=True)  # the mean of 39 steps, 50 among them, is ~3.03
    assert warning is not None and warning.startswith("loss spike at step 40: 12 is 4.0x")
    assert health.observe(41, 2.0, applied=True) is None
    assert RunHealth(10, spike_factor=0).observe(1, 1e9, applied=True) is None


def test_the_trainer_ends_a_run_inside_non_finite_losses_as_a_diverged_one():
    """StepHealth.at_end, which the Trainer calls after its last step and before the save on a stop: exit 3
    (TrainingDiverged), naming the last good checkpoint, unless a step trained since the non-finite loss."""
    health = StepHealth(SimpleNamespace(max_consecutive_skipped_steps=10, loss_spike_factor=3.0),
                        SimpleNamespace(loss_scale=1.0, grad_scaler=None), logs=False)
    health.after_step(1, 5.0, StepResult(True, 0.5), lambda: "")
    health.at_end(lambda: "unused")
    health.after_step(2, math.nan, StepResult(False, None), lambda: "")
    with pytest.raises(TrainingDiverged, match=r"step 2 did not train \(loss nan\).*\(last good checkpoint: x/step_1"):
        health.at_end(lambda: "last good checkpoint: x/step_1")
    health.after_step(3, 4.9, StepResult(True, 0.5), lambda: "")
    health.at_end(lambda: "unused")


def test_gradients_that_are_all_zero_are_said_once():
    """fp16 with a static scale of 1e-10: every gradient underflows, the steps apply and nothing trains."""
    health = RunHealth(max_consecutive_bad=10, spike_factor=0)
    said = [health.observe(step, 5.5, applied=True, loss_scale=1e-10, grad_norm=0.0) for step in range(1, 31)]
    assert said[:9] == [None] * 9 and said[10:] == [None] * 20
    assert said[9].startswith("steps 1-10 had a gradient norm of 0: nothing trains; the fp16 loss scale 1e-10 is "
                              "too small") and "--initial-loss-scale" in said[9]
    health.observe(31, 5.5, applied=True, grad_norm=0.5)  # a gradient: a new streak is said again
    said = [health.observe(step, 5.5, applied=True, grad_norm=0.0) for step in range(32, 42)]
    assert said[-1].startswith("steps 32-41 had a gradient norm of 0") and "masked" in said[-1]
    # the Trainer's health passes each step's gradient norm and loss scale on, and logs the line
    static = SimpleNamespace(loss_scale=1e-10, grad_scaler=object())
    health = StepHealth(SimpleNamespace(max_consecutive_skipped_steps=10, loss_spike_factor=3.0), static, logs=True)
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    get_logger().addHandler(handler)
    try:
        for step in range(1, 11):
            health.before_step()
            health.after_step(step, 5.5, StepResult(True, 0.0), lambda: "")
    finally:
        get_logger().removeHandler(handler)
    assert messages == ["steps 1-10 had a gradient norm of 0: nothing trains; the fp16 loss scale 1e-10 is too small: "
                        "the scaled gradients underflow to zero in fp16; raise it (static: --initial-loss-scale, or "
                        "drop --no-dynamic-loss-scale; dynamic: --min-loss-scale)"]


def test_a_checkpoint_is_good_once_the_next_step_is(tmp_path, monkeypatch):
    """Pruning keeps the newest confirmed checkpoint; divergence points 'latest' back at it."""
    import megatron.checkpoint as ckpt
    from megatron.health import GoodCheckpoints

    pruned: list[tuple] = []
    monkeypatch.setattr(ckpt, "prune_checkpoints", lambda out, step, keep, protect=None: pruned.append((step, protect)))
    for step in (3, 4):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "metadata.json").write_text("{}")
    keeper = GoodCheckpoints(str(tmp_path), keep_last=1, acts=True)
    assert keeper.after_divergence() == "no checkpoint of this run is known good"
    keeper.saved(3, str(tmp_path / "step_3"))
    keeper.step_done(math.nan, applied=False)  # step 4 with step_3's weights went wrong: not confirmed
    assert keeper.good is None
    keeper.step_done(2.0, applied=True)  # a later good step still confirms what was saved last
    assert keeper.good == str(tmp_path / "step_3")
    keeper.saved(4, str(tmp_path / "step_4"))
    (tmp_path / "latest").write_text("step_4")
    assert pruned == [(3, None), (3, str(tmp_path / "step_3")), (4, str(tmp_path / "step_3"))]
    assert keeper.after_divergence().endswith("step_3, which 'latest' now names again")
    assert (tmp_path / "latest").read_text().strip() == "step_3"
    assert keeper.after_divergence() == f"last good checkpoint: {tmp_path / 'step_3'}"
