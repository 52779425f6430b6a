"""One launch, several training runs: every rank runs ``pretrain_gpt.main`` for each run of a plan in turn, in
one process and one default process group.

    torchrun --standalone --nproc-per-node N tests/functional/several_runs.py PLAN.json
    python tests/functional/several_runs.py PLAN.json                     (one process)

What a tiny run costs is mostly its launch (the interpreter, torch, the rendezvous: seconds per rank on a
small machine), not its ten steps; the layouts of one world size share it. PLAN.json is a list of
``{"out": folder, "args": [...]}``: each run saves to its folder (``--save``), its output on rank r goes to
``folder/rank{r}.log`` and its exit code to ``folder/rank{r}.rc``. Between runs only the rank grid is torn
down (``parallel_state``), not the default group, whose rendezvous could not be repeated in one process.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402

import pretrain_gpt  # noqa: E402
from megatron import parallel_state  # noqa: E402


def _run(args: list[str], out: Path, rank: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"rank{rank}.log", "w") as log, contextlib.redirect_stderr(log), contextlib.redirect_stdout(log):
        try:
            return pretrain_gpt.main([*args, "--save", str(out)])
        except BaseException:  # noqa: B036 - reported in the run's log; the next run goes on
            traceback.print_exc()
            return 1


def main(plan_path: str) -> int:
    pretrain_gpt.shutdown = parallel_state.destroy  # keep the default group for the next run
    rank = int(os.environ.get("RANK", 0))
    for run in json.loads(Path(plan_path).read_text()):
        rc = _run(run["args"], Path(run["out"]), rank)
        (Path(run["out"]) / f"rank{rank}.rc").write_text(str(rc))
        if dist.is_initialized():
            dist.barrier()  # the next run starts together
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
