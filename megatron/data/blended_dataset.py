"""Weighted blending of several datasets, and the train/valid/test builder over ``input_dir``.

``input_dir`` is one of: a dataset prefix (``data/corpus_text_document`` for
``data/corpus_text_document.bin/.idx``); a folder (every prefix in it, weighted by its token
count); or Megatron's ``w1 prefix1 w2 prefix2 ...`` (prefixes without weights are weighted by
token count). Each prefix is split into train/valid/test document ranges on its own; each
split blends the prefixes' splits by weight, sample by sample, with the C++
``build_blending_indices`` (greedy: after every sample, each dataset's count stays close to
its share, typically within one sample).
"""

from __future__ import annotations

import glob
import math
import os

import numpy as np

from megatron.data import indexed_dataset
from megatron.data.gpt_dataset import GPTDataset, split_ranges
from megatron.data.helpers import build_blending_indices
from megatron.data.indexed_dataset import DatasetError, IndexedDataset

SPLIT_NAMES = ("train", "valid", "test")


class BlendedDataset:
    """``ds[i] = datasets[dataset_index[i]][dataset_sample_index[i]]`` for ``size`` samples."""

    def __init__(self, datasets: list, weights: list[float], size: int):
        total = float(sum(weights))
        self.datasets, self.weights, self.size = datasets, [w / total for w in weights], size
        self.dataset_index, self.dataset_sample_index = build_blending_indices(
            np.asarray(self.weights, dtype=np.float64), size)
        self.eod_id = datasets[0].eod_id
        self.samples_per_epoch = size
        for d, ds in enumerate(datasets):
            needed = int(np.count_nonzero(self.dataset_index == d))
            if needed > len(ds):
                raise DatasetError(f"blend member {d} has {len(ds)} samples but the blend draws {needed}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[index])][int(self.dataset_sample_index[index])]


def parse_input_dir(input_dir: str) -> tuple[list[str], list[float] | None]:
    """-> (prefixes, weights or None for token-count weighting). Raises DatasetError with a hint."""
    words = input_dir.split()
    if len(words) > 1 and _is_number(words[0]):
        if len(words) % 2 or not all(_is_number(w) for w in words[::2]):
            raise DatasetError(f"input_dir '{input_dir}' must alternate weights and prefixes: 'w1 prefix1 w2 prefix2'")
        weights, prefixes = [float(w) for w in words[::2]], list(words[1::2])
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise DatasetError(f"input_dir '{input_dir}': weights must be non-negative with a positive sum")
    else:
        weights, prefixes = None, []
        for word in words:
            prefixes.extend(_expand(word))
    for prefix in prefixes:
        if not indexed_dataset.exists(prefix):
            raise DatasetError(f"no dataset at '{prefix}': expected {prefix}.bin and {prefix}.idx (input_dir takes a "
                             f"prefix, a folder of prefixes, or 'w1 prefix1 w2 prefix2')")
    return prefixes, weights


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _expand(word: str) -> list[str]:
    if os.path.isdir(word):
        prefixes = sorted(p[:-4] for p in glob.glob(os.path.join(word, "*.idx")) if os.path.isfile(p[:-4] + ".bin"))
        if not prefixes:
            raise DatasetError(f"input_dir folder '{word}' holds no .bin/.idx pair; preprocess data with "
                             f"tools/preprocess_data.py")
        return prefixes
    for suffix in (".bin", ".idx"):
        if word.endswith(suffix):
            return [word[: -len(suffix)]]
    return [word]


def build_datasets(input_dir: str, split: str, num_samples: tuple[int, int, int], seq_length: int, seed: int,
                   eod_id: int, cache_dir: str | None = None) -> tuple:
    """(train, valid, test); a split with no documents (or no samples requested) is None."""
    prefixes, weights = parse_input_dir(input_dir)
    indexed = [IndexedDataset(p) for p in prefixes]
    if weights is None:
        weights = [float(ds.num_tokens) for ds in indexed]
    result = []
    for s, name in enumerate(SPLIT_NAMES):
        if num_samples[s] == 0:
            result.append(None)
            continue
        present = [(ds, w, split_ranges(split, ds.num_documents)[s]) for ds, w in zip(indexed, weights)]
        present = [(ds, w, r) for ds, w, r in present if r[1] > r[0] and w > 0]
        total_weight = sum(w for _, w, _ in present)
        members, member_weights = [], []
        for ds, weight, doc_range in present:
            # A little more than the weight's share, as Megatron-LM, so the greedy blend never runs out.
            wanted = num_samples[s] if len(present) == 1 else math.ceil(weight / total_weight * num_samples[s] * 1.005)
            cache = cache_dir or os.path.join(os.path.dirname(os.path.abspath(ds.prefix)), "index-cache")
            members.append(GPTDataset(ds, name, doc_range, wanted, seq_length, seed, cache, eod_id))
            member_weights.append(weight)
        if not members:
            result.append(None)
        elif len(members) == 1:
            result.append(members[0])
        else:
            result.append(BlendedDataset(members, member_weights, num_samples[s]))
    return tuple(result)
