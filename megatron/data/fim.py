"""Fill-in-the-middle samples (``--fim-data``): Megatron-LM's FIM transform (core_v0.16.1,
megatron/training/datasets/fim_dataset.py), applied to every sample of a split.

A sample (``seq_length + 1`` ids) is cut at each end-of-document token (``--fim-eod-token``) into documents,
each transformed on its own; the result is cut, or padded with ``--fim-pad-token``, back to the sample's length.
A document is transformed with probability ``fim_rate``: its text (``tokenizer.detokenize``) is cut at two
character positions drawn uniformly from ``0..len(text)`` and sorted, the three pieces tokenized again, and
laid out, with probability ``fim_spm_rate`` as SPM, else as PSM::

    PSM: <prefix> prefix <suffix> suffix <middle> middle
    SPM: <prefix> <suffix> suffix <middle> prefix middle

``--fim-split-sample TOKEN``: a document holding TOKEN is, with probability ``fim_rate``, cut at each TOKEN into
fragments, each transformed with probability ``fim_fragment_rate`` (a document without it: as above).
``--fim-no-prefix TEXT``: a document (fragment) whose text starts with TEXT is left as it is.

Megatron's details, kept: an empty document (two EODs in a row, or an EOD first) is dropped with its EOD, and
so is an empty fragment with its split token; the part after the last EOD (split token) is transformed even
when empty (then ``<prefix> <suffix> <middle>`` alone). The pad tokens stay in the loss, as Megatron's.

One difference, by design: Megatron draws from one ``RandomState(seed)`` per dataset, in the order the samples
are read, so a sample's transform depends on which samples the process read before it (the data-parallel rank,
the DataLoader worker, the step a run resumed at). Here sample ``i`` of split ``s`` draws from its own generator,
seeded from ``(seed, s, i)`` (``sample_rng``): the same sample gets the same transform under any layout, number
of workers or resume point. The draws themselves (``binomial``, ``randint``) are Megatron's, in its order: given
one shared ``RandomState``, the transform gives Megatron's samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from megatron.config import ConfigError
from megatron.config.schema import Config, DatasetConfig
from megatron.tokenizer import Tokenizer

FIM_STREAM = 0x46494D  # "FIM": keeps these seeds apart from any other SeedSequence of (seed, ...)
TOKEN_LEAVES = {"prefix": "fim_prefix_token", "middle": "fim_middle_token", "suffix": "fim_suffix_token",
                "pad": "fim_pad_token", "eod": "fim_eod_token", "split": "fim_split_sample"}


@dataclass(frozen=True)
class FIMTokens:
    """The ids of the FIM sentinels, the pad, the end-of-document token and the split token (None: no split)."""

    prefix: int
    middle: int
    suffix: int
    pad: int
    eod: int
    split: int | None = None


def fim_tokens(settings: DatasetConfig, tokenizer: Tokenizer) -> FIMTokens:
    """The tokens of ``settings`` (the ``--fim-*-token`` flags, ``--fim-split-sample``) looked up in the
    tokenizer's vocabulary by their spelling; one it lacks is a ConfigError naming the flag."""
    ids: dict[str, int | None] = {}
    for name, leaf in TOKEN_LEAVES.items():
        token = getattr(settings, leaf)
        if token is None:
            ids[name] = None
            continue
        token_id = tokenizer.token_id(token)
        if token_id is None:
            flag = "--" + leaf.replace("_", "-")
            raise ConfigError(f"{flag} {token!r} is not a token of the tokenizer's vocabulary (--tokenizer-type "
                              f"{tokenizer.name}), and --fim-data needs each FIM token as one vocabulary entry; give "
                              f"{flag} a token the tokenizer has, or use a tokenizer with FIM tokens (StarCoder's "
                              f"<fim_prefix>, <fim_middle>, <fim_suffix>, <fim_pad>).")
        ids[name] = token_id
    return FIMTokens(**ids)


def sample_rng(seed: int, split: int, index: int) -> np.random.RandomState:
    """The generator of sample ``index`` of split ``split`` (0 train, 1 valid, 2 test): Megatron's RandomState
    draws on an MT19937 seeded from ``(seed, split, index)`` through NumPy's SeedSequence."""
    return np.random.RandomState(np.random.MT19937(np.random.SeedSequence([FIM_STREAM, seed, split, index])))


def _each_part(sequence: np.ndarray, separator: int, transform: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """Megatron's loop over the parts between ``separator``s: each non-empty part transformed and followed by its
    separator (an empty part is dropped with it); the part after the last separator transformed, even empty."""
    out: list = []
    start = 0
    for at in np.flatnonzero(sequence == separator):
        if at > start:
            out += [transform(sequence[start:at]), [separator]]
        start = at + 1
    out.append(transform(sequence[start:]))
    return np.concatenate(out).astype(np.int64, copy=False)


class FIMTransform:
    """``transform(sample, rng)``: the FIM sample of ``sample`` (1-D ids, its length kept) with ``rng``'s draws."""

    def __init__(self, tokenizer: Tokenizer, tokens: FIMTokens, rate: float, spm_rate: float,
                 fragment_rate: float | None = None, no_prefix: str | None = None):
        self.tokenizer, self.tokens = tokenizer, tokens
        self.rate, self.spm_rate, self.fragment_rate, self.no_prefix = rate, spm_rate, fragment_rate, no_prefix

    @classmethod
    def from_config(cls, config: Config, tokenizer: Tokenizer) -> FIMTransform:
        d = config.dataset
        return cls(tokenizer, fim_tokens(d, tokenizer), d.fim_rate, d.fim_spm_rate, d.fim_fragment_rate,
                   d.fim_no_prefix)

    def __call__(self, sample: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        sample = np.asarray(sample, dtype=np.int64)
        out = _each_part(sample, self.tokens.eod, lambda document: self._document(document, rng))
        if len(out) >= len(sample):
            return out[:len(sample)]
        return np.concatenate([out, np.full(len(sample) - len(out), self.tokens.pad, dtype=np.int64)])

    def _document(self, document: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        split = self.tokens.split
        if split is None or not np.any(document == split):
            return self._rearrange(document, self.rate, rng)
        if not rng.binomial(1, self.rate):
            return document
        return _each_part(document, split, lambda fragment: self._rearrange(fragment, self.fragment_rate, rng))

    def _rearrange(self, ids: np.ndarray, rate: float, rng: np.random.RandomState) -> np.ndarray:
        """With probability ``rate``: PSM or SPM of ``ids``'s text cut at two random characters."""
        if not rng.binomial(1, rate):
            return ids
        text = self.tokenizer.detokenize(ids)
        if self.no_prefix is not None and text.startswith(self.no_prefix):
            return ids
        first, second = sorted(rng.randint(low=0, high=len(text) + 1, size=2))
        prefix, middle, suffix = (np.asarray(self.tokenizer.tokenize(piece), dtype=np.int64)
                                  for piece in (text[:first], text[first:second], text[second:]))
        t = self.tokens
        if rng.binomial(1, self.spm_rate):
            return np.concatenate([[t.prefix, t.suffix], suffix, [t.middle], prefix, middle])
        return np.concatenate([[t.prefix], prefix, [t.suffix], suffix, [t.middle], middle])


class FIMDataset:
    """``dataset`` (one split) with every sample FIM-transformed: ``ds[i]`` draws from ``sample_rng(seed, split,
    i)``, so it is the same whoever reads it, whenever."""

    def __init__(self, dataset, transform: FIMTransform, seed: int, split: int):
        self.dataset, self.transform, self.seed, self.split = dataset, transform, seed, split
        self.eod_id = dataset.eod_id
        self.samples_per_epoch = getattr(dataset, "samples_per_epoch", len(dataset))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.transform(self.dataset[index], sample_rng(self.seed, self.split, int(index)))


def with_fim(datasets: tuple, config: Config, tokenizer: Tokenizer) -> tuple:
    """(train, valid, test) with each split FIM-transformed (None stays None), as ``config`` says."""
    transform = FIMTransform.from_config(config, tokenizer)
    return tuple(None if ds is None else FIMDataset(ds, transform, config.seed, s) for s, ds in enumerate(datasets))
