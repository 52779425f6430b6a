"""Tensor (and sequence) parallelism under torchrun reproduces the single-process loss curve."""

from __future__ import annotations

import os

import pytest

from tests.functional.launch import FIVE, TINY, losses, parity_layouts, reference_runs, run, whole_share

pytestmark = pytest.mark.slow


LAYOUTS = parity_layouts({
    "tp2": (2, [*FIVE, *whole_share(), "--tp", "2"]),
    "tp4": (4, [*FIVE, *whole_share(), "--tp", "4"]),
    "tp2-dp2": (4, [*FIVE, *whole_share(2), "--tp", "2", "--dp", "2"]),
    "tp2-sp": (2, [*FIVE, *whole_share(), "--tp", "2", "--sequence-parallel"]),
    "tp2-recompute": (2, [*FIVE, *whole_share(), "--tp", "2", "--use-recompute", "--recompute-granularity", "full"]),
})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tp_losses_equal_single_process(parity, references, layout):
    parity.assert_matches(layout, references["tiny-5"])


# muP at width multiplier 2 with an embedding multiplier (docs/mup.md): the initialisation by name, the multipliers,
# the 1 / d attention scale and the hidden matrices' own learning rate and eps under tp 2 with sequence parallelism
MUP = ["--use-mup", "--mup-base-hidden-size", "32", "--mup-embedding-mult", "2"]
reference_runs({"mup-5": [*FIVE, *whole_share(), *MUP]})


@pytest.mark.parametrize("layout", parity_layouts({"tp2-sp-mup": (2, [*FIVE, *whole_share(), "--tp", "2",
                                                                      "--sequence-parallel", *MUP])}))
def test_mup_under_tp2_equals_single_process(parity, references, layout):
    parity.assert_matches(layout, references["mup-5"])
    assert parity.curves(layout)[0] != references["tiny-5"][0]  # muP trains another curve than the plain run


@pytest.mark.parametrize("layout", parity_layouts({"tp2-sp-recompute-compile": (
    2, [*TINY, *whole_share(), "--tp", "2", "--sequence-parallel", "--use-recompute", "--recompute-granularity", "full",
        "--compile"])}))
def test_tp2_compiled_matches_one_eager_process(parity, reference, layout):
    """tp2 with sequence parallelism and full recompute, compiled: the column- and row-parallel layers
    (and their collectives) run eager between compiled pieces; the loss curve is the eager one's."""
    parity.assert_matches(layout, reference)
    assert "--compile:" not in parity.outcome(layout).log  # compiled: no fallback

def test_the_start_up_line_says_how_many_threads_each_rank_computes_with(parity, references):
    """torchrun's ranks compute with one thread each (its OMP_NUM_THREADS); a one-process run (python, no torchrun)
    with the count this suite pins (MEGATRON_CPU_THREADS, tests/conftest.py): each says which and why."""
    assert "model: " in parity.outcome("tp2").log
    assert parity.outcome("tp2").log.count(
        "1 compute thread (OMP_NUM_THREADS, as torchrun sets it for several ranks per node)") == 1  # rank 0's line
    pinned = os.environ["MEGATRON_CPU_THREADS"]
    plural = "" if pinned == "1" else "s"
    assert f"{pinned} compute thread{plural} (MEGATRON_CPU_THREADS)" in parity.outcome("tiny-5").log


_DROPOUT_FLAGS = {"--hidden-dropout-prob", "--attention-probs-dropout-prob"}
_DROPOUT = [*(a for i, a in enumerate(FIVE) if a not in _DROPOUT_FLAGS and FIVE[i - 1] not in _DROPOUT_FLAGS),
            *whole_share(), "--tp", "2", "--sequence-parallel", "--hidden-dropout-prob", "0.1",
            "--attention-probs-dropout-prob", "0.1"]


@pytest.mark.parametrize("layout", parity_layouts({"tp2-sp-dropout": (2, _DROPOUT)}))
def test_dropout_runs_are_reproducible(tmp_path, parity, layout):
    """With dropout on, two runs of one layout in two launches give identical losses (seeded per-rank streams,
    nothing of the process)."""
    result = run(tmp_path, *_DROPOUT, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(tmp_path) == parity.curves(layout)[0]


def test_three_processes_with_tp2_fail_with_a_message(tmp_path):
    result = run(tmp_path, *TINY, "--tp", "2", nproc=3, timeout=120)
    assert result.returncode != 0
    assert "world size 3 is not divisible by mp_degree x pp_degree x sharding_degree = 2" in result.stderr


@pytest.mark.parametrize("layout", parity_layouts({"bad-heads-tp2": (
    2, [*TINY, "--tp", "2", "--num-attention-heads", "3", "--hidden-size", "63"])}))
def test_heads_not_divisible_by_tp_fails_on_every_rank(parity, layout):
    parity.assert_fails_on_every_rank(layout, "mp_degree (2) must divide Model.num_attention_heads (3)")
