"""The mmap indexed dataset: Megatron-LM's byte format, round trips, refusals, merging."""

from __future__ import annotations

import importlib.util
import os
import pickle
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from megatron.data.indexed_dataset import (
    DTYPES,
    MAGIC,
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    best_dtype,
)

ROOT = Path(__file__).resolve().parents[2]


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _random_docs(dtype, rng, count=7):
    info = np.iinfo(dtype) if np.issubdtype(dtype, np.integer) else None
    docs = []
    for n in rng.integers(0, 20, size=count):
        if info is not None:
            docs.append(rng.integers(info.min, info.max, size=n, endpoint=True, dtype=dtype))
        else:
            docs.append(rng.standard_normal(n).astype(dtype))
    return docs


@pytest.mark.parametrize("code", sorted(DTYPES))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = DTYPES[code]
    docs = _random_docs(dtype, np.random.default_rng(code))
    prefix = str(tmp_path / "ds")
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in docs:
            writer.add_document(doc)
    ds = IndexedDataset(prefix)
    assert len(ds) == ds.num_documents == len(docs)
    assert ds.dtype == np.dtype(dtype)
    for got, want in zip(ds, docs):
        np.testing.assert_array_equal(got, want)
    assert list(ds.document_indices) == list(range(len(docs) + 1))
    assert ds.num_tokens == sum(len(d) for d in docs)
    with open(tmp_path / "ds.idx", "rb") as f:
        assert f.read(9) == MAGIC and struct.unpack("<QB", f.read(9)) == (1, code)
    again = pickle.loads(pickle.dumps(ds))  # what DataLoader workers receive
    np.testing.assert_array_equal(again[len(docs) - 1], docs[-1])


def _write_by_hand(prefix: Path, docs: list[list[int]], code=8, dtype="<u2", version=1, magic=MAGIC,
                   doc_idx=None) -> None:
    """An index written byte by byte from the format's description, not with the writer."""
    lengths = [len(d) for d in docs]
    itemsize = np.dtype(dtype).itemsize
    pointers = [sum(lengths[:i]) * itemsize for i in range(len(docs))]
    doc_idx = list(range(len(docs) + 1)) if doc_idx is None else doc_idx
    header = magic + struct.pack("<Q", version) + struct.pack("<B", code)
    header += struct.pack("<Q", len(docs)) + struct.pack("<Q", len(doc_idx))
    body = b"".join(struct.pack("<i", n) for n in lengths) + b"".join(struct.pack("<q", p) for p in pointers)
    body += b"".join(struct.pack("<q", i) for i in doc_idx)
    prefix.with_suffix(".idx").write_bytes(header + body)
    prefix.with_suffix(".bin").write_bytes(b"".join(np.asarray(d, dtype=dtype).tobytes() for d in docs))


def test_hand_built_index_reads_and_writer_is_byte_identical(tmp_path):
    docs = [[5, 6, 7], [], [65535, 0], [1]]
    _write_by_hand(tmp_path / "hand", docs)
    ds = IndexedDataset(str(tmp_path / "hand"))
    assert [d.tolist() for d in ds] == docs
    assert ds.get(0, 1, 2).tolist() == [6, 7]
    with IndexedDatasetWriter(str(tmp_path / "ours"), np.uint16) as writer:
        for doc in docs:
            writer.add_document(doc)
    for suffix in (".idx", ".bin"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"hand{suffix}").read_bytes()


def test_documents_of_several_sequences(tmp_path):
    """Megatron's sentence-split data has documents of several sequences; the index keeps them."""
    _write_by_hand(tmp_path / "multi", [[1, 2], [3], [4, 5, 6]], doc_idx=[0, 2, 3])
    ds = IndexedDataset(str(tmp_path / "multi"))
    assert len(ds) == 3 and ds.num_documents == 2
    assert ds.document_indices.tolist() == [0, 2, 3]
    with IndexedDatasetWriter(str(tmp_path / "ours"), np.uint16) as writer:  # Megatron's add_item + end_document
        writer.add_item([1, 2])
        writer.add_item([3])
        writer.end_document()
        writer.add_item([4, 5, 6])  # finalize closes the open document
        assert writer.num_tokens == 6
    for suffix in (".idx", ".bin"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"multi{suffix}").read_bytes()


def test_content_key_follows_the_bytes_not_the_path_or_mtime(tmp_path):
    _write_by_hand(tmp_path / "a", [[1, 2], [3]])
    (tmp_path / "copy").mkdir()
    for suffix in (".idx", ".bin"):
        shutil.copyfile(tmp_path / f"a{suffix}", tmp_path / "copy" / f"b{suffix}")
    os.utime(tmp_path / "copy" / "b.idx", (5, 5))
    key = IndexedDataset(str(tmp_path / "a")).content_key()
    assert key == IndexedDataset(str(tmp_path / "copy" / "b")).content_key()
    assert key["idx_size"] == os.path.getsize(tmp_path / "a.idx") and key["bin_size"] == 6
    _write_by_hand(tmp_path / "a", [[1, 2], [4]])  # same sizes, other tokens: the .bin is not hashed
    assert IndexedDataset(str(tmp_path / "a")).content_key() == key
    _write_by_hand(tmp_path / "a", [[1], [2, 3]])  # other lengths: another .idx
    assert IndexedDataset(str(tmp_path / "a")).content_key() != key


@pytest.mark.parametrize("fault, words", [
    ("magic", "magic"),
    ("version", "version 2"),
    ("dtype", "dtype code 9"),
    ("bin_size", "does not match"),
    ("truncated_arrays", "truncated"),
    ("truncated_header", "truncated"),
    ("doc_idx", "document indices"),
    ("missing_bin", "does not exist"),
    ("pointers", "offsets"),
])
def test_malformed_files_are_refused_naming_file_and_fault(tmp_path, fault, words):
    prefix = tmp_path / "bad"
    docs = [[1, 2, 3], [4, 5]]
    if fault == "magic":
        _write_by_hand(prefix, docs, magic=b"TNTIDX\x00\x00\x00")
    elif fault == "version":
        _write_by_hand(prefix, docs, version=2)
    elif fault == "dtype":
        _write_by_hand(prefix, docs, code=9)
    elif fault == "doc_idx":
        _write_by_hand(prefix, docs, doc_idx=[0, 1, 1])
    else:
        _write_by_hand(prefix, docs)
    idx, bin_ = prefix.with_suffix(".idx"), prefix.with_suffix(".bin")
    if fault == "bin_size":
        bin_.write_bytes(bin_.read_bytes()[:-2])
    elif fault == "truncated_arrays":
        idx.write_bytes(idx.read_bytes()[:-8])
    elif fault == "truncated_header":
        idx.write_bytes(idx.read_bytes()[:20])
    elif fault == "missing_bin":
        bin_.unlink()
    elif fault == "pointers":
        data = bytearray(idx.read_bytes())
        data[34 + 8 + 8:34 + 8 + 16] = struct.pack("<q", 2)  # second pointer 2 instead of 6
        idx.write_bytes(bytes(data))
    with pytest.raises(IndexedDatasetError) as err:
        IndexedDataset(str(prefix))
    message = str(err.value)
    assert words in message
    assert "bad.idx" in message or "bad.bin" in message


def test_interrupted_write_leaves_nothing_and_keeps_previous_pair(tmp_path):
    prefix = str(tmp_path / "ds")
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_document([1, 2, 3])
    before = {p: (tmp_path / p).read_bytes() for p in ("ds.bin", "ds.idx")}
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(prefix, np.uint16) as writer:
            writer.add_document([9, 9])
            raise RuntimeError("killed")
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]
    assert {p: (tmp_path / p).read_bytes() for p in before} == before


def test_best_dtype():
    assert best_dtype(50304) is np.uint16
    assert best_dtype(65499) is np.uint16
    assert best_dtype(128256) is np.int32


def test_merge_datasets(tmp_path):
    merge = _load_tool("merge_datasets")
    parts = [[[1, 2], [3]], [[4, 5, 6]], [[], [7]]]
    prefixes = []
    for i, docs in enumerate(parts):
        prefix = str(tmp_path / f"part{i}")
        with IndexedDatasetWriter(prefix, np.int32) as writer:
            for doc in docs:
                writer.add_document(doc)
        prefixes.append(prefix)
    out = str(tmp_path / "merged" / "all")
    assert merge.main(["--input", *prefixes, "--output-prefix", out]) == 0
    merged = IndexedDataset(out)
    assert [d.tolist() for d in merged] == [d for docs in parts for d in docs]
    assert merged.document_indices.tolist() == list(range(6))
    assert merge.main(["--input", str(tmp_path / "nope"), "--output-prefix", out + "2"]) == 2
