"""Reading a finished (or running) run's ``metrics.jsonl`` and ``config.yaml``: shared by
tools/plot_runs.py and tools/compare_runs.py.

The file is read leniently, as a run leaves it: the partial last line of a killed run is ignored,
other unreadable lines are skipped and counted (``Run.unreadable``), and when a step appears twice
in a split (a run resumed into the same folder by a version that did not truncate) the later record
wins (counted in ``Run.replaced``). What cannot be worked around raises ``RunError``, a one-line
message for the user.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import yaml

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
SPLITS = ("train", "valid", "test")


class RunError(Exception):
    """A run that cannot be read (a one-line message; the tools exit with status 2)."""


@dataclass
class Run:
    """One run's records, by split and step (each split's steps in increasing order)."""

    path: str  # the run folder
    metrics_path: str
    label: str
    records: dict[str, dict[int, dict]] = field(default_factory=lambda: {s: {} for s in SPLITS})
    config: dict | None = None  # config.yaml, or None when absent or unreadable (config_error says why)
    config_error: str | None = None
    unreadable: int = 0  # lines skipped (not counting a killed run's partial last line)
    replaced: int = 0  # records overridden by a later record of the same split and step
    resumes: list[int] = field(default_factory=list)  # the steps the run resumed from (``resume`` records)

    def steps(self, split: str = "train") -> list[int]:
        return list(self.records[split])

    def has(self, key: str, split: str = "train") -> bool:
        """Whether any record of ``split`` has a number for ``key`` (null, e.g. ``mfu`` on CPU, does not count)."""
        return any(number(r.get(key)) is not None for r in self.records[split].values())

    def series(self, key: str, split: str = "train") -> tuple[list[int], list[float]]:
        """(steps, values) of the records that have a number for ``key``; non-finite values (a diverged
        loss) are kept, as NaN or inf, so that a plot shows the gap."""
        steps, values = [], []
        for step, record in self.records[split].items():
            value = number(record.get(key))
            if value is not None:
                steps.append(step)
                values.append(value)
        return steps, values

    def tokens_per_sample(self) -> int:
        """``dataset.max_seq_len`` of config.yaml: tokens = consumed samples x this."""
        return self._config_int("dataset", "max_seq_len")

    def tokens(self, steps: list[int]) -> list[int]:
        """Tokens trained on after each of ``steps``: the train record's ``consumed_samples`` x max_seq_len
        where there is one (right across a resume with another batch size), else step x
        global_batch_size x max_seq_len (validation steps that were not logged, older files)."""
        seq = self.tokens_per_sample()
        train = self.records["train"]
        gbs = None
        out = []
        for step in steps:
            samples = number(train.get(step, {}).get("consumed_samples"))
            if samples is None:
                gbs = gbs or self._config_int("batch_size", "global_batch_size")
                samples = step * gbs
            out.append(int(samples) * seq)
        return out

    def _config_int(self, section: str, key: str) -> int:
        if self.config is None:
            raise RunError(f"{self.path}: cannot count tokens: {self.config_error}")
        part = self.config.get(section)
        value = part.get(key) if isinstance(part, dict) else None
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise RunError(f"{self.config_path}: cannot count tokens: no positive {section}.{key}")
        return value

    @property
    def config_path(self) -> str:
        return os.path.join(self.path, CONFIG_FILE)


def number(value) -> float | None:
    """``value`` as a float when it is a JSON number (not a bool, not null); NaN and inf included."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def metrics_path(path: str) -> tuple[str, str]:
    """(run folder, metrics.jsonl) of ``path``: a run folder, or a metrics file itself."""
    if os.path.isdir(path):
        found = os.path.join(path, METRICS_FILE)
        if not os.path.isfile(found):
            raise RunError(f"no {METRICS_FILE} in {path} (the folder a run wrote with --save)")
        return path, found
    if os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path)), path
    raise RunError(f"{path}: no such run folder or metrics file")


def read_records(path: str, into: Run) -> None:
    """Add the records of ``path`` to ``into`` (later records of a split and step replace earlier ones)."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as err:
        raise RunError(f"cannot read {path} ({type(err).__name__}: {err})") from err
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        step = record.get("step") if isinstance(record, dict) else None
        split = record.get("split") if isinstance(record, dict) else None
        if split == "resume" and isinstance(step, int) and not isinstance(step, bool):
            into.resumes.append(step)  # written by a resumed run (megatron/metrics.py): where its curves continue
            continue
        if isinstance(split, str) and split not in SPLITS and isinstance(step, int):
            continue  # a kind of record these tools do not know (a later version's): not an error
        if split not in SPLITS or isinstance(step, bool) or not isinstance(step, int):
            killed_mid_line = i == len(lines) - 1 and not line.endswith("\n")  # expected of a killed run
            if not killed_mid_line:
                into.unreadable += 1
            continue
        by_step = into.records[split]
        if step in by_step:
            into.replaced += 1
        by_step[step] = record
    for split in SPLITS:  # steps increase in a file drop_records_after kept; sort anyway
        into.records[split] = dict(sorted(into.records[split].items()))


def read_config(run: Run) -> None:
    """Set ``run.config`` from config.yaml, or ``run.config_error`` (only --x tokens needs it)."""
    path = run.config_path
    if not os.path.isfile(path):
        run.config_error = f"no {CONFIG_FILE} in {run.path}"
        return
    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        run.config_error = f"cannot read {path} ({type(err).__name__})"
        return
    if not isinstance(config, dict):
        run.config_error = f"{path} is not a mapping"
        return
    run.config = config


def load_run(path: str, label: str | None = None) -> Run:
    """The run at ``path`` (a run folder or its metrics.jsonl); RunError when it has no training record."""
    folder, metrics = metrics_path(path)
    run = Run(path=folder, metrics_path=metrics, label=label or run_name(path))
    read_records(metrics, run)
    if not run.records["train"]:
        raise RunError(f"{metrics} has no training records" + (" (it is empty)" if os.path.getsize(metrics) == 0
                                                                else ""))
    read_config(run)
    return run


def reading_note(run: Run) -> str:
    """What reading ``run`` worked around, for the tools to print (stderr) when anything was."""
    parts = []
    if run.unreadable:
        parts.append(f"skipped {run.unreadable} unreadable line(s)")
    if run.replaced:
        parts.append(f"{run.replaced} record(s) replaced by a later record of the same step (the file holds "
                     f"more than one run, e.g. one started again without --load: the later one is shown)")
    return f"note: {run.metrics_path}: " + "; ".join(parts)


def run_name(path: str) -> str:
    """The run folder's name (the folder holding the metrics file, when given the file)."""
    path = os.path.abspath(path)
    if os.path.isfile(path):
        path = os.path.dirname(path)
    return os.path.basename(path.rstrip(os.sep)) or path


def load_runs(paths: list[str], labels: list[str] | None = None) -> list[Run]:
    """The runs at ``paths``, labelled by ``labels`` or by their folder names (made unique by adding
    the parent folder's name, as ``sweep1/out`` and ``sweep2/out``, then a number)."""
    if labels is not None and len(labels) != len(paths):
        raise RunError(f"{len(labels)} labels for {len(paths)} runs")
    names = labels or unique_names(paths)
    return [load_run(path, name) for path, name in zip(paths, names)]


def unique_names(paths: list[str]) -> list[str]:
    names = [run_name(p) for p in paths]
    for i, name in enumerate(names):
        if names.count(name) > 1:
            folder = os.path.abspath(paths[i])
            folder = os.path.dirname(folder) if os.path.isfile(folder) else folder
            parent = os.path.basename(os.path.dirname(folder.rstrip(os.sep)))
            names[i] = f"{parent}/{name}" if parent else name
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        seen[name] = seen.get(name, 0) + 1
        if names.count(name) > 1:
            names[i] = f"{name} ({seen[name]})"
    return names


def format_steps(steps: list[int], limit: int = 8) -> str:
    """``1-5, 8, 10-12``: runs of consecutive steps; at most ``limit`` ranges, then how many more steps."""
    ranges: list[list[int]] = []
    for step in sorted(steps):
        if ranges and step == ranges[-1][1] + 1:
            ranges[-1][1] = step
        else:
            ranges.append([step, step])
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in ranges[:limit]]
    rest = sum(b - a + 1 for a, b in ranges[limit:])
    return ", ".join(parts) + (f" and {rest} more" if rest else "")
