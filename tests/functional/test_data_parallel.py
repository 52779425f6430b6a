"""Data parallelism under torchrun reproduces the single-process loss curve."""

from __future__ import annotations

import pytest

from tests.functional.launch import TINY, parity_layouts, run

pytestmark = pytest.mark.slow


LAYOUTS = parity_layouts({
    "dp2": (2, TINY),  # 2 replicas x 2 micro-batches; on the CPU one all-reduce after the backward by default
    "dp2-overlap-bucket-per-param": (2, [*TINY, "--overlap-grad-reduce", "--bucket-size-mb", "0.001"]),
    "dp2-overlap-one-bucket": (2, [*TINY, "--overlap-grad-reduce"]),
    "dp4-overlap": (4, [*TINY, "--micro-batch-size", "2", "--overlap-grad-reduce", "--bucket-size-mb", "0.05"]),
})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dp_losses_equal_single_process(parity, reference, layout):
    parity.assert_matches(layout, reference)


def test_world_size_mismatch_fails_on_every_rank(tmp_path):
    result = run(tmp_path, *TINY, "--dp", "3", nproc=2, timeout=120)
    assert result.returncode != 0
    message = "dp_degree x mp_degree x pp_degree x sharding_degree = 3 but 2 process(es) were launched"
    # Every rank checks before any collective and exits; torchrun may stop the second rank before
    # it prints, so at least one copy is guaranteed. The only traceback is torchrun's own report.
    assert result.stderr.count(message) >= 1
    assert "megatron/" not in result.stderr and "pretrain_gpt.py\", line" not in result.stderr
