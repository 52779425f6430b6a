"""GPT dataset semantics: splits, sample windows, epochs, caching, blending, resumable sampling."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil

import numpy as np
import pytest

from megatron.data import gpt_dataset, index_cache, token_check
from megatron.data.blended_dataset import BlendedDataset, build_datasets, parse_input_dir
from megatron.data.gpt_dataset import GPTDataset, split_ranges
from megatron.data.indexed_dataset import DatasetError, IndexedDataset, IndexedDatasetWriter
from megatron.data.loader import build_batch, build_loader
from megatron.metrics import get_logger

EOD = 0


def _make(prefix: str, num_docs: int, seed: int = 0, doc_offset: int = 0) -> list[np.ndarray]:
    """Documents whose tokens name their document and position: token = 1000 * doc + position + 1."""
    rng = np.random.default_rng(seed)
    docs = [1000 * (doc_offset + d) + np.arange(1, 1 + n) for d, n in enumerate(rng.integers(1, 40, num_docs))]
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for doc in docs:
            writer.add_document(doc)
    return docs


def test_split_ranges_round_each_bookend_as_megatron_core():
    assert split_ranges("949,50,1", 1000) == [(0, 949), (949, 999), (999, 1000)]
    assert split_ranges("98/2/0", 10) == [(0, 10), (10, 10), (10, 10)]
    assert split_ranges("1", 7) == [(0, 7), (7, 7), (7, 7)]
    assert split_ranges("1,1,1", 10) == [(0, 3), (3, 7), (7, 10)]
    assert split_ranges("90,5,5", 250) == [(0, 225), (225, 238), (238, 250)]  # legacy: (0, 226), (226, 238)
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
    args = dict(split="train", sequence_range=(0, 30), num_samples=50, seq_length=8, seed=1, cache_dir=cache,
                eod_id=EOD)
    first = GPTDataset(IndexedDataset(prefix), **args)
    built = []
    real = gpt_dataset.build_indices
    monkeypatch.setattr(gpt_dataset, "build_indices", lambda *a: built.append(a) or real(*a))
    again = GPTDataset(IndexedDataset(prefix), **args)
    assert built == []  # loaded from the cache
    np.testing.assert_array_equal(first.sample_idx, again.sample_idx)
    for change in (dict(seed=2), dict(seq_length=9), dict(num_samples=60), dict(sequence_range=(0, 29)),
                   dict(split="valid")):
        GPTDataset(IndexedDataset(prefix), **{**args, **change})
        assert len(built) == 1, change
        built.clear()
    _make(prefix, 31, seed=5)  # the data itself changes
    GPTDataset(IndexedDataset(prefix), **args)
    assert len(built) == 1
    assert not [f for f in os.listdir(cache) if ".tmp" in f]
    built.clear()
    copy = str(tmp_path / "elsewhere" / "copy")  # a node-local copy: another path, another mtime, same content
    os.makedirs(os.path.dirname(copy))
    for suffix in (".bin", ".idx"):
        shutil.copyfile(prefix + suffix, copy + suffix)
    os.utime(copy + ".idx", (1, 1))
    GPTDataset(IndexedDataset(copy), **args)
    assert built == []


def _log_lines(monkeypatch) -> list[str]:
    """Messages the project's logger emits (it does not propagate to pytest's caplog)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = get_logger()
    monkeypatch.setattr(logger, "handlers", [*logger.handlers, handler])  # the old list is restored afterwards
    return lines


@pytest.mark.parametrize("damage", ["truncate", "empty", "other shape", "description"])
def test_a_damaged_cached_index_is_rebuilt_with_a_warning(tmp_path, monkeypatch, damage):
    prefix, cache = str(tmp_path / "ds"), str(tmp_path / "cache")
    _make(prefix, 30)
    args = ("train", (0, 30), 50, 8, 1, cache, EOD)
    first = GPTDataset(IndexedDataset(prefix), *args)
    want = [np.array(a) for a in (first.doc_idx, first.sample_idx, first.shuffle_idx)]
    del first
    (sample,) = [os.path.join(cache, f) for f in os.listdir(cache) if f.endswith("_sample_idx.npy")]
    if damage == "truncate":
        os.truncate(sample, os.path.getsize(sample) // 2)
    elif damage == "empty":
        os.truncate(sample, 0)
    elif damage == "other shape":
        np.save(sample, np.zeros((3, 2), np.int32))
    else:
        with open(sample.replace("_sample_idx.npy", "_description.json"), "w") as f:
            f.write("{not json")
    lines = _log_lines(monkeypatch)
    again = GPTDataset(IndexedDataset(prefix), *args)
    for got, expected in zip((again.doc_idx, again.sample_idx, again.shuffle_idx), want):
        np.testing.assert_array_equal(got, expected)
    assert len(lines) == 1 and "rebuilding it" in lines[0]
    assert not [f for f in os.listdir(cache) if ".tmp" in f]


@pytest.mark.parametrize("foreign", ["whole entry", "one array", "old format"])
def test_a_foreign_or_stale_cache_entry_is_never_used(tmp_path, monkeypatch, foreign):
    """The entry of another configuration (here seed 2: the same shapes, other contents) copied under this
    one's names, or only one of its arrays, or an entry of the previous format: the key stored inside the
    entry (or an array's digest) differs, so it is rebuilt with a warning, and the indices are this
    configuration's. (Before, shapes and dtypes were all that was checked: the seed-2 shuffle was used.)"""
    prefix, cache = str(tmp_path / "ds"), str(tmp_path / "cache")
    _make(prefix, 30)
    args = dict(split="train", sequence_range=(0, 30), num_samples=50, seq_length=8, cache_dir=cache, eod_id=EOD)
    mine = GPTDataset(IndexedDataset(prefix), seed=1, **args)
    want = [np.array(a) for a in (mine.doc_idx, mine.sample_idx, mine.shuffle_idx)]
    other = GPTDataset(IndexedDataset(prefix), seed=2, **args)
    assert not np.array_equal(other.shuffle_idx, want[2])
    del mine, other
    files = sorted(os.listdir(cache))
    mine_key = gpt_dataset.IndexSpec(**IndexedDataset(prefix).content_key(), split="train", first_sequence=0,
                                     last_sequence=30, num_samples=50, seq_length=8, seed=1).key()
    (theirs_key,) = {f.split("-")[0] for f in files} - {mine_key}
    suffixes = {"whole entry": ["_doc_idx.npy", "_sample_idx.npy", "_shuffle_idx.npy", "_description.json"],
                "one array": ["_shuffle_idx.npy"], "old format": []}[foreign]
    for suffix in suffixes:
        shutil.copyfile(os.path.join(cache, f"{theirs_key}-train{suffix}"),
                        os.path.join(cache, f"{mine_key}-train{suffix}"))
    if foreign == "old format":
        path = os.path.join(cache, f"{mine_key}-train_description.json")
        description = json.loads(open(path).read())
        old = {**description["key"], "arrays": {k: {"shape": v["shape"], "dtype": v["dtype"]}
                                                for k, v in description["arrays"].items()}}
        with open(path, "w") as f:
            json.dump(old, f)
    lines = _log_lines(monkeypatch)
    again = GPTDataset(IndexedDataset(prefix), seed=1, **args)
    for got, expected in zip((again.doc_idx, again.sample_idx, again.shuffle_idx), want):
        np.testing.assert_array_equal(got, expected)
    assert len(lines) == 1 and "rebuilding it" in lines[0], lines
    reason = {"whole entry": "was built for another dataset or configuration (seed 2, here 1)",
              "one array": "is not the file its description was written with", "old format": "holds no key"}[foreign]
    assert reason in lines[0]


@pytest.mark.parametrize("cache_state", ["missing", "damaged"])
def test_an_unwritable_cache_folder_is_a_one_line_error(tmp_path, monkeypatch, cache_state):
    prefix, cache = str(tmp_path / "ds"), str(tmp_path / "cache")
    _make(prefix, 30)
    if cache_state == "damaged":  # built once, then a file cut in half: it must be rebuilt, and cannot be
        build_datasets(prefix, "1,0,0", (50, 0, 0), 8, 1, EOD, cache)
        (shuffle,) = [os.path.join(cache, f) for f in os.listdir(cache) if f.endswith("_shuffle_idx.npy")]
        os.truncate(shuffle, os.path.getsize(shuffle) // 2)

    def refuse(path, data):
        raise PermissionError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(index_cache, "write_atomic", refuse)
    with pytest.raises(DatasetError) as err:
        build_datasets(prefix, "1,0,0", (50, 0, 0), 8, 1, EOD, cache)
    message = str(err.value)
    assert "\n" not in message and f"cannot write the dataset index cache in {cache}" in message
    assert "read-only" in message and "--data-cache-path" in message


def test_empty_datasets_and_an_empty_train_split_are_errors(tmp_path):
    with IndexedDatasetWriter(str(tmp_path / "none"), np.int32):
        pass
    with IndexedDatasetWriter(str(tmp_path / "blank"), np.int32) as writer:
        writer.add_document([])
    for name, count in (("none", 0), ("blank", 1)):
        with pytest.raises(DatasetError, match=re.escape(f"dataset {tmp_path}/{name} is empty ({count} sequences, 0 "
                                                         f"tokens); preprocess a non-empty corpus")):
            build_datasets(str(tmp_path / name), "1,0,0", (10, 0, 0), 8, 1, EOD, str(tmp_path / "cache"))
    _make(str(tmp_path / "ds"), 30)
    with pytest.raises(DatasetError, match="split '0,100,0' leaves the train split of .* 0 of its 30 sequences"):
        build_datasets(str(tmp_path / "ds"), "0,100,0", (10, 2, 0), 8, 1, EOD, str(tmp_path / "cache"))
    assert not os.path.exists(tmp_path / "cache")  # nothing was written


def test_token_ids_beyond_the_vocabulary_stop_and_the_scan_is_cached(tmp_path, monkeypatch):
    prefix, cache = str(tmp_path / "ds"), str(tmp_path / "cache")
    docs = _make(prefix, 30)
    largest = int(max(d.max() for d in docs))
    scans = []
    real = token_check.scan_token_range
    monkeypatch.setattr(token_check, "scan_token_range", lambda *a: scans.append(a) or real(*a))
    with pytest.raises(DatasetError) as err:
        build_datasets(prefix, "1,0,0", (50, 0, 0), 8, 1, EOD, cache, vocab_size=largest)
    assert str(err.value) == (f"{prefix}.bin holds token id {largest} but the model's vocabulary has {largest} ids "
                              f"(0..{largest - 1}); re-preprocess the data with the model's tokenizer or raise "
                              f"vocab_size.")
    assert not [f for f in os.listdir(cache) if f.endswith(".npy")]  # stopped before building indices
    train, _, _ = build_datasets(prefix, "1,0,0", (50, 0, 0), 8, 1, EOD, cache, vocab_size=largest + 1)
    assert len(train) >= 50 and len(scans) == 1  # the second check read the cached range


@pytest.mark.parametrize("keep_mtime", [False, True], ids=["new-mtime", "mtime-kept"])
def test_a_bin_rewritten_in_place_with_the_same_size_is_rescanned(tmp_path, monkeypatch, keep_mtime):
    """The content key hashes the .idx but only the .bin's size: the token-range entry is keyed by the .bin's
    mtime and a probe of its bytes too, so new bytes under the same .idx (here an id beyond the vocabulary) are
    not trusted to the old verdict, also when the rewrite kept the size and the mtime (before: trusted, and
    training died steps later with an IndexError). A copy that keeps the mtime (cp -p) keeps the entry."""
    prefix, cache = str(tmp_path / "ds"), str(tmp_path / "cache")
    docs = _make(prefix, 30)
    vocab = int(max(d.max() for d in docs)) + 1
    scans = []
    real = token_check.scan_token_range
    monkeypatch.setattr(token_check, "scan_token_range", lambda *a: scans.append(a) or real(*a))
    build_datasets(prefix, "1,0,0", (50, 0, 0), 8, 1, EOD, cache, vocab_size=vocab)
    copy = str(tmp_path / "copy" / "ds")
    os.makedirs(os.path.dirname(copy))
    for suffix in (".bin", ".idx"):
        shutil.copy2(prefix + suffix, copy + suffix)
    build_datasets(copy, "1,0,0", (50, 0, 0), 8, 1, EOD, cache, vocab_size=vocab)
    assert len(scans) == 1  # same content, same mtime: the cached range
    before = os.stat(prefix + ".bin")
    tokens = np.fromfile(prefix + ".bin", np.int32)
    tokens[len(tokens) // 3] = vocab + 7  # a token no sampled block need hold: the whole small file is probed
    tokens.tofile(prefix + ".bin")  # in place: same size, same .idx
    mtime = before.st_mtime_ns + (0 if keep_mtime else 1_000_000_000)
    os.utime(prefix + ".bin", ns=(before.st_atime_ns, mtime))
    assert os.stat(prefix + ".bin").st_size == before.st_size
    with pytest.raises(DatasetError, match=f"holds token id {vocab + 7} but the model's vocabulary has {vocab} ids"):
        build_datasets(prefix, "1,0,0", (50, 0, 0), 8, 1, EOD, cache, vocab_size=vocab)
    assert len(scans) == 2


def test_a_large_bin_is_probed_by_its_sampled_blocks(tmp_path, monkeypatch):
    """Above FULL_PROBE_BYTES the probe is the 64 sampled blocks: a change in one of them is a new key."""
    path = tmp_path / "big.bin"
    path.write_bytes(bytes(1 << 20))
    monkeypatch.setattr(token_check, "FULL_PROBE_BYTES", 1 << 16)
    first = token_check.bin_probe(str(path))
    with open(path, "r+b") as f:
        f.seek((1 << 20) - 10)  # inside the last sampled block
        f.write(b"\x01")
    assert first.startswith("sample:") and token_check.bin_probe(str(path)) != first


@pytest.mark.parametrize("bad", [1000, -1])
def test_a_batch_with_an_id_outside_the_vocabulary_stops_in_one_line(bad):
    """The last guard, on the CPU batch before it reaches the device: a change no probe saw."""
    samples = [np.arange(9), np.arange(9)]
    samples[1][4] = bad
    batch = build_batch(samples, EOD)
    token_check.check_batch(build_batch([np.arange(9)], EOD), 100)
    with pytest.raises(DatasetError) as raised:
        token_check.check_batch(batch, 100)
    assert str(raised.value).startswith(f"a batch holds token id {bad}, outside the model's vocabulary of 100 ids "
                                        f"(0..99): the data changed after its token ids were checked")
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_token_scan_in_chunks_finds_the_extremes(tmp_path, dtype):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 30000, size=10_001).astype(dtype)
    tokens[7777] = 31000
    if dtype == np.int32:
        tokens[3] = -5
    with IndexedDatasetWriter(str(tmp_path / "ds"), dtype) as writer:
        writer.add_document(tokens)
    low, high = token_check.scan_token_range(IndexedDataset(str(tmp_path / "ds")), chunk_bytes=1000)
    assert high == 31000 and low == (-5 if dtype == np.int32 else None)
    with pytest.raises(DatasetError, match="holds token id -5, a negative id"):
        token_check.check_range("x.bin", -5, 10, 50000)


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


@pytest.mark.parametrize("weight", ["nan", "inf", "NaN", "-inf"])
def test_a_blend_weight_that_is_not_finite_is_one_line(tmp_path, capsys, weight):
    for name in ("a", "b"):
        _make(str(tmp_path / name), 10)
    input_dir = f"{weight} {tmp_path}/a 1 {tmp_path}/b"
    message = (f"input_dir '{input_dir}': weight '{weight}' is not a finite number; give finite non-negative "
               f"weights, e.g. '0.3 prefix1 0.7 prefix2'")
    with pytest.raises(DatasetError) as err:
        parse_input_dir(input_dir)
    assert str(err.value) == message
    with pytest.raises(DatasetError, match=re.escape(message)):
        build_datasets(input_dir, "1,0,0", (50, 0, 0), 8, 1, EOD, str(tmp_path / "cache"))
    if not weight.startswith("-"):  # argparse takes '-inf' for a flag: its own one-line error
        import pretrain_gpt

        assert pretrain_gpt.main(["--data-path", *input_dir.split(), "--device", "cpu"]) == 2
        assert capsys.readouterr().err == f"pretrain_gpt.py: error: {message}.\n"


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


def test_a_split_with_a_share_but_no_sequences_is_said(tmp_path, monkeypatch):
    _make(str(tmp_path / "ds"), 30)
    lines = _log_lines(monkeypatch)
    train, valid, test = build_datasets(str(tmp_path / "ds"), "949,50,1", (20, 8, 8), 8, 1, EOD, str(tmp_path / "c"))
    assert train is not None and valid is not None and test is None  # test: round(0.999 x 30) = round(1.0 x 30)
    assert lines == [f"split '949,50,1' gives the test split of {tmp_path}/ds none of its 30 sequences; it is left "
                     f"out of test"]
    lines.clear()
    build_datasets(str(tmp_path / "ds"), "90,10,0", (20, 8, 8), 8, 1, EOD, str(tmp_path / "c"))
    assert lines == []  # no share asked, nothing to say


def test_a_blend_member_without_sequences_in_a_split_leaves_its_share_to_the_others(tmp_path):
    """The member left out is re-weighted away: the blend still holds every sample asked (evaluation must
    not silently run fewer batches), drawn from the members that have the split."""
    _make(str(tmp_path / "big"), 3000, seed=1)  # test: documents [2997, 3000)
    _make(str(tmp_path / "small"), 30, seed=2, doc_offset=500)  # 949,50,1 of 30: no test sequences
    blend = f"0.7 {tmp_path}/big 0.3 {tmp_path}/small"
    _, _, test = build_datasets(blend, "949,50,1", (20, 8, 8), 8, 1, EOD, str(tmp_path / "c"))
    assert len(test) == 8
    assert [len(m) >= 8 for m in test.datasets] == [True] and test.weights == [1.0]
    assert all(np.array_equal(test[i], test.datasets[0][i]) for i in range(8))


def _rewrite_one_token(prefix: str, keep_mtime: bool) -> None:
    before = os.stat(prefix + ".bin")
    tokens = np.fromfile(prefix + ".bin", np.int32)
    tokens[0] += 1
    with open(prefix + ".bin", "r+b") as f:  # in place: the same size, the same inode, the same .idx
        f.write(tokens.tobytes())
    if keep_mtime:
        os.utime(prefix + ".bin", ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.mark.parametrize("keep_mtime", [False, True], ids=["rewritten", "rewritten-keeping-mtime"])
def test_a_bin_changed_under_the_run_is_detected(tmp_path, keep_mtime):
    """A .bin rewritten while the run trains (even with its size and mtime kept): ``verify_unchanged`` (every
    rank, before a checkpoint) raises a one-line DatasetError naming it, and so does a data-loader worker that
    re-opens the files (unpickling); the run's data fingerprint no longer matches a resume's."""
    import pickle

    from megatron.data import fingerprint

    prefix, cache = str(tmp_path / "ds"), str(tmp_path / "cache")
    _make(prefix, 30)
    datasets = build_datasets(prefix, "1,0,0", (50, 0, 0), 8, 1, EOD, cache, vocab_size=40000)
    recorded = fingerprint.of_datasets(datasets)
    fingerprint.verify_unchanged(datasets)  # nothing changed: no error
    worker_copy = pickle.dumps(datasets[0].indexed)
    pickle.loads(worker_copy)
    _rewrite_one_token(prefix, keep_mtime)
    with pytest.raises(DatasetError) as err:
        fingerprint.verify_unchanged(datasets)
    assert str(err.value).startswith(f"{prefix}.bin (or its .idx) changed since the run opened it")
    if not keep_mtime:
        with pytest.raises(DatasetError, match="changed since the run opened it"):
            pickle.loads(worker_copy)
    resumed = build_datasets(prefix, "1,0,0", (50, 0, 0), 8, 1, EOD, cache, vocab_size=40000)
    # a resume sees other data: the full hash (rescanned: a new mtime) or the sampled blocks (its first changed)
    assert fingerprint.compare(recorded, fingerprint.of_datasets(resumed)).startswith("the data differs")


def test_the_data_fingerprint_follows_the_content_not_the_path(tmp_path):
    from megatron.data import fingerprint

    prefix, cache = str(tmp_path / "ds"), str(tmp_path / "cache")
    _make(prefix, 30)
    recorded = fingerprint.of_datasets(build_datasets(prefix, "1,0,0", (50, 0, 0), 8, 1, EOD, cache, vocab_size=40000))
    copy = str(tmp_path / "node copy" / "ds")
    os.makedirs(os.path.dirname(copy))
    for suffix in (".bin", ".idx"):
        shutil.copyfile(prefix + suffix, copy + suffix)
    again = fingerprint.of_datasets(build_datasets(copy, "1,0,0", (50, 0, 0), 8, 1, EOD, cache, vocab_size=40000))
    assert fingerprint.compare(recorded, again) is None and again["datasets"][0]["bin_crc32"]
    _make(str(tmp_path / "other"), 30, seed=3)
    other = fingerprint.of_datasets(build_datasets(str(tmp_path / "other"), "1,0,0", (50, 0, 0), 8, 1, EOD, cache,
                                                   vocab_size=40000))
    message = fingerprint.compare(recorded, other)
    assert message.startswith(f"the data differs from the checkpoint's run: {prefix} as it was then, ")


def test_paths_with_spaces_work_for_data_cache_save_and_load(tmp_path):
    """--data-path with a space in a weighted prefix (one argument each), --data-cache-path, --save and --load
    with spaces: the run trains, caches, saves and resumes. (Before, '0.5 /a b/ds 0.5 ...' was cut at the
    space: 'weights and prefixes must alternate' or 'no dataset at /a'.) In the weighted form the words between
    two weights are one prefix; unweighted, the runs of words that name existing data; quotes work too; a
    blend given as one argument still is a blend."""
    from tests.functional.launch import TINY, run_here

    root = tmp_path / "my data"
    (root / "part one").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix in (root / "part one" / "ds", root / "two"):  # token ids within TINY's vocabulary of 256
        with IndexedDatasetWriter(str(prefix), np.int32) as writer:
            for _ in range(20):
                writer.add_document(rng.integers(1, 256, size=20))
    cache, out = tmp_path / "index cache", tmp_path / "run output"
    model = [a for a in TINY if a != "--mock-data"]
    data = ["--data-path", "0.5", str(root / "part one" / "ds"), "0.5", str(root / "two"), "--tokenizer-type",
            "NullTokenizer", "--data-cache-path", str(cache), "--eval-iters", "0"]
    first = run_here(*model, *data, "--max-steps", "1", "--save", str(out))
    assert first.returncode == 0, first.stderr[-2000:]
    assert any(f.endswith("_shuffle_idx.npy") for f in os.listdir(cache)) and (out / "latest").exists()
    again = run_here(*model, *data, "--max-steps", "2", "--save", str(out), "--load", str(out))
    assert again.returncode == 0, again.stderr[-2000:]
    assert (out / "latest").read_text().strip().endswith("2") and "resuming at step 1" in again.stderr
    assert parse_input_dir(f"  {root / 'part one' / 'ds'}  ") == ([str(root / "part one" / "ds")], None)
    one, two = str(root / "part one" / "ds"), str(root / "two")
    assert parse_input_dir(f"0.3 '{one}' 0.7 \"{two}\"") == ([one, two], [0.3, 0.7])  # quoted (YAML)
    assert parse_input_dir(f"0.3 {one} 0.7 {two}") == ([one, two], [0.3, 0.7])  # a whole blend in one argument
    assert parse_input_dir(f"{one} {two}") == ([one, two], None)  # unweighted: runs of words that name data
    with pytest.raises(DatasetError, match=re.escape(f"input_dir '1 {two} x' must alternate weights and prefixes")):
        parse_input_dir(f"1 {two} x")
