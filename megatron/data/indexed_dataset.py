"""Megatron-LM's mmap indexed dataset: a ``.bin``/``.idx`` pair, bit for bit.

``.bin``: the token arrays of every sequence, concatenated, little-endian, no header.
``.idx`` (little-endian, no padding)::

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    u64       version (1)
    u8        dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
    u64       sequence count S
    u64       document count + 1 (D)
    int32[S]  sequence lengths (tokens)
    int64[S]  byte offsets of each sequence in .bin
    int64[D]  document indices: the first sequence of each document, starting 0 and ending S

A document is one or more sequences (``tools/preprocess_data.py`` writes one sequence per
document; Megatron-LM's ``--split-sentences`` writes one per sentence). The GPT dataset, as
Megatron Core's, ignores the document boundaries: it splits and samples by sequence. The reader
memory-maps both files and returns zero-copy views; the writer streams tokens to disk and keeps
only the lengths in memory (4 bytes per sequence), writing under temporary names that are
renamed once complete.
"""

from __future__ import annotations

import hashlib
import os
import struct
from array import array
from collections.abc import Iterable

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                           7: np.float32, 8: np.uint16}
CODES: dict[type, int] = {v: k for k, v in DTYPES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # 34 bytes


class DatasetError(ValueError):
    """Data that cannot serve the run; the message says what is wrong and what to do."""


class IndexedDatasetError(DatasetError):
    """A malformed or missing .bin/.idx pair; the message names the file and the fault."""


def data_file(prefix: str) -> str:
    return prefix + ".bin"


def index_file(prefix: str) -> str:
    return prefix + ".idx"


def exists(prefix: str) -> bool:
    return os.path.isfile(data_file(prefix)) and os.path.isfile(index_file(prefix))


def file_identity(prefix: str) -> dict:
    """The ``.bin`` and ``.idx``'s [size, mtime in ns, inode]: what any rewrite or replacement changes."""
    out = {}
    for kind, path in (("bin", data_file(prefix)), ("idx", index_file(prefix))):
        st = os.stat(path)
        out[kind] = [st.st_size, st.st_mtime_ns, st.st_ino]
    return out


def best_dtype(vocab_size: int) -> type:
    """uint16 when every token id fits, else int32 (Megatron-LM's rule)."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


class IndexedDataset:
    """Read-only view of ``prefix.bin`` / ``prefix.idx``; ``ds[i]`` is sequence ``i``.

    Picklable: the memory maps are reopened lazily in each process (DataLoader workers).
    """

    def __init__(self, prefix: str, check_offsets: bool = True):
        self.prefix = prefix
        self._read_index(check_offsets)
        self._bin = None
        self._content_key: dict | None = None

    def _read_index(self, check_offsets: bool) -> None:
        path, bin_path = index_file(self.prefix), data_file(self.prefix)
        for p in (path, bin_path):
            if not os.path.isfile(p):
                raise IndexedDatasetError(f"{p} does not exist; give the path prefix without .bin/.idx.")
        idx_size = os.path.getsize(path)
        if idx_size < _HEADER.size:
            raise IndexedDatasetError(f"{path} is truncated: {idx_size} bytes, shorter than the {_HEADER.size}-byte "
                                      f"header.")
        with open(path, "rb") as f:
            magic, version, code, count, doc_count = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC:
            raise IndexedDatasetError(f"{path} is not a Megatron mmap index: magic {magic!r}, expected {MAGIC!r}.")
        if version != VERSION:
            raise IndexedDatasetError(f"{path} has index version {version}; only version {VERSION} is supported.")
        if code not in DTYPES:
            raise IndexedDatasetError(f"{path} has unknown dtype code {code}; valid codes are 1..8.")
        expected = _HEADER.size + 4 * count + 8 * count + 8 * doc_count
        if idx_size != expected:
            raise IndexedDatasetError(f"{path} is {idx_size} bytes but its header (S={count}, D={doc_count}) needs "
                                      f"{expected}: the file is truncated or corrupt.")
        self.dtype = np.dtype(DTYPES[code])
        idx = np.memmap(path, mode="r", dtype=np.uint8)
        offset = _HEADER.size
        self.sequence_lengths = np.frombuffer(idx, np.int32, count, offset)
        self.sequence_pointers = np.frombuffer(idx, np.int64, count, offset + 4 * count)
        self.document_indices = np.frombuffer(idx, np.int64, doc_count, offset + 12 * count)
        self._check(path, bin_path, check_offsets)

    def _check(self, path: str, bin_path: str, check_offsets: bool) -> None:
        docs, lengths, pointers = self.document_indices, self.sequence_lengths, self.sequence_pointers
        if len(docs) < 1 or docs[0] != 0 or docs[-1] != len(lengths):
            raise IndexedDatasetError(f"{path}: document indices must start at 0 and end at the sequence count "
                                      f"{len(lengths)}.")
        if len(lengths) and lengths.min() < 0:
            raise IndexedDatasetError(f"{path}: negative sequence length.")
        total = int(lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        bin_size = os.path.getsize(bin_path)
        if bin_size != total:
            raise IndexedDatasetError(f"{bin_path} is {bin_size} bytes but {path} describes {total}: the pair does "
                                      f"not match (truncated or from another dataset).")
        if check_offsets and len(lengths):
            starts = np.zeros(len(lengths), np.int64)
            np.cumsum(lengths[:-1], out=starts[1:])
            if not np.array_equal(starts * self.dtype.itemsize, pointers):
                raise IndexedDatasetError(f"{path}: byte offsets do not match the sequence lengths.")

    def __getstate__(self) -> dict:
        state = {"prefix": self.prefix}
        for name in ("identity", "fingerprint"):  # set by megatron.data.fingerprint when the run opened the files
            if hasattr(self, name):
                state[name] = getattr(self, name)
        return state

    def __setstate__(self, state: dict) -> None:
        """Re-open in another process (a data-loader worker): files changed since the run opened them (another
        size, mtime or inode) are a DatasetError, never read as the same data."""
        self.__init__(state["prefix"], check_offsets=False)
        if "identity" in state:
            if file_identity(self.prefix) != state["identity"]:
                raise DatasetError(f"{data_file(self.prefix)} (or its .idx) changed since the run opened it: a dataset "
                                   f"must not be rewritten under a running job; restore it, or start a new run on the "
                                   f"new data")
            self.identity, self.fingerprint = state["identity"], state.get("fingerprint")

    @property
    def bin(self) -> np.ndarray:
        if self._bin is None:
            self._bin = np.memmap(data_file(self.prefix), mode="r", dtype=self.dtype) \
                if os.path.getsize(data_file(self.prefix)) else np.zeros(0, self.dtype)
        return self._bin

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def content_key(self) -> dict:
        """What identifies the pair's content wherever it is copied: the .idx size and the BLAKE2b hash of
        its bytes, and the .bin size (not the path, not the mtime). Hashed once per instance."""
        if self._content_key is None:
            path = index_file(self.prefix)
            digest = hashlib.blake2b(digest_size=16)
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
            self._content_key = {"idx_size": os.path.getsize(path), "idx_blake2b": digest.hexdigest(),
                                 "bin_size": os.path.getsize(data_file(self.prefix))}
        return dict(self._content_key)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``index`` (a view into the mmap)."""
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        if length is None:
            length = int(self.sequence_lengths[index]) - offset
        return self.bin[start:start + length]

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)


class IndexedDatasetWriter:
    """Streams documents into ``prefix.bin``/``prefix.idx``.

    Files are written as ``prefix.bin.tmp``/``prefix.idx.tmp`` and renamed by ``finalize()``
    (the .idx last), so an interrupted run never leaves a pair that looks complete.
    Use as a context manager: on an exception the temporary files are removed.
    """

    def __init__(self, prefix: str, dtype: type = np.uint16):
        if np.dtype(dtype).type not in CODES:
            raise ValueError(f"unsupported token dtype {dtype}")
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin = open(data_file(prefix) + ".tmp", "wb")
        self._lengths = array("i")  # int32, as the format stores them
        self._doc_starts = array("q", [0])
        self._num_tokens = 0
        self._closed = False

    def add_item(self, tokens: Iterable[int] | np.ndarray) -> None:
        """Append one sequence to the current document (Megatron-LM's ``add_item``); ``end_document`` closes it."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self._lengths.append(len(arr))
        self._num_tokens += len(arr)

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last one form a document."""
        self._doc_starts.append(len(self._lengths))

    def add_document(self, tokens: Iterable[int] | np.ndarray) -> None:
        """Append one document of one sequence of token ids."""
        self.add_item(tokens)
        self.end_document()

    def add_index(self, prefix: str, chunk_bytes: int = 1 << 26) -> None:
        """Append every document of an existing dataset (same dtype), copying its .bin in chunks."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(f"{index_file(prefix)} holds {other.dtype} tokens but this dataset holds "
                                      f"{self.dtype}; merge datasets of one dtype.")
        if self._doc_starts[-1] != len(self._lengths):
            self.end_document()
        base = len(self._lengths)
        self._lengths.extend(other.sequence_lengths.tolist())
        self._num_tokens += other.num_tokens
        self._doc_starts.extend((other.document_indices[1:] + base).tolist())
        with open(data_file(prefix), "rb") as f:
            while chunk := f.read(chunk_bytes):
                self._bin.write(chunk)

    @property
    def num_documents(self) -> int:
        return len(self._doc_starts) - 1

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def finalize(self) -> None:
        """Close an open document, write the .idx and rename both files into place."""
        if self._doc_starts[-1] != len(self._lengths):
            self.end_document()
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if len(self._lengths) else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), np.int64)
        if len(lengths):
            np.cumsum(lengths[:-1].astype(np.int64), out=pointers[1:])
        pointers *= self.dtype.itemsize
        tmp_idx = index_file(self.prefix) + ".tmp"
        with open(tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, CODES[self.dtype.type], len(lengths), len(self._doc_starts)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(np.frombuffer(self._doc_starts, dtype=np.int64).astype("<i8").tobytes())
        # Remove a previous .idx first: an interruption between the renames then leaves no pair.
        if os.path.exists(index_file(self.prefix)):
            os.remove(index_file(self.prefix))
        os.replace(data_file(self.prefix) + ".tmp", data_file(self.prefix))
        os.replace(tmp_idx, index_file(self.prefix))
        self._closed = True

    def abort(self) -> None:
        if not self._bin.closed:
            self._bin.close()
        for path in (data_file(self.prefix) + ".tmp", index_file(self.prefix) + ".tmp"):
            if os.path.exists(path):
                os.remove(path)
        self._closed = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.finalize()
