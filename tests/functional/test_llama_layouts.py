"""The Llama-shaped GPT (rotary positions, RMSNorm, SwiGLU, grouped-query attention, untied output
layer, no linear biases; with Qwen3's per-head RMSNorm on queries and keys, ``--qk-layernorm``, whose
gradients each tensor-parallel rank computes for its own heads) reproduces its single-process losses under
every parallel layout, with Megatron-LM's recompute methods folded in (recompute changes no result)."""

from __future__ import annotations

import pytest

from tests.functional.launch import TINY, parity_layouts, reference_runs, whole_share

pytestmark = pytest.mark.slow

LLAMA = [*TINY, "--num-layers", "4", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear", "--qk-layernorm"]
UNIFORM2 = ["--use-recompute", "--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "2"]
BLOCK1 = ["--use-recompute", "--recompute-granularity", "full", "--recompute-method", "block",
          "--recompute-num-layers", "1"]


# Qwen2's attention (Megatron-LM's --add-qkv-bias): a bias on the fused query/key/value projection alone
QWEN2 = [*LLAMA[:-1], "--add-qkv-bias"]
reference_runs({"llama": LLAMA, "qwen2": QWEN2})


@pytest.fixture(scope="module")
def llama_reference(references):
    """(train losses, validation losses, gradient norms) of the Llama-shaped TINY in one process."""
    return references["llama"]


LAYOUTS = parity_layouts({
    "llama-tp2": (2, [*LLAMA, *whole_share(), "--tp", "2"]),
    "llama-tp2-sp": (2, [*LLAMA, *whole_share(), "--tp", "2", "--sequence-parallel"]),
    # interleaved pipeline: each of the 4 chunks recomputes its first (only) layer; untied head on the last stage
    "llama-pp2-vpp2-block": (2, [*LLAMA, "--pp", "2", "--vpp", "2", *BLOCK1]),
    # stage 3 gathers each layer around its use, also inside a two-layer recompute unit's replay
    "llama-stage3-dp2-sharding2-uniform2": (4, [*LLAMA, "--dp", "2", "--sharding", "2", "--sharding-stage", "3",
                                                *UNIFORM2]),
})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_llama_shaped_losses_equal_single_process(parity, llama_reference, layout):
    parity.assert_matches(layout, llama_reference)


QWEN2_LAYOUTS = parity_layouts({"qwen2-tp2-sp": (2, [*QWEN2, *whole_share(), "--tp", "2", "--sequence-parallel"])})


@pytest.mark.parametrize("layout", QWEN2_LAYOUTS)
def test_a_bias_on_the_qkv_projection_alone_splits_with_its_heads(parity, references, layout):
    """The QKV bias is column-parallel with its rows (each rank its key/value groups' entries): tp 2 with sequence
    parallelism equals one process."""
    parity.assert_matches(layout, references["qwen2"])


@pytest.mark.parametrize("layout", parity_layouts({"bad-llama-query-groups-tp2": (
    2, [*LLAMA, "--num-query-groups", "1", "--tp", "2"])}))
def test_query_groups_not_divisible_by_tp_fail_before_any_process_group(parity, layout):
    parity.assert_fails_on_every_rank(
        layout, "Model.num_query_groups (1) must be divisible by the tensor-parallel size mp_degree (2)")


@pytest.mark.parametrize("layout", parity_layouts({
    "llama-pp2-vpp2-saved": (2, [*LLAMA, "--pp", "2", "--vpp", "2", "--save-interval", "5"]),
    "llama-resumed-tp2": (2, [*LLAMA, "--tp", "2", "--load", "{runs}/llama-pp2-vpp2-saved/step_5"],
                          ("llama-pp2-vpp2-saved",))})[1:])
def test_resume_under_another_layout_continues_the_run(parity, llama_reference, layout):
    """Saved under pp2 x vpp2 (the untied output layer on the last stage is written, as every parameter of
    its own) and resumed under tp2: the single-process run's steps 6-10."""
    assert parity.curves(layout)[0] == pytest.approx(llama_reference[0][5:], rel=1e-5)
