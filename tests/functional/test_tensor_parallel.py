"""Tensor (and sequence) parallelism under torchrun reproduces the single-process loss curve."""

from __future__ import annotations

import pytest

from tests.functional.launch import TINY, assert_matches_reference, losses, run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("nproc, extra", [
    (2, ["--tp", "2"]),
    (4, ["--tp", "4"]),
    (4, ["--tp", "2", "--dp", "2"]),
    (2, ["--tp", "2", "--sequence-parallel"]),
    (2, ["--tp", "2", "--use-recompute", "--recompute-granularity", "full"]),
], ids=["tp2", "tp4", "tp2-dp2", "tp2-sp", "tp2-recompute"])
def test_tp_losses_equal_single_process(tmp_path, reference, nproc, extra):
    assert_matches_reference(tmp_path, reference, *TINY, *extra, nproc=nproc)

def test_dropout_runs_are_reproducible(tmp_path):
    """With dropout on, two runs of one layout give identical losses (seeded per-rank streams)."""
    dropout_flags = {"--hidden-dropout-prob", "--attention-probs-dropout-prob"}
    args = [a for i, a in enumerate(TINY) if a not in dropout_flags and TINY[i - 1] not in dropout_flags]
    args += ["--tp", "2", "--sequence-parallel", "--hidden-dropout-prob", "0.1",
             "--attention-probs-dropout-prob", "0.1"]
    curves = []
    for name in ("a", "b"):
        result = run(tmp_path / name, *args, nproc=2)
        assert result.returncode == 0, result.stderr[-3000:]
        curves.append(losses(tmp_path / name))
    assert curves[0] == curves[1]


def test_three_processes_with_tp2_fail_with_a_message(tmp_path):
    result = run(tmp_path, *TINY, "--tp", "2", nproc=3, timeout=120)
    assert result.returncode != 0
    assert "world size 3 is not divisible by mp_degree x pp_degree x sharding_degree = 2" in result.stderr


def test_heads_not_divisible_by_tp_fails_on_every_rank(tmp_path):
    result = run(tmp_path, *TINY, "--tp", "2", "--num-attention-heads", "3", "--hidden-size", "63", nproc=2,
                 timeout=120)
    assert result.returncode != 0
    assert "mp_degree (2) must divide Model.num_attention_heads (3)" in result.stderr
