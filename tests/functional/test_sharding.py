"""Group-sharded optimizer (ZeRO stage 1) alone and composed reproduces the single-process losses."""

from __future__ import annotations

import pytest

from tests.functional.launch import TINY, assert_matches_reference, losses, run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("nproc, extra", [
    (2, ["--sharding", "2"]),
    (4, ["--sharding", "4", "--micro-batch-size", "2"]),
    (4, ["--sharding", "2", "--dp", "2"]),
    (4, ["--sharding", "2", "--tp", "2"]),
    (4, ["--sharding", "2", "--pp", "2"]),
    (2, ["--sharding", "2", "--sharding-stage", "2"]),
    (4, ["--sharding", "4", "--sharding-stage", "2", "--micro-batch-size", "2"]),
    (4, ["--sharding", "2", "--sharding-stage", "2", "--dp", "2"]),
    (4, ["--sharding", "2", "--sharding-stage", "2", "--tp", "2"]),
    (4, ["--sharding", "2", "--sharding-stage", "2", "--pp", "2"]),
], ids=["sharding2", "sharding4", "dp2-sharding2", "tp2-sharding2", "pp2-sharding2", "stage2-sharding2",
        "stage2-sharding4", "stage2-dp2-sharding2", "stage2-tp2-sharding2", "stage2-pp2-sharding2"])
def test_sharded_losses_equal_single_process(tmp_path, reference, nproc, extra):
    assert_matches_reference(tmp_path, reference, *TINY, *extra, nproc=nproc)


def test_unsupported_stage_fails_on_every_rank(tmp_path):
    result = run(tmp_path, *TINY, "--sharding", "2", "--sharding-stage", "3", nproc=2, timeout=120)
    assert result.returncode != 0
    assert "sharding_stage 3 is not supported by this version yet" in result.stderr


@pytest.mark.parametrize("precision, stage", [("--bf16", "1"), ("--fp16", "1"), ("--bf16", "2"), ("--fp16", "2")])
def test_low_precision_sharded_run_tracks_unsharded(tmp_path, precision, stage):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    for out, extra, nproc in ((single, [], 1), (sharded, ["--sharding", "2", "--sharding-stage", stage], 2)):
        result = run(out, *TINY, precision, *extra, nproc=nproc)
        assert result.returncode == 0, result.stderr[-3000:]
    # The fp32 main gradients are summed over the ranks in another order, so a bf16/fp16 rounding
    # of an updated weight can land one unit apart; over 10 steps that stays far below 1e-3.
    assert losses(sharded) == pytest.approx(losses(single), rel=1e-3)
