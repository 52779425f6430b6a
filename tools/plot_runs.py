"""Plot one or more runs' metrics.jsonl into one figure (PNG or SVG), the runs overlaid.

    python tools/plot_runs.py RUN [RUN ...] --output FILE.png [--x step|tokens] [--smooth N]
    python tools/plot_runs.py out_tp1 out_tp2 --labels "tp 1,tp 2" --output compare.svg

RUN: a run folder (what pretrain_gpt.py --save wrote) or its metrics.jsonl. Panels: training loss,
validation loss, learning rate, tokens/s, MFU (TFLOP/s per device when no run knows its peak), gradient
norm, loss scale (fp16 runs), and peak memory; a panel appears when any run has its metric.
``--x tokens`` puts tokens trained on (consumed samples x max_seq_len of config.yaml) on the x axes
rather than steps, so that runs with other batch sizes line up. ``--smooth N``: a trailing mean over
N records of the noisy series (training loss, tokens/s, MFU, gradient norm). A run that resumed (the
``resume`` record a resumed run writes into metrics.jsonl) gets a dotted vertical line in its colour at each
resume step in every panel, labelled "resumed" in the first. Needs matplotlib
(``pip install -e ".[plot]"``). Exit status 2, with a one-line message, for a missing or empty
metrics file or a bad argument.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.run_metrics import Run, RunError, load_runs, reading_note  # noqa: E402

PROG = "plot_runs.py"
FORMATS = (".png", ".svg")
DPI = 100
PANEL_INCHES = (5.0, 3.4)  # width, height of one panel


class ToolError(Exception):
    """A one-line message for the user (exit status 2)."""


@dataclass(frozen=True)
class Panel:
    title: str
    split: str
    key: str
    smooth: bool = False  # a noisy per-step series: --smooth applies
    scale: float = 1.0  # MFU is a fraction in metrics.jsonl, a percentage on the plot
    log_y: bool = False  # the loss scale moves by factors of 2
    marker: str | None = None  # validation points are sparse: mark them


@dataclass
class PlotSummary:
    """What plot() drew: enough for a caller (or a test) to check the figure without looking at it."""

    output: str
    runs: int
    panels: list[str]  # titles, in reading order
    lines: dict[str, int]  # title -> how many runs have a curve in that panel
    size: tuple[int, int]  # (width, height) in pixels of a PNG
    x: str  # "step" or "tokens"
    x_max: float  # the largest x of any curve
    resumes: dict[str, list[float]] = field(default_factory=dict)  # run label -> the x of each resume marked


def choose_panels(runs: list[Run]) -> list[Panel]:
    """The panels worth drawing: each only when some run has a number for it. MFU replaces TFLOP/s
    when any run knows its device's peak (null on CPU, or without --peak-tflops on an unknown GPU)."""
    def any_run(key: str, split: str = "train") -> bool:
        return any(run.has(key, split) for run in runs)

    throughput = (Panel("MFU (%)", "train", "mfu", smooth=True, scale=100.0) if any_run("mfu") else
                  Panel("TFLOP/s per device", "train", "tflops", smooth=True))
    candidates = [
        Panel("training loss", "train", "loss", smooth=True),
        Panel("validation loss", "valid", "loss", marker="o"),
        Panel("learning rate", "train", "learning_rate"),
        Panel("tokens/s (all ranks)", "train", "ips_total", smooth=True),
        throughput,
        Panel("gradient norm (before clipping)", "train", "grad_norm", smooth=True),
        Panel("loss scale", "train", "loss_scale", log_y=True),
        Panel("peak memory (GB)", "train", "max_memory_gb"),
    ]
    return [panel for panel in candidates if any_run(panel.key, panel.split)]


def trailing_mean(values: list[float], window: int) -> list[float]:
    """At each point, the mean of the finite values among the last ``window`` records; a non-finite
    point stays as it is (a diverged loss must still show, not be averaged away)."""
    out = []
    for i, value in enumerate(values):
        if not math.isfinite(value):
            out.append(value)
            continue
        recent = [v for v in values[max(0, i - window + 1):i + 1] if math.isfinite(v)]
        out.append(sum(recent) / len(recent))
    return out


def curve(run: Run, panel: Panel, x: str, smooth: int) -> tuple[list[float], list[float]]:
    """The (x, y) points of ``run`` in ``panel``; inf becomes NaN, which matplotlib draws as a gap
    instead of stretching the axis to infinity."""
    steps, values = run.series(panel.key, panel.split)
    if panel.smooth and smooth > 1:
        values = trailing_mean(values, smooth)
    ys = [v * panel.scale if math.isfinite(v) else math.nan for v in values]
    xs = run.tokens(steps) if x == "tokens" else steps
    return [float(v) for v in xs], ys


def human(value: float, _pos=None) -> str:
    """Tick labels for token counts: 0, 500, 2K, 1.5M, 3B."""
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= size:
            return f"{value / size:g}{suffix}"
    return f"{value:g}"


def grid(n: int) -> tuple[int, int]:
    """(rows, columns) for ``n`` panels: 2 columns up to 4 panels, 3 beyond."""
    cols = 1 if n == 1 else 2 if n <= 4 else 3
    return math.ceil(n / cols), cols


def import_matplotlib(backend: str | None = None):
    """matplotlib, or a ToolError saying how to install it (it is an extra, not a dependency)."""
    try:
        import matplotlib
    except ImportError as err:
        raise ToolError('matplotlib is not installed: pip install -e ".[plot]"') from err
    if backend:
        matplotlib.use(backend)
    return matplotlib


def plot(runs: list[Run], output: str, x: str = "step", smooth: int = 1) -> PlotSummary:
    """Draw ``runs`` into ``output`` (.png or .svg) and say what was drawn. Uses a bare Figure, not
    pyplot: nothing global is changed and no window is opened, whatever the caller's backend."""
    extension = os.path.splitext(output)[1].lower()
    if extension not in FORMATS:
        raise ToolError(f"--output {output}: give a .png or .svg file")
    import_matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    panels = choose_panels(runs)
    if not panels:
        raise ToolError("no run has a metric to plot (loss, learning_rate, ...) in its training records")
    rows, cols = grid(len(panels))
    fig = Figure(figsize=(PANEL_INCHES[0] * cols, PANEL_INCHES[1] * rows + 0.4), dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    lines: dict[str, int] = {}
    x_max = 0.0
    for ax, panel in zip(axes, panels):
        drawn = 0
        for i, run in enumerate(runs):
            xs, ys = curve(run, panel, x, smooth)
            if not xs:
                continue
            ax.plot(xs, ys, color=f"C{i % 10}", marker=panel.marker, markersize=3, linewidth=1.2, label=run.label)
            x_max = max(x_max, max(xs))
            drawn += 1
        lines[panel.title] = drawn
        ax.set_title(panel.title + (f" (mean of {smooth})" if panel.smooth and smooth > 1 else ""), fontsize=10)
        ax.set_xlabel("tokens" if x == "tokens" else "step", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(True, alpha=0.3)
        if panel.log_y:
            ax.set_yscale("log", base=2)
        if x == "tokens":
            ax.xaxis.set_major_formatter(FuncFormatter(human))
    resumes = mark_resumes(runs, axes[:len(panels)], x)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside upper center", ncols=min(len(runs), 4),
               fontsize=9, frameon=False)
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    fig.savefig(output, format=extension[1:])
    width, height = fig.get_size_inches() * DPI
    return PlotSummary(output=output, runs=len(runs), panels=[p.title for p in panels], lines=lines,
                       size=(round(width), round(height)), x=x, x_max=x_max, resumes=resumes)


def mark_resumes(runs: list[Run], axes, x: str) -> dict[str, list[float]]:
    """A dotted vertical line in the run's colour at each step a run resumed from, in every panel (its SVG id
    ``resume-{run}-{step}``), labelled "resumed" at the top of the first; run label -> the xs marked."""
    marked: dict[str, list[float]] = {}
    for i, run in enumerate(runs):
        steps = sorted(set(run.resumes))
        if not steps:
            continue
        xs = [float(v) for v in (run.tokens(steps) if x == "tokens" else steps)]
        marked[run.label] = xs
        for step, at in zip(steps, xs):
            for k, ax in enumerate(axes):
                ax.axvline(at, color=f"C{i % 10}", linestyle=":", linewidth=1.0, alpha=0.8,
                           gid=f"resume-{i}-{step}" if k == 0 else None)
            axes[0].annotate("resumed", xy=(at, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -2),
                             textcoords="offset points", ha="left", va="top", fontsize=7, color=f"C{i % 10}",
                             rotation=90)
    return marked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="A run folder (--save) or its metrics.jsonl.")
    parser.add_argument("--output", "-o", required=True, help="The figure to write: FILE.png or FILE.svg.")
    parser.add_argument("--x", choices=("step", "tokens"), default="step", help="The x axis (default: step).")
    parser.add_argument("--smooth", type=int, default=1, metavar="N",
                        help="Trailing mean over N records of the noisy series (default 1: raw).")
    parser.add_argument("--labels", help="Comma-separated legend labels, one per run (default: folder names).")
    args = parser.parse_args(argv)
    try:
        if args.smooth < 1:
            raise ToolError(f"--smooth {args.smooth}: give a window of 1 or more records")
        import_matplotlib("Agg")  # never a window, even where a display is set
        labels = None if args.labels is None else [label.strip() for label in args.labels.split(",")]
        runs = load_runs(args.runs, labels)
        summary = plot(runs, args.output, x=args.x, smooth=args.smooth)
    except (ToolError, RunError, OSError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    for run in runs:
        if run.unreadable or run.replaced:
            print(reading_note(run), file=sys.stderr)
    print(f"wrote {summary.output}: {summary.runs} runs, {len(summary.panels)} panels "
          f"({', '.join(summary.panels)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
