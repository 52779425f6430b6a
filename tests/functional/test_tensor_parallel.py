"""Tensor (and sequence) parallelism under torchrun reproduces the single-process loss curve."""

from __future__ import annotations

import pytest

from tests.functional.launch import TINY, losses, parity_layouts, run

pytestmark = pytest.mark.slow


LAYOUTS = parity_layouts({
    "tp2": (2, [*TINY, "--tp", "2"]),
    "tp4": (4, [*TINY, "--tp", "4"]),
    "tp2-dp2": (4, [*TINY, "--tp", "2", "--dp", "2"]),
    "tp2-sp": (2, [*TINY, "--tp", "2", "--sequence-parallel"]),
    "tp2-recompute": (2, [*TINY, "--tp", "2", "--use-recompute", "--recompute-granularity", "full"]),
})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tp_losses_equal_single_process(parity, reference, layout):
    parity.assert_matches(layout, reference)

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
