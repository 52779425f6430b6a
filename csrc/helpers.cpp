// Dataset index helpers for megatron.data, compiled by setup.py into ``megatron.data._helpers``.
//
// A pure NumPy reference implementation with the same semantics lives in
// megatron/data/helpers_reference.py; the tests check that both agree exactly (values and dtypes).
// Library code should go through megatron/data/helpers.py, which falls back to the reference
// when this extension has not been built.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kMaxDatasets = std::numeric_limits<int16_t>::max();  // 32767

// Converts an array-like of integers to a 1-D C-contiguous int32 array when its values are
// guaranteed to fit (signed integers of at most 4 bytes), else to int64 (which wraps unsigned
// 64-bit values above 2**63 to negatives, caught by the validation below). Mirrored by
// ``_as_index_array`` in helpers_reference.py.
py::array as_index_array(const py::handle& obj, const char* name) {
    py::array arr = py::array::ensure(obj);
    if (!arr) {
        throw py::type_error(std::string(name) + " must be an array of integers");
    }
    const char kind = arr.dtype().kind();
    if (kind != 'i' && kind != 'u') {
        throw py::type_error(std::string(name) + " must be an array of integers, got dtype " +
                             std::string(py::str(arr.dtype())));
    }
    if (arr.ndim() != 1) {
        throw std::invalid_argument(std::string(name) + " must be one-dimensional, got " +
                                    std::to_string(arr.ndim()) + " dimensions");
    }
    py::array out;
    if (kind == 'i' && arr.itemsize() <= 4) {
        out = py::array_t<int32_t, py::array::c_style | py::array::forcecast>::ensure(arr);
    } else {
        out = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
    }
    if (!out) {
        throw py::type_error(std::string(name) + " could not be converted to an integer array");
    }
    return out;
}

struct SampleIdxPlan {
    int64_t num_samples = 0;
    bool int32_output = true;
};

// Validates the inputs (no Python calls: may run without the GIL) and works out the output shape
// and dtype. Throws std::invalid_argument, which pybind11 raises as ValueError.
template <typename SizeT, typename DocT>
SampleIdxPlan plan_sample_idx(const SizeT* sizes, int64_t n_docs, const DocT* doc_idx, int64_t n_doc_idx,
                              int64_t seq_length, int64_t num_epochs, int64_t tokens_per_epoch) {
    SampleIdxPlan plan;
    const int64_t total_tokens_wanted = num_epochs * tokens_per_epoch;  // overflow checked by caller
    plan.num_samples = (total_tokens_wanted - 1) / seq_length;

    int64_t max_size = 0;
    for (int64_t k = 0; k < n_docs; ++k) {
        const int64_t s = static_cast<int64_t>(sizes[k]);
        if (s < 0) {
            throw std::invalid_argument("sizes must be non-negative, got sizes[" + std::to_string(k) +
                                        "] = " + std::to_string(s));
        }
        max_size = std::max(max_size, s);
    }

    int64_t available = 0;  // tokens covered by doc_idx, saturating at INT64_MAX
    for (int64_t k = 0; k < n_doc_idx; ++k) {
        const int64_t d = static_cast<int64_t>(doc_idx[k]);
        if (d < 0 || d >= n_docs) {
            throw std::invalid_argument("doc_idx[" + std::to_string(k) + "] = " + std::to_string(d) +
                                        " is out of range for " + std::to_string(n_docs) + " documents");
        }
        const int64_t s = static_cast<int64_t>(sizes[d]);
        available = (available > kInt64Max - s) ? kInt64Max : available + s;
    }

    // The last sample ends on position num_samples * seq_length, which must exist.
    const int64_t needed = plan.num_samples * seq_length + 1;
    if (available < needed) {
        throw std::invalid_argument(
            "tokens_per_epoch is inconsistent with doc_idx: " + std::to_string(plan.num_samples) +
            " samples of seq_length " + std::to_string(seq_length) + " (num_epochs=" + std::to_string(num_epochs) +
            ", tokens_per_epoch=" + std::to_string(tokens_per_epoch) + ") need " + std::to_string(needed) +
            " tokens but doc_idx covers only " + std::to_string(available));
    }

    plan.int32_output = plan.num_samples <= kInt32Max && n_doc_idx <= kInt32Max && max_size <= kInt32Max;
    return plan;
}

// The Megatron-LM loop (add_extra_token = 1): each sample spans seq_length + 1 tokens, the last of
// which is the first token of the next sample. Inputs have been validated by plan_sample_idx.
template <typename SizeT, typename DocT, typename OutT>
void fill_sample_idx(const SizeT* sizes, const DocT* doc_idx, int64_t n_doc_idx, int64_t seq_length,
                     int64_t num_samples, OutT* out) {
    int64_t doc_idx_index = 0;
    int64_t doc_offset = 0;
    out[0] = 0;
    out[1] = 0;
    for (int64_t sample = 1; sample <= num_samples; ++sample) {
        int64_t remaining = seq_length + 1;
        while (remaining != 0) {
            if (doc_idx_index >= n_doc_idx) {  // unreachable after validation; kept as a guard
                throw std::invalid_argument("build_sample_idx ran off the end of doc_idx");
            }
            const int64_t doc_length = static_cast<int64_t>(sizes[doc_idx[doc_idx_index]]) - doc_offset;
            remaining -= doc_length;
            if (remaining <= 0) {
                doc_offset += remaining + doc_length - 1;
                remaining = 0;
            } else {
                ++doc_idx_index;
                doc_offset = 0;
            }
        }
        out[2 * sample] = static_cast<OutT>(doc_idx_index);
        out[2 * sample + 1] = static_cast<OutT>(doc_offset);
    }
}

template <typename SizeT, typename DocT>
py::array build_sample_idx_typed(const py::array& sizes_arr, const py::array& doc_idx_arr, int64_t seq_length,
                                 int64_t num_epochs, int64_t tokens_per_epoch) {
    const auto* sizes = static_cast<const SizeT*>(sizes_arr.data());
    const auto* doc_idx = static_cast<const DocT*>(doc_idx_arr.data());
    const int64_t n_docs = static_cast<int64_t>(sizes_arr.shape(0));
    const int64_t n_doc_idx = static_cast<int64_t>(doc_idx_arr.shape(0));

    SampleIdxPlan plan;
    {
        py::gil_scoped_release release;
        plan = plan_sample_idx(sizes, n_docs, doc_idx, n_doc_idx, seq_length, num_epochs, tokens_per_epoch);
    }
    const auto rows = static_cast<py::ssize_t>(plan.num_samples + 1);
    if (plan.int32_output) {
        py::array_t<int32_t> out({rows, static_cast<py::ssize_t>(2)});
        int32_t* ptr = out.mutable_data();
        py::gil_scoped_release release;
        fill_sample_idx(sizes, doc_idx, n_doc_idx, seq_length, plan.num_samples, ptr);
        return std::move(out);
    }
    py::array_t<int64_t> out({rows, static_cast<py::ssize_t>(2)});
    int64_t* ptr = out.mutable_data();
    py::gil_scoped_release release;
    fill_sample_idx(sizes, doc_idx, n_doc_idx, seq_length, plan.num_samples, ptr);
    return std::move(out);
}

py::array build_sample_idx(const py::object& sizes_obj, const py::object& doc_idx_obj, int64_t seq_length,
                           int64_t num_epochs, int64_t tokens_per_epoch) {
    if (seq_length <= 0) {
        throw std::invalid_argument("seq_length must be positive, got " + std::to_string(seq_length));
    }
    if (num_epochs <= 0) {
        throw std::invalid_argument("num_epochs must be positive, got " + std::to_string(num_epochs));
    }
    if (tokens_per_epoch <= 0) {
        throw std::invalid_argument("tokens_per_epoch must be positive, got " + std::to_string(tokens_per_epoch));
    }
    if (tokens_per_epoch > kInt64Max / num_epochs) {
        throw std::invalid_argument("num_epochs * tokens_per_epoch overflows int64 (num_epochs=" +
                                    std::to_string(num_epochs) + ", tokens_per_epoch=" +
                                    std::to_string(tokens_per_epoch) + ")");
    }
    const py::array sizes = as_index_array(sizes_obj, "sizes");
    const py::array doc_idx = as_index_array(doc_idx_obj, "doc_idx");
    const bool sizes32 = sizes.itemsize() == 4;
    const bool doc32 = doc_idx.itemsize() == 4;
    if (sizes32 && doc32) {
        return build_sample_idx_typed<int32_t, int32_t>(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch);
    }
    if (sizes32) {
        return build_sample_idx_typed<int32_t, int64_t>(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch);
    }
    if (doc32) {
        return build_sample_idx_typed<int64_t, int32_t>(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch);
    }
    return build_sample_idx_typed<int64_t, int64_t>(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch);
}

py::tuple build_blending_indices(const py::object& weights_obj, int64_t size) {
    auto weights_arr = py::array_t<double, py::array::c_style | py::array::forcecast>::ensure(weights_obj);
    if (!weights_arr) {
        throw py::type_error("weights must be an array of floats");
    }
    if (weights_arr.ndim() != 1) {
        throw std::invalid_argument("weights must be one-dimensional, got " + std::to_string(weights_arr.ndim()) +
                                    " dimensions");
    }
    const int64_t num_datasets = static_cast<int64_t>(weights_arr.shape(0));
    if (num_datasets == 0) {
        throw std::invalid_argument("weights must not be empty");
    }
    if (num_datasets > kMaxDatasets) {
        throw std::invalid_argument("at most " + std::to_string(kMaxDatasets) + " datasets can be blended, got " +
                                    std::to_string(num_datasets));
    }
    if (size < 0) {
        throw std::invalid_argument("size must be non-negative, got " + std::to_string(size));
    }
    const double* weights = weights_arr.data();
    for (int64_t d = 0; d < num_datasets; ++d) {
        if (!std::isfinite(weights[d]) || weights[d] < 0.0) {
            throw std::invalid_argument("weights must be finite and non-negative, got weights[" + std::to_string(d) +
                                        "] = " + std::string(py::str(py::float_(weights[d]))));
        }
    }

    py::array_t<int16_t> dataset_index(static_cast<py::ssize_t>(size));
    py::array_t<int64_t> dataset_sample_index(static_cast<py::ssize_t>(size));
    int16_t* di = dataset_index.mutable_data();
    int64_t* dsi = dataset_sample_index.mutable_data();
    {
        py::gil_scoped_release release;
        std::vector<int64_t> current_samples(static_cast<size_t>(num_datasets), 0);
        for (int64_t i = 0; i < size; ++i) {
            const double i_d = std::max(static_cast<double>(i), 1.0);
            int64_t best = 0;
            double best_error = weights[0] * i_d - static_cast<double>(current_samples[0]);
            for (int64_t d = 1; d < num_datasets; ++d) {
                const double error = weights[d] * i_d - static_cast<double>(current_samples[d]);
                if (error > best_error) {
                    best_error = error;
                    best = d;
                }
            }
            di[i] = static_cast<int16_t>(best);
            dsi[i] = current_samples[best];
            ++current_samples[best];
        }
    }
    return py::make_tuple(dataset_index, dataset_sample_index);
}

}  // namespace

PYBIND11_MODULE(_helpers, m) {
    m.doc() = "C++ dataset index helpers for megatron.data (use megatron.data.helpers, not this module).";
    m.def("build_sample_idx", &build_sample_idx, py::arg("sizes"), py::arg("doc_idx"), py::arg("seq_length"),
          py::arg("num_epochs"), py::arg("tokens_per_epoch"),
          "Start (doc_idx index, offset) of each sample; see megatron.data.helpers.build_sample_idx.");
    m.def("build_blending_indices", &build_blending_indices, py::arg("weights"), py::arg("size"),
          "Greedy blending of datasets by weight; see megatron.data.helpers.build_blending_indices.");
}
