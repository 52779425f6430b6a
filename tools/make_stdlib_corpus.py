"""Build a small English corpus from text already on this machine: the Python standard library.

    python tools/make_stdlib_corpus.py --output corpus.jsonl --max-mb 20

One JSONL document per module: its docstrings (module, classes, functions) in source order,
read with ``ast`` (nothing is imported or executed), plus one document per help topic of
``pydoc_data.topics`` (the language reference text behind ``help()``). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import sysconfig
from collections.abc import Iterator


def module_docstrings(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 40:
                docs.append(doc.strip())
    return "\n\n".join(docs)


def documents(stdlib: str) -> Iterator[dict]:
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "test", "tests", "idle_test", "__pycache__"))
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                text = module_docstrings(path)
                if text:
                    yield {"text": text, "source": os.path.relpath(path, stdlib)}
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return
    for name in sorted(topics):
        yield {"text": topics[name].strip(), "source": f"pydoc_data.topics:{name}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make_stdlib_corpus.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="JSONL file to write.")
    parser.add_argument("--max-mb", type=float, default=20.0, help="Stop after this many MB of text.")
    args = parser.parse_args(argv)
    stdlib = sysconfig.get_paths()["stdlib"]
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    count = size = 0
    tmp = args.output + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for doc in documents(stdlib):
            line = json.dumps(doc, ensure_ascii=False)
            f.write(line + "\n")
            count, size = count + 1, size + len(line)
            if size >= args.max_mb * 2**20:
                break
    os.replace(tmp, args.output)
    print(f"wrote {count} documents ({size / 2**20:.1f} MB) from {stdlib} to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
