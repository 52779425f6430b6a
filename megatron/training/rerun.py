"""Megatron's rerun state machine (``--rerun-mode``): re-run a step whose result failed a check to tell a transient
fault from a persistent one from a correct result (Megatron Core 0.16.1's ``rerun_state_machine``, its semantics).

validate_results: a step is run once (INITIAL_RUN). A check that rejects its result (a NaN loss, a spiky loss, ...)
makes every rank re-run the step in place, from the same batch and the same RNG states (RERUNNING_IN_PLACE):

- the rejected result is *not* reproduced: a transient fault ("Possible transient error!"). A fatal check (NaN / Inf)
  then saves the checkpoint before the step and exits 17; a non-fatal one (spiky loss, large gradients) goes on.
- it is reproduced: a fatal check saves the checkpoint before the step with this machine's state in it (the "rerun
  from checkpoint" marker) and exits 16: resume the job, ideally on another node. The resumed job re-runs the step
  from that checkpoint (RERUNNING_FROM_CHECKPOINT): reproduced there, the result was correct (a real numerical
  problem, "Correct result"); not reproduced, the first device is faulty ("Possible persistent error!"); both exit 17.
  Resumed on the same node and device, it exits 16 again, the checkpoint kept.

report_stats re-runs every step once and logs, every ``REPORTING_INTERVAL`` steps, how far each check's results moved
between the two runs (the determinism of the computation). disabled (the default here) checks nothing: the run's
health (megatron/health.py) handles non-finite losses as before. Every decision is an any-reduction over all ranks,
so every rank takes the same branch. ``--error-injection-rate N`` injects a rejected result at about one check in N
(``--error-injection-type``: which diagnosis the re-runs then reach), to exercise all of this.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import random
import socket
from collections.abc import Callable
from enum import IntEnum

import numpy as np
import torch
import torch.distributed as dist

from megatron import device as dev
from megatron.metrics import get_logger

EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17
MODES = ("disabled", "validate_results", "report_stats")
DIAGNOSES = ("correct_result", "transient_error", "persistent_error")
_INJECTED_NAMES = {"correct_result": "Expected result", "transient_error": "Transient error",
                   "persistent_error": "Persistent error"}
MATCH, MISMATCH = 0.0, math.inf
REPORTING_INTERVAL = 2  # report_stats: steps between two reports (Megatron's REPORTING_INTERVAL_ITERATIONS)
MAX_SAMPLES = 100_000  # report_stats: relative differences kept per check


class State(IntEnum):
    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3
    RERUNNING_FROM_CHECKPOINT = 4
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5


# the state after a step's forward-backward -> (save the checkpoint before the step, exit status, Megatron's line)
_EXITS = {
    State.RERUNNING_IN_PLACE: (True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION, "Exiting now. A checkpoint at the last "
                               "iteration is being saved if further examination is needed"),
    State.WILL_RERUN_FROM_CHECKPOINT: (True, EXIT_CODE_RESUME_TO_DISAMBIGUATE, "Saving a checkpoint and exiting now. "
                                       "Please resume the job from the checkpoint to rerun the last iteration and "
                                       "establish a diagnostic"),
    State.RERUNNING_FROM_CHECKPOINT: (False, EXIT_CODE_FAILED_ON_RESULT_VALIDATION, "Exiting now. A checkpoint at the "
                                      "last iteration already exists if further examination is needed"),
    State.RERUNNING_AGAIN_FROM_CHECKPOINT: (False, EXIT_CODE_RESUME_TO_DISAMBIGUATE, "Exiting now. Please resume the "
                                            "job from the same checkpoint to rerun the last iteration and establish "
                                            "a diagnostic"),
}


class RerunExit(Exception):
    """The step may not be applied: exit with ``exit_code`` (16 or 17), after saving the checkpoint before the step
    when ``checkpoint``. Raised on every rank alike (the decision is reduced over all of them)."""

    def __init__(self, exit_code: int, checkpoint: bool, message: str):
        super().__init__(message)
        self.exit_code, self.checkpoint = exit_code, checkpoint


def rerun_exit_message(step: int, exit_code: int) -> str:
    """The run's last line when the machine stops it before step ``step``'s update."""
    if exit_code == EXIT_CODE_RESUME_TO_DISAMBIGUATE:
        return (f"step {step} was not applied: its rejected result needs a re-run from the checkpoint of step "
                f"{step - 1} on another node or device to be diagnosed; resume the job there (exit "
                f"{EXIT_CODE_RESUME_TO_DISAMBIGUATE})")
    return (f"step {step} was not applied: it failed result validation (the log above names the diagnosis; exit "
            f"{EXIT_CODE_FAILED_ON_RESULT_VALIDATION})")


def compare_floats(a: float, b: float) -> float:
    """The relative difference of two results (0: identical, both NaN included; inf: one is NaN or inf, the other
    not)."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return MATCH
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
        return MISMATCH
    return math.fabs((a - b) / (a + b) * 2) if a + b else MISMATCH


class ErrorInjector:
    """Rejects about one check in ``rate`` (rank-shifted, from Python's ``random``), then makes the re-runs compare as
    ``kind`` says: transient (the in-place re-run differs), persistent (reproduced in place, differs from the
    checkpoint), correct_result (reproduced both times)."""

    def __init__(self, rate: int = 0, kind: str = "transient_error"):
        self.rate, self.kind = rate, kind
        self.injected: str | None = None  # set while an injected rejection is being diagnosed

    def maybe_inject(self, rank: int) -> bool:
        if self.rate <= 0 or self.injected is not None:
            return False
        if (random.randint(0, self.rate - 1) + rank) % self.rate != 0:
            return False
        self.injected = self.kind
        get_logger().warning(f"Injecting error type {_INJECTED_NAMES[self.kind]}")
        return True

    def maybe_miscompare(self, initial: float, result: float, state: State) -> float:
        if self.injected is None:
            return compare_floats(initial, result)
        if state == State.RERUNNING_IN_PLACE:
            if self.injected == "transient_error":
                self.injected = None
                return MISMATCH
            return MATCH
        kind, self.injected = self.injected, None  # RERUNNING_FROM_CHECKPOINT: the diagnosis is reached
        return MISMATCH if kind == "persistent_error" else MATCH

    def state_dict(self) -> dict:
        return {"rate": self.rate, "kind": self.kind, "injected": self.injected}

    def load_state_dict(self, state: dict) -> None:
        self.rate, self.kind, self.injected = int(state["rate"]), str(state["kind"]), state["injected"]


def _rng_snapshot() -> dict:
    """Every stream a step draws from: Python, NumPy, torch (CPU), the GPU's and the tensor-parallel tracker's."""
    from megatron.tensor_parallel import get_rng_tracker

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": dev.cuda_rng_state(), "tracker": get_rng_tracker().get_states()}


def _rng_restore(state: dict) -> None:
    from megatron.tensor_parallel import get_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        dev.set_cuda_rng_state(state["cuda"])
    get_rng_tracker().set_states(state["tracker"])


def _world() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def reduce_any(flags: list[bool]) -> list[bool]:
    """Each flag or-ed over every rank (one all-reduce over the world group)."""
    if not _world():
        return list(flags)
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=dev.collective_device(dist.get_backend()))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(x) for x in t.tolist()]


def gather_json(value) -> list:
    """Every rank's ``value`` (plain JSON data), in rank order, on every rank: bytes in tensors, no pickle."""
    if not _world():
        return [value]
    device = dev.collective_device(dist.get_backend())
    data = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device))
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    chunks = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in sizes]
    dist.all_gather(chunks, padded)
    return [json.loads(bytes(c[:int(s)].tolist()).decode()) for c, s in zip(chunks, sizes)]


class RerunMachine:
    """One rank's state machine. The training step runs ``while machine.should_run_forward_backward(step):`` around
    its forward and backward (the same batch each time), calls ``validate_result`` on the results it checks, then
    ``should_checkpoint_and_exit()`` before the optimizer step. ``node`` and ``device``: where this rank runs (a re-run
    from a checkpoint must be elsewhere to tell)."""

    def __init__(self, mode: str = "disabled", injector: ErrorInjector | None = None, tracker_file: str | None = None,
                 rank: int = 0, node: str | None = None, device: str = "cpu"):
        self.mode, self.state, self.rank = mode, State.NOT_RUNNING_YET, rank
        self.node, self.device = node or socket.gethostname(), device
        self.injector = injector or ErrorInjector()
        self.tracker_file = tracker_file
        if tracker_file is not None:
            try:
                with open(tracker_file, "a"):
                    pass
            except OSError as err:
                raise RuntimeError(f"RerunStateMachine result validation log cannot be appended to! ({err})") from None
        self.step = 0
        self.first_step_complete = self.logged_enabled = False
        self.rerun_requested = self.checkpoint_requested = self.restart_again_requested = False
        self.continue_requested = False
        self.counts: dict[str, int] = {}  # validate_result calls of this run of the step, by message
        self.failed_call: tuple[str, int] | None = None  # (message, sequence) of the rejected result
        self.initial_result: float | None = None
        self.suspicious: tuple[str, str] | None = None  # (node, device) that reproduced the rejected result
        self.saved_rng: dict | None = None
        self.max_values: dict[str, float] = {}
        self.value_counts: dict[str, int] = {}
        self.results: dict[tuple[str, int], float] = {}  # report_stats: the initial run's results
        self.stats: dict[str, list] = {}  # report_stats: message -> [identical count, max, samples]
        self.checks = None  # the RerunConfig whose checks the training step runs (build_rerun_machine)
        self.log = get_logger()
        if mode != "disabled" and rank == 0:
            self.log.warning(f"RerunStateMachine initialized in mode {mode}")

    # --- the step's loop --------------------------------------------------------------------------------------
    def should_run_forward_backward(self, step: int) -> bool:
        """Whether to (re)run the step's forward and backward now."""
        self.counts = {}
        if self.state == State.NOT_RUNNING_YET:
            self.step, self.state = step, State.INITIAL_RUN
            if self.mode != "disabled":
                self.saved_rng = _rng_snapshot()
                self.rerun_requested = self.checkpoint_requested = False
                self.restart_again_requested = self.continue_requested = False
            return True
        if self.state == State.INITIAL_RUN:
            rerun = self.mode != "disabled" and reduce_any([self.rerun_requested])[0]
            if not rerun:
                self.state = State.NOT_RUNNING_YET
                return False
            if self.mode == "validate_results" and self.rank == 0:
                self.log.warning("Need to rerun step to check reproducibility of initial result")
            self.state = State.RERUNNING_IN_PLACE
            _rng_restore(self.saved_rng)
            return True
        if self.state == State.RERUNNING_IN_PLACE:
            return self._after_rerun_in_place()
        if self.state == State.WILL_RERUN_FROM_CHECKPOINT:
            self.state = State.RERUNNING_FROM_CHECKPOINT
            return True
        if self.state == State.RERUNNING_FROM_CHECKPOINT:
            again, goes_on = reduce_any([self.restart_again_requested, self.continue_requested])
            if again:
                self._warn("Need to restart job from the same checkpoint because it was scheduled on the same "
                           "node/GPU")
                self.state = State.RERUNNING_AGAIN_FROM_CHECKPOINT
            elif goes_on:
                self._warn("Continuing normal execution because failed validation was not fatal")
                self.state = State.NOT_RUNNING_YET
            return False
        raise RuntimeError(f"should_run_forward_backward called in state {self.state.name}")

    def _after_rerun_in_place(self) -> bool:
        if self.mode == "report_stats":
            self.state = State.NOT_RUNNING_YET
            self._maybe_report_stats()
            self.results = {}
            return False
        goes_on, checkpoint = reduce_any([self.continue_requested, self.checkpoint_requested])
        if goes_on:
            self._warn("Continuing normal execution because failed validation was not fatal")
            self.state = State.NOT_RUNNING_YET
            return False
        if checkpoint:
            self.state = State.WILL_RERUN_FROM_CHECKPOINT
        _rng_restore(self.saved_rng)  # the checkpoint before the step holds the step's RNG states
        return False

    def should_checkpoint_and_exit(self) -> tuple[bool, bool, int]:
        """(save the checkpoint before this step, exit, the exit status); call after the loop, before the optimizer
        step."""
        self.first_step_complete = True
        if self.mode != "validate_results":
            return False, False, 0
        if self.state not in _EXITS:
            return False, False, 0
        checkpoint, code, message = _EXITS[self.state]
        self._warn(message)
        return checkpoint, True, code

    def _warn(self, message: str) -> None:
        if self.rank == 0:
            self.log.warning(message)

    # --- checks ----------------------------------------------------------------------------------------------
    def validate_result(self, result: float, rejected: Callable[[float], bool], message: str,
                        tolerance: float = 0.0, fatal: bool = True) -> None:
        """Check one result of the step (this rank's): in the initial run, a rejected one asks for a re-run; in a
        re-run, the same call (by ``message`` and its sequence in the step) is compared with the initial result
        within the relative ``tolerance``, and the diagnosis logged. ``fatal``: the job exits once diagnosed."""
        if self.mode == "disabled":
            return  # the run's health judges the step (megatron/health.py)
        if self.state == State.NOT_RUNNING_YET:
            raise RuntimeError("validate_result is called outside the step's forward and backward")
        self.counts[message] = self.counts.get(message, 0) + 1
        call = (message, self.counts[message])
        if self.mode == "report_stats":
            if self.state == State.INITIAL_RUN:
                self.rerun_requested, self.results[call] = True, result
            elif self.state == State.RERUNNING_IN_PLACE and call in self.results:
                self._record(message, compare_floats(self.results[call], result))
            return
        if not self.logged_enabled:
            self.logged_enabled = True
            self._warn("Result validation enabled")
        if self.state == State.INITIAL_RUN and not self.rerun_requested:
            if self.first_step_complete and (self.injector.maybe_inject(self.rank) or rejected(result)):
                self.failed_call, self.initial_result, self.rerun_requested = call, result, True
                self._track("initial_run", result, message)
                self.log.error(f"Unexpected result {result} on rank {self.rank} at iteration #{self.step} "
                               f"invocation #{call[1]} (message='{message}')")
        elif self.state in (State.RERUNNING_IN_PLACE, State.RERUNNING_FROM_CHECKPOINT) and call == self.failed_call:
            differs = self.injector.maybe_miscompare(self.initial_result, result, self.state) > tolerance
            if self.state == State.RERUNNING_IN_PLACE:
                self._first_rerun(result, message, differs, fatal)
            else:
                self._second_rerun(result, message, differs, fatal)

    def _first_rerun(self, result: float, message: str, differs: bool, fatal: bool) -> None:
        if differs:
            self.continue_requested = not fatal
            self._failure(f"First rerun: unexpected result is not reproducible within the tolerance ({result} != "
                          f"{self.initial_result})", fatal)
            self._track("first_rerun_not_reproducible", result, message)
            self._failure("Possible transient error!", fatal)
            return
        self.checkpoint_requested, self.continue_requested = fatal, not fatal
        self.suspicious = (self.node, self.device)
        self._track("first_rerun_reproducible", result, message)
        self._failure(f"First rerun: unexpected result is reproducible within the tolerance ({result} = "
                      f"{self.initial_result}). Need to rerun on a different GPU to verify correctness.", fatal)

    def _second_rerun(self, result: float, message: str, differs: bool, fatal: bool) -> None:
        if self.suspicious == (self.node, self.device):
            self.log.error(f"Got rescheduled on the same GPU. Need to resume again from the same checkpoint "
                           f"(node: {self.node}, gpu: {self.device})")
            self.restart_again_requested = True
            return
        if differs:
            self._track("second_rerun_not_reproducible", result, message)
            self.log.warning(f"Second rerun: unexpected result is not reproducible on a different GPU, therefore "
                             f"was likely incorrect ({result} != {self.initial_result})")
            self._failure("Possible persistent error!")
        else:
            self._track("second_rerun_reproducible", result, message)
            self.log.warning(f"Second rerun: unexpected result is reproducible on a different GPU, therefore it was "
                             f"likely correct ({result} = {self.initial_result})")
            self._failure(f"Correct result (but possible Application error) ({message})")
        self.continue_requested = not fatal

    def _failure(self, message: str, fatal: bool = True) -> None:
        line = f"Rank {self.rank}, node {self.node}, device {self.device}, iteration #{self.step}: {message}!"
        (self.log.error if fatal else self.log.warning)(line)

    def is_unexpectedly_large(self, value: float, threshold: float, context: str, num_samples: int = 100) -> bool:
        """Whether ``|value|`` is at least ``threshold`` x the largest of the first ``num_samples`` values seen in
        ``context`` (False while those are gathered, and for NaN / inf: checked apart)."""
        value = math.fabs(value)
        if not math.isfinite(value):
            return False
        seen = self.value_counts.get(context, 0)
        if seen < num_samples:
            self.value_counts[context] = seen + 1
            self.max_values[context] = max(self.max_values.get(context, 0.0), value)
            if seen + 1 == num_samples and self.rank == 0:
                self.log.warning(f"Max value for {context}: {self.max_values[context]}")
            return False
        return value >= self.max_values[context] * threshold

    def _track(self, status: str, result: float, message: str) -> None:
        """One line in ``--result-rejected-tracker-filename`` (Megatron's format)."""
        if self.tracker_file is None:
            return
        try:
            with open(self.tracker_file, "a") as f:
                f.write(f"ts={datetime.datetime.now()} node={self.node} device={self.device} "
                        f"jobID={os.environ.get('SLURM_JOBID', 'N/A')} rank={self.rank} iteration={self.step} "
                        f"status={status} result={result} message='{message}'\n")
        except OSError as err:
            self.log.error(f"Could not log validation error! ({err})")

    # --- report_stats ----------------------------------------------------------------------------------------
    def _record(self, message: str, diff: float) -> None:
        identical, largest, samples = self.stats.setdefault(message, [0, 0.0, []])
        if diff == 0.0:
            self.stats[message][0] = identical + 1
            return
        if len(samples) < MAX_SAMPLES:
            samples.append(diff)
        self.stats[message][1] = max(largest, diff)

    def _maybe_report_stats(self) -> None:
        """Every ``REPORTING_INTERVAL`` steps: each check's relative differences between the two runs, over every
        rank (gathered on all, logged by rank 0)."""
        if self.step % REPORTING_INTERVAL:
            return
        gathered = gather_json({m: [i, mx if math.isfinite(mx) else "inf", [s if math.isfinite(s) else "inf"
                                                                             for s in samples]]
                                for m, (i, mx, samples) in self.stats.items()})
        if self.rank != 0:
            return
        self.log.info("Stats on computation determinism in validation calls")
        for message in sorted({m for g in gathered for m in g}):
            parts = [g[message] for g in gathered if message in g]
            identical = sum(p[0] for p in parts)
            samples = sorted(float(s) for p in parts for s in p[2])
            self.log.info(f"  {message}:")
            self.log.info(f"    {describe_stats(identical, samples, max(float(p[1]) for p in parts))}")

    # --- the checkpoint --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's state for the checkpoint before the step (plain JSON: results as text, NaN is not JSON)."""
        return {"mode": self.mode, "state": self.state.name, "step": self.step,
                "rerun_requested": self.rerun_requested, "checkpoint_requested": self.checkpoint_requested,
                "restart_again_requested": self.restart_again_requested,
                "continue_requested": self.continue_requested, "injector": self.injector.state_dict(),
                "failed_call": list(self.failed_call) if self.failed_call else None,
                "initial_result": None if self.initial_result is None else repr(float(self.initial_result)),
                "suspicious": list(self.suspicious) if self.suspicious else None,
                "value_counts": self.value_counts, "max_values": {k: repr(v) for k, v in self.max_values.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Take a checkpoint's state (``state_dict``): the next step re-runs the one it was saved before."""
        if self.mode == "disabled":
            self._warn("RerunStateMachine disabled via CLI, ignoring machine state saved in checkpoint")
            return
        self._warn("Getting RerunStateMachine state from checkpoint. Will rerun step.")
        self.mode, self.state, self.step = str(state["mode"]), State[state["state"]], int(state["step"])
        for key in ("rerun_requested", "checkpoint_requested", "restart_again_requested", "continue_requested"):
            setattr(self, key, bool(state[key]))
        self.injector.load_state_dict(state["injector"])
        self.failed_call = (str(state["failed_call"][0]), int(state["failed_call"][1])) if state["failed_call"] \
            else None
        self.initial_result = None if state["initial_result"] is None else float(state["initial_result"])
        self.suspicious = tuple(state["suspicious"]) if state["suspicious"] else None
        self.value_counts = {str(k): int(v) for k, v in state["value_counts"].items()}
        self.max_values = {str(k): float(v) for k, v in state["max_values"].items()}

    @property
    def pending(self) -> bool:
        """Whether a step is to be re-run from the checkpoint (the marker a save must carry)."""
        return self.state != State.NOT_RUNNING_YET


def describe_stats(identical: int, samples: list[float], largest: float) -> str:
    """Megatron's line: total / identical results, the mean and percentiles of the relative differences."""
    n = len(samples)
    if not n:
        return f"{identical:,} samples, all identical"
    total = identical + n
    pct = {p: f"{samples[int(total * p) - identical]:.3E}" if int(total * p) - identical >= 0 else "0.0"
           for p in (0.5, 0.9, 0.99, 0.999)}
    return (f"{total:,}/{identical:,} total/identical samples, rel. variability: avg= {sum(samples) / total:.3E}, "
            f"p50= {pct[0.5]}, p90= {pct[0.9]}, p99= {pct[0.99]}, p99.9= {pct[0.999]}, max: {largest:.3E}")


def build_rerun_machine(rerun, rank: int, device: torch.device) -> RerunMachine:
    """The machine of a run's ``rerun`` settings (``Config.rerun``)."""
    machine = RerunMachine(rerun.rerun_mode, ErrorInjector(rerun.error_injection_rate, rerun.error_injection_type),
                           rerun.result_rejected_tracker_filename, rank, device=str(device))
    machine.checks = rerun
    return machine


def checked_loss(machine: RerunMachine, loss_sum: float) -> None:
    """pretrain_gpt.py's checks of Megatron on this rank's loss (the sum over its micro-batches' tokens)."""
    rerun = machine.checks
    if rerun.check_for_nan_in_loss_and_grad:
        machine.validate_result(loss_sum, math.isnan, "found NaN in local forward loss calculation")
        machine.validate_result(loss_sum, math.isinf, "found Inf in local forward loss calculation")
    if rerun.check_for_spiky_loss:
        machine.validate_result(loss_sum, lambda v: machine.is_unexpectedly_large(v, SPIKY_LOSS_FACTOR, "loss"),
                                "Spiky loss", fatal=False)


def checked_grads(machine: RerunMachine, grads: list[torch.Tensor]) -> None:
    """Megatron's checks on this rank's gradients (here: the norm of those it steps, after their reduction)."""
    rerun = machine.checks
    if not (rerun.check_for_nan_in_loss_and_grad or rerun.check_for_large_grads) or machine.mode == "disabled":
        return
    norm = float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads]))) if grads else 0.0
    where = "in backward pass before the optimizer step"
    if rerun.check_for_nan_in_loss_and_grad:
        machine.validate_result(norm, math.isnan, f"found NaN in local grad norm {where}", tolerance=0.001)
        machine.validate_result(norm, math.isinf, f"found Inf in local grad norm {where}", tolerance=0.001)
    if rerun.check_for_large_grads:
        machine.validate_result(norm, lambda v: machine.is_unexpectedly_large(v, 10, "grads"),
                                f"found unexpected large grads {where}", tolerance=0.001, fatal=False)


SPIKY_LOSS_FACTOR = 10  # pretrain_gpt.py's
