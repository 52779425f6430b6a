"""The GPT dataset over an indexed dataset, with Megatron-LM's semantics.

For one split (a contiguous range of documents) and a requested number of samples:

1. **document index**: the split's document ids repeated for as many epochs as the samples
   need, shuffled with the seed. When the last epoch is needed only for a small part
   (< 80% of an epoch's samples), it is shuffled separately, so that the samples drawn from
   it are not biased towards the documents of the other epochs.
2. **sample index** (``[num_samples + 1, 2]``, built by the C++ helper): row ``i`` is the
   (position in the document index, token offset) where sample ``i`` starts; a sample is
   ``seq_len + 1`` tokens that may span documents, and consecutive samples share one token.
3. **shuffle index**: a permutation of the samples (the separate last epoch again shuffled
   on its own).

The three indices are cached as .npy files under a name that hashes everything they depend
on, built once (by one rank, the others waiting) and memory-mapped afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass

import numpy as np

from megatron.data.helpers import build_sample_idx
from megatron.data.indexed_dataset import DatasetError, IndexedDataset, index_file

CACHE_FORMAT = 1


def parse_split(split: str) -> list[float]:
    """'949,50,1' (or '949/50/1') -> three fractions summing to 1."""
    parts = [p for p in split.replace("/", ",").split(",") if p.strip()]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise DatasetError(f"split '{split}' must be up to three numbers like '949,50,1'") from None
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise DatasetError(f"split '{split}' must be up to three non-negative numbers with a positive sum")
    weights += [0.0] * (3 - len(weights))
    return [w / sum(weights) for w in weights]


def split_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) document ranges of the train, valid and test splits (Megatron's rounding)."""
    bounds = [0]
    for fraction in parse_split(split):
        bounds.append(bounds[-1] + int(round(fraction * num_documents)))
    excess = bounds[-1] - num_documents
    bounds = [0] + [b - excess for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


@dataclass(frozen=True)
class IndexSpec:
    """Everything the cached indices depend on; its hash names the cache files."""

    prefix: str
    idx_size: int
    idx_mtime_ns: int
    split: str
    first_document: int
    last_document: int
    num_samples: int
    seq_length: int
    seed: int
    format: int = CACHE_FORMAT

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:24]


def _num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    epochs = 1
    while (epochs * tokens_per_epoch - 1) // seq_length < num_samples:
        epochs += 1
    return epochs


def build_indices(sizes: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int,
                  seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document index, sample index, shuffle index) for ``num_samples`` samples."""
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    if tokens_per_epoch < 2:
        raise DatasetError(f"the split's {len(documents)} documents hold {tokens_per_epoch} tokens; a sample needs "
                         f"at least 2")
    epochs = _num_epochs(tokens_per_epoch, seq_length, num_samples)
    samples_before_last = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    separate_last = epochs > 1 and (num_samples - samples_before_last) < int(0.8 * samples_per_epoch)
    rng = np.random.RandomState(seed)
    doc_idx = _document_index(documents, epochs, rng, separate_last)
    sample_idx = build_sample_idx(sizes.astype(np.int32, copy=False), doc_idx, seq_length, epochs, tokens_per_epoch)
    total = sample_idx.shape[0] - 1
    shuffle_idx = _shuffle_index(samples_before_last if separate_last else total, total, rng)
    return doc_idx, sample_idx, shuffle_idx


def _document_index(documents: np.ndarray, epochs: int, rng: np.random.RandomState, separate_last: bool) -> np.ndarray:
    if not separate_last or epochs == 1:
        doc_idx = np.tile(documents.astype(np.int32), epochs)
        rng.shuffle(doc_idx)
        return doc_idx
    first = _document_index(documents, epochs - 1, rng, False)
    last = _document_index(documents, 1, rng, False)
    return np.concatenate([first, last])


def _shuffle_index(num_first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_first, dtype=dtype)
    rng.shuffle(first)
    if num_first == total:
        return first
    last = np.arange(num_first, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _is_builder_rank() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def load_or_build_indices(spec: IndexSpec, sizes: np.ndarray, cache_dir: str) -> tuple[np.ndarray, ...]:
    """The cached indices of ``spec``: built and saved by one rank, memory-mapped by all."""
    base = os.path.join(cache_dir, f"{spec.key()}-{spec.split}")
    paths = [f"{base}_{name}_idx.npy" for name in ("doc", "sample", "shuffle")]
    if _is_builder_rank() and not all(os.path.isfile(p) for p in paths):
        os.makedirs(cache_dir, exist_ok=True)
        documents = np.arange(spec.first_document, spec.last_document, dtype=np.int64)
        arrays = build_indices(sizes, documents, spec.num_samples, spec.seq_length, spec.seed)
        for path, arr in zip(paths, arrays):
            tmp = path + f".tmp{os.getpid()}.npy"
            np.save(tmp, arr)
            os.replace(tmp, path)
        with open(base + "_description.json", "w") as f:
            json.dump(asdict(spec), f, indent=2)
    _barrier()
    return tuple(np.load(p, mmap_mode="r") for p in paths)


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens from one split of an indexed dataset.

    ``len(ds)`` is at least the requested ``num_samples`` (whole epochs of the sample index
    are kept); ``ds[i]`` is an int64 array.
    """

    def __init__(self, indexed: IndexedDataset, split: str, document_range: tuple[int, int], num_samples: int,
                 seq_length: int, seed: int, cache_dir: str, eod_id: int):
        self.indexed, self.split, self.seq_length, self.eod_id = indexed, split, seq_length, eod_id
        stat = os.stat(index_file(indexed.prefix))
        spec = IndexSpec(os.path.abspath(indexed.prefix), stat.st_size, stat.st_mtime_ns, split, document_range[0],
                         document_range[1], num_samples, seq_length, seed)
        self.doc_idx, self.sample_idx, self.shuffle_idx = load_or_build_indices(
            spec, indexed.sequence_lengths, cache_dir)
        tokens_per_epoch = int(indexed.sequence_lengths[document_range[0]:document_range[1]].sum(dtype=np.int64))
        self.samples_per_epoch = max((tokens_per_epoch - 1) // seq_length, 0)

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def __getitem__(self, index: int) -> np.ndarray:
        i = int(self.shuffle_idx[index])
        (doc_first, off_first), (doc_last, off_last) = self.sample_idx[i], self.sample_idx[i + 1]
        doc_first, doc_last, off_first, off_last = int(doc_first), int(doc_last), int(off_first), int(off_last)
        if doc_first == doc_last:
            tokens = self.indexed.get(int(self.doc_idx[doc_first]), off_first, off_last - off_first + 1)
        else:
            parts = [self.indexed.get(int(self.doc_idx[doc_first]), off_first)]
            parts += [self.indexed.get(int(self.doc_idx[j])) for j in range(doc_first + 1, doc_last)]
            parts.append(self.indexed.get(int(self.doc_idx[doc_last]), 0, off_last + 1))
            tokens = np.concatenate(parts)
        return tokens.astype(np.int64)
