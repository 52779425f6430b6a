"""How fast a hang ends the job: the watchdog's detection time, and workers dying with torchrun.

    python benchmarks/watchdog.py            # 2 gloo ranks on the CPU, through torchrun
    python benchmarks/watchdog.py --write    # also update docs/benchmarks.md

**Hang.** A 2-rank torchrun job trains a tiny GPT on synthetic data (``--logging-freq 1``); at step 5
rank 1 is sent SIGSTOP. Timed from that moment: when rank 0's ``output_dir/hang/rank0.txt`` exists
(rank 0 waits in a collective; its watchdog fires ``watchdog_timeout_minutes`` after the last beat,
which came shortly before the stop), and when every process (torchrun and both workers) has exited.
The second includes torchrun's grace between the SIGTERM it sends the remaining workers after a
failure and its SIGKILL: 30 s in torch 2.13, whatever ``--shutdown-timeout`` says (that path does not
pass it on), and a stopped process cannot act on a SIGTERM.

**Launcher death.** The same job, at step 3 torchrun is sent SIGKILL; timed until both workers have
exited (their parent-death signal, ``megatron/initialize.py``). Each scenario runs ``--repeats`` times;
the median and the range are reported. The beat's own cost is timed with ``timeit``.

The process helpers are those of the tests (``tests/functional/processes.py``), so the benchmark
measures exactly what the tests bound.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import write_section  # noqa: E402
from megatron.watchdog import Watchdog  # noqa: E402
from tests.functional.processes import (  # noqa: E402
    ENDLESS,
    alive,
    kill_everything,
    stop_one_rank,
    torchrun,
    wait_for_step,
    wait_until,
    workers,
)

GRACE_S = 30  # torchrun's SIGTERM -> SIGKILL grace after a worker failed


def hang_times(minutes: float, repeats: int, work: Path) -> tuple[list[float], list[float]]:
    """(seconds from SIGSTOP to the dump, seconds from SIGSTOP to every process gone) per repeat."""
    dumps, gone = [], []
    for i in range(repeats):
        result = stop_one_rank(work / f"hang-{minutes:g}-{i}", ["--watchdog-timeout-minutes", str(minutes)],
                               bound=60 * minutes + GRACE_S + 60)
        if result.dump_s is None or result.all_gone_s is None or "exiting with status 4" not in result.log:
            raise SystemExit(f"the hang at timeout {minutes:g} minutes was not handled; log:\n{result.log[-3000:]}")
        dumps.append(result.dump_s)
        gone.append(result.all_gone_s)
    return dumps, gone


def launcher_death_times(repeats: int, work: Path) -> list[float]:
    """Seconds from SIGKILL of torchrun to both workers gone, per repeat."""
    times = []
    for i in range(repeats):
        out = work / f"orphan-{i}"
        out.mkdir()
        job = torchrun([*ENDLESS, "--save", str(out)], work / f"orphan-{i}.log")
        pids = {}
        try:
            pids = workers(job, 2)
            wait_for_step(out, 3, job)
            os.kill(job.pid, signal.SIGKILL)
            start = time.monotonic()
            job.wait()
            live = list(pids.values())
            gone = wait_until(lambda live=live: not any(alive(p) for p in live), 30, interval=0.005)
            times.append(time.monotonic() - start if gone is not None else float("inf"))
        finally:
            kill_everything(job, list(pids.values()))
    return times


def beat_ns() -> float:
    dog = Watchdog(600, tempfile.gettempdir(), rank=0)
    number = 200_000
    return min(timeit.repeat(lambda: dog.beat("training step 12"), number=number, repeat=5)) / number * 1e9


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeouts", type=float, nargs="+", default=[0.1, 0.25], help="watchdog minutes")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    started = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for minutes in args.timeouts:
            dumps, gone = hang_times(minutes, args.repeats, Path(tmp))
            rows.append(f"| rank 1 stopped, watchdog {minutes:g} min ({60 * minutes:g} s) | {_cell(dumps)} | "
                        f"{_cell(gone)} |")
            print(rows[-1], flush=True)
        orphans = launcher_death_times(args.repeats, Path(tmp))
        rows.append(f"| torchrun killed (SIGKILL) | - | {_cell(orphans)} |")
        print(rows[-1], flush=True)
    cost = beat_ns()
    table = "\n".join([
        f"2 gloo ranks through torchrun on the CPU (2 cores), torch {torch.__version__}; {args.repeats} runs per row, "
        f"median (min-max) seconds; run took {time.monotonic() - started:.0f} s. `beat()` costs {cost:.0f} ns "
        f"(one clock read and a store; once per step and per evaluation batch).",
        "",
        "| event | hang dump written after | every process gone after |",
        "| --- | ---: | ---: |",
        *rows,
    ])
    print(table)
    if args.write:
        write_section("watchdog", "Hang watchdog and launcher death: time to a clean end",
                      "python benchmarks/watchdog.py " + " ".join(sys.argv[1:]), table, intro=INTRO)


INTRO = (
    "`benchmarks/watchdog.py` stops one rank of a 2-rank torchrun job (SIGSTOP) and times the other rank's "
    "hang dump (`output_dir/hang/rank0.txt`) and the end of every process; then it kills torchrun itself "
    "(SIGKILL) and times the end of its workers. The dump comes `watchdog_timeout_minutes` after the last "
    "beat (which precedes the stop by at most a step; the thread sleeps until that deadline, no polling). "
    "The rest of the time to a clean end is torchrun's: after a worker fails it SIGTERMs the others and "
    "SIGKILLs them 30 s later (torch 2.13 does not apply `--shutdown-timeout` on this path), and a stopped "
    "rank cannot act on a SIGTERM. Workers die with a killed torchrun through their parent-death signal "
    "(`prctl(PR_SET_PDEATHSIG, SIGKILL)`), at once."
)

if __name__ == "__main__":
    main()
