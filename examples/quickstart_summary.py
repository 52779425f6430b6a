"""The quickstart's summary of its training run (examples/quickstart.sh runs it after pretrain_gpt.py):

    python examples/quickstart_summary.py RUN_DIR [--vocab-size 4096]

the training loss from the first to the last logged step, the validation losses, and whether the model
learned: its last validation loss at least 2 nats below an untrained model's, ln(vocab size). Exit 0 when it
did, and with one line saying so when there is nothing to compare yet: the run was stopped (a SIGTERM or Ctrl-C
saves and exits 0) before its first logged step or its first evaluation. Exit 1 with one line on stderr when it
did not learn, or its metrics cannot be read.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.run_metrics import METRICS_FILE, Run, RunError, read_config, read_records  # noqa: E402

PROG = "quickstart"
AGAIN = "run examples/quickstart.sh again to train the model to the end"


class Stopped(str):
    """The one line of a run stopped before there was anything to compare: not a failure (exit 0)."""


def summary(run_dir: str, vocab_size: int = 4096) -> tuple[list[str], str | None]:
    """(the lines to print, the one-line reason the run shows no learning (a ``Stopped`` when it was stopped
    before there was anything to compare), or None when it learned)."""
    metrics = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(metrics):
        return [], Stopped(f"{PROG}: the training run wrote no {metrics}: it stopped before its first logged step, "
                           f"so there is nothing to compare; {AGAIN}.")
    run = Run(path=run_dir, metrics_path=metrics, label=os.path.basename(run_dir))
    try:
        read_records(metrics, run)
    except RunError as err:
        return [], f"{PROG}: {err}; {AGAIN}."
    train, valid = list(run.records["train"].values()), list(run.records["valid"].values())
    if not train:
        return [], Stopped(f"{PROG}: the training run stopped before its first logged step ({metrics} has no "
                           f"training record), so there is nothing to compare; {AGAIN}.")
    start = math.log(vocab_size)
    lines = [f"\n{PROG}: untrained loss ln({vocab_size}) = {start:.2f}; train loss {train[0]['loss']:.2f} at step "
             f"{train[0]['step']} -> {train[-1]['loss']:.2f} at step {train[-1]['step']}"]
    if not valid:
        read_config(run)
        every = (run.config or {}).get("eval_freq")
        when = f" (every {every} steps)" if isinstance(every, int) else ""
        return lines, Stopped(f"{PROG}: the training run stopped at step {train[-1]['step']}, before its first "
                              f"evaluation{when}: there is no validation loss to compare; {AGAIN}.")
    lines.append(f"{PROG}: validation loss (held-out modules): "
                 + ", ".join(f"{r['loss']:.2f} at step {r['step']}" for r in valid))
    if not valid[-1]["loss"] < start - 2.0:
        return lines, (f"{PROG}: the validation loss did not fall as expected ({valid[-1]['loss']:.2f} at step "
                       f"{valid[-1]['step']}, not below {start - 2.0:.2f})")
    return [*lines, f"{PROG}: the model learned."], None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="quickstart_summary.py", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="The training run's --save folder (its metrics.jsonl).")
    p.add_argument("--vocab-size", type=int, default=4096, help="The tokenizer's vocabulary size.")
    args = p.parse_args(argv)
    lines, failure = summary(args.run_dir, args.vocab_size)
    for line in lines:
        print(line, flush=True)
    if isinstance(failure, Stopped):
        print(failure, flush=True)
        return 0
    if failure:
        print(failure, file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
