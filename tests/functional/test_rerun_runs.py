"""The rerun state machine through pretrain_gpt.py (megatron/training/rerun.py, docs/reliability.md), with Megatron's
fault injection, dropout on (the re-runs must restore the RNG streams to reproduce a result): a transient fault on a
non-fatal check is logged and training goes on; a persistent one saves the checkpoint before the step and exits 16;
resumed on the same node it exits 16 again, resumed on another it re-runs the step from the checkpoint and exits 17."""

from __future__ import annotations

import json
import re
from unittest import mock

import pytest

from tests.functional.launch import TINY, parity_layouts, run_here

pytestmark = pytest.mark.slow

_RUN = [*TINY, "--max-steps", "3", "--eval-iters", "0", "--hidden-dropout-prob", "0.1", "--rerun-mode",
        "validate_results", "--error-injection-rate", "1"]
_CKPT = ["--save", "{runs}/rerun-ckpt", "--load", "{runs}/rerun-ckpt"]
_TRANSIENT = [*_RUN, "--error-injection-type", "transient_error", "--no-check-for-nan-in-loss-and-grad",
              "--check-for-spiky-loss"]
parity_layouts({
    "rerun-transient": (1, _TRANSIENT),
    "rerun-transient-dp2": (2, [*_TRANSIENT, "--dp", "2"]),  # every rank injects (rate 1) and re-runs the step
    "rerun-persistent-dp2": (2, [*_RUN, "--error-injection-type", "persistent_error", "--dp", "2",
                                 "--save", "{runs}/rerun-ckpt-dp2"]),
    "rerun-persistent": (1, [*_RUN, "--error-injection-type", "persistent_error", *_CKPT]),
    "rerun-persistent-same-node": (1, [*_RUN, *_CKPT], ("rerun-persistent",))})


def _values(log: str, pattern: str) -> tuple[float, float]:
    a, b = re.search(pattern, log).groups()
    return float(a), float(b)


@pytest.mark.parametrize("layout,ranks", [("rerun-transient", 1), ("rerun-transient-dp2", 2)])
def test_a_transient_fault_on_a_non_fatal_check_is_logged_and_training_goes_on(parity, layout, ranks):
    """On every data-parallel rank; the ranks agree to re-run each step together and to go on."""
    result = parity.outcome(layout)
    log = result.log
    assert result.returncode == 0, log[-3000:]
    assert log.count("Injecting error type Transient error") == 2 * ranks  # every step after the first (rate 1)
    for rank in range(ranks):
        for step in (2, 3):
            assert re.search(rf"Rank {rank}, node \S+, device cpu, iteration #{step}: Possible transient error!!", log)
    assert log.count("Need to rerun step to check reproducibility of initial result") == 2  # once a step (rank 0)
    assert log.count("Continuing normal execution because failed validation was not fatal") == 2
    assert re.findall(r" - global step (\d+),", log) == ["1", "2", "3"]
    rows = [json.loads(line) for line in (result.out / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if r["split"] == "train"]) == 3


@pytest.mark.parametrize("layout", ["rerun-persistent"])
def test_a_persistent_fault_is_checkpointed_exits_16_then_is_diagnosed_elsewhere(parity, layout, tmp_path):
    first = parity.outcome(layout)
    assert first.returncode == 16, first.log[-3000:]
    initial, rerun = _values(first.log, r"First rerun: unexpected result is reproducible within the tolerance "
                                        r"\((\S+) = (\S+)\)")
    assert initial == rerun  # the same batch and RNG streams (dropout) in the re-run in place
    assert ("Saving a checkpoint and exiting now. Please resume the job from the checkpoint to rerun the last "
            "iteration and establish a diagnostic") in first.log
    assert "pretrain_gpt.py: error: step 2 was not applied" in first.log and "(exit 16)" in first.log
    ckpt = parity.root / "rerun-ckpt"
    assert (ckpt / "latest").read_text().strip() == "step_1"
    marker = json.loads((ckpt / "step_1" / "common.json").read_text())["train_state"]["rerun_state"]
    assert marker[0]["state"] == "WILL_RERUN_FROM_CHECKPOINT" and marker[0]["step"] == 2

    again = parity.outcome("rerun-persistent-same-node")  # resumed on this node: it cannot tell, exit 16 again
    assert again.returncode == 16, again.log[-3000:]
    assert "Got rescheduled on the same GPU. Need to resume again from the same checkpoint" in again.log

    args = [a.replace("{runs}", str(parity.root)) for a in [*_RUN, *_CKPT]]
    with mock.patch("megatron.training.rerun.socket.gethostname", return_value="another-node"):
        resumed = run_here(*args)  # resumed on another node (the marker names this one as the suspect)
    assert resumed.returncode == 17, resumed.stderr[-3000:]
    assert "Rank 0, node another-node, device cpu, iteration #2: Possible persistent error!!" in resumed.stderr
    second = r"Second rerun: unexpected result is not reproducible on a different GPU, therefore was likely incorrect"
    first_loss, second_loss = _values(resumed.stderr, second + r" \((\S+) != (\S+)\)")
    assert first_loss == second_loss == initial  # the checkpoint re-ran the step exactly (data, RNG)


@pytest.mark.parametrize("layout", ["rerun-persistent-dp2"])
def test_a_persistent_fault_at_dp2_stops_every_rank_and_saves_each_ranks_state(parity, layout):
    """Both ranks reproduce their result in place, both exit 16, and the checkpoint before the step holds each
    rank's machine state (the resumed diagnosis reads its own rank's)."""
    result = parity.outcome(layout)
    assert result.returncode == 16, result.log[-3000:]
    for rank in (0, 1):
        assert re.search(rf"Rank {rank}, node \S+, device cpu, iteration #2: First rerun: unexpected result is "
                         rf"reproducible within the tolerance", result.log)
    ckpt = parity.root / "rerun-ckpt-dp2"
    assert (ckpt / "latest").read_text().strip() == "step_1"
    states = json.loads((ckpt / "step_1" / "common.json").read_text())["train_state"]["rerun_state"]
    assert [(s["state"], s["step"]) for s in states] == [("WILL_RERUN_FROM_CHECKPOINT", 2)] * 2
    assert states[0]["initial_result"] != states[1]["initial_result"]  # each rank's own micro-batches
