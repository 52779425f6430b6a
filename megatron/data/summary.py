"""What the data layer says at start-up: one summary per split, and the index cache being built or loaded.

Every line starts with ``data:`` and goes to the project's logger (``megatron.metrics.get_logger``):

- the summary, on global rank 0, once per split after the datasets are built (``split_lines``)::

      data: train: 1,234 documents, 2.31M tokens -> 9,000 samples of 256 tokens (3.9 epochs) from data/corpus

  *documents*: the sequences of the dataset in that split (the GPT dataset's documents; ``sequences`` is said
  instead for data whose ``.idx`` holds several sequences per document, ``--split-sentences``); *tokens*: theirs;
  *samples*: the samples the run asks of the split, each ``seq_length`` tokens (plus one label token);
  *epochs*: the passes over the split's tokens those samples need, ``(samples x seq_length + 1) / tokens``
  (for one dataset, its ceiling is the number of epochs its document index is built for). A blend gives its
  total, then a line per dataset with its weight (normalized over the datasets the split draws from) and the
  samples the blend draws from it (a blend's members are built for a few more, Megatron Core's surplus);
- the index cache (``GPTDataset``, given ``report``): on the rank that builds an entry, a line before the
  build and one after it (its time and files); on global rank 0, a line for an entry loaded from the cache.
"""

from __future__ import annotations

import numpy as np

from megatron.data import index_cache

PREFIX = "data:"


def info(message: str) -> None:
    """Log ``message`` on this rank (the caller decides which ranks speak)."""
    from megatron.metrics import get_logger

    get_logger().info(message)


def is_rank0() -> bool:
    """Global rank 0 (``torch.distributed.get_rank() == 0``), or the only process without process groups."""
    return index_cache.is_global_builder()


def on_this_rank() -> str:
    """'' on global rank 0; elsewhere ' on rank R (HOST)', for a line that another node's builder writes."""
    import socket

    import torch.distributed as dist

    if is_rank0() or not (dist.is_available() and dist.is_initialized()):
        return ""
    return f" on rank {dist.get_rank()} ({socket.gethostname()})"


# ----------------------------------------------------------------------------- numbers
def count(n: int) -> str:
    """1234567 -> '1,234,567'."""
    return f"{int(n):,}"


def tokens(n: int) -> str:
    """Exact below 100,000 ('4,321'), else three significant digits: '2.31M', '123k', '1.5B', '2T'."""
    n = int(n)
    if n < 100_000:
        return count(n)
    for scale, suffix in ((10**3, "k"), (10**6, "M"), (10**9, "B"), (10**12, "T")):
        value = float(f"{n / scale:.3g}")  # 999,999 -> 1000k: take the next unit, 1M
        if value < 1000 or suffix == "T":
            return (f"{value:.3g}" if value < 1000 else f"{value:,.0f}") + suffix
    raise AssertionError("unreachable")


def epochs(samples: int, seq_length: int, num_tokens: int) -> float:
    """Passes over ``num_tokens`` that ``samples`` samples of ``seq_length`` read: ``(samples x seq_length + 1)
    / tokens`` (a sample is seq_length tokens plus the next one as its last label); 0 for no samples."""
    if samples <= 0 or num_tokens <= 0:
        return 0.0
    return (samples * seq_length + 1) / num_tokens


def fmt_epochs(value: float) -> str:
    """'3.94 epochs', '0.000312 epochs', '1 epoch', '1,234 epochs'."""
    text = f"{value:,.0f}" if value >= 1000 else f"{value:.3g}"
    return f"{text} epoch" + ("" if text == "1" else "s")


def many(n: int, word: str) -> str:
    """'1 document', '1,234 documents'."""
    return f"{count(n)} {word}" + ("" if n == 1 else "s")


def noun(indexed_datasets) -> str:
    """'document', or 'sequence' when a dataset's .idx holds several sequences per document."""
    return "document" if all(len(ds) == ds.num_documents for ds in indexed_datasets) else "sequence"


# ----------------------------------------------------------------------------- the summary
def _unwrap(dataset) -> tuple[object, int]:
    """(the dataset built, the samples the run asks of it): ``FirstSamples`` (a train split capped by
    num_train_epochs) asks its size of the dataset under it; a GPT dataset or a blend its ``num_samples``."""
    if hasattr(dataset, "dataset") and not hasattr(dataset, "indexed"):  # FirstSamples
        return dataset.dataset, len(dataset)
    return dataset, int(getattr(dataset, "num_samples", len(dataset)))


def split_lines(split: str, dataset, seq_length: int, why_none: str | None = None) -> list[str]:
    """The summary lines of one split: a ``GPTDataset``, a ``BlendedDataset`` (the total, then a line per
    member), either under ``FirstSamples``, or None (``why_none`` says why)."""
    if dataset is None:
        return [f"{PREFIX} {split}: none ({why_none or 'no samples asked'})"]
    built, samples = _unwrap(dataset)
    if not hasattr(built, "datasets"):  # one GPT dataset
        return [f"{PREFIX} {split}: {many(built.num_sequences, noun([built.indexed]))}, "
                f"{tokens(built.tokens_per_epoch)} tokens -> {count(samples)} samples of {seq_length} tokens "
                f"({fmt_epochs(epochs(samples, seq_length, built.tokens_per_epoch))}) from {built.indexed.prefix}"]
    members = built.datasets
    drawn = np.bincount(np.asarray(built.dataset_index[:samples], dtype=np.int64), minlength=len(members))
    docs = sum(ds.num_sequences for ds in members)
    toks = sum(ds.tokens_per_epoch for ds in members)
    kind = noun([ds.indexed for ds in members])
    lines = [f"{PREFIX} {split}: {many(docs, kind)}, {tokens(toks)} tokens -> {count(samples)} samples of "
             f"{seq_length} tokens ({fmt_epochs(epochs(samples, seq_length, toks))}) from a blend of "
             f"{many(len(members), 'dataset')}:"]
    for ds, weight, n in zip(members, built.weights, drawn.tolist()):
        lines.append(f"{PREFIX}   {split}, weight {weight:.3g}: {many(ds.num_sequences, noun([ds.indexed]))}, "
                     f"{tokens(ds.tokens_per_epoch)} tokens -> {count(n)} samples "
                     f"({fmt_epochs(epochs(n, seq_length, ds.tokens_per_epoch))}) from {ds.indexed.prefix}")
    return lines


def log_splits(datasets: tuple, seq_length: int, why_none: tuple[str | None, ...]) -> None:
    """The summary of (train, valid, test), on global rank 0."""
    if not is_rank0():
        return
    for split, dataset, why in zip(("train", "valid", "test"), datasets, why_none):
        for line in split_lines(split, dataset, seq_length, why):
            info(line)


def log_mock(num_samples: tuple[int, ...], seq_length: int, vocab_size: int) -> None:
    """The summary of ``--mock-data``, on global rank 0: synthetic samples per split."""
    if not is_rank0():
        return
    what = f" (--mock-data: a random bigram language over {count(vocab_size)} token ids, no files)"
    for split, n in zip(("train", "valid", "test"), num_samples):
        if n == 0:
            info(f"{PREFIX} {split}: none (no samples asked)")
        else:
            info(f"{PREFIX} {split}: {count(n)} synthetic samples of {seq_length} tokens{what}")
            what = " (--mock-data)"


def seconds(value: float) -> str:
    """'0.04 s', '12.3 s', '2 min 5 s'."""
    if value < 10:
        return f"{value:.2f} s"
    if value < 120:
        return f"{value:.1f} s"
    return f"{int(value // 60)} min {int(value % 60)} s"

