"""Data parallelism under torchrun reproduces the single-process loss curve."""

from __future__ import annotations

import pytest

from tests.functional.launch import TINY, assert_matches_reference, run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("nproc, extra", [
    (2, []),                                           # 2 replicas x 2 micro-batches; on the CPU one
                                                       # all-reduce after the backward by default
    (2, ["--overlap-grad-reduce", "--bucket-size-mb", "0.001"]),  # overlapped, a bucket per parameter
    (2, ["--overlap-grad-reduce"]),                    # overlapped, one bucket
    (4, ["--micro-batch-size", "2", "--overlap-grad-reduce", "--bucket-size-mb", "0.05"]),  # 4 replicas
])
def test_dp_losses_equal_single_process(tmp_path, reference, nproc, extra):
    assert_matches_reference(tmp_path, reference, *TINY, *extra, nproc=nproc)


def test_world_size_mismatch_fails_on_every_rank(tmp_path):
    result = run(tmp_path, *TINY, "--dp", "3", nproc=2, timeout=120)
    assert result.returncode != 0
    message = "dp_degree x mp_degree x pp_degree x sharding_degree = 3 but 2 process(es) were launched"
    # Every rank checks before any collective and exits; torchrun may stop the second rank before
    # it prints, so at least one copy is guaranteed. The only traceback is torchrun's own report.
    assert result.stderr.count(message) >= 1
    assert "megatron/" not in result.stderr and "pretrain_gpt.py\", line" not in result.stderr
