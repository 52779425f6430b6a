"""The rerun state machine's transitions (megatron/training/rerun.py), one process: the initial run, the in-place
re-run (reproduced or not), the checkpoint flow (its JSON state, the re-run elsewhere or on the same device) and
report_stats."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from megatron.metrics import get_logger
from megatron.training.rerun import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    ErrorInjector,
    RerunMachine,
    State,
)

NAN = "found NaN in local forward loss calculation"


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def log():
    handler = _Lines()
    get_logger().addHandler(handler)
    yield handler.lines
    get_logger().removeHandler(handler)


def _step(machine: RerunMachine, step: int, result, fatal: bool = True, rejected=math.isnan) -> tuple[list, tuple]:
    """One training step's loop: ``result(run)`` is the checked value of the run-th forward (0: the initial one);
    returns the random numbers each run drew (the RNG restored for a re-run) and the exit decision."""
    draws, run = [], 0
    while machine.should_run_forward_backward(step):
        draws.append(torch.rand(1).item())
        machine.validate_result(result(run), rejected, NAN if fatal else "Spiky loss", fatal=fatal)
        run += 1
    return draws, machine.should_checkpoint_and_exit()


def _machine(kind: str | None = None, node: str = "node-a", mode: str = "validate_results") -> RerunMachine:
    return RerunMachine(mode, ErrorInjector(1 if kind else 0, kind or "transient_error"), node=node)


def test_disabled_runs_each_step_once_and_checks_nothing():
    machine = _machine(mode="disabled")
    for step in (1, 2):
        draws, decision = _step(machine, step, lambda run: math.nan)
        assert len(draws) == 1 and decision == (False, False, 0)


def test_a_good_result_runs_once_and_the_first_step_is_never_judged(log):
    machine = _machine()
    draws, decision = _step(machine, 1, lambda run: math.nan)  # first step: no checkpoint before it to go back to
    assert len(draws) == 1 and decision == (False, False, 0)
    draws, decision = _step(machine, 2, lambda run: 1.5)
    assert len(draws) == 1 and decision == (False, False, 0) and machine.state == State.NOT_RUNNING_YET
    assert "Result validation enabled" in log


def test_a_result_not_reproduced_in_place_is_a_transient_error(log):
    """Fatal: the checkpoint before the step, then exit 17; the re-run drew the same random numbers."""
    machine = _machine()
    _step(machine, 1, lambda run: 1.0)
    draws, decision = _step(machine, 2, lambda run: math.nan if run == 0 else 2.0)
    assert len(draws) == 2 and draws[0] == draws[1]
    assert decision == (True, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
    assert "Need to rerun step to check reproducibility of initial result" in log
    assert "Rank 0, node node-a, device cpu, iteration #2: Possible transient error!!" in log
    assert machine.state == State.RERUNNING_IN_PLACE  # saved without the marker: a resume trains on


def test_a_non_fatal_transient_error_goes_on(log):
    machine = _machine("transient_error")
    _step(machine, 1, lambda run: 1.0, fatal=False)
    draws, decision = _step(machine, 2, lambda run: 1.0, fatal=False)  # injected: the re-run "differs"
    assert len(draws) == 2 and decision == (False, False, 0) and machine.state == State.NOT_RUNNING_YET
    assert "Injecting error type Transient error" in log
    assert "Continuing normal execution because failed validation was not fatal" in log
    draws, decision = _step(machine, 3, lambda run: 1.0, fatal=False)  # one injection diagnosed: the next again
    assert len(draws) == 2 and decision == (False, False, 0)


def _persistent_first_job(kind: str, log) -> dict:
    machine = _machine(kind)
    _step(machine, 1, lambda run: 1.0)
    draws, decision = _step(machine, 2, lambda run: 3.0)
    assert len(draws) == 2 and decision == (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
    assert machine.state == State.WILL_RERUN_FROM_CHECKPOINT and machine.pending
    assert ("Saving a checkpoint and exiting now. Please resume the job from the checkpoint to rerun the last "
            "iteration and establish a diagnostic") in log
    return json.loads(json.dumps(machine.state_dict(), allow_nan=False))  # strict JSON, as common.json


@pytest.mark.parametrize("kind, diagnosis", [("persistent_error", "Possible persistent error!!"),
                                             ("correct_result", "Correct result (but possible Application error) "
                                                                f"({NAN})!")])
def test_a_reproduced_result_is_checkpointed_and_diagnosed_on_another_node(kind, diagnosis, log):
    saved = _persistent_first_job(kind, log)
    resumed = _machine(mode="validate_results", node="node-b")  # the resumed job, elsewhere, no injection asked
    resumed.load_state_dict(saved)
    draws, decision = _step(resumed, 2, lambda run: 3.0)
    assert len(draws) == 1 and decision == (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
    assert f"Rank 0, node node-b, device cpu, iteration #2: {diagnosis}" in log


def test_a_real_nan_reproduced_elsewhere_is_a_correct_result(log):
    machine = _machine()
    _step(machine, 1, lambda run: 1.0)
    assert _step(machine, 2, lambda run: math.nan)[1] == (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
    resumed = _machine(node="node-b")
    resumed.load_state_dict(json.loads(json.dumps(machine.state_dict(), allow_nan=False)))
    assert _step(resumed, 2, lambda run: math.nan)[1] == (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
    assert any("Correct result (but possible Application error)" in line for line in log)


def test_resumed_on_the_same_device_it_exits_16_again(log):
    saved = _persistent_first_job("persistent_error", log)
    resumed = _machine(node="node-a")
    resumed.load_state_dict(saved)
    assert _step(resumed, 2, lambda run: 3.0)[1] == (False, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
    assert "Got rescheduled on the same GPU. Need to resume again from the same checkpoint (node: node-a, gpu: cpu)" \
        in log


def test_a_disabled_job_ignores_the_saved_marker(log):
    saved = _persistent_first_job("persistent_error", log)
    resumed = _machine(mode="disabled", node="node-b")
    resumed.load_state_dict(saved)
    assert resumed.state == State.NOT_RUNNING_YET
    assert "RerunStateMachine disabled via CLI, ignoring machine state saved in checkpoint" in log


def test_report_stats_reruns_every_step_and_reports_the_variability(log):
    machine = _machine(mode="report_stats")
    values = {1: (2.0, 2.0), 2: (4.0, 4.004)}  # step 2's re-run differs by 0.1%
    for step in (1, 2):
        draws, decision = _step(machine, step, lambda run, s=step: values[s][run])
        assert len(draws) == 2 and draws[0] == draws[1] and decision == (False, False, 0)
    assert "Stats on computation determinism in validation calls" in log
    line = log[log.index(f"  {NAN}:") + 1]
    assert line.startswith("    2/1 total/identical samples, rel. variability:") and "max: 9.995E-04" in line


def test_injection_without_validation_and_the_fp16_nan_check_are_settled_at_validation():
    from megatron.config import ConfigError, validate
    from megatron.config.cli import parse_config

    with pytest.raises(ConfigError, match="error_injection_rate 5 injects into result validation, which rerun_mode "
                                          "disabled does not run; add --rerun-mode validate_results"):
        validate(parse_config(["--mock-data", "--error-injection-rate", "5"]))
    config = parse_config(["--mock-data", "--fp16", "--rerun-mode", "validate_results"])
    warnings = validate(config)
    assert config.rerun.check_for_nan_in_loss_and_grad is False
    assert any("check_for_nan_in_loss_and_grad is off" in w for w in warnings)
