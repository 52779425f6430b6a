"""What the data layer says at start-up: a summary per split (documents, tokens, samples, epochs; a line per
blended dataset) and the index cache being built or loaded. Every figure is checked against values computed
here from the sequences written, and against the datasets built."""

from __future__ import annotations

import glob
import logging
import math
import re

import numpy as np
import pytest

import pretrain_gpt
from megatron.config import parse_config, validate
from megatron.config.batch_schedule import total_train_samples
from megatron.data import gpt_dataset, summary
from megatron.data.blended_dataset import build_datasets, build_per_split_datasets
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from megatron.metrics import get_logger
from megatron.tokenizer import configured_tokenizer

VOCAB, EOD, SEQ, SEED = 512, 511, 16, 7
LINE = re.compile(r"^data: (?P<split>train|valid|test): (?P<docs>[\d,]+) (?:documents?|sequences?), "
                  r"(?P<tokens>[\d,]+) tokens -> (?P<samples>[\d,]+) samples of (?P<seq>\d+) tokens "
                  r"\((?P<epochs>[\d.,e+-]+) epochs?\) from (?P<source>.+)$")
MEMBER = re.compile(r"^data:   (?P<split>train|valid|test), weight (?P<weight>[\d.]+): (?P<docs>[\d,]+) documents?, "
                    r"(?P<tokens>[\d,]+) tokens -> (?P<samples>[\d,]+) samples \((?P<epochs>[\d.e+-]+) epochs?\) "
                    r"from (?P<source>.+)$")


def _write(prefix: str, num_sequences: int, seed: int = 0) -> np.ndarray:
    """Sequences of 5 to 60 tokens; returns their lengths (what every figure is computed from)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 60, num_sequences)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for n in lengths:
            writer.add_document(rng.integers(0, EOD, int(n)))
    return lengths


@pytest.fixture
def lines():
    """The project logger's messages (it does not propagate to pytest's caplog)."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    get_logger().addHandler(handler)
    yield messages
    get_logger().removeHandler(handler)


def _summary(messages: list[str]) -> dict[str, dict]:
    """{split: its summary figures} from the ``data: <split>: ...`` lines."""
    out = {}
    for message in messages:
        if m := LINE.match(message):
            fields = m.groupdict()
            assert fields["split"] not in out, f"two summaries of {fields['split']}"
            out[fields["split"]] = {"docs": int(fields["docs"].replace(",", "")),
                                    "tokens": int(fields["tokens"].replace(",", "")),
                                    "samples": int(fields["samples"].replace(",", "")), "seq": int(fields["seq"]),
                                    "epochs": float(fields["epochs"].replace(",", "")), "source": fields["source"]}
    return out


def _epochs(samples: int, tokens: int) -> float:
    return (samples * SEQ + 1) / tokens


def test_each_split_is_summarized_with_its_real_figures(tmp_path, lines):
    prefix, cache = str(tmp_path / "ds"), str(tmp_path / "cache")
    lengths = _write(prefix, 200)
    bounds = [0, 180, 196, 200]  # split 90,8,2 of 200 sequences
    asked = (300, 40, 24)
    datasets = build_datasets(prefix, "90,8,2", asked, SEQ, SEED, EOD, cache, vocab_size=VOCAB, report=True)
    got = _summary(lines)
    assert list(got) == ["train", "valid", "test"]
    for s, (split, ds) in enumerate(zip(("train", "valid", "test"), datasets)):
        docs, tokens = bounds[s + 1] - bounds[s], int(lengths[bounds[s]:bounds[s + 1]].sum())
        figures = got[split]
        assert (figures["docs"], figures["tokens"], figures["samples"], figures["seq"], figures["source"]) == \
               (docs, tokens, asked[s], SEQ, prefix)
        assert figures["epochs"] == pytest.approx(_epochs(asked[s], tokens), rel=5e-3)
        # the dataset built agrees: its documents and tokens, and the whole epochs its document index holds
        assert (ds.num_sequences, ds.tokens_per_epoch, ds.num_samples) == (docs, tokens, asked[s])
        assert len(ds.doc_idx) == docs * math.ceil(_epochs(asked[s], tokens)) and len(ds) >= asked[s]
    assert got["test"]["epochs"] > 1 > got["train"]["epochs"]  # 24 samples of 4 sequences: several passes


def test_the_index_is_built_once_then_loaded_from_the_cache(tmp_path, lines):
    prefix, cache = str(tmp_path / "ds"), str(tmp_path / "cache")
    lengths = _write(prefix, 100)
    train_tokens = int(lengths[:90].sum())
    epochs = math.ceil(_epochs(500, train_tokens))
    assert epochs >= 2
    build_datasets(prefix, "90,10,0", (500, 16, 0), SEQ, SEED, EOD, cache, vocab_size=VOCAB, report=True)
    (description,) = glob.glob(f"{cache}/*-train_description.json")
    files = re.escape(description[:-len("_description.json")] + "_*.npy")  # the train split's cached indices
    data = [m for m in lines if m.startswith("data: ") and not LINE.match(m)]
    largest = int(IndexedDataset(prefix).bin.max())
    assert data[0].startswith(f"data: scanning the token ids of {prefix}.bin ")
    assert re.fullmatch(rf"data: scanned {re.escape(prefix)}\.bin in [\d.]+ s: largest token id {largest}, "
                        rf"cached in {re.escape(cache)}/\w+-token_range\.json", data[1])
    assert data[2] == f"data: building the sample index of split train of {prefix} (90 documents, {epochs} epochs)..."
    assert re.fullmatch(rf"data: built the sample index of split train in [\d.]+ s \(\d[\d,]* samples over {epochs} "
                        rf"epochs\), cached in {files}", data[3]), data[3]
    assert data[4] == f"data: building the sample index of split valid of {prefix} (10 documents, 1 epoch)..."
    assert data[5].startswith("data: built the sample index of split valid in ")
    assert data[6:] == ["data: test: none (no samples asked)"] and not [m for m in lines if "loaded" in m]
    assert _summary(lines)["train"]["samples"] == 500

    lines.clear()
    again = build_datasets(prefix, "90,10,0", (500, 16, 0), SEQ, SEED, EOD, cache, vocab_size=VOCAB, report=True)
    data = [m for m in lines if m.startswith("data: ") and not LINE.match(m)]
    assert re.fullmatch(rf"data: sample index of split train of {re.escape(prefix)} loaded from the cache {files} "
                        rf"\({len(again[0]):,} samples over {epochs} epochs\)", data[0]), data[0]
    assert data[1].startswith(f"data: sample index of split valid of {prefix} loaded from the cache {cache}/")
    assert len(data) == 3 and data[2] == "data: test: none (no samples asked)"
    assert not [m for m in lines if "building" in m or "scann" in m]
    assert list(_summary(lines)) == ["train", "valid"]


def test_a_blend_gives_a_line_per_dataset_and_the_total(tmp_path, lines):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    lengths = {a: _write(a, 60, seed=1), b: _write(b, 40, seed=2)}
    asked = 400
    train, valid, test = build_datasets(f"0.7 {a} 0.3 {b}", "90,10,0", (asked, 16, 0), SEQ, SEED, EOD,
                                        str(tmp_path / "cache"), report=True)
    ranges = {a: (0, 54), b: (0, 36)}  # 90% of 60 and of 40 sequences
    header = [m for m in lines if m.startswith("data: train:")]
    members = [{k: v.replace(",", "") if k in ("docs", "tokens", "samples") else v
                for k, v in MEMBER.match(m).groupdict().items()} for m in lines if m.startswith("data:   train,")]
    total = _summary(lines)["train"]
    docs = sum(e - f for f, e in ranges.values())
    tokens = sum(int(lengths[p][f:e].sum()) for p, (f, e) in ranges.items())
    assert header[0].endswith(" from a blend of 2 datasets:") and total["source"] == "a blend of 2 datasets:"
    assert (total["docs"], total["tokens"], total["samples"]) == (docs, tokens, asked)
    assert total["epochs"] == pytest.approx(_epochs(asked, tokens), rel=5e-3)
    drawn = np.bincount(np.asarray(train.dataset_index[:asked]), minlength=2)
    assert [m["source"] for m in members] == [a, b] and [m["weight"] for m in members] == ["0.7", "0.3"]
    for member, prefix, n in zip(members, (a, b), drawn):
        first, last = ranges[prefix]
        member_tokens = int(lengths[prefix][first:last].sum())
        assert int(member["docs"]) == last - first and int(member["tokens"]) == member_tokens
        assert int(member["samples"]) == n and abs(n - asked * float(member["weight"])) <= 1
        assert float(member["epochs"]) == pytest.approx(_epochs(int(n), member_tokens), rel=5e-3)
    assert sum(int(m["samples"]) for m in members) == asked
    assert len([m for m in lines if m.startswith("data:   valid,")]) == 2  # valid is a blend of both too
    # each member's index was built, named by its dataset
    for prefix, (first, last) in ranges.items():
        assert any(m.startswith(f"data: building the sample index of split train of {prefix} ({last - first} "
                                f"documents, ") for m in lines)


def test_per_split_paths_are_summarized_and_a_missing_one_named(tmp_path, lines):
    train_prefix, valid_prefix = str(tmp_path / "t"), str(tmp_path / "v")
    train_lengths, valid_lengths = _write(train_prefix, 50, seed=3), _write(valid_prefix, 12, seed=4)
    build_per_split_datasets((train_prefix, valid_prefix, None), (64, 16, 16), SEQ, SEED, EOD,
                             str(tmp_path / "cache"), report=True)
    got = _summary(lines)
    assert (got["train"]["docs"], got["train"]["tokens"], got["train"]["source"]) == \
           (50, int(train_lengths.sum()), train_prefix)
    assert (got["valid"]["docs"], got["valid"]["tokens"], got["valid"]["source"]) == \
           (12, int(valid_lengths.sum()), valid_prefix)
    assert "data: test: none (no test_data_path)" in lines


def test_num_train_epochs_gives_the_samples_trained_on(tmp_path, lines):
    prefix = str(tmp_path / "ds")
    lengths = _write(prefix, 40)
    gbs, tokens = 4, int(lengths.sum())
    train, _, _ = build_datasets(prefix, "1", (10_000, 0, 0), SEQ, SEED, EOD, str(tmp_path / "cache"),
                                 train_epochs=1, global_batch_size=gbs, report=True)
    figures = _summary(lines)["train"]
    assert figures["samples"] == len(train) == (tokens - 1) // SEQ // gbs * gbs
    assert figures["epochs"] == pytest.approx(_epochs(len(train), tokens), rel=5e-3) and figures["epochs"] <= 1


def test_sentence_split_data_counts_sequences(tmp_path, lines):
    prefix = str(tmp_path / "s")
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for d in range(20):
            for sentence in range(3):
                writer.add_item(np.arange(1, 8 + sentence + d % 5))
            writer.end_document()
    build_datasets(prefix, "1", (8, 0, 0), SEQ, SEED, EOD, str(tmp_path / "cache"), report=True)
    assert _summary(lines)["train"]["docs"] == 60
    assert any(m.startswith("data: train: 60 sequences, ") for m in lines)


def test_only_rank_0_summarizes_and_only_the_builder_says_building(tmp_path, lines, monkeypatch):
    prefix, cache = str(tmp_path / "ds"), str(tmp_path / "cache")
    _write(prefix, 30)
    monkeypatch.setattr(summary, "is_rank0", lambda: False)  # this process still builds (it is every builder)
    build_datasets(prefix, "1", (20, 0, 0), SEQ, SEED, EOD, cache, report=True)
    assert [m for m in lines if m.startswith("data:")] and all(m.startswith(("data: building", "data: built"))
                                                               for m in lines if m.startswith("data:"))
    lines.clear()
    build_datasets(prefix, "1", (20, 0, 0), SEQ, SEED, EOD, cache, report=True)
    assert not [m for m in lines if m.startswith("data:")]  # loaded: rank 0 would say so, not this rank


def test_a_long_build_says_when_each_step_is_done(tmp_path, lines, monkeypatch):
    prefix = str(tmp_path / "ds")
    _write(prefix, 30)
    monkeypatch.setattr(gpt_dataset, "PROGRESS_AFTER_S", -1.0)  # every build counts as long
    build_datasets(prefix, "1", (20, 0, 0), SEQ, SEED, EOD, str(tmp_path / "cache"), report=True)
    steps = [m for m in lines if m.startswith(f"data:   split train of {prefix}: ")]
    assert len(steps) == 3 and [s.split(": ")[2].split(" of ")[0] for s in steps] == [
        "document index", "sample index", "shuffle index"]


def test_without_report_the_builders_say_nothing(tmp_path, lines):
    _write(str(tmp_path / "ds"), 30)
    build_datasets(str(tmp_path / "ds"), "1", (20, 0, 0), SEQ, SEED, EOD, str(tmp_path / "cache"), vocab_size=VOCAB)
    assert lines == []


def _config(tmp_path, *argv: str):
    config = parse_config(["--device", "cpu", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads",
                           "4", "--max-seq-len", str(SEQ), "--max-position-embeddings", str(SEQ),
                           "--global-batch-size", "4", "--max-steps", "5", "--eval-iters", "2",
                           "--save", str(tmp_path / "out"), *argv])
    tokenizer = configured_tokenizer(config.tokenizer, config.model.vocab_size)
    validate(config, world_size=1, cuda_available=False,
             tokenizer_vocab_size=None if tokenizer is None else tokenizer.vocab_size)
    return config, tokenizer


def test_the_datasets_provider_summarizes_real_data(tmp_path, lines):
    prefix = str(tmp_path / "ds")
    lengths = _write(prefix, 100)
    config, tokenizer = _config(tmp_path, "--input-dir", prefix, "--tokenizer-type", "NullTokenizer",
                                "--vocab-size", str(VOCAB), "--split", "90,10,0")
    pretrain_gpt.datasets_provider(config, tokenizer)
    got = _summary(lines)
    assert got["train"]["samples"] == total_train_samples(config) == 20
    assert (got["train"]["docs"], got["train"]["tokens"]) == (90, int(lengths[:90].sum()))
    assert (got["valid"]["docs"], got["valid"]["samples"]) == (10, 8)
    assert "data: test: none (no samples asked)" not in lines and "data: test: none (split '90,10,0' gives it " \
           "no sequences)" in lines


def test_the_datasets_provider_says_mock_data_is_synthetic(tmp_path, lines):
    config, _ = _config(tmp_path, "--mock-data")
    pretrain_gpt.datasets_provider(config)
    data = [m for m in lines if m.startswith("data:")]
    assert len(data) == 3
    assert data[0].startswith(f"data: train: 20 synthetic samples of {SEQ} tokens (--mock-data: ")
    assert data[1:] == [f"data: valid: 8 synthetic samples of {SEQ} tokens (--mock-data)",
                        f"data: test: 8 synthetic samples of {SEQ} tokens (--mock-data)"]


@pytest.mark.parametrize("n, text", [(0, "0"), (4321, "4,321"), (99_999, "99,999"), (123_456, "123k"),
                                     (2_310_000, "2.31M"), (999_999, "1M"), (1_500_000_000, "1.5B"),
                                     (2 * 10**12, "2T"), (5 * 10**15, "5,000T")])
def test_token_counts_are_readable(n, text):
    assert summary.tokens(n) == text


@pytest.mark.parametrize("value, text", [(1.0, "1 epoch"), (3.94, "3.94 epochs"), (0.000312, "0.000312 epochs"),
                                         (1234.5, "1,234 epochs"), (21.83, "21.8 epochs")])
def test_epochs_are_readable(value, text):
    assert summary.fmt_epochs(value) == text
