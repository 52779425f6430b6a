"""Group-sharded optimizer (ZeRO stages 1-3, offload) alone and composed reproduces the single-process losses (5 steps
against 5-step references); so do bf16 gradient reductions (--grad-reduce-in-bf16, within bf16 rounding) and SGD."""

from __future__ import annotations

import pytest

from tests.functional.launch import FIVE, TINY, losses, parity_layouts, reference_runs

pytestmark = pytest.mark.slow

LAYOUTS = parity_layouts({
    # stage 1 alone; its compositions with dp, tp and pp are stage 2's and 3's below (a superset of its steps: the
    # same sharded optimizer, with the gradients, and the parameters, sharded too) and Megatron's distributed
    # optimizer's over cp and ep (tests/functional/test_context_parallel.py, test_moe_layouts.py)
    "sharding2": (2, [*FIVE, "--sharding", "2"]),
    "stage2-sharding2": (2, [*FIVE, "--sharding", "2", "--sharding-stage", "2"]),
    "stage2-sharding4": (4, [*FIVE, "--sharding", "4", "--sharding-stage", "2", "--micro-batch-size", "2"]),
    "stage2-dp2-sharding2": (4, [*FIVE, "--sharding", "2", "--sharding-stage", "2", "--dp", "2"]),
    "stage2-tp2-sp-sharding2": (4, [*FIVE, "--sharding", "2", "--sharding-stage", "2", "--tp", "2",
                                    "--sequence-parallel"]),
    "stage2-pp2-sharding2": (4, [*FIVE, "--sharding", "2", "--sharding-stage", "2", "--pp", "2"]),
    "stage2-overlap": (2, [*FIVE, "--sharding", "2", "--sharding-stage", "2", "--overlap-grad-reduce"]),
    "stage2-offload": (2, [*FIVE, "--sharding", "2", "--sharding-stage", "2", "--sharding-offload"]),
    "stage3-sharding2": (2, [*FIVE, "--sharding", "2", "--sharding-stage", "3"]),
    "stage3-sharding4": (4, [*FIVE, "--sharding", "4", "--sharding-stage", "3", "--micro-batch-size", "2"]),
    "stage3-dp2-sharding2": (4, [*FIVE, "--sharding", "2", "--sharding-stage", "3", "--dp", "2"]),
    "stage3-tp2-sp-sharding2": (4, [*FIVE, "--sharding", "2", "--sharding-stage", "3", "--tp", "2",
                                    "--sequence-parallel"]),
    "stage3-pp2-sharding2": (4, [*FIVE, "--sharding", "2", "--sharding-stage", "3", "--pp", "2"]),
    "stage3-pp2-vpp2-sharding2": (4, [*FIVE, "--sharding", "2", "--sharding-stage", "3", "--pp", "2", "--vpp", "2",
                                      "--num-layers", "4"]),
    "stage3-offload": (2, [*FIVE, "--sharding", "2", "--sharding-stage", "3", "--sharding-offload"]),
    "stage3-recompute": (2, [*FIVE, "--sharding", "2", "--sharding-stage", "3", "--use-recompute"]),
})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_losses_equal_single_process(parity, references, layout):
    parity.assert_matches(layout, references["tiny4-5" if layout == "stage3-pp2-vpp2-sharding2" else "tiny-5"])


BAD = {"bad-sharding-stage-4": "sharding_stage must be one of 1, 2, 3, got 4",
       "bad-sharding-degree": "world size 2 is not divisible by mp_degree x pp_degree x sharding_degree = 4"}
parity_layouts({"bad-sharding-stage-4": (2, [*TINY, "--sharding", "2", "--sharding-stage", "4"]),
                "bad-sharding-degree": (2, [*TINY, "--sharding", "4"])})


@pytest.mark.parametrize("layout", list(BAD))
def test_bad_sharding_fails_on_every_rank(parity, layout):
    parity.assert_fails_on_every_rank(layout, BAD[layout])


reference_runs({"tiny-bf16": [*TINY, "--bf16"], "tiny-fp16": [*TINY, "--fp16"]})
LOW_PRECISION = parity_layouts({f"{precision}-stage{stage}-sharding2": (2, [*TINY, f"--{precision}", "--sharding", "2",
                                                                            "--sharding-stage", stage])
                                for stage in ("1", "2", "3") for precision in ("bf16", "fp16")})


@pytest.mark.parametrize("layout", LOW_PRECISION)
def test_low_precision_sharded_run_tracks_unsharded(parity, references, layout):
    single = references[f"tiny-{layout.split('-')[0]}"][0]
    # The fp32 main gradients are summed over the ranks in another order, so a bf16/fp16 rounding
    # of an updated weight can land one unit apart; over 10 steps that stays far below 1e-3.
    assert parity.curves(layout)[0] == pytest.approx(single, rel=1e-3)


# --grad-reduce-in-bf16: bf16 gradient buffers (micro-batches accumulated and the data-parallel reduction run in bf16,
# upcast to fp32 for the step) under plain data parallelism, ZeRO stage 2 with offload and stage 3, against one
# process with the same flag. What bf16 rounding allows: a layout sums the same gradients in another order and rounds
# to bf16 at other points (one process after each micro-batch's addition, dp2 after each rank's two and after the
# all-reduce), each rounding moving an element by up to half a bf16 unit (2**-9 relative); so the first step's
# gradient norm, before any update, moves by a few such units at most (bound 2**-7, measured 2.4e-5); then the bf16
# weights differ wherever an update crosses a rounding boundary, and the losses drift as bf16 training's with fp32
# reductions do (rel 1e-3 above). The yardstick is that fp32 reduction's own gap (bf16-stage1-sharding2 against
# tiny-bf16: 4.1e-5 at most, measured); the bf16 reduction's is of the same size (measured 2.1e-5 to 3.1e-5): at most
# twice it.
BF16_REDUCE = ["--bf16", "--grad-reduce-in-bf16"]
reference_runs({"tiny-bf16-gr": [*TINY, *BF16_REDUCE]})
BF16_REDUCE_LAYOUTS = parity_layouts({
    "bf16-gr-dp2": (2, [*TINY, *BF16_REDUCE, "--dp", "2", "--save-interval", "5"]),  # all-reduce in bf16
    "bf16-gr-stage2-offload": (2, [*TINY, *BF16_REDUCE, "--sharding", "2", "--sharding-stage", "2",
                                   "--sharding-offload"]),  # reduce-scatter in bf16, upcast into the CPU copy
    "bf16-gr-stage3-sharding2": (2, [*TINY, *BF16_REDUCE, "--sharding", "2", "--sharding-stage", "3"]),
})


def _gap(got: list[float], want: list[float]) -> float:
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


@pytest.mark.parametrize("layout", BF16_REDUCE_LAYOUTS)
@pytest.mark.shared_runs("bf16-stage1-sharding2")
def test_bf16_reduction_tracks_one_process_within_bf16_rounding(parity, references, layout):
    (train, valid, norms), (want_train, want_valid, want_norms) = parity.curves(layout), references["tiny-bf16-gr"]
    assert len(train) == len(want_train) == 10
    assert abs(norms[0] - want_norms[0]) <= 2.0**-7 * want_norms[0]  # step 1: the same weights, other roundings
    assert train == pytest.approx(want_train, rel=1e-3)
    assert valid == pytest.approx(want_valid, rel=1e-3)
    yardstick = _gap(parity.curves("bf16-stage1-sharding2")[0], references["tiny-bf16"][0])
    assert 0 < _gap(train, want_train) <= 2 * yardstick


@pytest.mark.parametrize("layout", parity_layouts({"bf16-gr-dp2-resumed": (
    2, [*TINY, *BF16_REDUCE, "--dp", "2", "--load", "{runs}/bf16-gr-dp2/step_5"], ("bf16-gr-dp2",))}))
def test_a_run_with_bf16_gradients_resumes_bitwise(parity, layout):
    """Gradients are not saved (each step starts from zero): steps 6-10 resumed from step 5 are the saved run's."""
    saved = parity.outcome("bf16-gr-dp2").check()
    assert losses(parity.outcome(layout).check()) == losses(saved)[5:]


# SGD (--optimizer sgd): its momentum sharded by ZeRO stage 3 over two ranks, against one process; resumed bitwise
# from the momentum pieces the two ranks saved.
SGD = ["--optimizer", "sgd", "--sgd-momentum", "0.9", "--lr", "0.3", "--weight-decay", "0.1"]
reference_runs({"sgd-10": [*TINY, *SGD]})
SGD_SHARDED = parity_layouts({"sgd-stage3-sharding2": (2, [*TINY, *SGD, "--sharding", "2", "--sharding-stage", "3",
                                                            "--save-interval", "5"])})


@pytest.mark.parametrize("layout", SGD_SHARDED)
def test_sharded_sgd_equals_single_process(parity, references, layout):
    parity.assert_matches(layout, references["sgd-10"])


@pytest.mark.parametrize("layout", parity_layouts({"sgd-stage3-sharding2-resumed": (
    2, [*TINY, *SGD, "--sharding", "2", "--sharding-stage", "3", "--load", "{runs}/sgd-stage3-sharding2/step_5"],
    ("sgd-stage3-sharding2",))}))
def test_sharded_sgd_resumes_bitwise(parity, layout):
    saved = parity.outcome("sgd-stage3-sharding2").check()
    assert losses(parity.outcome(layout).check()) == losses(saved)[5:]
