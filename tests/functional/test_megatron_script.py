"""A Megatron-LM functional-test command line, scaled down, trains here unchanged and resumes."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from tests.functional.launch import outcome, run_several
from tests.functional.test_pretrain_data import corpus  # noqa: F401  (the fixture: a tiny BPE corpus)
from tests.unit.megatron_flag_sets import FUNCTIONAL

pytestmark = pytest.mark.slow

# Megatron-LM's Llama-shaped GPT (RMSNorm, SwiGLU, GQA, RoPE, untied, no biases, distributed optimizer,
# pipeline 2): its sizes scaled to this machine, every other flag as Megatron's test gives it.
SCALED = {"--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "128", "--num-attention-heads": "4",
          "--num-query-groups": "2", "--kv-channels": "16", "--seq-length": "32", "--max-position-embeddings": "32",
          "--global-batch-size": "8", "--micro-batch-size": "2", "--train-iters": "6"}


def _command_line(corpus_dir: Path, out: Path, **changes: str) -> list[str]:
    text = FUNCTIONAL["gpt3_mcore_reruns_resume"]
    paths = {"${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document":
             corpus_dir / "data" / "c_text_document",
             "${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json": corpus_dir / "tok" / "vocab.json",
             "${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt": corpus_dir / "tok" / "merges.txt",
             "${CHECKPOINT_SAVE_PATH}": out, "${CHECKPOINT_LOAD_PATH}": out, "${TENSORBOARD_PATH}": out / "tb",
             "${DATA_CACHE_PATH}": out.parent / "cache"}
    for placeholder, path in paths.items():
        text = text.replace(placeholder, str(path))
    argv = shlex.split(text)
    for flag, value in {**SCALED, **changes}.items():
        argv[argv.index(flag) + 1] = value
    return argv


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_megatron_llama_command_line_trains_and_resumes(corpus, tmp_path):  # noqa: F811
    """The command line trains; the same with a longer --train-iters, launched again (after it, by the same
    torchrun: ``run_several``), resumes from the checkpoint --save wrote at the end."""
    out = tmp_path / "ckpt"
    launch = run_several([(tmp_path / "first", [*_command_line(corpus, out), "--device", "cpu"]),
                          (tmp_path / "second", [*_command_line(corpus, out, **{"--train-iters": "8"}),
                                                 "--device", "cpu"])], nproc=2)
    first, second = (outcome(tmp_path / name, 2, launch) for name in ("first", "second"))
    first.check()
    log = first.log + first.stdout
    assert "accepted, no effect here: --deterministic-mode, --manual-gc, --use-mcore-models" in log
    assert "Megatron-LM command line" in log
    train = [r for r in _records(out) if r["split"] == "train"][:6]  # the first run's (the second adds 7-8)
    assert [r["step"] for r in train] == list(range(1, 7))
    # Megatron-LM's schedule for these flags: no warm-up (--lr-warmup-samples 0), its default linear decay to
    # its default min_lr 0 over --train-iters; iteration k trains at the rate after k - 1 iterations.
    assert [r["learning_rate"] for r in train] == pytest.approx([3e-4 * (1 - k / 6) for k in range(6)], rel=1e-6)
    assert all(r["consumed_samples"] == 8 * r["step"] for r in train)
    # the same command line with a longer --train-iters resumes from the checkpoint --save wrote at the end
    second.check()
    assert "resuming at step 6" in second.log + second.stdout
    assert [r["step"] for r in _records(out) if r["split"] == "train"] == list(range(1, 9))
