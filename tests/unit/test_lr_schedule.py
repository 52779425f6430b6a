"""The learning-rate and weight-decay schedule against Megatron-LM's OptimizerParamScheduler rule.

Every expected value is written from the rule by hand (positions n in samples; iteration-based lengths
are x global batch), not computed by the implementation. The schedules are built from command lines
through validation, so the unit conversions (iterations -> samples, fractions) are tested too. These
command lines name their length the Megatron way, so Megatron's defaults apply (linear decay, no warm-up)."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

import pretrain_gpt
from megatron.config import ConfigError, parse_config, validate
from megatron.metrics import get_logger
from megatron.optimizer import build_param_schedule
from megatron.parallelize_gpt import build_model
from megatron.training import Trainer, set_seed

BASE = ("--mock-data", "--device", "cpu", "--global-batch-size", "8", "--micro-batch-size", "8", "--lr", "1.0",
        "--min-lr", "0.1")


def schedule(*argv: str):
    config = parse_config([*BASE, *argv])
    validate(config)
    return build_param_schedule(config)


# ---------------------------------------------------------------- warm-up


@pytest.mark.parametrize("length", [
    ("--train-iters", "100", "--lr-warmup-iters", "10"),  # 10 x 8 = 80 of 100 x 8 = 800 samples
    ("--train-iters", "100", "--lr-warmup-fraction", "0.1"),  # 0.1 x 800
    ("--train-iters", "100", "--lr-decay-iters", "100", "--lr-warmup-fraction", "0.1"),
    ("--train-samples", "800", "--lr-warmup-samples", "80"),
    ("--train-samples", "800", "--lr-warmup-fraction", "0.1"),
    ("--train-samples", "900", "--lr-decay-samples", "800", "--lr-warmup-samples", "80"),
], ids=["iters", "iters-fraction", "decay-iters", "samples", "samples-fraction", "decay-samples"])
def test_warmup_from_warmup_init_then_linear_decay(length):
    s = schedule(*length, "--lr-warmup-init", "0.2", "--lr-decay-style", "linear")
    assert s.lr(0) == pytest.approx(0.2)  # the first step trains at warmup_init
    assert s.lr(8) == pytest.approx(0.2 + 0.8 * 8 / 80)
    assert s.lr(40) == pytest.approx(0.6)
    assert s.lr(80) == pytest.approx(1.0)
    assert s.lr(440) == pytest.approx(0.1 + 0.9 * (1 - (440 - 80) / 720))
    assert s.lr(800) == pytest.approx(0.1) and s.lr(801) == s.lr(10**9) == pytest.approx(0.1)


def test_fractional_warmup_is_not_rounded_to_whole_steps():
    """0.01 x 150 iterations = 1.5 warm-up steps = 12 samples (Megatron keeps the fraction)."""
    s = schedule("--train-iters", "150", "--lr-warmup-fraction", "0.01", "--lr-decay-style", "cosine")
    assert s.warmup == pytest.approx(12.0)
    assert s.lr(0) == 0.0 and s.lr(8) == pytest.approx(8 / 12)
    assert s.lr(16) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (16 - 12) / (1200 - 12))))


def test_no_warmup_starts_at_max_lr():
    s = schedule("--train-iters", "100", "--lr-warmup-fraction", "0")
    assert s.lr(0) == pytest.approx(1.0)
    assert s.lr(400) == pytest.approx(0.55)


# ---------------------------------------------------------------- decay styles (warm-up 100, decay 1000 samples)


LENGTH = ("--train-samples", "1000", "--lr-warmup-samples", "100")
C = 0.5 * (1 + math.cos(math.pi / 4))  # cosine coefficient a quarter of the way


@pytest.mark.parametrize("style, points", [
    ("cosine", {50: 0.5, 100: 1.0, 325: 0.1 + 0.9 * C, 550: 0.55, 1000: 0.1, 1001: 0.1}),
    ("linear", {50: 0.5, 325: 0.1 + 0.9 * 0.75, 550: 0.55, 1000: 0.1, 5000: 0.1}),
    ("constant", {0: 0.0, 50: 0.5, 101: 1.0, 5000: 1.0}),
    # max_lr sqrt(max(warm-up, 1) / max(n, 1)), floored at min_lr, and min_lr past the decay
    ("inverse-square-root", {50: 0.5, 100: 1.0, 400: 0.5, 900: 1 / 3, 1000: math.sqrt(0.1), 1001: 0.1}),
])
def test_decay_styles(style, points):
    s = schedule(*LENGTH, "--lr-decay-style", style)
    for n, lr in points.items():
        assert s.lr(n) == pytest.approx(lr), n


def test_inverse_square_root_is_floored_at_min_lr():
    s = schedule(*LENGTH, "--lr-decay-style", "inverse-square-root", "--min-lr", "0.4")
    assert s.lr(400) == pytest.approx(0.5) and s.lr(900) == pytest.approx(0.4)


@pytest.mark.parametrize("wsd_style, coefficient_half_way", [
    ("exponential", 2 * 0.5**0.5 - 1), ("linear", 0.5), ("cosine", 0.5), ("minus_sqrt", 1 - math.sqrt(0.5)),
])
@pytest.mark.parametrize("length", [
    (*LENGTH, "--lr-wsd-decay-samples", "200"),
    ("--train-iters", "125", "--lr-warmup-iters", "12", "--lr-wsd-decay-iters", "25"),
], ids=["samples", "iters"])
def test_wsd_stays_flat_then_decays_over_its_last_part(wsd_style, coefficient_half_way, length):
    s = schedule(*length, "--lr-decay-style", "WSD", "--lr-wsd-decay-style", wsd_style)
    assert s.lr(150) == s.lr(500) == s.lr(800) == pytest.approx(1.0)  # stable until decay - 200 = 800
    assert s.lr(900) == pytest.approx(0.1 + 0.9 * coefficient_half_way)
    assert s.lr(1000) == pytest.approx(0.1) and s.lr(1001) == pytest.approx(0.1)


# ---------------------------------------------------------------- weight decay (over the training length)


@pytest.mark.parametrize("length", [("--train-samples", "1000"), ("--train-iters", "125")], ids=["samples", "iters"])
def test_weight_decay_styles(length):
    linear = schedule(*length, "--weight-decay-incr-style", "linear", "--start-weight-decay", "0.1",
                      "--end-weight-decay", "0.5")
    assert [linear.weight_decay(n) for n in (0, 250, 1000, 2000)] == pytest.approx([0.1, 0.2, 0.5, 0.5])
    cosine = schedule(*length, "--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.1",
                      "--end-weight-decay", "0.5")
    assert cosine.weight_decay(0) == pytest.approx(0.1)
    assert cosine.weight_decay(250) == pytest.approx(0.1 + 0.4 * 0.5 * (1 + math.cos(math.pi * 0.75)))
    assert cosine.weight_decay(1000) == pytest.approx(0.5) and cosine.weight_decay(1500) == pytest.approx(0.5)
    constant = schedule(*length, "--weight-decay", "0.3")
    assert constant.weight_decay(0) == constant.weight_decay(10**6) == 0.3
    default_ends = schedule(*length, "--weight-decay", "0.3", "--weight-decay-incr-style", "linear",
                            "--end-weight-decay", "0.7")
    assert default_ends.weight_decay(500) == pytest.approx(0.5)  # from weight_decay 0.3 to 0.7


# ---------------------------------------------------------------- refused


@pytest.mark.parametrize("argv, message", [
    (("--train-iters", "100", "--lr-decay-samples", "800"),
     "decay_samples is counted in samples, which needs train_samples"),
    (("--train-samples", "800", "--train-iters", "100"), "but max_steps is counted in steps; drop it"),
    (("--train-samples", "800", "--lr-warmup-iters", "1", "--lr-decay-iters", "9"),
     "but decay_steps, warmup_steps are counted in steps; drop them"),
    (("--train-iters", "10", "--lr-warmup-iters", "10"), r"warm-up \(10 steps\) must end before the decay"),
    (("--train-iters", "10", "--lr-decay-style", "WSD"), "decay_style WSD needs .* wsd_decay_steps"),
    (("--train-samples", "80", "--lr-decay-style", "WSD"), "wsd_decay_samples"),
    (("--train-iters", "10", "--lr-warmup-init", "2"), r"warmup_init \(2\) must be in \[0, max_lr"),
    (("--train-iters", "10", "--start-weight-decay", "0.1"), "with weight_decay_incr_style constant"),
    (("--train-iters", "10", "--weight-decay-incr-style", "linear", "--start-weight-decay", "0.5",
      "--end-weight-decay", "0.1"), "goes from start_weight_decay"),
])
def test_inconsistent_schedules_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        schedule(*argv)


def test_train_samples_with_the_default_max_steps_is_no_conflict():
    """max_steps always has FleetX's default (500000): only another value is a conflict; the config keeps it."""
    config = parse_config([*BASE, "--train-samples", "800"])
    validate(config)
    assert config.optimizer.lr.decay_samples == 800 and config.optimizer.lr.decay_steps is None
    # Megatron's scripts pass a zero warm-up of the other kind (its default): no conflict either
    assert schedule("--train-iters", "100", "--lr-warmup-samples", "0").warmup == 0
    assert schedule("--train-samples", "800", "--lr-warmup-iters", "0", "--lr-warmup-fraction", "0.1").warmup == 80


# ---------------------------------------------------------------- in the training loop


def test_the_trainer_applies_the_schedule_of_applied_samples(tmp_path):
    """Iteration 1 trains at warmup_init, each step at the position of the samples of the *applied* steps
    before it: fp16 overflow skips (a huge initial loss scale, hysteresis 1) do not advance it. metrics.jsonl
    shows the learning rate each step applied and the weight decay schedule reaches the optimizer."""
    argv = ["--mock-data", "--device", "cpu", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads",
            "4", "--vocab-size", "64", "--max-seq-len", "16", "--max-position-embeddings", "16",
            "--global-batch-size", "8", "--micro-batch-size", "4", "--train-samples", "160",
            "--lr-warmup-samples", "159", "--lr", "1e-2", "--lr-warmup-init", "1e-3", "--fp16",
            "--initial-loss-scale", str(2.0**30), "--hysteresis", "1", "--eval-iters", "0", "--num-workers", "0",
            "--logging-freq", "1",
            "--weight-decay-incr-style", "linear", "--start-weight-decay", "0.0", "--end-weight-decay", "0.16",
            "--save", str(tmp_path)]
    config = parse_config(argv)
    validate(config)
    logger = get_logger()
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        set_seed(config.seed)
        trainer = Trainer(config, build_model(config), pretrain_gpt.forward_step,
                          pretrain_gpt.datasets_provider(config), torch.device("cpu"))
        state = trainer.run()
    finally:
        logger.setLevel(level)
    train = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 21)) and state.consumed_samples == 160
    assert 1 <= state.skipped_steps < 20  # the scale's search skipped some steps: the test sees both kinds
    applied_before = 0
    for r in train:
        assert r["learning_rate"] == pytest.approx(1e-3 + (1e-2 - 1e-3) * 8 * applied_before / 159), r["step"]
        skipped = r["skipped_steps"] - (train[r["step"] - 2]["skipped_steps"] if r["step"] > 1 else 0)
        applied_before += 1 - skipped
    assert state.schedule_samples == 8 * applied_before
    decaying = next(g for g in trainer.optimizer.inner.param_groups if g["decays"])
    last_position = state.schedule_samples - 8  # the last applied step's (a skipped step sets nothing)
    assert decaying["weight_decay"] == pytest.approx(0.16 * last_position / 160)


def test_a_checkpoint_from_before_the_schedule_position_resumes_at_its_applied_steps(tmp_path, monkeypatch):
    """A checkpoint without ``schedule_samples`` (written before it existed, always with a constant batch)
    resumes the schedule at (step - skipped_steps) x global_batch_size; one with it, at its value."""
    import megatron.training.checkpointing as checkpointing

    config = parse_config(["--mock-data", "--device", "cpu", "--num-layers", "1", "--hidden-size", "32",
                           "--num-attention-heads", "4", "--vocab-size", "64", "--max-seq-len", "16",
                           "--max-position-embeddings", "16", "--global-batch-size", "8", "--max-steps", "9",
                           "--num-workers", "0", "--save", str(tmp_path), "--load", str(tmp_path / "old")])
    validate(config)
    saved = {"step": 5, "consumed_samples": 40, "skipped_steps": 2, "path": str(tmp_path / "old"),
             "same_layout": True}
    for extra, position in (({}, (5 - 2) * 8), ({"schedule_samples": 16}, 16)):
        monkeypatch.setattr(checkpointing, "load_checkpoint", lambda *args, extra=extra, **kwargs: {**saved, **extra})
        trainer = Trainer(config, build_model(config), pretrain_gpt.forward_step, (None, None, None),
                          torch.device("cpu"))
        assert (trainer.state.step, trainer.state.consumed_samples, trainer.state.schedule_samples) == (5, 40, position)
        trainer.step_log.close(exit_code=0)
