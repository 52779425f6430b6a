"""Dataset index helpers: sample index over a document stream, and weighted dataset blending.

These call the C++ extension ``megatron.data._helpers`` (``csrc/helpers.cpp``), which ``pip
install -e .`` builds; nothing is compiled at run time. When the extension cannot be imported they
fall back to the NumPy references in ``megatron.data.helpers_reference`` (same results, slower for
blending) and warn once.
"""

from __future__ import annotations

import warnings
from types import ModuleType

import numpy as np

from megatron.data.helpers_reference import build_blending_indices_reference, build_sample_idx_reference

_helpers: ModuleType | None
try:
    from megatron.data import _helpers
except ImportError:
    _helpers = None

_warned = False

__all__ = ["build_blending_indices", "build_sample_idx", "helpers_compiled"]


def helpers_compiled() -> bool:
    """Whether the C++ extension ``megatron.data._helpers`` is built and importable."""
    return _helpers is not None


def _warn_not_built() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "megatron.data._helpers (the C++ dataset index helpers) is not built; using the slower NumPy "
            "reference instead. Run `pip install -e .` in the repository root to build it.",
            RuntimeWarning,
            stacklevel=3,
        )


def build_sample_idx(
    sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int, tokens_per_epoch: int
) -> np.ndarray:
    """Where each training sample starts in the stream of documents ``doc_idx`` (Megatron-LM semantics).

    The token stream is the concatenation of documents ``doc_idx[0], doc_idx[1], ...`` whose
    lengths are ``sizes[doc_idx[k]]``. There are ``num_samples = (num_epochs * tokens_per_epoch
    - 1) // seq_length`` samples; sample ``i`` is the ``seq_length + 1`` tokens at stream positions
    ``i * seq_length .. i * seq_length + seq_length`` (inputs plus the shifted label), so consecutive
    samples share one token and a trailing partial sample is dropped.

    Returns an array of shape ``[num_samples + 1, 2]``. Row ``r = (k, offset)`` is a stream
    position: token ``offset`` of document ``doc_idx[k]``. Sample ``i`` runs from row ``i`` to row
    ``i + 1`` *inclusive*, reading documents ``doc_idx[row_i[0]] .. doc_idx[row_{i+1}[0]]`` in order.
    Row 0 is ``(0, 0)``; every other row points into a non-empty document (empty documents are
    skipped), and a sample ending on the last token of a document puts the next row on that token.

    Args:
        sizes: document lengths in tokens, ``[n_docs]``, non-negative integers (int32 normally).
        doc_idx: document ids in reading order (usually shuffled epochs), ``[len]``, each in ``[0, n_docs)``.
        seq_length: tokens per sample excluding the extra label token; positive.
        num_epochs: number of epochs ``doc_idx`` covers; positive.
        tokens_per_epoch: tokens in one epoch (``sizes.sum()`` for a plain epoch); positive, and
            ``doc_idx`` must hold at least ``num_samples * seq_length + 1`` tokens.

    Returns:
        int32 array when ``num_samples``, ``len(doc_idx)`` and ``max(sizes)`` fit in int32, else int64.

    Raises:
        ValueError: non-positive counts, negative sizes, document ids out of range, or a ``doc_idx``
            too short for ``num_epochs * tokens_per_epoch``.
        TypeError: ``sizes`` or ``doc_idx`` is not an integer array.
    """
    if _helpers is None:
        _warn_not_built()
        return build_sample_idx_reference(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    return _helpers.build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)


def build_blending_indices(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Interleave datasets by weight with Megatron-LM's greedy rule.

    For ``i`` in ``0 .. size - 1``, sample ``i`` goes to the first dataset ``d`` maximising
    ``weights[d] * max(i, 1) - current_samples[d]`` (its shortfall against its share), which then
    gives its next sample. Weights need not sum to 1 but normally do; each dataset's count after
    ``n`` samples then stays within about one sample of ``weights[d] * n``.

    Args:
        weights: ``[num_datasets]`` finite non-negative floats, 1 to 32767 datasets.
        size: number of blended samples; non-negative.

    Returns:
        ``(dataset_index, dataset_sample_index)``: int16 ``[size]`` dataset of each sample, and int64
        ``[size]`` index of that sample within its dataset (0, 1, 2, ... per dataset).

    Raises:
        ValueError: empty weights, more than 32767 datasets, negative or non-finite weights, negative size.
    """
    if _helpers is None:
        _warn_not_built()
        return build_blending_indices_reference(weights, size)
    return _helpers.build_blending_indices(weights, size)
