"""A scaled-down Mamba-2 hybrid (Megatron-LM's flags: ``--is-hybrid-model --hybrid-override-pattern``, Nemotron-H's
kinds of layer: Mamba-2 mixers, attention, MLPs with squared ReLU, a mixture of experts) on packed documents
reproduces its single-process losses (within 1e-5; fp32, dropout off) under tensor parallelism with sequence
parallelism (the Mamba groups split over the ranks), pipelining (the pattern cut over the stages), context
parallelism (packed documents cut across the chunks) and expert parallelism with the distributed optimizer. A run
saved at step 5 resumes bitwise."""

from __future__ import annotations

import pytest

from tests.functional.launch import FIVE, TINY, parity_layouts, reference_runs

pytestmark = pytest.mark.slow

PACKED = ["--mock-document-length", "12", "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
HYBRID = [*FIVE, *PACKED, "--num-layers", "6", "--normalization", "RMSNorm", "--squared-relu", "--disable-bias-linear",
          "--position-embedding-type", "none", "--untie-embeddings-and-output-weights", "--group-query-attention",
          "--num-query-groups", "2", "--is-hybrid-model", "--hybrid-override-pattern", "M-M*-E",
          "--mamba-head-dim", "16", "--mamba-num-groups", "2", "--mamba-state-dim", "16", "--num-experts", "4",
          "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "0.01"]
TEN = ["--max-steps", str(TINY[TINY.index("--max-steps") + 1])]  # the 10-step schedule a resumed run goes on in
reference_runs({"mamba-hybrid-5": HYBRID, "mamba-hybrid-10": [*HYBRID, *TEN]})

LAYOUTS = parity_layouts({f"mamba-hybrid-{name}": (2, [*HYBRID, *flags]) for name, flags in {
    "tp2-sp": ["--tp", "2", "--sequence-parallel"],  # one Mamba group and its heads on each rank
    "pp2": ["--pp", "2"],  # M-M on the first stage, *-E on the last
    "cp2": ["--cp", "2"],  # each chunk's convolution halo and entering scan state from the other rank
    "ep2-distributed-optimizer": ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"],
}.items()})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mamba_hybrid_layouts_equal_single_process(parity, references, layout):
    parity.assert_matches(layout, references["mamba-hybrid-5"])


SAVED, RESUMED = "mamba-hybrid-saved", "mamba-hybrid-resumed"  # one process each: steps 1-5, then 6-10
parity_layouts({
    SAVED: (1, [*HYBRID, *TEN, "--save-interval", "5", "--exit-interval", "5"]),
    RESUMED: (1, [*HYBRID, *TEN, "--load", f"{{runs}}/{SAVED}/step_5"], (SAVED,)),
})


@pytest.mark.shared_runs(SAVED, RESUMED)
def test_mamba_hybrid_resumes_bitwise(parity, references):
    """Saved at step 5 and resumed: the losses and gradient norms are the uninterrupted run's, bit for bit."""
    train, valid, norms = references["mamba-hybrid-10"]
    saved_train, _, saved_norms = parity.curves(SAVED)
    got_train, got_valid, got_norms = parity.curves(RESUMED)
    assert saved_train + got_train == train and saved_norms + got_norms == norms
    assert got_valid == valid[1:]
