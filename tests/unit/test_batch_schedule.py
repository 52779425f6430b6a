"""The global batch of every step (Megatron-LM's ramp-up and step schedule), the training length it gives,
the sampler that reads it, and the configurations validation refuses. Expected sizes are worked out by
hand from Megatron's rules."""

from __future__ import annotations

import pytest

from megatron.config import ConfigError, parse_config, validate
from megatron.config.batch_schedule import (
    BatchSchedule,
    build_batch_schedule,
    parse_count,
    parse_step_schedule,
    rampup_thresholds,
    total_train_samples,
    train_steps,
)
from megatron.data.loader import GlobalBatchSampler

BASE = ("--mock-data", "--device", "cpu", "--max-seq-len", "16", "--max-position-embeddings", "16")


def config_of(*argv: str, world_size: int = 1):
    config = parse_config([*BASE, *argv])
    warnings = validate(config, world_size=world_size)
    return config, warnings


# ---------------------------------------------------------------- ramp-up


RAMP = ("--global-batch-size", "64", "--micro-batch-size", "4", "--rampup-batch-size", "16", "16", "96")


def test_rampup_sizes_at_the_boundaries():
    """16 -> 64 by 16: 3 increments, one every 96 / 3 = 32 samples; past 96 samples, 64."""
    config, warnings = config_of(*RAMP, "--train-samples", "300")
    assert warnings == []
    batch = build_batch_schedule(config)
    expected = {0: 16, 31: 16, 32: 32, 63: 32, 64: 48, 95: 48, 96: 64, 97: 64, 10**9: 64}
    assert {c: batch(c) for c in expected} == expected
    assert batch.sizes() == [16, 32, 48, 64] and batch.varies and batch.final == 64


def test_rampup_takes_megatrons_float_boundaries():
    """Megatron computes ``int(consumed / (SAMPLES / n))`` in floats. Ramp 1 by 1 to 8 over 9 samples (n = 7):
    at exactly 9 samples 9 / (9 / 7) is just under 7, so the batch is still 7 there and 8 only past 9 (the
    exact rational would give 8 at 9). And Megatron's 175B ramp (16 by 16 to 1536 over 5859375 samples)
    agrees with the formula at its boundaries."""
    small = BatchSchedule(tuple(rampup_thresholds(1, 1, 9, 8)))
    assert [small(c) for c in range(12)] == [1, 1, 2, 3, 4, 4, 5, 6, 7, 7, 8, 8]
    batch = BatchSchedule(tuple(rampup_thresholds(16, 16, 5859375, 1536)), unit=16)
    per_increment = 5859375 / 95
    for c in (0, 61677, 61678, 123355, 123356, 3000000, 5797697, 5797698, 5859374, 5859375, 5859376):
        megatron = 1536 if c > 5859375 else 16 + 16 * int(c / per_increment)
        assert batch(c) == megatron, c
    assert batch(61677) == 16 and batch(61678) == 32 and len(batch.sizes()) == 96


def test_rampup_rounds_down_to_whole_micro_batches_and_says_so():
    """micro 4 x dp 2 = 8: a ramp 12, 24, 36, 48 runs 8, 24, 32, 48."""
    config, warnings = config_of("--global-batch-size", "48", "--micro-batch-size", "4", "--rampup-batch-size", "12",
                                 "12", "90", "--train-samples", "500", world_size=2)
    batch = build_batch_schedule(config)
    assert [batch(c) for c in (0, 30, 60, 91)] == [8, 24, 32, 48]
    assert len(warnings) == 1 and "rounded down: 12 to 8, 36 to 32" in warnings[0]


def test_sample_based_length_under_a_ramp():
    """From 0: 16, 16, 32, 48 (at 64), then 64 at 112, 176, 240: the step that starts below 300 is taken
    (Megatron's loop), so 7 steps consume 304 samples; 6 whole batches fit in 300."""
    config, _ = config_of(*RAMP, "--train-samples", "300")
    assert train_steps(config) == 7 and total_train_samples(config) == 304
    assert build_batch_schedule(config).steps_within(300) == 6


def test_sample_based_length_with_a_constant_batch_is_whole_batches():
    config, _ = config_of("--global-batch-size", "16", "--train-samples", "100")
    assert train_steps(config) == 6 and total_train_samples(config) == 96  # train_samples // 16


# ---------------------------------------------------------------- step schedule (tokens)


def test_parse_counts_and_schedules_as_megatron():
    assert [parse_count(x) for x in ("0", "16", "2.4B", "1.5k", "3M", "2T")] == [0, 16, 2400000000, 1500, 3000000,
                                                                                 2000000000000]
    assert parse_step_schedule("0:16 2.4B:320 4.8B:624", 2048) == [(0, 16), (1171875, 320), (2343750, 624)]
    assert parse_step_schedule("2K:64,0:16, 1K:32", 16) == [(0, 16), (62, 32), (125, 64)]  # sorted, commas
    with pytest.raises(ValueError, match="is empty"):
        parse_step_schedule(" ", 16)


def test_step_schedule_sizes_at_the_boundaries_and_its_last_batch_is_the_global_batch():
    """Thresholds 1K and 2K tokens of 16-token samples: 62 and 125 samples."""
    config, _ = config_of("--micro-batch-size", "4", "--step-batch-size-schedule", "0:16 1K:32 2K:64",
                          "--train-samples", "500")
    assert config.batch_size.global_batch_size == 64 and config.batch_size.local_batch_size == 64
    batch = build_batch_schedule(config)
    expected = {0: 16, 61: 16, 62: 32, 124: 32, 125: 64, 10**6: 64}
    assert {c: batch(c) for c in expected} == expected
    # 0, 16, 32, 48 (16 each: 4 steps to 64), 64 and 96 (32 each), then 64 from 128: 128..448 (6), 512
    assert train_steps(config) == 12 and total_train_samples(config) == 512


def test_step_schedule_with_max_steps_counts_the_batches_it_takes():
    """Megatron's 175B example pairs the schedule with --train-iters and a --global-batch-size equal to its
    last batch; the data covers the samples those steps take."""
    config, _ = config_of("--micro-batch-size", "4", "--step-batch-size-schedule", "0:16 1K:32 2K:64",
                          "--global-batch-size", "64", "--max-steps", "7")
    assert train_steps(config) == 7 and total_train_samples(config) == 4 * 16 + 2 * 32 + 64


@pytest.mark.parametrize("text, message", [
    ("0:16 500", "entry '500' is not 'TOKENS:BATCH'"),
    ("16:16 1K:32", "must start at 0 tokens"),
    ("0:16 8:32", "two thresholds fall on the same sample"),  # 8 tokens // 16 = sample 0
    ("0:16 1K:0", "every batch must be at least 1"),
    ("0:16 1Q:32", "'1Q' is not a number"),
])
def test_bad_step_schedules_refused(text, message):
    with pytest.raises(ConfigError, match=message):
        config_of("--micro-batch-size", "4", "--step-batch-size-schedule", text, "--train-samples", "100")


# ---------------------------------------------------------------- what validation refuses


@pytest.mark.parametrize("argv, message", [
    (RAMP, "rampup_batch_size needs train_samples"),
    ((*RAMP, "--train-samples", "100", "--step-batch-size-schedule", "0:16"), "both set; choose one"),
    (("--global-batch-size", "64", "--rampup-batch-size", "16", "16", "96", "--train-samples", "100"),
     "needs micro_batch_size"),
    (("--micro-batch-size", "4", "--global-batch-size", "32", "--step-batch-size-schedule", "0:16 1K:64"),
     r"global_batch_size \(32\) is not the last batch of step_batch_size_schedule \(64\)"),
    (("--global-batch-size", "64", "--micro-batch-size", "4", "--rampup-batch-size", "16", "20", "96",
      "--train-samples", "100"), "must be a non-negative multiple of the increment"),
    (("--global-batch-size", "64", "--micro-batch-size", "4", "--rampup-batch-size", "80", "16", "96",
      "--train-samples", "100"), "must be a non-negative multiple of the increment"),
    (("--global-batch-size", "64", "--micro-batch-size", "8", "--rampup-batch-size", "4", "4", "96",
      "--train-samples", "100"), r"a global batch of 4 is smaller than micro_batch_size x data-parallel size \(8\)"),
    (("--global-batch-size", "64", "--micro-batch-size", "4", "--rampup-batch-size", "16", "16", "--train-samples",
      "100"), "takes three numbers"),
    (("--global-batch-size", "64", "--train-samples", "63"), "less than one global batch"),
    (("--micro-batch-size", "4", "--step-batch-size-schedule", "0:32 1K:16", "--train-samples", "100"),
     "never decreases .* goes 32 -> 16"),
])
def test_inconsistent_batch_schedules_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        config_of(*argv)


def test_interleaved_pipeline_needs_a_multiple_of_pp_micro_batches_at_every_size():
    """pp 2 x vpp 2: micro-batches of 16 make the ramp's 16 and 48 odd counts (1, 3): refused; of 8, all even."""
    pipe = ("--num-layers", "4", "--pp", "2", "--vpp", "2", "--global-batch-size", "64", "--rampup-batch-size",
            "16", "16", "96", "--train-samples", "300")
    with pytest.raises(ConfigError, match="a global batch of 16 is 1 micro-batches"):
        config_of(*pipe, "--micro-batch-size", "16", world_size=2)
    config, _ = config_of(*pipe, "--micro-batch-size", "8", world_size=2)
    assert build_batch_schedule(config).sizes() == [16, 32, 48, 64]


# ---------------------------------------------------------------- the sampler


def test_each_rank_reads_its_slice_of_every_steps_batch_and_a_resume_continues_it():
    config, _ = config_of(*RAMP, "--train-samples", "300", world_size=2)
    batch = build_batch_schedule(config)  # 16, 16, 32, 48, 64, ...
    ranks = [list(GlobalBatchSampler(304, 0, batch, dp_rank=r, dp_size=2)) for r in range(2)]
    assert ranks[0][:4] == [list(range(0, 8)), list(range(16, 24)), list(range(32, 48)), list(range(64, 88))]
    assert ranks[1][:4] == [list(range(8, 16)), list(range(24, 32)), list(range(48, 64)), list(range(88, 112))]
    assert len(ranks[0]) == 7 and ranks[1][-1] == list(range(272, 304))
    for r in range(2):  # resumed after three steps (64 samples consumed): the same batches from the fourth on
        resumed = GlobalBatchSampler(304, 64, batch, dp_rank=r, dp_size=2)
        assert list(resumed) == ranks[r][3:] and len(resumed) == 4
