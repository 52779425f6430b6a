"""Mixture of experts under every layout reproduces the single-process losses and gradient norms (within 1e-5,
relative; fp32, dropless, dropout off): expert parallelism at ep 2 (and ep 4: the resumed run below), with tensor
parallelism (ep 2 x tp 2, with and without sequence parallelism; the experts' own tensor parallelism etp 1 under
tp 2), pipelining, context parallelism, the distributed optimizer and ZeRO stages 2 and 3 (the experts sharded over
their own ranks), both dispatchers, a shared expert, the balancing losses (aux, sequence aux, z) and the expert bias.
A checkpoint saved at ep 2 x tp 2 resumes at ep 4 and in one process as the uninterrupted run goes on.
The global-batch aux loss at ep 2 x dp 2 and tp 2, Sinkhorn routing at tp 2 (sequence parallel) x ep 2, both with
the shared expert's gate, equal their one-process runs over the same global batch.

The layouts train 5 steps against 5-step references (the resumed ones steps 6-10 of a 10-step reference); each
world size is one shared launch."""

from __future__ import annotations

import pytest

from tests.functional.launch import FIVE, TINY, parity_layouts, reference_runs, whole_share

pytestmark = pytest.mark.slow

MOE = [*FIVE, "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.1", "--moe-z-loss-coeff",
       "1e-2", "--moe-shared-expert-intermediate-size", "32"]
BIAS = [*TINY, "--num-experts", "4", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "0.01", "--moe-router-load-balancing-type", "seq_aux_loss",
        "--moe-aux-loss-coeff", "0.1"]
# the layouts without data parallelism or pipelining take the global batch in one micro-batch (``whole_share``), and
# so does their reference: a MoE model's auxiliary losses are per micro-batch
WHOLE = {"tp2", "tp2-sp-etp1-ep2", "cp2-ep2"}
reference_runs({"moe-5": MOE, "moe-5-whole": [*MOE, *whole_share()], "moe-bias-10": BIAS})

EP2, EP4 = ["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size", "4"]
ALLGATHER = ["--moe-token-dispatcher-type", "allgather"]
LAYOUTS = parity_layouts({f"moe-{name}": (n, [*MOE, *(whole_share() if name in WHOLE else []), *flags])
                          for name, (n, flags) in {
    "ep2-allgather-distributed-optimizer": (2, ["--use-distributed-optimizer", *EP2, *ALLGATHER]),
    "tp2": (2, ["--tp", "2"]),  # the experts cut over tp (etp = tp), the sequence split over tp for the router
    "tp2-sp-etp1-ep2": (2, ["--tp", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1", *EP2]),
    "cp2-ep2": (2, ["--cp", "2", *EP2]),
    # the token exchange overlapped with the shared expert and the experts' weight gradients (megatron/moe/overlap.py)
    "ep2-zero2-overlap": (2, ["--sharding", "2", "--sharding-stage", "2", *EP2, "--moe-shared-expert-overlap",
                              "--delay-wgrad-compute"]),
    "ep2-tp2-sp-allgather": (4, ["--tp", "2", "--sequence-parallel", "--dp", "2", *EP2, *ALLGATHER]),
    "ep2-pp2": (4, ["--pp", "2", "--dp", "2", *EP2]),
    # the expert states sharded over their 2 expert-data-parallel ranks, parameters gathered layer by layer
    "ep2-zero3-recompute": (4, ["--sharding", "2", "--dp", "2", "--sharding-stage", "3", "--use-recompute", *EP2]),
}.items()})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_losses_equal_single_process(parity, references, layout):
    parity.assert_matches(layout, references["moe-5-whole" if layout.removeprefix("moe-") in WHOLE else "moe-5"])


# the global-batch aux loss (its counts summed over the data-parallel ranks) with Qwen2-MoE's gated shared expert,
# and Sinkhorn routing (its balanced assignment over the micro-batch's tokens, split over tp 2 under sequence
# parallelism) with the gate: each layout takes the global batch in one micro-batch a step, and so does its reference
GATED = [*MOE, "--moe-shared-expert-gate"]
GLOBAL = [*GATED, "--moe-router-load-balancing-type", "global_aux_loss"]
SINKHORN = [*GATED, "--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0"]
reference_runs({"moe-global-5-whole": [*GLOBAL, *whole_share()], "moe-sinkhorn-5-whole": [*SINKHORN, *whole_share()]})
BALANCING = parity_layouts({
    "moe-global-ep2-dp2": (2, [*GLOBAL, "--dp", "2", *EP2, *whole_share(2)]),
    "moe-global-tp2": (2, [*GLOBAL, "--tp", "2", *whole_share()]),  # the gate on the whole sequence, replicated
    "moe-sinkhorn-tp2-sp-etp1-ep2": (2, [*SINKHORN, "--tp", "2", "--sequence-parallel",
                                         "--expert-tensor-parallel-size", "1", *EP2, *whole_share()]),
})


@pytest.mark.parametrize("layout", BALANCING)
def test_global_aux_loss_sinkhorn_and_the_shared_expert_gate_equal_single_process(parity, references, layout):
    parity.assert_matches(layout, references["moe-sinkhorn-5-whole" if "sinkhorn" in layout else "moe-global-5-whole"])


SAVED = "moe-bias-ep2-tp2-saved"
RESUMED = parity_layouts({
    SAVED: (4, [*BIAS, "--tp", "2", "--dp", "2", *EP2, "--save-interval", "5", "--exit-interval", "5"]),
    "moe-bias-ep4-resumed": (4, [*BIAS, "--dp", "4", *EP4, "--load", f"{{runs}}/{SAVED}/step_5"], (SAVED,)),
    "moe-bias-ep1-resumed": (1, [*BIAS, "--load", f"{{runs}}/{SAVED}/step_5"], (SAVED,)),
})[1:]


@pytest.mark.shared_runs(SAVED)
def test_expert_bias_at_ep2_tp2_equals_single_process(parity, references):
    """The first half of the saved run (ep 2 x tp 2 without sequence parallelism: the router's sequence split
    over tp, sequence-level aux loss, expert bias) is the reference's first half."""
    train, _, norms = references["moe-bias-10"]
    got_train, _, got_norms = parity.curves(SAVED)  # (it exits at step 5, before that step's validation)
    assert got_train == pytest.approx(train[:5], rel=1e-5) and got_norms == pytest.approx(norms[:5], rel=1e-5)


@pytest.mark.parametrize("layout", RESUMED)
def test_moe_checkpoint_resumes_at_another_expert_layout(parity, references, layout):
    """Saved at ep 2 x tp 2, resumed at ep 4 and in one process: the expert weights (named by their global
    index), their AdamW states and the expert bias come back and training goes on as the uninterrupted run."""
    train, valid, norms = references["moe-bias-10"]
    got_train, got_valid, got_norms = parity.curves(layout)
    assert got_train == pytest.approx(train[5:], rel=1e-5) and got_norms == pytest.approx(norms[5:], rel=1e-5)
    assert got_valid == pytest.approx(valid[1:], rel=1e-5)
