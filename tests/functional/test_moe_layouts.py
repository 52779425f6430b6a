"""Mixture of experts under data, tensor (with and without sequence) and pipeline parallelism and ZeRO stage 3
reproduces the single-process losses and gradient norms (within 1e-5, relative), the balancing losses and the
expert bias included; the expert bias survives a resume at another layout."""

from __future__ import annotations

import pytest

from tests.functional.launch import TINY, parity_layouts

pytestmark = pytest.mark.slow

MOE = [*TINY, "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.1", "--moe-z-loss-coeff",
       "1e-2", "--moe-shared-expert-intermediate-size", "32"]
BIAS = [*TINY, "--num-experts", "4", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "0.01", "--moe-router-load-balancing-type", "seq_aux_loss",
        "--moe-aux-loss-coeff", "0.1", "--save-interval", "5"]
REFERENCE = {"moe": "moe-reference", "bias": "moe-bias-reference"}
parity_layouts({"moe-reference": (1, MOE), "moe-bias-reference": (1, BIAS)})
LAYOUTS = parity_layouts({
    "moe-dp2": (2, [*MOE, "--dp", "2"]),
    "moe-pp2": (2, [*MOE, "--pp", "2"]),
    "moe-tp2": (2, [*MOE, "--tp", "2"]),
    "moe-tp2-sp": (2, [*MOE, "--tp", "2", "--sequence-parallel"]),
    "moe-stage3-sharding2": (2, [*MOE, "--sharding", "2", "--sharding-stage", "3", "--use-recompute"]),
    "moe-bias-dp2": (2, [*BIAS, "--dp", "2", "--micro-batch-size", "2"]),
})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_losses_equal_single_process(parity, layout):
    reference = REFERENCE["bias" if layout.startswith("moe-bias") else "moe"]
    parity.assert_matches(layout, parity.curves(reference))


parity_layouts({"moe-bias-pp2-resumed": (2, [*BIAS, "--pp", "2", "--load", "{runs}/moe-bias-reference/step_5"],
                                         ("moe-bias-reference",))})


@pytest.mark.shared_runs("moe-bias-pp2-resumed")
def test_expert_bias_is_saved_and_resumed_across_layouts(parity):
    """The expert bias is no parameter: the checkpoint keeps it (gathered over the pipeline stages) and a resume at
    another layout routes as the uninterrupted run does."""
    train, _, norms = parity.curves("moe-bias-reference")
    resumed_train, _, resumed_norms = parity.curves("moe-bias-pp2-resumed")
    assert resumed_train == pytest.approx(train[5:], rel=1e-5)
    assert resumed_norms == pytest.approx(norms[5:], rel=1e-5)
