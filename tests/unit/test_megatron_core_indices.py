"""Our split, document, sample, shuffle and blending indices equal Megatron Core's for the same inputs.

Megatron-LM is not imported: the reference below is written from the format's facts and Core's rules
(megatron/core/datasets: blended_megatron_dataset_builder.py, gpt_dataset.py, helpers.cpp,
blended_dataset.py, utils.py), independently of our implementation:

- split: the split weights are normalized in float64; the bookends are their running sums from 0; split
  ``i`` is ``arange(round(b[i] * N), round(b[i + 1] * N))`` (int32) with Python's round, N the number of
  *sequences* (``GPTDataset.numel_low_level_dataset``); every sequence is a document to the GPT dataset;
- epochs: the fewest E with ``E * tokens_per_epoch >= num_samples * seq_length + 1``;
- separate final epoch: E > 1 and the samples drawn from it, ``num_samples - ((E - 1) * T - 1) // seq``,
  are fewer than ``int(0.80 * ((T - 1) // seq))``;
- one ``numpy.random.RandomState(seed)``: the document index (E epochs of the split's ids, int32,
  shuffled; or E - 1 epochs shuffled then the last epoch shuffled), then the shuffle index (uint32
  ``arange`` shuffled; or the samples before the final epoch, then those of the final epoch);
- sample index: helpers.cpp's walk, ``seq_length + 1`` tokens per sample (add_extra_token_to_sequence),
  consecutive samples sharing one token, int32;
- blending with weights: each member built for ``ceil(ceil(n * w) * 1.005)`` samples, the blend holding
  ``sum(ceil(n * w))``; sample i goes to the first dataset maximizing ``w * max(i, 1) - count``.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from megatron.data.blended_dataset import BlendedDataset, build_datasets
from megatron.data.gpt_dataset import GPTDataset, split_ranges

EOD = 0


# ----------------------------------------------------------------------------- the format, written by hand
def write_pair(prefix: str, documents: list[list[np.ndarray]]) -> None:
    """A .bin/.idx pair of int32 tokens (dtype code 4), each document a list of sequences."""
    sequences = [seq for doc in documents for seq in doc]
    lengths = np.array([len(s) for s in sequences], dtype="<i4")
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]).astype("<i8") * 4
    doc_starts = np.concatenate([[0], np.cumsum([len(d) for d in documents])]).astype("<i8")
    with open(prefix + ".bin", "wb") as f:
        f.write(np.concatenate(sequences).astype("<i4").tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, len(lengths), len(doc_starts)))
        f.write(lengths.tobytes() + pointers.tobytes() + doc_starts.tobytes())


def documents(num_docs: int, seqs_per_doc: int, seed: int, base: int = 0) -> list[list[np.ndarray]]:
    """Token = 10**6 * (base + global sequence id) + position + 1: every token is unique and names its sequence."""
    rng = np.random.default_rng(seed)
    docs, k = [], 0
    for _ in range(num_docs):
        doc = []
        for _ in range(seqs_per_doc):
            doc.append(10**6 * (base + k) + np.arange(1, 1 + int(rng.integers(1, 30))))
            k += 1
        docs.append(doc)
    return docs


# ----------------------------------------------------------------------------- Megatron Core's rules
def core_split(split: list[float], num_sequences: int) -> list[tuple[int, int] | None]:
    weights = np.array(split, dtype=np.float64)
    weights = (weights / np.sum(weights)).tolist()
    bookends = [0]
    for w in weights:
        bookends.append(bookends[-1] + w)
    out = []
    for lo, hi in zip(bookends[:-1], bookends[1:]):
        out.append(None if hi <= lo else (int(round(lo * float(num_sequences))), int(round(hi * float(num_sequences)))))
    return out


def legacy_split(split: list[float], n: int) -> list[tuple[int, int]]:
    """Megatron's old rule: round each size, then move the excess off every bound but the first."""
    fractions = [w / sum(split) for w in split]
    bounds = [0]
    for f in fractions:
        bounds.append(bounds[-1] + int(round(f * n)))
    diff = bounds[-1] - n
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return list(zip(bounds[:-1], bounds[1:]))


def core_sample_index(sizes: np.ndarray, doc_index: np.ndarray, seq: int, epochs: int, tpe: int) -> np.ndarray:
    num_samples = (epochs * tpe - 1) // seq
    rows, d, offset = [(0, 0)], 0, 0
    while len(rows) <= num_samples:
        remaining = seq + 1
        while remaining != 0:
            length = int(sizes[doc_index[d]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                d, offset = d + 1, 0
        rows.append((d, offset))
    return np.array(rows, dtype=np.int32)


def core_indices(sizes: np.ndarray, begin: int, end: int, num_samples: int, seq: int, seed: int):
    ids = np.arange(begin, end, dtype=np.int32)
    tpe = int(np.sum(sizes[ids]))
    epochs = 1
    while epochs * tpe < num_samples * seq + 1:
        epochs += 1
    separate = False
    if epochs > 1:
        before_final = ((epochs - 1) * tpe - 1) // seq
        separate = num_samples - before_final < int(0.80 * ((tpe - 1) // seq))
    rng = np.random.RandomState(seed)
    if separate:
        first = np.concatenate([ids] * (epochs - 1)).astype(np.int32)
        rng.shuffle(first)
        last = ids.copy()
        rng.shuffle(last)
        doc_index = np.concatenate([first, last])
    else:
        doc_index = np.concatenate([ids] * epochs).astype(np.int32)
        rng.shuffle(doc_index)
    sample_index = core_sample_index(sizes, doc_index, seq, epochs, tpe)
    total = len(sample_index) - 1
    cut = before_final if separate else total
    head = np.arange(0, cut, dtype=np.uint32)
    rng.shuffle(head)
    tail = np.arange(cut, total, dtype=np.uint32)
    rng.shuffle(tail)
    return doc_index, sample_index, np.concatenate([head, tail]) if separate else head, separate


def core_blending(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    counts = [0] * len(weights)
    which, nth = np.zeros(size, np.int16), np.zeros(size, np.int64)
    for i in range(size):
        errors = [w * max(float(i), 1.0) - c for w, c in zip(weights, counts)]
        d = errors.index(max(errors))
        which[i], nth[i] = d, counts[d]
        counts[d] += 1
    return which, nth


def normalized(weights: list[float]) -> list[float]:
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


# ----------------------------------------------------------------------------- the comparisons
@pytest.mark.parametrize("split, n", [("90,5,5", 250), ("949,50,1", 1000), ("949,50,1", 37), ("98,2,0", 10),
                                      ("1,1,1", 10), ("80,15,5", 201), ("33,33,34", 7), ("100,0,0", 900),
                                      ("0,100,0", 9), ("969,30,1", 1234567)])
def test_split_ranges_are_cores_bookends(split, n):
    weights = [float(w) for w in split.split(",")]
    want = [r if r is not None else None for r in core_split(weights, n)]
    got = split_ranges(split, n)
    for g, w in zip(got, want):
        assert (g[1] == g[0]) if w is None else g == w


def test_90_5_5_on_250_rounds_each_bookend_unlike_the_legacy_rule():
    assert split_ranges("90,5,5", 250) == [(0, 225), (225, 238), (238, 250)]
    assert legacy_split([90, 5, 5], 250) == [(0, 226), (226, 238), (238, 250)]


CASES = {  # name: (documents, sequences per document, split, samples per split, seq_length)
    "one sequence per document": (120, 1, "90,5,5", (40, 6, 6), 16),
    "three sequences per document": (100, 3, "90,5,5", (60, 6, 6), 16),
    "90,5,5 on 250 sequences": (250, 1, "90,5,5", (50, 5, 5), 8),
    "separate final epoch": (40, 2, "100,0,0", None, 8),
    "several whole epochs": (30, 1, "80,20,0", (400, 50, 0), 8),
}


@pytest.mark.parametrize("case", CASES)
def test_document_sample_and_shuffle_indices_equal_cores(tmp_path, case):
    num_docs, per_doc, split, samples, seq = CASES[case]
    prefix = str(tmp_path / "ds")
    docs = documents(num_docs, per_doc, seed=3)
    write_pair(prefix, docs)
    sizes = np.array([len(s) for d in docs for s in d], dtype=np.int32)
    if samples is None:  # one epoch and two samples more: the final epoch is separate
        samples = ((int(sizes.sum()) - 1) // seq + 2, 0, 0)
    datasets = build_datasets(prefix, split, samples, seq, 1234, EOD, str(tmp_path / "cache"))
    separate_seen = False
    for s, ds in enumerate(datasets):
        bookends = core_split([float(w) for w in split.split(",")], len(sizes))[s]
        if samples[s] == 0 or bookends is None or bookends[0] == bookends[1]:
            assert ds is None
            continue
        doc, sample, shuffle, separate = core_indices(sizes, *bookends, samples[s], seq, 1234)
        separate_seen |= separate
        assert isinstance(ds, GPTDataset)
        for ours, core in ((ds.doc_idx, doc), (ds.sample_idx, sample), (ds.shuffle_idx, shuffle)):
            assert ours.dtype == core.dtype and ours.shape == core.shape
            np.testing.assert_array_equal(ours, core)
    assert separate_seen or case != "separate final epoch"


def test_a_multi_sequence_datasets_train_split_covers_all_its_tokens(tmp_path):
    """300 documents of 3 sequences: one epoch of training samples reads every sequence's tokens (the old
    split by document numbered 300 documents and read only sequences 0..299)."""
    prefix, seq = str(tmp_path / "ds"), 16
    docs = documents(300, 3, seed=5)
    write_pair(prefix, docs)
    every = np.concatenate([s for d in docs for s in d])
    samples = (len(every) - 1) // seq
    train, _, _ = build_datasets(prefix, "100,0,0", (samples, 0, 0), seq, 7, EOD, str(tmp_path / "cache"))
    assert sorted(train.doc_idx.tolist()) == list(range(900))
    read = np.unique(np.concatenate([train[i] for i in range(len(train))]))
    assert len(read) >= len(every) - seq  # all but the tail that does not fill a last sample
    assert set(read.tolist()) <= set(every.tolist())


def test_blended_member_sizes_and_blending_index_equal_cores(tmp_path):
    weights, seq, n, split = [0.2, 0.5, 0.3], 8, 300, "90,5,5"
    prefixes, sizes = [], []
    for d, (num, per) in enumerate([(60, 1), (30, 3), (80, 2)]):
        prefixes.append(str(tmp_path / f"p{d}"))
        docs = documents(num, per, seed=d, base=1000 * d)
        write_pair(prefixes[-1], docs)
        sizes.append(np.array([len(s) for doc in docs for s in doc], dtype=np.int32))
    spec = " ".join(f"{w} {p}" for w, p in zip(weights, prefixes))
    train, valid, _ = build_datasets(spec, split, (n, 30, 0), seq, 99, EOD, str(tmp_path / "cache"))
    for blend, wanted, s in ((train, n, 0), (valid, 30, 1)):
        w = normalized(weights)
        targets = [math.ceil(wanted * x) for x in w]
        assert isinstance(blend, BlendedDataset) and len(blend) == sum(targets)
        which, nth = core_blending(normalized(w), sum(targets))
        np.testing.assert_array_equal(blend.dataset_index, which)
        np.testing.assert_array_equal(blend.dataset_sample_index, nth)
        for member, size, t in zip(blend.datasets, sizes, targets):
            bookends = core_split([90.0, 5.0, 5.0], len(size))[s]
            assert member.num_samples == math.ceil(t * (1 + 0.005))
            doc, sample, shuffle, _ = core_indices(size, *bookends, member.num_samples, seq, 99)
            np.testing.assert_array_equal(member.doc_idx, doc)
            np.testing.assert_array_equal(member.sample_idx, sample)
            np.testing.assert_array_equal(member.shuffle_idx, shuffle)
