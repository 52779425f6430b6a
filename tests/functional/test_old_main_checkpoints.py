"""A checkpoint written by the code before the model/parallelism seam moved (issue 52: the plain GPT, one
``parallelize_gpt`` recipe) resumes on today's code exactly as that code went on: losses, gradient norms and
multi-token prediction losses of steps 6-10, bitwise. One process and tp 2 with sequence parallelism (dropout and
recompute too: the tensor-parallel RNG streams), a dense GPT and a DeepSeek-V3 shape (``tests/functional/old_main.py``
and the fixtures it names)."""

from __future__ import annotations

import json

import pytest

from tests.functional.launch import parity_layouts
from tests.functional.old_main import CASES, FOLDER, KEYS, SAVED_STEP, saved

pytestmark = pytest.mark.slow

LAYOUTS = parity_layouts({f"old-main-{name}": (nproc, [*args, "--load", str(saved(name))])
                          for name, (nproc, args) in CASES.items()})


@pytest.mark.parametrize("name", list(CASES))
def test_a_checkpoint_of_the_old_main_resumes_as_the_old_code_went_on(parity, name):
    out = parity.outcome(f"old-main-{name}").check()
    expected = json.loads((FOLDER / name / "expected.json").read_text())["steps"]
    assert [r["step"] for r in expected] == list(range(SAVED_STEP + 1, 11))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    resumed = [{k: r[k] for k in ("step", *KEYS) if k in r} for r in records if r["split"] == "train"]
    assert resumed == expected  # exactly
