"""Checkpoints saved by the code before the model/parallelism seam moved (main at c990eae, issue 52), and that
code's own continuation of each run: a checkpoint written before the change must resume bitwise after it.

``tests/fixtures/old_main/NAME/step_5`` is step 5 of a 10-step schedule saved by that code; ``NAME/expected.json``
holds what the same code logged for steps 6-10 when it resumed from that folder (losses, gradient norms and, for
the DeepSeek-V3 shape, multi-token prediction losses). ``make.py`` beside it wrote both; run again
on a later main it would record that main's continuation instead, so it is kept for the record, not rerun.
"""

from __future__ import annotations

from pathlib import Path

from tests.functional.launch import TINY
from tests.functional.test_deepseek_layouts import DEEPSEEK, TEN

FOLDER = Path(__file__).resolve().parents[1] / "fixtures" / "old_main"
SAVED_STEP = 5
TEN_STEPS = [*TINY, *TEN]
DEEPSEEK_TEN = [*DEEPSEEK, *TEN, "--micro-batch-size", "16"]

# name -> (processes, pretrain_gpt.py arguments of the whole 10-step run)
CASES: dict[str, tuple[int, list[str]]] = {
    "dense-1": (1, TEN_STEPS),
    "dense-tp2-sp": (2, [*TEN_STEPS, "--tp", "2", "--sequence-parallel"]),
    # dropout on: the tensor-parallel RNG streams (per-rank regions, sequence shards) saved and replayed
    "dense-tp2-sp-dropout": (2, [*TEN_STEPS, "--tp", "2", "--sequence-parallel", "--hidden-dropout-prob", "0.1",
                                 "--attention-probs-dropout-prob", "0.1", "--use-recompute"]),
    "deepseek-1": (1, DEEPSEEK_TEN),
    "deepseek-tp2-sp": (2, [*DEEPSEEK_TEN, "--tp", "2", "--sequence-parallel"]),
}
KEYS = ("loss", "grad_norm", "mtp_loss")  # what expected.json records per resumed step, where logged


def saved(name: str) -> Path:
    return FOLDER / name / f"step_{SAVED_STEP}"
