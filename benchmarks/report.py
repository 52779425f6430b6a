"""Shared by the benchmark scripts: rewrite one script's section of docs/benchmarks.md."""

from __future__ import annotations

import os

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks.md")


def write_section(name: str, heading: str, command: str, body: str, intro: str = "",
                  replace_intro: bool = False) -> None:
    """Replace the text between ``<!-- name:begin -->`` and ``<!-- name:end -->`` with the command
    and ``body``; append a new section (heading, intro, block) when the markers are absent. With
    ``replace_intro``, an existing section's heading and intro (from its ``## `` line to the begin
    marker) are rewritten too."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = open(DOCS).read() if os.path.exists(DOCS) else "# Benchmarks\n"
    block = f"{begin}\nCommand: `{command}`\n\n{body}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        if replace_intro and "\n## " in head:
            head = head[:head.rindex("\n## ") + 1] + f"## {heading}\n\n" + (f"{intro}\n\n" if intro else "")
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + f"\n\n## {heading}\n\n" + (f"{intro}\n\n" if intro else "") + f"{block}\n"
    with open(DOCS, "w") as f:
        f.write(text)


if __name__ == "__main__":  # a module of the benchmark scripts, not one of them
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="report.py", description=__doc__.splitlines()[0],
                                     epilog="Not run on its own: each benchmarks/*.py script with --write calls it.")
    parser.parse_args()
    sys.exit("report.py: nothing to run: run a benchmark script with --write (e.g. python benchmarks/throughput.py "
             "--write).")
