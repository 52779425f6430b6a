"""One launch, several runs: every rank runs ``pretrain_gpt.main`` (or another program's ``main``: a tool's) for
each run of a plan in turn, in one process and one default process group.

    torchrun --standalone --nproc-per-node N tests/functional/several_runs.py PLAN.json
    python tests/functional/several_runs.py PLAN.json                     (one process)

What a tiny run costs is mostly its launch (the interpreter, torch, the rendezvous: seconds per rank on a
small machine), not its ten steps; the layouts of one world size share it. PLAN.json is a list of
``{"out": folder, "args": [...], "program": path}``; ``program`` (default ``pretrain_gpt.py``) is relative to the
repository. A training run saves to its folder (``--save`` is added unless given); a run's stderr on rank r goes to
``folder/rank{r}.log``, its stdout to ``folder/rank{r}.out``, its exit code to ``folder/rank{r}.rc``, its wall time
to ``folder/rank{r}.seconds``. Between
runs only the rank grid is torn down (the program's ``shutdown`` becomes ``parallel_state.destroy``), not the
default group, whose rendezvous could not be repeated in one process.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402

from megatron import parallel_state  # noqa: E402
from tests.functional.launch import program_module  # noqa: E402


def _program(path: str) -> ModuleType:
    """The program's module, its ``shutdown`` keeping the default group for the next run."""
    module = program_module(path)
    module.shutdown = parallel_state.destroy
    return module


def _run(program: str, args: list[str], out: Path, rank: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    if program == "pretrain_gpt.py" and "--save" not in args:
        args = [*args, "--save", str(out)]
    with (open(out / f"rank{rank}.log", "w") as log, open(out / f"rank{rank}.out", "w") as printed,
          contextlib.redirect_stderr(log), contextlib.redirect_stdout(printed)):
        try:
            return _program(program).main(args)
        except BaseException:  # noqa: B036 - reported in the run's log; the next run goes on
            traceback.print_exc()
            return 1


def main(plan_path: str) -> int:
    rank = int(os.environ.get("RANK", 0))
    for run in json.loads(Path(plan_path).read_text()):
        start = time.perf_counter()
        rc = _run(run.get("program", "pretrain_gpt.py"), run["args"], Path(run["out"]), rank)
        (Path(run["out"]) / f"rank{rank}.rc").write_text(str(rc))
        (Path(run["out"]) / f"rank{rank}.seconds").write_text(f"{time.perf_counter() - start:.3f}")  # its cost
        if dist.is_initialized():
            dist.barrier()  # the next run starts together
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
