"""The planner's documented outputs are what the tool prints: every ``$ python tools/plan_layout.py ...`` block of
docs/moe.md and docs/performance.md is run in-process and its header, its rows (the best layout first) and its
``flags of #1`` line must appear in the doc verbatim.

A documented search takes seconds to minutes; the test runs the same command narrowed with ``--only`` to the
values the quoted rows take on each axis. That sub-search holds every quoted row, and its ranking is the full
search's restricted to it, so its best rows are the quoted ones whenever they are the full search's best (a
layout it ranked above them would be in the full search too). What it cannot check is the candidates count line
and the configuration's rank, which need the whole search."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.unit.test_plan_search import _name_axes, plan_layout

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("docs/moe.md", "docs/performance.md")
ROW = re.compile(r"^ +\d+  (tp\d+ .*?)  +[\d.-]+ ")


def _blocks() -> list[tuple[str, str, list[str]]]:
    """(doc, command, the quoted output's lines) of each documented run of the planner that lists layouts."""
    found = []
    for doc in DOCS:
        for block in re.findall(r"```\n(\$ python tools/plan_layout\.py .*?)\n```", (ROOT / doc).read_text(), re.S):
            command, *output = block.split("\n")
            if any(ROW.match(line) for line in output):
                found.append((doc, command.removeprefix("$ python tools/plan_layout.py "), output))
    return found


def _narrowing(rows: list[str]) -> list[str]:
    """``--only`` flags keeping, on each axis, the values the quoted rows take."""
    values: dict[str, set] = {}
    for row in rows:
        axes = _name_axes(ROW.match(row)[1])
        axes["zero"] = axes["zero"] or 0
        axes["offload"] = "on" if axes["offload"] else "off"
        axes["recompute"] = re.sub(r"^block\d+$", "block", axes["recompute"])
        axes["cp-comm"] = axes.pop("cp_comm") or "p2p"
        for axis, value in axes.items():
            values.setdefault(axis, set()).add(value)
    return [flag for axis, vals in sorted(values.items())
            for flag in ("--only", f"{axis}={','.join(str(v) for v in sorted(vals, key=str))}")]


BLOCKS = _blocks()


def test_the_docs_quote_planner_runs():
    assert {doc for doc, _, _ in BLOCKS} == set(DOCS)
    assert any("planner_mixtral_8x7b.yaml --devices 8" in command for _, command, _ in BLOCKS)


@pytest.mark.parametrize("doc,command,output", BLOCKS, ids=[f"{d}:{c.split()[1]}:{c.split()[3]}"
                                                            for d, c, _ in BLOCKS])
def test_a_documented_run_prints_what_the_doc_quotes(doc, command, output, capsys):
    rows = [line for line in output if ROW.match(line)]
    argv = shlex.split(command) + _narrowing(rows) + ["--no-progress", "--top", str(len(rows))]
    plan_layout.main(argv)
    printed = capsys.readouterr().out.splitlines()
    assert printed[:2] == output[:2], f"{doc}: the header of `{command}` changed"
    assert [line for line in printed if ROW.match(line)] == rows, f"{doc}: the rows of `{command}` changed"
    flags = [line for line in output if line.startswith("flags of #1: ")]
    assert flags and flags[0] in printed
