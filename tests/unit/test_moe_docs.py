"""docs/moe.md's commands run as written and learn (a first-hour report: the first example's 20 steps stayed at
ln 50304, the loss of a model that knows nothing)."""

from __future__ import annotations

import json

import pytest

from tests.functional.launch import run_here


def _doc_commands() -> list[str]:
    """Every ``python pretrain_gpt.py`` command of docs/moe.md, as written."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "moe.md").read_text()
    return re.findall(r"```(?:bash)?\n(python pretrain_gpt\.py .*?)```", text, re.S)


@pytest.mark.parametrize("command", _doc_commands(), ids=lambda c: c.split("--save ")[1].split()[0])
def test_the_commands_of_the_docs_run_as_written_and_learn(tmp_path, command):
    """docs/moe.md's first example and Megatron-LM's Mixtral script scaled down: each runs as written (only its
    --save folder moved here) and its validation loss ends at least one nat below ln(vocabulary), the loss of a
    model that knows nothing (a first-hour report: the first example's 20 steps stayed at ln 50304)."""
    import math
    import shlex

    argv = shlex.split(command.replace("\\\n", " "))[2:]
    argv[argv.index("--save") + 1] = str(tmp_path / "run")
    proc = run_here(*argv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = int(argv[argv.index("--train-iters" if "--train-iters" in argv else "--max-steps") + 1])
    assert [r["step"] for r in records if r["split"] == "train"][-1] == steps
    valid = [r["loss"] for r in records if r["split"] == "valid"]
    vocab = int(argv[argv.index("--vocab-size") + 1])
    assert len(valid) >= 2 and valid[-1] < valid[0] and valid[-1] < math.log(vocab) - 1.0, valid
    if "--use-mcore-models" in argv:
        assert "accepted, no effect here: --use-mcore-models, --no-masked-softmax-fusion, --no-position-embedding" \
            in proc.stderr
