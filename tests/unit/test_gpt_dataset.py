"""GPT dataset semantics: splits, sample windows, epochs, caching, blending, resumable sampling."""

from __future__ import annotations

import os

import numpy as np
import pytest

from megatron.data import gpt_dataset
from megatron.data.blended_dataset import BlendedDataset, build_datasets, parse_input_dir
from megatron.data.gpt_dataset import GPTDataset, split_ranges
from megatron.data.indexed_dataset import DatasetError, IndexedDataset, IndexedDatasetWriter
from megatron.data.loader import build_loader

EOD = 0


def _make(prefix: str, num_docs: int, seed: int = 0, doc_offset: int = 0) -> list[np.ndarray]:
    """Documents whose tokens name their document and position: token = 1000 * doc + position + 1."""
    rng = np.random.default_rng(seed)
    docs = [1000 * (doc_offset + d) + np.arange(1, 1 + n) for d, n in enumerate(rng.integers(1, 40, num_docs))]
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for doc in docs:
            writer.add_document(doc)
    return docs


def test_split_ranges_megatron_rounding():
    assert split_ranges("949,50,1", 1000) == [(0, 949), (949, 999), (999, 1000)]
    assert split_ranges("98/2/0", 10) == [(0, 10), (10, 10), (10, 10)]
    assert split_ranges("1", 7) == [(0, 7), (7, 7), (7, 7)]
    assert split_ranges("1,1,1", 10)[-1][1] == 10
    with pytest.raises(ValueError):
        split_ranges("a,b", 10)


@pytest.mark.parametrize("seq_len, num_samples", [(8, 10), (16, 200), (5, 1000), (64, 3)])
def test_samples_are_contiguous_windows_of_the_shuffled_document_stream(tmp_path, seq_len, num_samples):
    docs = _make(str(tmp_path / "ds"), 30)
    ds = GPTDataset(IndexedDataset(str(tmp_path / "ds")), "train", (0, 30), num_samples, seq_len, 7,
                    str(tmp_path / "cache"), EOD)
    assert len(ds) >= num_samples
    stream = np.concatenate([docs[d] for d in ds.doc_idx])
    seen = set()
    for i in range(len(ds)):
        j = int(ds.shuffle_idx[i])
        seen.add(j)
        np.testing.assert_array_equal(ds[i], stream[j * seq_len: j * seq_len + seq_len + 1])
    assert seen == set(range(len(ds)))  # the shuffle is a permutation
    epochs = len(ds.doc_idx) // 30
    counts = np.bincount(ds.doc_idx, minlength=30)
    assert (counts == epochs).all()  # every document once per epoch


def test_separate_last_epoch_is_shuffled_on_its_own(tmp_path):
    docs = _make(str(tmp_path / "ds"), 20)
    tokens = sum(len(d) for d in docs)
    seq_len = 8
    per_epoch = (tokens - 1) // seq_len
    ds = GPTDataset(IndexedDataset(str(tmp_path / "ds")), "train", (0, 20), per_epoch + 2, seq_len, 1,
                    str(tmp_path / "cache"), EOD)
    # Two epochs, the second needed for 2 samples only: it is a separate permutation of the documents.
    assert len(ds.doc_idx) == 40
    assert sorted(ds.doc_idx[:20]) == list(range(20)) and sorted(ds.doc_idx[20:]) == list(range(20))
    before_last = (tokens - 1) // seq_len
    assert sorted(ds.shuffle_idx[:before_last]) == list(range(before_last))


def test_no_token_of_valid_or_test_documents_in_training_samples(tmp_path):
    _make(str(tmp_path / "ds"), 200)
    train, valid, test = build_datasets(str(tmp_path / "ds"), "80,15,5", (300, 40, 20), 16, 3, EOD,
                                        str(tmp_path / "cache"))
    (t0, t1), (v0, v1), (s0, s1) = split_ranges("80,15,5", 200)

    def docs_of(dataset):
        return {int(tok) // 1000 for i in range(len(dataset)) for tok in dataset[i]}

    assert docs_of(train) <= set(range(t0, t1))
    assert docs_of(valid) <= set(range(v0, v1))
    assert docs_of(test) <= set(range(s0, s1))


def test_cache_is_reused_and_rebuilt_when_any_input_changes(tmp_path, monkeypatch):
    prefix, cache = str(tmp_path / "ds"), str(tmp_path / "cache")
    _make(prefix, 30)
    args = dict(split="train", document_range=(0, 30), num_samples=50, seq_length=8, seed=1, cache_dir=cache,
                eod_id=EOD)
    first = GPTDataset(IndexedDataset(prefix), **args)
    built = []
    real = gpt_dataset.build_indices
    monkeypatch.setattr(gpt_dataset, "build_indices", lambda *a: built.append(a) or real(*a))
    again = GPTDataset(IndexedDataset(prefix), **args)
    assert built == []  # loaded from the cache
    np.testing.assert_array_equal(first.sample_idx, again.sample_idx)
    for change in (dict(seed=2), dict(seq_length=9), dict(num_samples=60), dict(document_range=(0, 29)),
                   dict(split="valid")):
        GPTDataset(IndexedDataset(prefix), **{**args, **change})
        assert len(built) == 1, change
        built.clear()
    _make(prefix, 31, seed=5)  # the data itself changes
    GPTDataset(IndexedDataset(prefix), **args)
    assert len(built) == 1
    assert not [f for f in os.listdir(cache) if ".tmp" in f]


def test_input_dir_forms(tmp_path):
    for i in range(3):
        _make(str(tmp_path / f"p{i}_text_document"), 10, seed=i)
    folder = sorted(parse_input_dir(str(tmp_path))[0])
    assert [os.path.basename(p) for p in folder] == ["p0_text_document", "p1_text_document", "p2_text_document"]
    assert parse_input_dir(str(tmp_path / "p1_text_document.bin")) == ([str(tmp_path / "p1_text_document")], None)
    weighted = parse_input_dir(f"0.3 {tmp_path}/p0_text_document 0.7 {tmp_path}/p2_text_document")
    assert weighted[1] == [0.3, 0.7]
    for bad in (str(tmp_path / "missing"), f"0.3 {tmp_path}/p0_text_document 0.7", str(tmp_path / "empty")):
        os.makedirs(tmp_path / "empty", exist_ok=True)
        with pytest.raises(DatasetError):
            parse_input_dir(bad)


def test_blending_follows_weights(tmp_path):
    _make(str(tmp_path / "a"), 50, seed=1, doc_offset=0)
    _make(str(tmp_path / "b"), 50, seed=2, doc_offset=100)
    train, _, _ = build_datasets(f"0.25 {tmp_path}/a 0.75 {tmp_path}/b", "1,0,0", (400, 0, 0), 8, 1, EOD,
                                 str(tmp_path / "cache"))
    assert isinstance(train, BlendedDataset) and len(train) == 400
    from_b = [bool(train[i][0] // 1000 >= 100) for i in range(400)]
    for n in range(1, 401):
        assert abs(sum(from_b[:n]) - 0.75 * n) <= 1.0 + 1e-9  # within one sample at every prefix


def test_loader_resumed_at_consumed_samples_matches_uninterrupted(tmp_path):
    _make(str(tmp_path / "ds"), 60)
    train, _, _ = build_datasets(str(tmp_path / "ds"), "1,0,0", (80, 0, 0), 8, 1, EOD, str(tmp_path / "cache"))
    gbs = 8
    full = [b["tokens"] for b in build_loader(train, 0, gbs, EOD, True, num_workers=0)]
    for step in (0, 3, 7):
        resumed = [b["tokens"] for b in build_loader(train, step * gbs, gbs, EOD, True, num_workers=1)]
        assert len(resumed) == len(full) - step
        for got, want in zip(resumed, full[step:]):
            assert np.array_equal(got.numpy(), want.numpy())
