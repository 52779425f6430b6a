"""``--profile``: PyTorch's profiler over a window of training steps (Megatron-LM's ``--profile``,
``--profile-step-start``, ``--profile-step-end``, ``--profile-ranks``).

The steps are numbered as the log numbers them (``global step N``, the first step is 1). The profiler starts
when the step about to run is ``profile_step_start`` and stops when it reaches ``profile_step_end``, which is
not profiled: steps ``profile_step_start`` .. ``profile_step_end - 1``, as Megatron-LM's PyTorch-profiler
schedule records them; its ``--profile-step-start 0`` profiles from the first step, as 1 does. Each profiled
step is a ``ProfilerStep#N`` range in the trace (N its logged number), holding everything the loop does in it
(the step, and an evaluation or a save after it).

On each rank of ``profile_ranks`` (every rank when the list is empty, as in Megatron-LM) the trace goes to
``output_dir/profile/rank{R}.pt.trace.json`` (Chrome's trace format: Perfetto, chrome://tracing, TensorBoard's
profiler plug-in), and the rank logs one line naming the file and the table of its operations by self time.
A run that ends inside the window (its last step, a stop signal, an error) stops the profiler and writes
what it recorded (``close``, from the Trainer's cleanup). A resumed run that starts past
``profile_step_start`` profiles nothing and says so once.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from megatron.config import Config
from megatron.metrics import get_logger

TABLE_ROWS = 15


def trace_path(output_dir: str | Path, rank: int) -> Path:
    """Where ``rank``'s trace of a run in ``output_dir`` goes."""
    return Path(output_dir) / "profile" / f"rank{rank}.pt.trace.json"


class StepProfiler:
    """Driven by the training loop: ``before_step(done)`` at the top of each iteration (``done``: the steps
    completed so far), ``close()`` when the loop ends, however it ends. Does nothing on a rank that does not
    profile, or without ``--profile``."""

    def __init__(self, config: Config, rank: int, device: torch.device, with_stack: bool = False):
        self.first = max(config.profile_step_start, 1)  # Megatron's 0: from the first step, as 1
        self.start, self.end = config.profile_step_start, config.profile_step_end
        self.enabled = config.profile and (not config.profile_ranks or rank in config.profile_ranks)
        self.rank, self.path = rank, trace_path(config.save_load.output_dir, rank)
        self.cuda, self.with_stack = device.type == "cuda", with_stack
        self.prof: torch.profiler.profile | None = None
        self.steps: list[int] = []  # the logged numbers of the steps profiled
        self.checked = False  # the resumed-past-the-window line said (once)
        self.log = get_logger()

    @property
    def active(self) -> bool:
        return self.prof is not None

    def before_step(self, done: int) -> None:
        """The step ``done + 1`` is about to run: start, mark the next step, or stop at ``profile_step_end``."""
        if not self.enabled:
            return
        step = done + 1
        if not self.checked:
            self.checked = True
            if step > self.first:
                self.log.warning(f"profile: nothing is profiled on rank {self.rank}: this run starts at step {step}, "
                                 f"past profile_step_start ({self.start}); give --profile-step-start {step} or later "
                                 f"to profile it")
                self.enabled = False
                return
        if self.prof is None:
            if step == self.first:
                self._start(step)
        elif step >= self.end:
            self.close()
        else:
            self.prof.step()  # ends ProfilerStep#(step - 1), begins ProfilerStep#step
            self.steps.append(step)

    def _start(self, step: int) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        # a schedule that always records: the profiler marks each step (ProfilerStep#N) without a window of its own
        self.prof = torch.profiler.profile(activities=activities, schedule=lambda _: ProfilerAction.RECORD,
                                           record_shapes=True, profile_memory=True, with_stack=self.with_stack)
        self.prof.step_num = step  # the first mark is ProfilerStep#step, the log's number
        self.prof.start()
        self.steps.append(step)

    def close(self) -> None:
        """Stop the profiler if it runs, write its trace and log the table. Safe to call again; a trace that
        cannot be written is a warning (this runs in the Trainer's cleanup, where an error would hide the
        run's own)."""
        prof, self.prof = self.prof, None
        if prof is None:
            return
        self.enabled = False  # one window per run
        prof.stop()
        steps = f"step {self.steps[0]}" if len(self.steps) == 1 else f"steps {self.steps[0]}-{self.steps[-1]}"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(self.path))
        except OSError as err:
            self.log.warning(f"profile: the trace of {steps} on rank {self.rank} could not be written to "
                             f"{self.path} ({err}); check that output_dir is writable")
            return
        sort_by, by = ("self_cuda_time_total", "CUDA") if self.cuda else ("self_cpu_time_total", "CPU")
        table = prof.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS)
        self.log.info(f"profile: {steps} on rank {self.rank} traced to {self.path} (open it in https://ui.perfetto.dev "
                      f"or chrome://tracing); the {TABLE_ROWS} operations of most self {by} time:\n{table}")
