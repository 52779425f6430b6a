"""Deterministic synthetic GPT data: a fixed random bigram language with documents.

Sample ``i`` of split ``k`` is a function of ``(seed, k, i)`` alone, so any parallel layout
(or a resumed run) sees exactly the same global batch. The language is learnable: each token
has four possible successors (drawn once from the seed) with probabilities 0.5, 0.25, 0.15
and 0.1, so the loss can fall from ln(vocab) towards the entropy of that choice (~1.2 nats).
Documents end with the end-of-document token (id ``vocab_size - 1``) with probability 1 / L per
position (``document_length`` L, default 128: the mean document length); the next document starts
at a uniformly random token. A short L packs many documents into each sample (packed-document
training, ``--reset-attention-mask``).
"""

from __future__ import annotations

import numpy as np

SUCCESSOR_PROBS = np.array([0.5, 0.25, 0.15, 0.1])
SPLITS = {"train": 0, "valid": 1, "test": 2}


class MockGPTDataset:
    """``dataset[i]`` -> int64 array of ``seq_len + 1`` tokens."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int, split: str = "train",
                 document_length: int = 128):
        if vocab_size < 2:
            raise ValueError("mock data needs a vocabulary of at least 2 tokens")
        if document_length < 1:
            raise ValueError(f"mock data's mean document length must be at least 1, got {document_length}")
        self.eod_prob = 1.0 / document_length
        self.num_samples, self.seq_len, self.seed = num_samples, seq_len, seed
        self.split_id = SPLITS[split]
        self.eod_id = vocab_size - 1
        table_rng = np.random.default_rng([seed, 0xB16A])
        self.successors = table_rng.integers(0, self.eod_id, size=(self.eod_id, len(SUCCESSOR_PROBS)))
        self._cdf = np.cumsum(SUCCESSOR_PROBS)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, self.split_id, index])
        n = self.seq_len + 1
        choice = np.searchsorted(self._cdf, rng.random(n), side="right").clip(max=len(self._cdf) - 1).tolist()
        is_eod = (rng.random(n) < self.eod_prob).tolist()
        starts = rng.integers(0, self.eod_id, size=n).tolist()
        out = [0] * n
        prev = starts[0]
        out[0] = prev
        for t in range(1, n):
            if is_eod[t]:
                token = self.eod_id
            elif prev == self.eod_id:
                token = starts[t]
            else:
                token = int(self.successors[prev, choice[t]])
            out[t] = prev = token
        return np.asarray(out, dtype=np.int64)


def build_mock_datasets(num_samples: tuple[int, int, int], seq_len: int, vocab_size: int, seed: int,
                        report: bool = False, document_length: int = 128
                        ) -> tuple[MockGPTDataset, MockGPTDataset, MockGPTDataset]:
    """(train, valid, test) of ``num_samples`` samples each; ``report``: say so on global rank 0, one line per
    split (``megatron.data.summary.log_mock``)."""
    datasets = tuple(MockGPTDataset(n, seq_len, vocab_size, seed, split=split, document_length=document_length)
                     for n, split in zip(num_samples, SPLITS))
    if report:
        from megatron.data import summary

        summary.log_mock(num_samples, seq_len, vocab_size)
    return datasets
