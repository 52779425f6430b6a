"""The dataset index helpers: the C++ extension against its NumPy reference, and their semantics."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.data import helpers
from megatron.data.helpers_reference import build_blending_indices_reference, build_sample_idx_reference

try:
    from megatron.data import _helpers
except ImportError:  # test_helpers_compiled fails; everything else comparing with the extension skips
    _helpers = None

NOT_BUILT = "megatron.data._helpers is not built: run `pip install -e .`"
needs_cpp = pytest.mark.skipif(_helpers is None, reason=NOT_BUILT)

SETTINGS = settings(max_examples=200, deadline=None)

SAMPLE_IDX_IMPLS = BLENDING_IMPLS = pytest.mark.parametrize("impl", [pytest.param("cpp", marks=needs_cpp), "reference"])


def _sample_idx_impl(impl: str):
    return _helpers.build_sample_idx if impl == "cpp" else build_sample_idx_reference


def _blending_impl(impl: str):
    return _helpers.build_blending_indices if impl == "cpp" else build_blending_indices_reference


def test_helpers_compiled():
    assert helpers.helpers_compiled(), NOT_BUILT


# ---------------------------------------------------------------------------------------------
# build_sample_idx
# ---------------------------------------------------------------------------------------------


@st.composite
def document_sets(draw):
    """(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch): a shuffled tiling over epochs."""
    sizes = draw(st.lists(st.integers(0, 50), min_size=1, max_size=40))
    num_epochs = draw(st.integers(1, 3))
    tokens_per_epoch = sum(sizes)
    total = num_epochs * tokens_per_epoch
    if total < 2:  # at least one sample of seq_length + 1 >= 2 tokens
        sizes[draw(st.integers(0, len(sizes) - 1))] += 2 - total // num_epochs
        tokens_per_epoch = sum(sizes)
        total = num_epochs * tokens_per_epoch
    seq_length = draw(st.integers(1, min(64, total - 1)))
    seed = draw(st.integers(0, 2**32 - 1))
    doc_idx = np.tile(np.arange(len(sizes), dtype=np.int32), num_epochs)
    np.random.default_rng(seed).shuffle(doc_idx)
    return np.asarray(sizes, dtype=np.int32), doc_idx, seq_length, num_epochs, tokens_per_epoch


def _sample(doc_tokens: list[np.ndarray], sample_idx: np.ndarray, i: int) -> np.ndarray:
    """Tokens of sample ``i``: from position ``sample_idx[i]`` to ``sample_idx[i + 1]`` inclusive."""
    (j0, o0), (j1, o1) = (int(x) for x in sample_idx[i]), (int(x) for x in sample_idx[i + 1])
    if j0 == j1:
        return doc_tokens[j0][o0 : o1 + 1]
    parts = [doc_tokens[j0][o0:], *doc_tokens[j0 + 1 : j1], doc_tokens[j1][: o1 + 1]]
    return np.concatenate(parts)


@needs_cpp
@SETTINGS
@given(document_sets())
def test_sample_idx_cpp_matches_reference(case):
    expected = build_sample_idx_reference(*case)
    got = _helpers.build_sample_idx(*case)
    assert got.dtype == expected.dtype == np.int32
    np.testing.assert_array_equal(got, expected)


@needs_cpp
@SETTINGS
@given(document_sets())
def test_samples_are_contiguous_windows_of_the_stream(case):
    sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch = case
    sample_idx = _helpers.build_sample_idx(*case)
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    assert sample_idx.shape == (num_samples + 1, 2)
    assert tuple(sample_idx[0]) == (0, 0)

    # Each document holds globally unique tokens; the stream is the documents in doc_idx order.
    bases = np.concatenate([[0], np.cumsum(sizes)])
    docs = [np.arange(bases[d], bases[d] + sizes[d]) for d in range(len(sizes))]
    stream = np.concatenate([docs[d] for d in doc_idx])
    # Each occurrence in doc_idx holds its own stream positions: these tokens identify positions.
    starts = np.concatenate([[0], np.cumsum(sizes[doc_idx])])
    occurrences = [np.arange(starts[k], starts[k + 1]) for k in range(len(doc_idx))]
    by_doc = [docs[d] for d in doc_idx]

    previous = None
    for i in range(num_samples):
        window = np.arange(i * seq_length, i * seq_length + seq_length + 1)
        positions = _sample(occurrences, sample_idx, i)
        np.testing.assert_array_equal(positions, window)
        np.testing.assert_array_equal(_sample(by_doc, sample_idx, i), stream[window])
        if previous is not None:  # consecutive samples share exactly one token: prev's last, this one's first
            assert np.intersect1d(previous, positions).tolist() == [positions[0]] == [previous[-1]]
        previous = positions
    # Every row after the first points at a real token of a non-empty document.
    for k, offset in sample_idx[1:]:
        assert 0 <= offset < sizes[doc_idx[k]]


@needs_cpp
def test_sample_idx_small_example_with_empty_documents():
    sizes = np.array([3, 0, 5, 2, 0, 4], dtype=np.int32)
    doc_idx = np.array([1, 0, 2, 4, 3, 5, 1], dtype=np.int32)  # stream: 3 + 0 + 5 + 0 + 2 + 4 + 0 tokens
    got = _helpers.build_sample_idx(sizes, doc_idx, 4, 1, 14)
    # Samples at positions 0-4, 4-8, 8-12: position 4 is doc_idx[2] offset 2 (doc_idx[1] is empty), position
    # 8 is the first token of doc_idx[4] (skipping the empty doc_idx[3]), position 12 is doc_idx[5] offset 2.
    assert got.tolist() == [[0, 0], [2, 1], [4, 0], [5, 2]]
    np.testing.assert_array_equal(build_sample_idx_reference(sizes, doc_idx, 4, 1, 14), got)


@needs_cpp
def test_sample_idx_ending_on_a_document_boundary_points_at_its_last_token():
    sizes = np.array([4, 4], dtype=np.int32)
    doc_idx = np.array([0, 1], dtype=np.int32)
    # Sample 0 is positions 0..3 (document 0 exactly); sample 1 starts on that same last token.
    got = _helpers.build_sample_idx(sizes, doc_idx, 3, 1, 8)
    assert got.tolist() == [[0, 0], [0, 3], [1, 2]]


@needs_cpp
@pytest.mark.parametrize(
    "sizes_dtype, doc_dtype", [(np.int64, np.int32), (np.int32, np.int64), (np.uint16, np.int16), (np.int8, np.uint32)]
)
def test_sample_idx_accepts_other_integer_dtypes(sizes_dtype, doc_dtype):
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 100, size=50).astype(np.int32)
    doc_idx = np.tile(np.arange(50, dtype=np.int32), 2)
    rng.shuffle(doc_idx)
    tokens = int(sizes.sum())
    expected = _helpers.build_sample_idx(sizes, doc_idx, 16, 2, tokens)
    for build in (_helpers.build_sample_idx, build_sample_idx_reference):
        # Non-contiguous views too.
        s = np.repeat(sizes.astype(sizes_dtype), 2)[::2]
        d = np.repeat(doc_idx.astype(doc_dtype), 2)[::2]
        got = build(s, d, 16, 2, tokens)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(_helpers.build_sample_idx(sizes.tolist(), doc_idx.tolist(), 16, 2, tokens), expected)


@needs_cpp
def test_sample_idx_int64_output_for_offsets_beyond_int32():
    sizes = np.array([2**31 + 5], dtype=np.int64)
    doc_idx = np.array([0], dtype=np.int64)
    args = (sizes, doc_idx, 2**30, 1, 2**31 + 5)
    got = _helpers.build_sample_idx(*args)
    assert got.dtype == np.int64
    assert got.tolist() == [[0, 0], [0, 2**30], [0, 2**31]]
    expected = build_sample_idx_reference(*args)
    assert expected.dtype == np.int64
    np.testing.assert_array_equal(got, expected)


@needs_cpp
def test_sample_idx_drops_the_last_partial_sample():
    sizes = np.array([5], dtype=np.int32)
    doc_idx = np.array([0], dtype=np.int32)
    assert _helpers.build_sample_idx(sizes, doc_idx, 4, 1, 5).tolist() == [[0, 0], [0, 4]]
    assert _helpers.build_sample_idx(sizes, doc_idx, 5, 1, 5).tolist() == [[0, 0]]  # 6 tokens needed, 5 given


_GOOD_SIZES = np.array([3, 4, 5], dtype=np.int32)
_GOOD_DOCS = np.array([2, 0, 1], dtype=np.int32)


@SAMPLE_IDX_IMPLS
@pytest.mark.parametrize(
    "args, message",
    [
        ((_GOOD_SIZES, _GOOD_DOCS, 0, 1, 12), "seq_length must be positive"),
        ((_GOOD_SIZES, _GOOD_DOCS, -3, 1, 12), "seq_length must be positive"),
        ((_GOOD_SIZES, _GOOD_DOCS, 4, 0, 12), "num_epochs must be positive"),
        ((_GOOD_SIZES, _GOOD_DOCS, 4, 1, 0), "tokens_per_epoch must be positive"),
        ((_GOOD_SIZES, _GOOD_DOCS, 4, 2**40, 2**40), "overflows int64"),
        ((np.array([3, -4, 5], dtype=np.int32), _GOOD_DOCS, 4, 1, 12), r"sizes\[1\] = -4"),
        ((_GOOD_SIZES, np.array([2, 3, 1], dtype=np.int32), 4, 1, 12), r"doc_idx\[1\] = 3 is out of range for 3"),
        ((_GOOD_SIZES, np.array([2, -1, 1], dtype=np.int32), 4, 1, 12), r"doc_idx\[1\] = -1 is out of range"),
        ((_GOOD_SIZES, _GOOD_DOCS, 4, 1, 13), "tokens_per_epoch is inconsistent with doc_idx"),
        ((_GOOD_SIZES, _GOOD_DOCS, 4, 2, 12), "tokens_per_epoch is inconsistent with doc_idx"),
        ((_GOOD_SIZES, np.array([], dtype=np.int32), 4, 1, 12), "doc_idx covers only 0"),
        ((_GOOD_SIZES.reshape(1, 3), _GOOD_DOCS, 4, 1, 12), "sizes must be one-dimensional"),
    ],
)
def test_sample_idx_errors(impl, args, message):
    with pytest.raises(ValueError, match=message):
        _sample_idx_impl(impl)(*args)


@needs_cpp
def test_sample_idx_error_messages_agree():
    cases = [
        (_GOOD_SIZES, np.array([0, 7], dtype=np.int32), 4, 1, 7),
        (np.array([1, -2], dtype=np.int32), _GOOD_DOCS, 4, 1, 12),
        (_GOOD_SIZES, _GOOD_DOCS, 4, 3, 12),
    ]
    for args in cases:
        with pytest.raises(ValueError) as cpp:
            _helpers.build_sample_idx(*args)
        with pytest.raises(ValueError) as ref:
            build_sample_idx_reference(*args)
        assert str(cpp.value) == str(ref.value)


@SAMPLE_IDX_IMPLS
def test_sample_idx_rejects_non_integer_arrays(impl):
    with pytest.raises(TypeError, match="sizes must be an array of integers"):
        _sample_idx_impl(impl)(_GOOD_SIZES.astype(np.float64), _GOOD_DOCS, 4, 1, 12)


# ---------------------------------------------------------------------------------------------
# build_blending_indices
# ---------------------------------------------------------------------------------------------


@needs_cpp
@SETTINGS
@given(
    st.lists(st.floats(0.0, 1.0, allow_subnormal=False), min_size=1, max_size=8),
    st.booleans(),
    st.integers(0, 300),
)
def test_blending_cpp_matches_reference(weights, normalise, size):
    w = np.asarray(weights, dtype=np.float64)
    if normalise and w.sum() > 0:
        w = w / w.sum()
    dataset_index, dataset_sample_index = _helpers.build_blending_indices(w, size)
    ref_index, ref_sample_index = build_blending_indices_reference(w, size)
    assert dataset_index.dtype == ref_index.dtype == np.int16
    assert dataset_sample_index.dtype == ref_sample_index.dtype == np.int64
    np.testing.assert_array_equal(dataset_index, ref_index)
    np.testing.assert_array_equal(dataset_sample_index, ref_sample_index)
    # Each dataset's samples are drawn in order 0, 1, 2, ...
    for d in range(len(w)):
        np.testing.assert_array_equal(dataset_sample_index[dataset_index == d], np.arange((dataset_index == d).sum()))


@needs_cpp
@pytest.mark.parametrize(
    "weights", [[0.5, 0.3, 0.2], [0.9, 0.1], [1 / 3, 1 / 3, 1 / 3], [0.7, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]]
)
def test_blending_every_prefix_is_within_one_sample(weights):
    size = 1000
    w = np.asarray(weights)
    dataset_index, _ = _helpers.build_blending_indices(w, size)
    counts = np.cumsum(np.eye(len(w), dtype=np.int64)[dataset_index], axis=0)  # counts[n - 1, d] after n samples
    targets = np.outer(np.arange(1, size + 1), w)
    assert np.abs(counts - targets).max() <= 1.0


@needs_cpp
def test_blending_ties_go_to_the_first_dataset():
    dataset_index, dataset_sample_index = _helpers.build_blending_indices(np.array([0.25] * 4), 8)
    assert dataset_index.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert dataset_sample_index.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


@BLENDING_IMPLS
@pytest.mark.parametrize(
    "weights, size, message",
    [
        (np.array([], dtype=np.float64), 10, "weights must not be empty"),
        (np.array([0.5, -0.1, 0.6]), 10, r"weights\[1\] = -0.1"),
        (np.array([0.5, np.nan]), 10, "finite and non-negative"),
        (np.array([0.5, np.inf]), 10, "finite and non-negative"),
        (np.full(32768, 1 / 32768), 10, "at most 32767 datasets"),
        (np.array([1.0]), -1, "size must be non-negative"),
        (np.ones((2, 2)), 10, "one-dimensional"),
    ],
)
def test_blending_errors(impl, weights, size, message):
    with pytest.raises(ValueError, match=message):
        _blending_impl(impl)(weights, size)


@needs_cpp
def test_blending_accepts_32767_datasets():
    dataset_index, _ = _helpers.build_blending_indices(np.full(32767, 1 / 32767), 32767)
    assert dataset_index[-1] == 32766
    assert np.array_equal(np.sort(dataset_index), np.arange(32767))


# ---------------------------------------------------------------------------------------------
# The front: megatron.data.helpers
# ---------------------------------------------------------------------------------------------


@needs_cpp
def test_front_uses_the_extension():
    sizes, doc_idx = _GOOD_SIZES, _GOOD_DOCS
    np.testing.assert_array_equal(
        helpers.build_sample_idx(sizes, doc_idx, 4, 1, 12), _helpers.build_sample_idx(sizes, doc_idx, 4, 1, 12)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        helpers.build_blending_indices(np.array([0.5, 0.5]), 4)


@needs_cpp
def test_front_falls_back_to_the_reference_and_warns_once(monkeypatch):
    monkeypatch.setattr(helpers, "_helpers", None)
    monkeypatch.setattr(helpers, "_warned", False)
    assert not helpers.helpers_compiled()
    with pytest.warns(RuntimeWarning, match="pip install -e"):
        got = helpers.build_sample_idx(_GOOD_SIZES, _GOOD_DOCS, 4, 1, 12)
    np.testing.assert_array_equal(got, _helpers.build_sample_idx(_GOOD_SIZES, _GOOD_DOCS, 4, 1, 12))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        index, sample_index = helpers.build_blending_indices(np.array([0.5, 0.3, 0.2]), 50)
    ref = _helpers.build_blending_indices(np.array([0.5, 0.3, 0.2]), 50)
    np.testing.assert_array_equal(index, ref[0])
    np.testing.assert_array_equal(sample_index, ref[1])
