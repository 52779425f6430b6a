"""pretrain_gpt.py on a preprocessed corpus: tokenizer -> preprocess -> train with evaluation."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from tests.functional.corpus import sentences
from tests.functional.launch import run_here, run_tool_here
from tests.functional.processes import error_lines

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _preprocess_here(*args) -> None:
    """tools/preprocess_data.py in this process (its ``main``: no interpreter of its own); it must succeed."""
    done = run_tool_here("tools/preprocess_data.py", *map(str, args))
    assert done.returncode == 0, done.stderr[-3000:]


def _gpt2(corpus: Path) -> list[str]:
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(corpus / "tok" / "vocab.json"),
            "--merge-file", str(corpus / "tok" / "merges.txt")]


def _train(corpus: Path, out: Path, *extra: str, data: list[str] | None = None) -> subprocess.CompletedProcess:
    """pretrain_gpt.py on ``data`` (the data and tokenizer flags; default the corpus as --input-dir), in this
    process (``run_here``: one run needs no interpreter of its own)."""
    data = ["--input-dir", str(corpus / "data" / "c_text_document"), *_gpt2(corpus)] if data is None else data
    args = [*data, "--device", "cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--max-seq-len", "32", "--max-position-embeddings", "32", "--global-batch-size", "16",
            "--micro-batch-size", "8", "--max-steps", "60", "--eval-freq", "30", "--eval-iters", "2",
            "--lr", "5e-3", "--min-lr", "5e-4", "--warmup-rate", "0.05", "--logging-freq", "10",
            "--split", "90,8,2", "--save", str(out), *extra]
    return run_here(*args)


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


def test_trains_on_sentence_split_data(corpus, tmp_path):
    """preprocess_data.py --split-sentences: one sequence per sentence, documents kept; training reads it."""
    docs = [" ".join(s.capitalize() for s in sentences(random.Random(i).randint(3, 12))) for i in range(600)]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    _preprocess_here("--input", tmp_path / "s.jsonl", "--output-prefix", tmp_path / "s", "--tokenizer-type",
                     "GPT2BPETokenizer", "--vocab-file", corpus / "tok" / "vocab.json", "--merge-file",
                     corpus / "tok" / "merges.txt", "--append-eod", "--split-sentences")
    ds = IndexedDataset(str(tmp_path / "s_text_sentence"))
    assert ds.num_documents == 600 and len(ds) > 5 * 600  # 3 to 12 sentences a document
    run = _train(corpus, tmp_path / "out", "--input-dir", str(tmp_path / "s_text_sentence"), "--max-steps", "4")
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [4]  # logged every 10 steps, and the last
    assert math.isfinite(records[-1]["loss"]) and records[-1]["split"] == "test"


@pytest.mark.parametrize("change, message", [
    (["--input-dir", "/nonexistent/prefix"], "no dataset at '/nonexistent/prefix'"),
    (["--tokenizer-type", "SentencePieceTokenizer"], "--tokenizer-model"),
    (["--vocab-size", "100"], "smaller than the tokenizer's vocabulary"),
    (["--split", "a,b"], "split 'a,b'"),
    (["--train-data-path", "/nonexistent/prefix"], "both input_dir (--data-path) and train_data_path are set"),
    (["--valid-data-path", "/nonexistent/prefix"], "valid_data_path is set without train_data_path"),
])
def test_bad_data_settings_are_one_line_errors(corpus, tmp_path, change, message):
    run = _train(corpus, tmp_path / "out", *change)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in run.stderr


def _one_error_line(run: subprocess.CompletedProcess) -> str:
    """The run stopped with exit 2 and exactly one error line, its last, and no traceback."""
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert error_lines(run.stderr) == [lines[-1]]
    assert lines[-1].startswith("pretrain_gpt.py: error: ")
    return lines[-1][len("pretrain_gpt.py: error: "):]


def _no_partial_files(folder: Path) -> None:
    assert not [p for p in folder.rglob("*") if ".tmp" in p.name]


def test_token_ids_beyond_the_vocabulary_stop_before_training(corpus, tmp_path):
    vocab = len(json.loads((corpus / "tok" / "vocab.json").read_text()))
    (tmp_path / "big").mkdir()
    with IndexedDatasetWriter(str(tmp_path / "big" / "d"), np.uint16) as writer:  # made with a larger tokenizer
        for d in range(200):
            writer.add_document((np.arange(40) * 37 + d) % (vocab + 100))
    largest = int(IndexedDataset(str(tmp_path / "big" / "d")).bin.max())
    run = _train(corpus, tmp_path / "out", "--input-dir", str(tmp_path / "big" / "d"))
    assert _one_error_line(run) == (f"{tmp_path}/big/d.bin holds token id {largest} but the model's vocabulary "
                                    f"has {vocab} ids (0..{vocab - 1}); re-preprocess the data with the model's "
                                    f"tokenizer or raise vocab_size.")
    assert not list((tmp_path / "big").rglob("*.npy")) and not (tmp_path / "out" / "metrics.jsonl").exists()
    _no_partial_files(tmp_path / "big")


def test_a_bin_rewritten_with_its_size_and_mtime_kept_is_rescanned_before_training(corpus, tmp_path):
    """Out-of-vocabulary ids written into a .bin whose size and mtime are kept (before: the cached scan was
    trusted, and training died steps later with an IndexError traceback): one line, exit 2, before training."""
    vocab = len(json.loads((corpus / "tok" / "vocab.json").read_text()))
    (tmp_path / "d").mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy2(corpus / "data" / f"c_text_document{suffix}", tmp_path / "d" / f"c{suffix}")
    data = ["--input-dir", str(tmp_path / "d" / "c"), *_gpt2(corpus)]
    assert _train(corpus, tmp_path / "first", "--max-steps", "1", data=data).returncode == 0
    bin_path = tmp_path / "d" / "c.bin"
    before = os.stat(bin_path)
    tokens = np.fromfile(bin_path, np.uint16)
    tokens[len(tokens) // 2] = vocab + 3
    with open(bin_path, "r+b") as f:
        f.write(tokens.tobytes())
    os.utime(bin_path, ns=(before.st_atime_ns, before.st_mtime_ns))
    run = _train(corpus, tmp_path / "out", data=data)
    assert _one_error_line(run).startswith(f"{bin_path} holds token id {vocab + 3} but the model's vocabulary has "
                                           f"{vocab} ids")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.parametrize("case", ["empty dataset", "empty train split"])
def test_an_empty_dataset_or_train_split_is_one_line(corpus, tmp_path, case):
    if case == "empty dataset":
        with IndexedDatasetWriter(str(tmp_path / "empty"), np.uint16):
            pass
        run = _train(corpus, tmp_path / "out", "--input-dir", str(tmp_path / "empty"))
        expected = f"dataset {tmp_path}/empty is empty (0 sequences, 0 tokens)"
    else:
        run = _train(corpus, tmp_path / "out", "--split", "0,100,0")
        n = len(IndexedDataset(str(corpus / "data" / "c_text_document")))
        expected = f"split '0,100,0' leaves the train split of {corpus}/data/c_text_document 0 of its {n} sequences"
    assert _one_error_line(run).startswith(expected)
    assert not list(tmp_path.rglob("*.npy"))


@contextlib.contextmanager
def _read_only(folder: Path):
    """``folder`` made read-only (chmod; for root, which chmod does not stop, chattr +i); skip if impossible."""
    os.chmod(folder, 0o555)
    immutable = os.geteuid() == 0 and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
    try:
        try:
            (folder / "probe").write_text("")
        except OSError:
            yield
        else:
            (folder / "probe").unlink()
            pytest.skip("cannot make a folder read-only here")
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        os.chmod(folder, 0o755)


def test_a_read_only_data_folder_asks_for_data_cache_path(corpus, tmp_path):
    data = tmp_path / "ro"
    data.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copyfile(corpus / "data" / f"c_text_document{suffix}", data / f"c{suffix}")
    with _read_only(data):
        run = _train(corpus, tmp_path / "out", "--input-dir", str(data / "c"), "--max-steps", "2")
        message = _one_error_line(run)
        assert message.startswith(f"cannot write the dataset index cache in {data}/index-cache: ")
        assert message.endswith("(the folder is read-only); give --data-cache-path a writable folder (by default "
                                "the cache is written beside the data).")
        run = _train(corpus, tmp_path / "out", "--input-dir", str(data / "c"), "--max-steps", "2",
                     "--data-cache-path", str(tmp_path / "cache"))
        assert run.returncode == 0, run.stderr[-2000:]
    assert list((tmp_path / "cache").glob("*_sample_idx.npy"))
    assert sorted(os.listdir(data)) == ["c.bin", "c.idx"]  # nothing was written beside the data


def test_a_truncated_cached_index_is_rebuilt_with_a_warning(corpus, tmp_path):
    cache = tmp_path / "cache"
    assert _train(corpus, tmp_path / "a", "--max-steps", "2", "--data-cache-path", str(cache)).returncode == 0
    for path in cache.glob("*_sample_idx.npy"):
        os.truncate(path, path.stat().st_size // 2)
    run = _train(corpus, tmp_path / "b", "--max-steps", "2", "--data-cache-path", str(cache))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "is unreadable" in run.stderr and "rebuilding it" in run.stderr
    _no_partial_files(cache)


# ------------------------------------------------------------------------------------------ per-split paths
def _preprocess(corpus: Path, docs: list[str], prefix: Path) -> Path:
    (prefix.parent).mkdir(parents=True, exist_ok=True)
    (prefix.parent / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    _preprocess_here("--input", prefix.parent / "in.jsonl", "--output-prefix", prefix, *_gpt2(corpus), "--append-eod")
    return Path(f"{prefix}_text_document")


def test_separate_train_and_valid_paths_train_and_evaluate_on_their_own_data(corpus, tmp_path):
    """Megatron-LM's --train-data-path / --valid-data-path: no --split, validation on the valid data only, no
    test data (no test pass)."""
    valid = _preprocess(corpus, [" ".join(sentences(random.Random(i).randint(3, 12))) for i in range(1000, 1100)],
                        tmp_path / "valid" / "v")
    train = corpus / "data" / "c_text_document"
    run = _train(corpus, tmp_path / "out", "--max-steps", "4", "--eval-freq", "2", "--eval-iters", "1",
                 data=["--train-data-path", f"1.0 {train}", "--valid-data-path", str(valid), *_gpt2(corpus)])
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "valid"] == [2, 4]
    assert not [r for r in records if r["split"] == "test"]
    assert "validation results at global step 2" in run.stdout + run.stderr
    assert list((tmp_path / "valid" / "index-cache").glob("*_sample_idx.npy"))  # indices of the valid data


def test_per_split_datasets_take_every_sequence_of_their_own_data(corpus, tmp_path):
    from megatron.data.blended_dataset import BlendedDataset, build_per_split_datasets
    from megatron.data.gpt_dataset import GPTDataset

    other = _preprocess(corpus, [" ".join(sentences(random.Random(i).randint(3, 12))) for i in range(2000, 2100)],
                        tmp_path / "o" / "o")
    train = corpus / "data" / "c_text_document"
    built = build_per_split_datasets((f"0.5 {train} 0.5 {other}", f"2 {other}", None), (64, 16, 16), 32, 1234, 0,
                                     str(tmp_path / "cache"))
    assert isinstance(built[0], BlendedDataset) and len(built[0]) == 64 and built[2] is None
    valid = built[1]  # a single prefix is used directly, even with a weight (Megatron Core's blend_per_split)
    assert isinstance(valid, GPTDataset) and valid.split == "valid" and len(valid) >= 16
    assert set(np.unique(valid.doc_idx).tolist()) == set(range(len(IndexedDataset(str(other)))))
    for member in built[0].datasets:
        assert set(np.unique(member.doc_idx).tolist()) == set(range(len(member.indexed)))


def test_per_split_path_errors_are_one_line(corpus, tmp_path):
    train = str(corpus / "data" / "c_text_document")
    run = _train(corpus, tmp_path / "out", data=["--train-data-path", train, "--valid-data-path",
                                                 "/nonexistent/v", *_gpt2(corpus)])
    assert _one_error_line(run) == ("no dataset at '/nonexistent/v': expected /nonexistent/v.bin and "
                                    "/nonexistent/v.idx (valid_data_path takes a prefix, a folder of prefixes, or "
                                    "'w1 prefix1 w2 prefix2').")
    run = _train(corpus, tmp_path / "out", data=["--data-path", train, "--train-data-path", train, *_gpt2(corpus)])
    assert "both input_dir (--data-path) and train_data_path are set" in _one_error_line(run)
    run = _train(corpus, tmp_path / "out", data=["--train-data-path", f"1 {train} x", *_gpt2(corpus)])
    assert _one_error_line(run).startswith(f"train_data_path '1 {train} x' must alternate weights and prefixes")


# ------------------------------------------------------------------------------------------ NullTokenizer
def test_null_tokenizer_preprocesses_and_trains_on_pre_tokenized_data(tmp_path):
    """Text that is already token ids: preprocess with --tokenizer-type NullTokenizer --vocab-size 64, then
    train 2 steps with the same flags (end-of-document id 63, the model's vocabulary 64, padded to 128)."""
    rng = random.Random(0)
    docs = [" ".join(str(rng.randrange(63)) for _ in range(rng.randint(5, 40))) for _ in range(200)]
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]
    _preprocess_here("--input", tmp_path / "ids.jsonl", "--output-prefix", tmp_path / "n", *null, "--append-eod")
    ds = IndexedDataset(str(tmp_path / "n_text_document"))
    assert ds[0].tolist() == [int(w) for w in docs[0].split()] + [63]
    run = _train(tmp_path, tmp_path / "out", "--max-steps", "2", "--eval-freq", "2", "--eval-iters", "1",
                 data=["--data-path", str(tmp_path / "n_text_document"), *null])
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [2]
    assert math.isfinite(records[-1]["loss"])
    saved = (tmp_path / "out" / "config.yaml").read_text()
    assert "NullTokenizer" in saved and "vocab_size: 64" in saved
