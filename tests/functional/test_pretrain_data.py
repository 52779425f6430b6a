"""pretrain_gpt.py on a preprocessed corpus: tokenizer -> preprocess -> train with evaluation."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _sentences(n: int) -> list[str]:
    rng = random.Random(0)
    subjects, verbs, objects = ["the cat", "a dog", "my friend", "the teacher"], ["sees", "likes", "finds"], \
        ["the ball", "a book", "the garden", "some bread"]
    return [" ".join([rng.choice(subjects), rng.choice(verbs), rng.choice(objects)]) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    work = tmp_path_factory.mktemp("corpus")
    docs = [" ".join(_sentences(random.Random(i).randint(3, 12))) for i in range(600)]
    (work / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tools = ROOT / "tools"
    subprocess.run([sys.executable, tools / "train_tokenizer.py", "--input", work / "c.jsonl", "--type", "bpe",
                    "--vocab-size", "400", "--output-dir", work / "tok"], check=True, capture_output=True)
    subprocess.run([sys.executable, tools / "preprocess_data.py", "--input", work / "c.jsonl", "--output-prefix",
                    work / "data" / "c", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                    work / "tok" / "vocab.json", "--merge-file", work / "tok" / "merges.txt", "--append-eod",
                    "--workers", "2"], check=True, capture_output=True)
    return work


def _train(corpus: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    args = ["--input-dir", str(corpus / "data" / "c_text_document"), "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", str(corpus / "tok" / "vocab.json"), "--merge-file", str(corpus / "tok" / "merges.txt"),
            "--device", "cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--max-seq-len", "32", "--max-position-embeddings", "32", "--global-batch-size", "16",
            "--micro-batch-size", "8", "--max-steps", "60", "--eval-freq", "30", "--eval-iters", "2",
            "--lr", "5e-3", "--min-lr", "5e-4", "--warmup-rate", "0.05", "--logging-freq", "10",
            "--split", "90,8,2", "--num-train-epochs", "10", "--save", str(out), *extra]
    return subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_trains_from_input_dir_and_validation_loss_falls(corpus, tmp_path):
    run = _train(corpus, tmp_path / "out")
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in records if r["split"] == "valid"]
    assert [r["step"] for r in valid] == [30, 60]
    vocab = json.loads((corpus / "tok" / "vocab.json").read_text())
    # The sentences come from a 4 x 3 x 4 grammar: a model that learned it is far below uniform guessing.
    assert valid[-1]["loss"] < 0.5 * math.log(len(vocab))
    assert any(r["split"] == "test" for r in records)
    assert list((corpus / "data").glob("index-cache/*_sample_idx.npy"))  # indices cached beside the data


@pytest.mark.parametrize("change, message", [
    (["--input-dir", "/nonexistent/prefix"], "no dataset at '/nonexistent/prefix'"),
    (["--tokenizer-type", "SentencePieceTokenizer"], "--tokenizer-model"),
    (["--vocab-size", "100"], "smaller than the tokenizer's vocabulary"),
    (["--split", "a,b"], "split 'a,b'"),
])
def test_bad_data_settings_are_one_line_errors(corpus, tmp_path, change, message):
    run = _train(corpus, tmp_path / "out", *change)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in run.stderr
