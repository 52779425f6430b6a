"""The GPT dataset over an indexed dataset, with Megatron Core's semantics.

Megatron Core's GPT dataset treats every *sequence* of the indexed dataset as a document: the
``.idx`` document boundaries (several sequences per document with Megatron-LM's
``--split-sentences``) play no part. For one split (a contiguous range of sequences) and a
requested number of samples:

1. **document index** (int32): the split's sequence ids repeated for as many epochs as the samples
   need, shuffled with ``RandomState(seed)``. When the last epoch is needed only for a small part
   (fewer than ``int(0.8 * samples_per_epoch)`` samples), it is shuffled separately, so that the
   samples drawn from it are not biased towards the sequences of the other epochs.
2. **sample index** (``[num_samples + 1, 2]``, int32, built by the C++ helper): row ``i`` is the
   (position in the document index, token offset) where sample ``i`` starts; a sample is
   ``seq_length + 1`` tokens that may span sequences, and consecutive samples share one token.
3. **shuffle index** (uint32): a permutation of the samples (the separate last epoch again shuffled
   on its own), drawn from the same RandomState after the document index.

The three indices are cached as .npy files under a name that hashes everything they depend on
(``IndexSpec``: the dataset's content, not its path), built and loaded as ``index_cache`` says. Given a
``report`` (the builders in ``blended_dataset`` give ``summary.info``), a ``GPTDataset`` says so: the rank
that builds an entry, before and after (with the time and the files; a build past ``PROGRESS_AFTER_S`` also
after each of its three steps), and global rank 0 when it loads an entry another run built.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from megatron.config import syntax
from megatron.data import index_cache, summary
from megatron.data.helpers import build_sample_idx
from megatron.data.indexed_dataset import DatasetError, IndexedDataset

ARRAYS = ("doc_idx", "sample_idx", "shuffle_idx")
PROGRESS_AFTER_S = 10.0  # a build running longer than this says when each of its steps is done


def parse_split(split: str) -> list[float]:
    """'949,50,1' (or '949/50/1') -> three fractions summing to 1: ``megatron.config.syntax.parse_split``
    (the configuration layer owns the syntax), its error a DatasetError."""
    try:
        return syntax.parse_split(split)
    except ValueError as err:
        raise DatasetError(str(err)) from None


def split_ranges(split: str, num_sequences: int) -> list[tuple[int, int]]:
    """Contiguous [begin, end) sequence ranges of the train, valid and test splits, by Megatron Core's rule.

    With ``b`` the cumulative sums of the normalized fractions (``0, f0, f0 + f1, f0 + f1 + f2``),
    split ``i`` is ``[round(b[i] * N), round(b[i + 1] * N))`` with Python's ``round`` (half to even),
    each bookend rounded on its own. (Megatron's legacy rule rounded each split's size and moved
    the excess; e.g. ``90,5,5`` on 250 gives (0, 225), (225, 238), (238, 250) here, (0, 226),
    (226, 238), (238, 250) there.)
    """
    bounds = [0.0]
    for fraction in parse_split(split):
        bounds.append(bounds[-1] + fraction)
    ends = [int(round(b * float(num_sequences))) for b in bounds]
    return [(ends[i], ends[i + 1]) for i in range(3)]


@dataclass(frozen=True)
class IndexSpec:
    """Everything the cached indices depend on; its hash names the cache files. The dataset enters by
    its content (``IndexedDataset.content_key``), so a copy of it at another path has the same spec."""

    idx_size: int
    idx_blake2b: str
    bin_size: int
    split: str
    first_sequence: int
    last_sequence: int
    num_samples: int
    seq_length: int
    seed: int
    format: int = index_cache.CACHE_FORMAT

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:24]


def _num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """The fewest epochs holding ``num_samples * seq_length + 1`` tokens (Core's ``_get_num_epochs``)."""
    epochs, needed = 1, num_samples * seq_length + 1
    while epochs * tokens_per_epoch < needed:
        epochs += 1
    return epochs


def build_indices(sizes: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int, seed: int,
                  progress: Callable[[str], None] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document index, sample index, shuffle index) for ``num_samples`` samples of the sequences
    ``documents`` (ids into ``sizes``), as Megatron Core's ``_build_document_sample_shuffle_indices``.
    ``progress(what)`` is called after each of the three (``what`` says which is done)."""
    progress = progress or (lambda what: None)
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    if tokens_per_epoch < 2:
        raise DatasetError(f"the split's {len(documents)} sequences hold {tokens_per_epoch} tokens but a sample "
                           f"needs at least 2; give the split a larger share or add data.")
    epochs = _num_epochs(tokens_per_epoch, seq_length, num_samples)
    samples_before_last = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    separate_last = epochs > 1 and (num_samples - samples_before_last) < int(0.8 * samples_per_epoch)
    rng = np.random.RandomState(seed)
    doc_idx = _document_index(documents, epochs, rng, separate_last)
    progress(f"document index of {len(doc_idx):,} entries shuffled")
    sample_idx = build_sample_idx(sizes.astype(np.int32, copy=False), doc_idx, seq_length, epochs, tokens_per_epoch)
    total = sample_idx.shape[0] - 1
    progress(f"sample index of {total:,} samples built")
    shuffle_idx = _shuffle_index(samples_before_last if separate_last else total, total, rng)
    progress(f"shuffle index of {len(shuffle_idx):,} samples shuffled")
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


def index_files(spec: IndexSpec, cache_dir: str) -> str:
    """The cache files of ``spec``'s indices, as a pattern: ``{cache_dir}/{key}-{split}_*.npy``."""
    return os.path.join(cache_dir, f"{spec.key()}-{spec.split}") + "_*.npy"


def load_or_build_indices(spec: IndexSpec, sizes: np.ndarray, cache_dir: str,
                          report: Callable[[str], None] | None = None, name: str = "",
                          noun: str = "document") -> tuple[np.ndarray, ...]:
    """The cached indices of ``spec`` in ``cache_dir``, memory-mapped; built where missing (see index_cache).
    With ``report``, the building rank says when it starts and ends, and global rank 0 that it loaded the
    entry from the cache (if it did not build it); ``name`` (the dataset) and ``noun`` are for those lines."""
    base = os.path.join(cache_dir, f"{spec.key()}-{spec.split}")
    files = index_files(spec, cache_dir)
    of = f" of {name}" if name else ""
    built = []

    def build() -> None:
        sequences = np.arange(spec.first_sequence, spec.last_sequence, dtype=np.int64)
        progress = None
        if report is not None:
            where = summary.on_this_rank()
            what = summary.many(len(sequences), noun)
            tokens = int(sizes[spec.first_sequence:spec.last_sequence].sum(dtype=np.int64))
            if tokens >= 2:  # else build_indices says what is wrong
                what += ", " + summary.many(_num_epochs(tokens, spec.seq_length, spec.num_samples), "epoch")
            report(f"{summary.PREFIX} building the sample index of split {spec.split}{of} ({what}){where}...")
            start = time.perf_counter()

            def progress(what: str) -> None:
                elapsed = time.perf_counter() - start
                if elapsed > PROGRESS_AFTER_S:
                    report(f"{summary.PREFIX}   split {spec.split}{of}: {what} ({summary.seconds(elapsed)} so far)")

        arrays = build_indices(sizes, sequences, spec.num_samples, spec.seq_length, spec.seed, progress)
        index_cache.save_arrays(base, dict(zip(ARRAYS, arrays)), asdict(spec))
        built.append(True)
        if report is not None:
            epochs = summary.many(len(arrays[0]) // max(len(sequences), 1), "epoch")
            report(f"{summary.PREFIX} built the sample index of split {spec.split} in "
                   f"{summary.seconds(time.perf_counter() - start)} ({summary.many(len(arrays[2]), 'sample')} over "
                   f"{epochs}), cached in {files}{where}")

    arrays = index_cache.load_or_build(f"the {spec.split} indices in {cache_dir}",
                                       lambda: index_cache.load_arrays(base, ARRAYS, asdict(spec)), build)
    if report is not None and not built and summary.is_rank0():
        epochs = summary.many(len(arrays["doc_idx"]) // max(spec.last_sequence - spec.first_sequence, 1), "epoch")
        report(f"{summary.PREFIX} sample index of split {spec.split}{of} loaded from the cache {files} "
               f"({summary.many(len(arrays['shuffle_idx']), 'sample')} over {epochs})")
    return tuple(arrays[array] for array in ARRAYS)


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens from the sequences ``sequence_range`` of an indexed dataset.

    ``len(ds)`` is at least the requested ``num_samples`` (whole epochs of the sample index
    are kept); ``ds[i]`` is an int64 array. ``report`` (a logging function): say when the indices are built
    or loaded (``load_or_build_indices``).
    """

    def __init__(self, indexed: IndexedDataset, split: str, sequence_range: tuple[int, int], num_samples: int,
                 seq_length: int, seed: int, cache_dir: str, eod_id: int,
                 report: Callable[[str], None] | None = None):
        self.indexed, self.split, self.seq_length, self.eod_id = indexed, split, seq_length, eod_id
        self.num_samples = num_samples
        first, last = sequence_range
        self.sequence_range, self.num_sequences = (first, last), last - first
        spec = IndexSpec(**indexed.content_key(), split=split, first_sequence=first, last_sequence=last,
                         num_samples=num_samples, seq_length=seq_length, seed=seed)
        self.doc_idx, self.sample_idx, self.shuffle_idx = load_or_build_indices(
            spec, indexed.sequence_lengths, cache_dir, report, indexed.prefix, summary.noun([indexed]))
        self.tokens_per_epoch = int(indexed.sequence_lengths[first:last].sum(dtype=np.int64))
        self.samples_per_epoch = max((self.tokens_per_epoch - 1) // seq_length, 0)

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
