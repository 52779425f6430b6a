"""Pure NumPy references for the C++ dataset index helpers (``csrc/helpers.cpp``).

They return exactly what ``megatron.data._helpers`` returns (values and dtypes) and raise the
same errors. ``megatron.data.helpers`` falls back to them when the extension is not built; the
tests compare the two. See ``megatron.data.helpers`` for the semantics.
"""

from __future__ import annotations

import numpy as np

_INT32_MAX = int(np.iinfo(np.int32).max)
_INT64_MAX = int(np.iinfo(np.int64).max)
_MAX_DATASETS = int(np.iinfo(np.int16).max)  # 32767


def _as_index_array(obj: object, name: str) -> np.ndarray:
    """1-D C-contiguous int32 array (signed integers of at most 4 bytes) or int64 array (other integers)."""
    try:
        arr = np.asarray(obj)
    except Exception as exc:  # e.g. ragged nested lists
        raise TypeError(f"{name} must be an array of integers") from exc
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an array of integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got {arr.ndim} dimensions")
    dtype = np.int32 if arr.dtype.kind == "i" and arr.dtype.itemsize <= 4 else np.int64
    return np.ascontiguousarray(arr.astype(dtype, copy=False))


def _check_counts(seq_length: int, num_epochs: int, tokens_per_epoch: int) -> None:
    if seq_length <= 0:
        raise ValueError(f"seq_length must be positive, got {seq_length}")
    if num_epochs <= 0:
        raise ValueError(f"num_epochs must be positive, got {num_epochs}")
    if tokens_per_epoch <= 0:
        raise ValueError(f"tokens_per_epoch must be positive, got {tokens_per_epoch}")
    if tokens_per_epoch > _INT64_MAX // num_epochs:
        raise ValueError(
            f"num_epochs * tokens_per_epoch overflows int64 (num_epochs={num_epochs}, "
            f"tokens_per_epoch={tokens_per_epoch})"
        )


def build_sample_idx_reference(
    sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int, tokens_per_epoch: int
) -> np.ndarray:
    """Vectorised reference for ``megatron.data.helpers.build_sample_idx`` (same result, same dtype).

    Sample ``i`` starts at stream position ``i * seq_length``. With ``starts`` the exclusive prefix
    sums of the sizes of doc_idx's documents, row ``i`` is ``(j, i * seq_length - starts[j])`` where
    ``j`` is the last index with ``starts[j] <= i * seq_length`` (``side="right"`` skips empty
    documents, whose start equals the next one's); row 0 is always ``(0, 0)``.
    """
    seq_length, num_epochs, tokens_per_epoch = int(seq_length), int(num_epochs), int(tokens_per_epoch)
    _check_counts(seq_length, num_epochs, tokens_per_epoch)
    sizes = _as_index_array(sizes, "sizes")
    doc_idx = _as_index_array(doc_idx, "doc_idx")
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length

    sizes64 = sizes.astype(np.int64, copy=False)
    negative = np.flatnonzero(sizes64 < 0)
    if negative.size:
        k = int(negative[0])
        raise ValueError(f"sizes must be non-negative, got sizes[{k}] = {int(sizes64[k])}")
    doc_idx64 = doc_idx.astype(np.int64, copy=False)
    bad = np.flatnonzero((doc_idx64 < 0) | (doc_idx64 >= sizes.shape[0]))
    if bad.size:
        k = int(bad[0])
        raise ValueError(f"doc_idx[{k}] = {int(doc_idx64[k])} is out of range for {sizes.shape[0]} documents")

    lengths = sizes64[doc_idx64]
    ends = np.cumsum(lengths)  # inclusive prefix sums (int64 overflow is not a practical concern here)
    available = int(ends[-1]) if ends.size else 0
    needed = num_samples * seq_length + 1
    if available < needed:
        raise ValueError(
            f"tokens_per_epoch is inconsistent with doc_idx: {num_samples} samples of seq_length {seq_length} "
            f"(num_epochs={num_epochs}, tokens_per_epoch={tokens_per_epoch}) need {needed} tokens "
            f"but doc_idx covers only {available}"
        )

    max_size = int(sizes64.max()) if sizes64.size else 0
    int32_output = num_samples <= _INT32_MAX and doc_idx.shape[0] <= _INT32_MAX and max_size <= _INT32_MAX
    out_dtype = np.int32 if int32_output else np.int64

    starts = ends - lengths  # exclusive prefix sums
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    j = np.searchsorted(starts, positions, side="right") - 1
    out = np.empty((num_samples + 1, 2), dtype=out_dtype)
    out[:, 0] = j
    out[:, 1] = positions - starts[j]
    out[0] = 0
    return out


def build_blending_indices_reference(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Python-loop reference for ``megatron.data.helpers.build_blending_indices`` (same result, same dtypes)."""
    try:
        w = np.ascontiguousarray(np.asarray(weights, dtype=np.float64))
    except (TypeError, ValueError) as exc:
        raise TypeError("weights must be an array of floats") from exc
    if w.ndim != 1:
        raise ValueError(f"weights must be one-dimensional, got {w.ndim} dimensions")
    num_datasets = w.shape[0]
    if num_datasets == 0:
        raise ValueError("weights must not be empty")
    if num_datasets > _MAX_DATASETS:
        raise ValueError(f"at most {_MAX_DATASETS} datasets can be blended, got {num_datasets}")
    size = int(size)
    if size < 0:
        raise ValueError(f"size must be non-negative, got {size}")
    for d, value in enumerate(w.tolist()):
        if not np.isfinite(value) or value < 0.0:
            raise ValueError(f"weights must be finite and non-negative, got weights[{d}] = {value!r}")

    weight_list = w.tolist()
    current = [0] * num_datasets
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    for i in range(size):
        i_d = max(float(i), 1.0)
        best = 0
        best_error = weight_list[0] * i_d - float(current[0])
        for d in range(1, num_datasets):
            error = weight_list[d] * i_d - float(current[d])
            if error > best_error:
                best_error = error
                best = d
        dataset_index[i] = best
        dataset_sample_index[i] = current[best]
        current[best] += 1
    return dataset_index, dataset_sample_index
