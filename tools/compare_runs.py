"""Compare runs step by step: their losses and gradient norms side by side, the largest gaps, and
(``--assert-equal``) whether they agree within a tolerance.

    python tools/compare_runs.py RUN RUN [RUN ...] [--metrics loss,grad_norm] [--rtol R] [--atol A]
    python tools/compare_runs.py out_tp1 out_tp2 --assert-equal --rtol 1e-5

RUN: a run folder (what pretrain_gpt.py --save wrote) or its metrics.jsonl. The first run is the
reference. Train records are aligned by step, on the steps every run logged; validation and test
losses likewise. Values a (a run) and b (the reference) agree when ``|a - b| <= atol + rtol * |b|``
(default rtol 1e-5, atol 0); two nulls, or two NaNs, agree; a null and a number do not.
Exit status: 0, or with ``--assert-equal`` 0 when everything compared agrees and 1 at the first
step where something does not (named on stderr); 2, with a one-line message, for a missing or empty
metrics file, a bad argument, or runs without a common step.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.run_metrics import Run, RunError, format_steps, load_runs, number, reading_note  # noqa: E402

PROG = "compare_runs.py"
EVAL_SPLITS = ("valid", "test")  # compared on their loss, where every run has the step


class ToolError(Exception):
    """A one-line message for the user (exit status 2)."""


@dataclass
class Difference:
    """The first value that disagrees with the reference beyond the tolerance."""

    step: int
    split: str
    metric: str
    run: str
    value: float | None
    reference: float | None
    reference_run: str

    def describe(self, rtol: float, atol: float) -> str:
        where = "" if self.split == "train" else f"{self.split} "
        a, b = self.value, self.reference
        gap = ""
        if a is not None and b is not None and math.isfinite(a) and math.isfinite(b):
            gap = f" (|a - b| = {abs(a - b):.3g} > {atol + rtol * abs(b):.3g})"
        return (f"step {self.step}: {where}{self.metric} is {fmt(a)} in {self.run}, {fmt(b)} in "
                f"{self.reference_run}{gap}")


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.7g}"


def agree(a: float | None, b: float | None, rtol: float, atol: float) -> bool:
    """``|a - b| <= atol + rtol * |b|``; two nulls agree, as do two NaNs or the same infinity (a run that
    diverged at the same step as its reference reproduces it)."""
    if a is None or b is None:
        return a is None and b is None
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= atol + rtol * abs(b)


def relative_gap(a: float | None, b: float | None) -> float | None:
    """|a - b| / |b|: 0 for equal values (zeros included), inf when only b is 0, None without two numbers."""
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return None
    if a == b:
        return 0.0
    return abs(a - b) / abs(b) if b else math.inf


def common_steps(runs: list[Run], split: str) -> tuple[list[int], list[str]]:
    """The steps of ``split`` every run logged, and one line per run that lacks steps others have."""
    every = [set(run.steps(split)) for run in runs]
    common = sorted(set.intersection(*every))
    union = set.union(*every)
    missing = [f"{run.label} lacks {len(union - steps)} of them: {format_steps(sorted(union - steps))}"
               for run, steps in zip(runs, every) if union - steps]
    return common, missing


def value(run: Run, split: str, step: int, metric: str) -> float | None:
    return number(run.records[split][step].get(metric))


def table(runs: list[Run], split: str, steps: list[int], metrics: list[str]) -> list[str]:
    """One row per step: each run's value of each metric, then each other run's relative gap to the first."""
    header, widths = ["step"], [7]
    for metric in metrics:
        for run in runs:
            header.append(f"{metric}[{run.label}]")
        for run in runs[1:]:
            header.append(f"rel.gap[{run.label}]")
    widths += [max(12, len(h)) for h in header[1:]]
    rows = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    for step in steps:
        cells = [str(step)]
        for metric in metrics:
            values = [value(run, split, step, metric) for run in runs]
            cells += [fmt(v) for v in values]
            gaps = [relative_gap(v, values[0]) for v in values[1:]]
            cells += ["-" if g is None else f"{g:.3e}" for g in gaps]
        rows.append("  ".join(c.rjust(w) for c, w in zip(cells, widths)))
    return rows


def largest_gaps(runs: list[Run], split: str, steps: list[int], metrics: list[str]) -> list[str]:
    """Per metric and run (against the first), the largest relative gap and its step."""
    lines = []
    for metric in metrics:
        for run in runs[1:]:
            gaps = [(relative_gap(value(run, split, s, metric), value(runs[0], split, s, metric)), s) for s in steps]
            gaps = [(g, s) for g, s in gaps if g is not None]
            if not gaps:
                lines.append(f"  {metric} [{run.label} vs {runs[0].label}]: no step where both have a number")
                continue
            gap, step = max(gaps, key=lambda gs: (gs[0], -gs[1]))  # the first step of the largest gap
            pair = f"  {metric} [{run.label} vs {runs[0].label}]"
            lines.append(f"{pair}: largest relative gap {gap:.3e} at step {step}" if gap else
                         f"{pair}: identical at all {len(gaps)} step(s)")
    return lines


def differences(runs: list[Run], compared: dict[str, tuple[list[int], list[str]]], rtol: float, atol: float):
    """Every (step, metric, run) whose value disagrees with the first run's."""
    for split, (steps, metrics) in compared.items():
        for step in steps:
            for metric in metrics:
                ref = value(runs[0], split, step, metric)
                for run in runs[1:]:
                    got = value(run, split, step, metric)
                    if not agree(got, ref, rtol, atol):
                        yield Difference(step, split, metric, run.label, got, ref, runs[0].label)


def first_difference(runs: list[Run], compared: dict[str, tuple[list[int], list[str]]], rtol: float,
                     atol: float) -> Difference | None:
    """The earliest step where some run disagrees with the first: at one step, train before valid before
    test, then metrics and runs in the order given."""
    order = {split: i for i, split in enumerate(("train", *EVAL_SPLITS))}
    return min(differences(runs, compared, rtol, atol), key=lambda d: (d.step, order[d.split]), default=None)


def check_metrics(runs: list[Run], metrics: list[str]) -> None:
    for metric in metrics:
        if not any(run.has(metric) for run in runs):
            known = sorted({k for run in runs for r in run.records["train"].values() for k, v in r.items()
                            if number(v) is not None and k not in ("step", "split")})
            raise ToolError(f"--metrics: no run has a number for {metric!r} in its training records (they have: "
                            f"{', '.join(known)})")


def compare(runs: list[Run], metrics: list[str], rtol: float, atol: float) -> tuple[list[str], Difference | None]:
    """The report's lines, and the first difference beyond the tolerance (None when all agree)."""
    check_metrics(runs, metrics)
    steps, missing = common_steps(runs, "train")
    if not steps:
        raise ToolError(f"the runs have no training step in common ({'; '.join(missing)})")
    names = ", ".join(run.label for run in runs)
    lines = [f"runs: {names} (reference: {runs[0].label})",
             f"training steps in common: {len(steps)} ({format_steps(steps)})"]
    lines += [f"  {line}" for line in missing]
    lines += table(runs, "train", steps, metrics)
    lines.append("largest gaps to the reference (training):")
    lines += largest_gaps(runs, "train", steps, metrics)
    compared = {"train": (steps, metrics)}
    for split in EVAL_SPLITS:
        split_steps, split_missing = common_steps(runs, split)
        if not split_steps:
            if split_missing:
                lines.append(f"{split} loss: no step in common ({'; '.join(split_missing)})")
            continue
        lines.append(f"{split} loss at the {len(split_steps)} step(s) in common:")
        lines += [f"  {line}" for line in split_missing]
        lines += table(runs, split, split_steps, ["loss"])
        lines += largest_gaps(runs, split, split_steps, ["loss"])
        compared[split] = (split_steps, ["loss"])
    return lines, first_difference(runs, compared, rtol, atol)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="Run folders (--save) or metrics.jsonl files; "
                        "the first is the reference.")
    parser.add_argument("--metrics", default="loss,grad_norm",
                        help="Comma-separated training-record fields to compare (default: loss,grad_norm).")
    parser.add_argument("--rtol", type=float, default=1e-5, help="Relative tolerance (default 1e-5).")
    parser.add_argument("--atol", type=float, default=0.0, help="Absolute tolerance (default 0).")
    parser.add_argument("--assert-equal", action="store_true",
                        help="Exit 1 when any compared value differs beyond atol + rtol * |reference|.")
    parser.add_argument("--labels", help="Comma-separated labels, one per run (default: folder names).")
    args = parser.parse_args(argv)
    try:
        if len(args.runs) < 2:
            raise ToolError("give two runs or more to compare")
        if not (args.rtol >= 0 and args.atol >= 0):  # NaN fails too
            raise ToolError(f"--rtol {args.rtol:g} --atol {args.atol:g}: tolerances must be 0 or more")
        metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
        if not metrics:
            raise ToolError("--metrics: name at least one field, e.g. loss")
        labels = None if args.labels is None else [label.strip() for label in args.labels.split(",")]
        runs = load_runs(args.runs, labels)
        lines, difference = compare(runs, metrics, args.rtol, args.atol)
    except (ToolError, RunError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    for run in runs:
        if run.unreadable or run.replaced:
            print(reading_note(run), file=sys.stderr)
    print("\n".join(lines))
    rule = f"|a - b| <= {args.atol:g} + {args.rtol:g} * |b|"
    if difference is None:
        print(f"all compared values agree ({rule})")
        return 0
    if args.assert_equal:
        print(f"{PROG}: runs differ beyond {rule} at {difference.describe(args.rtol, args.atol)}", file=sys.stderr)
        return 1
    print(f"first difference beyond {rule}: {difference.describe(args.rtol, args.atol)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
