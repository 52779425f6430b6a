"""Data parallelism under torchrun reproduces the single-process loss curve."""

from __future__ import annotations

import pytest

from tests.functional.launch import FIVE, TINY, parity_layouts

pytestmark = pytest.mark.slow


LAYOUTS = parity_layouts({
    "dp2": (2, TINY),  # 2 replicas x 2 micro-batches; on the CPU one all-reduce after the backward by default
    "dp2-overlap-bucket-per-param": (2, [*FIVE, "--overlap-grad-reduce", "--bucket-size-mb", "0.001"]),
    "dp2-overlap-one-bucket": (2, [*FIVE, "--overlap-grad-reduce"]),
    "dp4-overlap": (4, [*FIVE, "--micro-batch-size", "2", "--overlap-grad-reduce", "--bucket-size-mb", "0.05"]),
})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dp_losses_equal_single_process(parity, references, layout):
    parity.assert_matches(layout, references["tiny" if layout == "dp2" else "tiny-5"])  # dp2: shared, 10 steps


@pytest.mark.parametrize("layout", parity_layouts({"bad-dp3-on-2": (2, [*TINY, "--dp", "3"])}))
def test_world_size_mismatch_fails_on_every_rank(parity, layout):
    """Every rank checks before any collective and exits with one line (the torchrun path of such an error:
    test_tensor_parallel.py::test_three_processes_with_tp2_fail_with_a_message)."""
    parity.assert_fails_on_every_rank(
        layout, "dp_degree x mp_degree x pp_degree x sharding_degree = 3 but 2 process(es) were launched")
