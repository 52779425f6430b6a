"""pretrain_gpt.py --fim-data (fill-in-the-middle, Megatron-LM's flags) on the test corpus: the loss falls and the
batches it trains on hold the FIM sentinels; a tokenizer without them is a one-line error before training."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import pretrain_gpt
from megatron.data.loader import build_loader
from tests.fim_helpers import gpt2_with_fim_tokens
from tests.functional.launch import run_here

pytestmark = pytest.mark.slow

SHAPE = ["--device", "cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--max-seq-len", "32", "--max-position-embeddings", "32", "--global-batch-size", "16",
         "--micro-batch-size", "8", "--max-steps", "60", "--eval-freq", "30", "--eval-iters", "2", "--lr", "5e-3",
         "--min-lr", "5e-4", "--warmup-rate", "0.05", "--logging-freq", "10", "--split", "90,8,2", "--seed", "7"]
FIM = ["--fim-data", "--fim-rate", "0.5", "--fim-spm-rate", "0.5"]  # Megatron's functional test's


def _argv(corpus: Path, tokenizer: list[str], out: Path) -> list[str]:
    return ["--input-dir", str(corpus / "data" / "c_text_document"), *tokenizer, *SHAPE, *FIM, "--save", str(out)]


def test_trains_on_fim_samples_and_the_loss_falls(corpus, tmp_path):
    argv = _argv(corpus, gpt2_with_fim_tokens(corpus, tmp_path / "tok"), tmp_path / "out")
    run = run_here(*argv)
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in records if r["split"] == "train"]
    valid = [r["loss"] for r in records if r["split"] == "valid"]
    vocab = len(json.loads((tmp_path / "tok" / "vocab.json").read_text()))
    assert train[-1] < 0.6 * train[0] and valid[-1] < valid[0] < math.log(vocab), (train, valid)
    # The run's first global batches, read again as the run read them (each sample's FIM is its own: any reader
    # gets the same): a FIM sentinel opens about half the documents (--fim-rate 0.5).
    config, tokenizer = pretrain_gpt.resolve(argv, [])
    train_ds = pretrain_gpt.datasets_provider(config, tokenizer)[0]
    tokens = np.concatenate([b["tokens"].numpy() for _, b in zip(range(4), build_loader(train_ds, 0, 16,
                                                                                        tokenizer.eod, True))])
    ids = {name: tokenizer.token_id(f"<fim_{name}>") for name in ("prefix", "middle", "suffix")}
    counts = {name: int((tokens == i).sum()) for name, i in ids.items()}
    documents = int((tokens == tokenizer.eod).sum()) + len(tokens)  # about: EODs plus each sample's first piece
    assert 0.25 * documents < counts["prefix"] < 0.75 * documents, (counts, documents)
    assert min(counts.values()) > 0.5 * counts["prefix"], counts  # truncation may cut a sample's last sentinels
    plain = train_ds.dataset
    assert sum(not np.array_equal(train_ds[i], plain[i]) for i in range(64)) > 16  # samples rearranged


def test_a_tokenizer_without_the_fim_tokens_is_one_line_before_training(corpus, tmp_path):
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(corpus / "tok" / "vocab.json"),
                 "--merge-file", str(corpus / "tok" / "merges.txt")]
    run = run_here(*_argv(corpus, tokenizer, tmp_path / "out"))
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: --fim-prefix-token '<fim_prefix>' is not a token of the tokenizer's vocabulary "
        "(--tokenizer-type GPT2BPETokenizer), and --fim-data needs each FIM token as one vocabulary entry; give "
        "--fim-prefix-token a token the tokenizer has, or use a tokenizer with FIM tokens (StarCoder's <fim_prefix>, "
        "<fim_middle>, <fim_suffix>, <fim_pad>)."]
    assert not (tmp_path / "out").exists()
