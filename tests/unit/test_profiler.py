"""``--profile`` (megatron/training/profiler.py): one tiny in-process run of 4 steps that profiles steps 2-3 (its
Chrome trace beside the run, the table in the log); the window driven step by step without a model (a run that
ends or raises inside it, a resumed run past it); the window's and the ranks' validation."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import pytest
import torch

import pretrain_gpt
from megatron.config import ConfigError, parse_config, validate
from megatron.metrics import get_logger
from megatron.parallelize_gpt import build_model
from megatron.training import Trainer, set_seed
from megatron.training.profiler import StepProfiler, trace_path

RUN = ("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "128",
       "--max-seq-len", "16", "--max-position-embeddings", "16", "--global-batch-size", "4", "--eval-iters", "0",
       "--num-workers", "0", "--no-save-at-end")


def config_of(*argv: str, world_size: int = 1):
    config = parse_config(["--mock-data", "--device", "cpu", *argv])
    return config, validate(config, world_size=world_size, cuda_available=False)


@contextlib.contextmanager
def logged():
    """The project logger's messages, in a list."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = get_logger()
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def trace_of(path: Path) -> tuple[list[str], set[str]]:
    """The trace's step marks (ProfilerStep#N, in order) and its operator names; it must be valid JSON."""
    events = json.loads(path.read_text())["traceEvents"]
    names = [e.get("name", "") for e in events if e.get("ph") == "X"]
    marks = sorted({n for n in names if n.startswith("ProfilerStep#")}, key=lambda n: int(n.split("#")[1]))
    return marks, set(names)


def test_a_run_profiles_the_window_and_writes_its_trace(tmp_path):
    """4 steps, --profile-step-start 2 --profile-step-end 4: steps 2 and 3 traced (step 4, the end, is not),
    the trace in output_dir/profile/rank0.pt.trace.json, one line naming it and the table in the log."""
    config, warnings = config_of(*RUN, "--max-steps", "4", "--save", str(tmp_path), "--profile",
                                 "--profile-step-start", "2", "--profile-step-end", "4")
    assert warnings == []
    set_seed(config.seed)
    with logged() as messages:
        state = Trainer(config, build_model(config), pretrain_gpt.forward_step,
                        pretrain_gpt.datasets_provider(config), torch.device("cpu")).run()
    assert state.step == 4
    assert not torch.autograd._profiler_enabled()  # stopped: nothing left running
    path = trace_path(tmp_path, 0)
    assert path == tmp_path / "profile" / "rank0.pt.trace.json" and path.is_file()
    marks, names = trace_of(path)
    assert marks == ["ProfilerStep#2", "ProfilerStep#3"]
    assert names & {"aten::mm", "aten::addmm"}
    (line,) = [m for m in messages if m.startswith("profile:")]
    assert line.startswith(f"profile: steps 2-3 on rank 0 traced to {path} ")
    assert "Self CPU" in line and "aten::" in line  # key_averages' table, by self CPU time


def _drive(profiler: StepProfiler, steps: range) -> None:
    """The loop's calls around a step of some work (a matmul) each."""
    x = torch.ones(8, 8)
    for done in steps:
        profiler.before_step(done)
        torch.mm(x, x)


def test_the_window_ends_with_the_run_or_its_error(tmp_path):
    """A run whose last step (3) is inside the window (2 .. 5): the loop's close() writes steps 2-3. A run that
    raises inside it: the Trainer's cleanup (close) still writes what was recorded, and stops the profiler."""
    config, _ = config_of("--output-dir", str(tmp_path), "--max-steps", "3", "--profile", "--profile-step-start",
                          "2", "--profile-step-end", "6")
    profiler = StepProfiler(config, 0, torch.device("cpu"))
    _drive(profiler, range(3))
    assert profiler.active
    with logged() as messages:
        profiler.close()
        profiler.close()  # again (the Trainer's cleanup after the loop's): nothing more
    assert not profiler.active and not torch.autograd._profiler_enabled()
    assert trace_of(trace_path(tmp_path, 0))[0] == ["ProfilerStep#2", "ProfilerStep#3"]
    assert len(messages) == 1 and messages[0].startswith("profile: steps 2-3 on rank 0")

    config.save_load.output_dir = str(tmp_path / "raised")
    profiler = StepProfiler(config, 0, torch.device("cpu"))
    with pytest.raises(RuntimeError), logged():
        try:
            _drive(profiler, range(2))
            raise RuntimeError("the step failed")
        finally:
            profiler.close()
    assert not torch.autograd._profiler_enabled()
    assert trace_of(trace_path(tmp_path / "raised", 0))[0] == ["ProfilerStep#2"]


def test_only_the_profile_ranks_profile_and_a_resumed_run_says_it_is_past_the_window(tmp_path):
    config, _ = config_of("--output-dir", str(tmp_path), "--profile", "--profile-step-start", "2",
                          "--profile-step-end", "4", "--profile-ranks", "1", world_size=2)
    with logged() as messages:
        _drive(StepProfiler(config, 0, torch.device("cpu")), range(4))  # rank 0 is not in profile_ranks
        resumed = StepProfiler(config, 1, torch.device("cpu"))
        _drive(resumed, range(2, 5))  # resumed after step 2: its first step is 3
        resumed.close()
    assert not (tmp_path / "profile").exists()
    assert messages == ["profile: nothing is profiled on rank 1: this run starts at step 3, past profile_step_start "
                        "(2); give --profile-step-start 3 or later to profile it"]
    config.profile_ranks = []  # Megatron-LM's empty list: every rank
    assert StepProfiler(config, 5, torch.device("cpu")).enabled
    config.profile = False
    assert not StepProfiler(config, 0, torch.device("cpu")).enabled


def test_a_negative_step_is_refused_with_or_without_profile():
    """As every numeric key (tests/unit/test_validate.py): a negative step number is never meant."""
    for flags in (["--profile"], []):
        with pytest.raises(ConfigError, match=r"profile_step_start must be a step number \(0 or more\), got -1"):
            config_of(*flags, "--profile-step-start", "-1", world_size=2)


@pytest.mark.parametrize("argv, message", [
    (["--profile-step-start", "5", "--profile-step-end", "5"], r"profile_step_start \(5\) .. profile_step_end - 1 "
                                                                r"\(4\)"),
    (["--profile-step-start", "0", "--profile-step-end", "1"], r"\(and above 1\)"),
    (["--profile-ranks", "0", "2"], r"profile_ranks holds 2, but this launch has ranks 0..1"),
])
def test_a_bad_window_or_rank_is_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        config_of("--profile", *argv, world_size=2)
    config_of(*argv, world_size=2)  # without --profile the keys are unused


@pytest.mark.parametrize("argv, warning", [
    (["--profile-step-start", "8", "--profile-step-end", "12"], "profiling stops at the run's end (step 10)"),
    (["--profile-step-start", "11", "--profile-step-end", "12"], "nothing is profiled"),
    (["--profile-step-start", "9", "--profile-step-end", "11"], None),  # steps 9-10: within the run
    (["--profile-step-start", "0", "--profile-step-end", "2"], None),  # Megatron's 0: from the first step
])
def test_a_window_past_the_run_is_a_warning(argv, warning):
    _, warnings = config_of("--max-steps", "10", "--profile", *argv)
    if warning is None:
        assert warnings == []
    else:
        (line,) = warnings
        assert "go past the run's last step (10)" in line and warning in line
