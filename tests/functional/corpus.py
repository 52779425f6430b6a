"""``corpus``: the tiny BPE corpus several test modules train on, built once a session (a fixture of
tests/conftest.py) and in this process (the tools' ``main``: no interpreter and torch import of their own)."""

from __future__ import annotations

import functools
import json
import random
import threading
from pathlib import Path

import pytest

from tests.functional.launch import run_tool_here


def sentences(n: int) -> list[str]:
    rng = random.Random(0)
    subjects, verbs, objects = ["the cat", "a dog", "my friend", "the teacher"], ["sees", "likes", "finds"], \
        ["the ball", "a book", "the garden", "some bread"]
    return [" ".join([rng.choice(subjects), rng.choice(verbs), rng.choice(objects)]) + "." for _ in range(n)]


def build(work: Path, docs: list[str], vocab_size: int) -> Path:
    """``docs`` in ``work/c.jsonl``, a BPE tokenizer of ``vocab_size`` trained on them (``tok/``) and their mmap
    dataset (``data/c_text_document``), made by the tools in this process."""
    (work / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = work / "tok"
    tokenizer = ["--input", work / "c.jsonl", "--type", "bpe", "--vocab-size", vocab_size, "--output-dir", tok]
    preprocess = ["--input", work / "c.jsonl", "--output-prefix", work / "data" / "c", "--tokenizer-type",
                  "GPT2BPETokenizer", "--vocab-file", tok / "vocab.json", "--merge-file", tok / "merges.txt",
                  "--append-eod", "--workers", "1"]
    for tool, args in (("tools/train_tokenizer.py", tokenizer), ("tools/preprocess_data.py", preprocess)):
        result = run_tool_here(tool, *map(str, args))
        assert result.returncode == 0, result.stderr[-3000:]
    return work


_LOCK = threading.Lock()  # the shared launches' threads may ask for it too


def shared(root: Path) -> Path:
    """The suite's corpus, under ``root`` (the session's temporary folder), built at its first use: 600 documents
    of 3-12 sentences, a 400-token BPE tokenizer trained on them and their mmap dataset."""
    with _LOCK:
        return _shared(root)


@functools.cache
def _shared(root: Path) -> Path:
    work = root / "corpus"
    work.mkdir()
    return build(work, [" ".join(sentences(random.Random(i).randint(3, 12))) for i in range(600)], 400)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """``shared``: the same folder as the shared runs' "{corpus}"."""
    return shared(tmp_path_factory.getbasetemp())
