"""README's "A tiny model on your own text": its commands, as written, on a few text files (a first-hour report:
adapting the tiny CPU config to real data took three tries, and the docs had no such command)."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from tests.functional.launch import ROOT, run_here, run_tool_here

pytestmark = pytest.mark.slow  # trains a tokenizer, tokenizes and trains: ~10 s


def _readme_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"\*\*A tiny model on your own text\*\*.*?```bash\n(.*?)```", text, re.S).group(1)
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_the_readme_commands_train_a_tiny_model_on_text_files_and_generate(tmp_path, monkeypatch):
    texts = tmp_path / "my_texts"
    texts.mkdir()
    for name in ("argparse", "textwrap", "difflib", "calendar"):  # ~150 KB of English and Python from the stdlib
        source = Path(os.__file__).with_name(f"{name}.py")
        (texts / f"{name}.txt").write_text(source.read_text())
    monkeypatch.chdir(tmp_path)
    commands = _readme_commands()
    assert [c[:2] for c in commands] == [["python", "tools/train_tokenizer.py"], ["python", "tools/preprocess_data.py"],
                                         ["python", "pretrain_gpt.py"], ["python", "tools/generate.py"]]
    for program, *args in (c[1:] for c in commands):
        args = [str(ROOT / a) if a.startswith("examples/") else a for a in args]
        if program == "pretrain_gpt.py":  # the quickstart's settings, a few steps of them
            done = run_here(*args, "--max-steps", "4", "--eval-freq", "2", "--eval-iters", "1")
        else:
            done = run_tool_here(program, *args)
        assert done.returncode == 0, f"{program}: {done.stderr[-2000:]}"
    assert (tmp_path / "my_run" / "latest").read_text().strip() == "step_4"
    assert done.stdout.startswith("Once upon a time") and len(done.stdout) > len("Once upon a time")
