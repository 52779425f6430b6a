"""Weighted blending of several datasets, and the train/valid/test builders: over ``input_dir`` cut by
``split``, or over ``train_data_path`` / ``valid_data_path`` / ``test_data_path``, each split its own data.

``input_dir`` is one of: a dataset prefix (``data/corpus_text_document`` for
``data/corpus_text_document.bin/.idx``); a folder (every prefix in it, weighted by its token
count); or Megatron's ``w1 prefix1 w2 prefix2 ...`` (prefixes without weights are weighted by
token count). Each prefix is split into train/valid/test sequence ranges on its own (Megatron
Core's bookend rounding). A single prefix without a weight gives each split's ``GPTDataset``
directly; otherwise, as Megatron Core's builder, with the weights ``w`` normalized and ``n``
samples wanted for a split, member ``d`` is built for ``ceil(ceil(n * w[d]) * 1.005)`` samples and
the blend holds ``sum_d ceil(n * w[d])`` samples interleaved by the C++ ``build_blending_indices``
(greedy: after every sample, each dataset's count stays close to its share, within one sample).

With ``train_epochs`` (``num_train_epochs``) the train split is built for at most that many passes: one
pass is ``(tokens - 1) // seq_length`` samples of one dataset's train split (Megatron's samples per
epoch), or for a blend the sum of its members' (each member's share still follows its weight), and
the train samples are rounded down to whole global batches (``train_samples``).

``build_per_split_datasets`` is Megatron's ``--train-data-path`` / ``--valid-data-path`` /
``--test-data-path`` (Megatron Core's ``blend_per_split``): each path takes ``input_dir``'s syntax, each
split is built from every sequence of its own datasets (no ``split``), the same way, except that a single
prefix is used directly even with a weight (as Core); a split without a path is None.

With ``report=True`` (``pretrain_gpt.py``'s datasets provider), both builders say what they build: the
index cache being built or loaded, and one summary per split on global rank 0 (``megatron.data.summary``).
"""

from __future__ import annotations

import glob
import math
import os

import numpy as np

from megatron.config import syntax
from megatron.data import fingerprint, index_cache, indexed_dataset, summary
from megatron.data.gpt_dataset import GPTDataset, parse_split, split_ranges
from megatron.data.helpers import build_blending_indices
from megatron.data.index_cache import cache_folder, run_agreed
from megatron.data.indexed_dataset import DatasetError, IndexedDataset
from megatron.data.token_check import scanned

SPLIT_NAMES = ("train", "valid", "test")
PER_SPLIT_NAMES = ("train_data_path", "valid_data_path", "test_data_path")
WHOLE = ("1,0,0", "0,1,0", "0,0,1")  # the split that gives split s every sequence (bookends 0 and N)
SURPLUS = 0.005  # Megatron Core's mid_level_dataset_surplus


def normalize(weights: list[float]) -> list[float]:
    """Weights divided by their sum in float64 (Megatron Core's ``normalize``)."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


class BlendedDataset:
    """``ds[i] = datasets[dataset_index[i]][dataset_sample_index[i]]`` for ``size`` samples; ``num_samples``
    is the samples asked of the blend (``size`` is each member's share rounded up: a few more)."""

    def __init__(self, datasets: list, weights: list[float], size: int, num_samples: int | None = None):
        self.datasets, self.weights, self.size = datasets, normalize(weights), size
        self.num_samples = size if num_samples is None else min(num_samples, size)
        self.dataset_index, self.dataset_sample_index = build_blending_indices(
            np.asarray(self.weights, dtype=np.float64), size)
        self.eod_id = datasets[0].eod_id
        self.samples_per_epoch = sum(ds.samples_per_epoch for ds in datasets)  # one pass: every member's once
        for d, ds in enumerate(datasets):
            needed = int(np.count_nonzero(self.dataset_index == d))
            if needed > len(ds):
                raise DatasetError(f"blend member {d} has {len(ds)} samples but the blend draws {needed}; this is a "
                                   f"bug in the member sizes: please report it.")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[index])][int(self.dataset_sample_index[index])]


def parse_input_dir(input_dir: str, name: str = "input_dir") -> tuple[list[str], list[float] | None]:
    """-> (prefixes, weights or None for token-count weighting). The syntax is the configuration layer's
    (``megatron.config.syntax.input_dir_words``); folders are expanded here and every prefix must have its
    .bin and .idx. ``name`` is the setting in the messages (input_dir, train_data_path, ...). Raises
    DatasetError with a hint."""
    whole = input_dir.strip()
    if _names_data(whole):  # one existing path, taken whole: with spaces, quotes or backslashes (a YAML value)
        return _expand(whole, name), None
    try:
        words, weights = syntax.input_dir_words(input_dir, name)
    except ValueError as err:
        raise DatasetError(str(err)) from None
    if weights is None:
        words = _group_paths(words)
    prefixes = words if weights is not None else [prefix for word in words for prefix in _expand(word, name)]
    for prefix in prefixes:
        if not indexed_dataset.exists(prefix):
            if weights is not None and " " in prefix and prefix not in input_dir.replace("'", '"').split('"'):
                raise DatasetError(f"{name} '{input_dir}' must alternate weights and prefixes: 'w1 prefix1 w2 prefix2' "
                                   f"(no dataset at '{prefix}'; a path with spaces is one argument of the flag, or "
                                   f"quoted: '0.5 \"/my data/a\" 0.5 /data/b')")
            raise DatasetError(f"no dataset at '{prefix}': expected {prefix}.bin and {prefix}.idx ({name} takes a "
                               f"prefix, a folder of prefixes, or 'w1 prefix1 w2 prefix2')")
    return prefixes, weights


def _group_paths(words: list[str]) -> list[str]:
    """Unweighted words, with the runs of words that together name existing data (a path with spaces given
    unquoted) joined: each word that is not data alone starts the longest run that is."""
    grouped, i = [], 0
    while i < len(words):
        end = i + 1
        if not _names_data(words[i]):
            end = next((j for j in range(len(words), i + 1, -1) if _names_data(" ".join(words[i:j]))), i + 1)
        grouped.append(" ".join(words[i:end]))
        i = end
    return grouped


def _names_data(path: str) -> bool:
    """Whether ``path`` (with its spaces) is a dataset prefix, its .bin or .idx, or a folder."""
    if not path:
        return False
    return os.path.isdir(path) or indexed_dataset.exists(path) or (
        path.endswith((".bin", ".idx")) and indexed_dataset.exists(path[:-4]))


def _expand(word: str, name: str) -> list[str]:
    if os.path.isdir(word):
        prefixes = sorted(p[:-4] for p in glob.glob(os.path.join(word, "*.idx")) if os.path.isfile(p[:-4] + ".bin"))
        if not prefixes:
            raise DatasetError(f"{name} folder '{word}' holds no .bin/.idx pair; preprocess data with "
                             f"tools/preprocess_data.py")
        return prefixes
    for suffix in (".bin", ".idx"):
        if word.endswith(suffix):
            return [word[: -len(suffix)]]
    return [word]


def open_datasets(prefixes: list[str]) -> list[IndexedDataset]:
    """The indexed datasets of ``prefixes``; an empty one (no sequences or no tokens) is a DatasetError."""
    indexed = [IndexedDataset(p) for p in prefixes]
    for ds in indexed:
        if len(ds) == 0 or ds.num_tokens == 0:
            raise DatasetError(f"dataset {ds.prefix} is empty ({len(ds)} sequences, {ds.num_tokens} tokens); "
                               f"preprocess a non-empty corpus or leave it out of input_dir.")
    return indexed


def _train_ranges(indexed: list[IndexedDataset], split: str, weights: list[float] | None) -> None:
    """Every dataset that training draws from must have training sequences holding 2 tokens or more."""
    for d, ds in enumerate(indexed):
        if weights is not None and weights[d] == 0:
            continue
        first, last = split_ranges(split, len(ds))[0]
        tokens = int(ds.sequence_lengths[first:last].sum(dtype=np.int64))
        if tokens < 2 and split == WHOLE[0]:
            raise DatasetError(f"train_data_path dataset {ds.prefix} holds {tokens} token(s); training needs at "
                               f"least 2: preprocess a larger corpus or leave it out.")
        if tokens < 2:
            raise DatasetError(f"split '{split}' leaves the train split of {ds.prefix} {last - first} of its {len(ds)} "
                               f"sequences ({tokens} tokens); give train a larger share, e.g. --split 949,50,1.")


def build_datasets(input_dir: str, split: str, num_samples: tuple[int, int, int], seq_length: int, seed: int,
                   eod_id: int, cache_dir: str | None = None, vocab_size: int | None = None,
                   train_epochs: int | None = None, global_batch_size: int = 1, report: bool = False) -> tuple:
    """(train, valid, test); a split with no sequences (or no samples requested) is None.

    With ``vocab_size``, every dataset's token ids are checked against it first (``token_check``). With
    ``train_epochs``, the train split holds exactly ``train_samples(...)`` samples: at most that many passes,
    in whole global batches. Every failure is a DatasetError raised on every rank (see ``index_cache``).
    With ``report``, the index cache's builds and loads are logged, then a summary per split (``summary``).
    """
    prefixes, weights = parse_input_dir(input_dir)
    datasets = _build(prefixes, weights, len(prefixes) == 1 and weights is None, f"input_dir '{input_dir}'", split,
                      num_samples, seq_length, seed, eod_id, cache_dir, vocab_size, train_epochs, global_batch_size,
                      report)
    if report:
        why = tuple("no samples asked" if num_samples[s] == 0 else f"split '{split}' gives it no sequences"
                    for s in range(3))
        summary.log_splits(datasets, seq_length, why)
    return datasets


def build_per_split_datasets(paths: tuple[str | None, str | None, str | None], num_samples: tuple[int, int, int],
                             seq_length: int, seed: int, eod_id: int, cache_dir: str | None = None,
                             vocab_size: int | None = None, train_epochs: int | None = None,
                             global_batch_size: int = 1, report: bool = False) -> tuple:
    """(train, valid, test) from (train_data_path, valid_data_path, test_data_path): split ``s`` is built from
    every sequence of path ``s``'s datasets, for ``num_samples[s]`` samples, as ``build_datasets`` builds it; a
    split without a path (or without samples) is None. ``train_epochs`` counts passes over train_data_path."""
    out = []
    for s, (name, path) in enumerate(zip(PER_SPLIT_NAMES, paths)):
        if not path or num_samples[s] == 0:
            out.append(None)
            continue
        prefixes, weights = parse_input_dir(path, name)
        wanted = tuple(n if i == s else 0 for i, n in enumerate(num_samples))
        out.append(_build(prefixes, weights, len(prefixes) == 1, f"{name} '{path}'", WHOLE[s], wanted, seq_length,
                          seed, eod_id, cache_dir, vocab_size, train_epochs, global_batch_size, report)[s])
    if report:
        why = tuple(f"no {name}" if not path else "no samples asked" for name, path in zip(PER_SPLIT_NAMES, paths))
        summary.log_splits(tuple(out), seq_length, why)
    return tuple(out)


def _build(prefixes: list[str], weights: list[float] | None, single: bool, what: str, split: str,
           num_samples: tuple[int, ...], seq_length: int, seed: int, eod_id: int, cache_dir: str | None,
           vocab_size: int | None, train_epochs: int | None, global_batch_size: int, report: bool = False) -> tuple:
    """The three splits of ``prefixes`` (``what`` names them in messages) cut by ``split``: one dataset's own
    (``single``) or a blend. ``report``: log the index cache's builds and loads."""
    log = summary.info if report else None

    def open_and_check() -> list[IndexedDataset]:
        indexed = open_datasets(prefixes)
        if num_samples[0] > 0:
            _train_ranges(indexed, split, weights)
        return indexed

    indexed = run_agreed(open_and_check, f"opening the datasets of {what}")
    for ds in indexed:  # with vocab_size (a run's): the token ids checked and the .bin hashed, in one cached scan
        entry = scanned(ds, cache_folder(ds.prefix, cache_dir), vocab_size, log) if vocab_size is not None else {}
        fingerprint.record(ds, entry)
    fingerprint.agree(indexed, what)  # a node whose copy differs stops every rank
    if train_epochs is not None and num_samples[0] > 0:
        per_epoch = samples_per_epoch(indexed, weights, split, seq_length)
        num_samples = (train_samples(num_samples[0], train_epochs, per_epoch, global_batch_size, seq_length),
                       *num_samples[1:])
    if single:
        datasets = tuple(_single(indexed[0], split, s, n, seq_length, seed, eod_id, cache_dir, log)
                         for s, n in enumerate(num_samples))
    else:
        weights = normalize(weights if weights is not None else [float(ds.num_tokens) for ds in indexed])
        datasets = tuple(_blend(indexed, weights, split, s, n, seq_length, seed, eod_id, cache_dir, log)
                         for s, n in enumerate(num_samples))
    if train_epochs is None or datasets[0] is None:
        return datasets
    return (FirstSamples(datasets[0], num_samples[0]), *datasets[1:])


def samples_per_epoch(indexed: list[IndexedDataset], weights: list[float] | None, split: str,
                      seq_length: int) -> int:
    """One pass over the train split: ``(tokens - 1) // seq_length`` samples of one dataset (Megatron's samples
    per epoch); for a blend, the sum over the members it draws from (weight above 0)."""
    total = 0
    for d, ds in enumerate(indexed):
        if weights is not None and weights[d] == 0:
            continue
        first, last = split_ranges(split, len(ds))[0]
        total += max((int(ds.sequence_lengths[first:last].sum(dtype=np.int64)) - 1) // seq_length, 0)
    return total


def train_samples(max_samples: int, epochs: int, per_epoch: int, global_batch_size: int, seq_length: int) -> int:
    """``min(max_samples, epochs x per_epoch)`` rounded down to whole global batches; none is a DatasetError."""
    steps = min(max_samples, epochs * per_epoch) // global_batch_size
    if steps == 0:
        raise DatasetError(f"num_train_epochs {epochs} gives {epochs * per_epoch} training samples ({per_epoch} per "
                           f"pass over the train split at max_seq_len {seq_length}), fewer than one global batch of "
                           f"{global_batch_size}; raise num_train_epochs, lower global_batch_size or add data.")
    return steps * global_batch_size


class FirstSamples:
    """The first ``size`` samples of ``dataset``: a train split capped to ``num_train_epochs`` passes, whose
    ``len`` is exactly the samples the run trains on (the dataset built under it may hold a few more)."""

    def __init__(self, dataset, size: int):
        if size > len(dataset):
            raise DatasetError(f"the train split holds {len(dataset)} samples but {size} were asked; this is a bug "
                               f"in the sample counts: please report it.")
        self.dataset, self.size = dataset, size
        self.eod_id, self.samples_per_epoch = dataset.eod_id, dataset.samples_per_epoch

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} out of range [0, {self.size})")
        return self.dataset[index]


def _single(ds: IndexedDataset, split: str, s: int, n: int, seq_length: int, seed: int, eod_id: int,
            cache_dir: str | None, log=None) -> GPTDataset | None:
    first, last = split_ranges(split, len(ds))[s]
    if n == 0:
        return None
    if last == first:
        _warn_empty(ds, split, s)
        return None
    return GPTDataset(ds, SPLIT_NAMES[s], (first, last), n, seq_length, seed, cache_folder(ds.prefix, cache_dir),
                      eod_id, log)


def _blend(indexed: list[IndexedDataset], weights: list[float], split: str, s: int, n: int, seq_length: int,
           seed: int, eod_id: int, cache_dir: str | None, log=None) -> BlendedDataset | None:
    """Megatron Core's sizes: member d built for ceil(ceil(n w_d) 1.005) samples, the blend sum_d ceil(n w_d).
    Members without sequences in this split (or weight 0) are left out and the rest re-weighted."""
    if n == 0:
        return None
    kept = []  # (dataset, weight, its range in this split)
    for ds, weight in zip(indexed, weights):
        first, last = split_ranges(split, len(ds))[s]
        if weight == 0:
            continue
        if last == first:
            _warn_empty(ds, split, s)
            continue
        kept.append((ds, weight, (first, last)))
    if not kept:
        return None
    total = sum(weight for _, weight, _ in kept)  # re-weighted: the blend still holds the n samples asked
    members, member_weights, size = [], [], 0
    for ds, weight, bounds in kept:
        target = math.ceil(n * weight / total)
        members.append(GPTDataset(ds, SPLIT_NAMES[s], bounds, math.ceil(target * (1 + SURPLUS)), seq_length,
                                  seed, cache_folder(ds.prefix, cache_dir), eod_id, log))
        member_weights.append(weight / total)
        size += target
    return BlendedDataset(members, member_weights, size, n)


def _warn_empty(ds: IndexedDataset, split: str, s: int) -> None:
    """Say (on global rank 0) that a split given a share, and samples, rounds to no sequences of ``ds``."""
    if parse_split(split)[s] > 0 and index_cache.is_global_builder():
        from megatron.metrics import get_logger

        get_logger().warning(f"split '{split}' gives the {SPLIT_NAMES[s]} split of {ds.prefix} none of its {len(ds)} "
                             f"sequences; it is left out of {SPLIT_NAMES[s]}")
