"""A scaled-down Qwen3-Next (Megatron-LM's flags: ``--experimental-attention-variant gated_delta_net``, three Gated
DeltaNet layers then one gated full-attention layer, zero-centred norms, partial rotary embeddings, QK-norm, a MoE with
a gated shared expert) on packed documents reproduces its single-process losses (within 1e-5; fp32, dropout off) under
tensor parallelism with sequence parallelism, pipelining, and expert parallelism with the distributed optimizer.
A run saved at step 5 resumes bitwise. (Context parallelism of the linear-attention layers is not built yet:
docs/hybrid.md.)"""

from __future__ import annotations

import pytest

from tests.functional.launch import FIVE, TINY, parity_layouts, reference_runs

pytestmark = pytest.mark.slow

PACKED = ["--mock-document-length", "12", "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
QWEN3_NEXT = [*FIVE, *PACKED, "--num-layers", "4", "--position-embedding-type", "rope", "--rotary-percent", "0.25",
              "--normalization", "RMSNorm", "--apply-layernorm-1p", "--swiglu", "--group-query-attention",
              "--num-query-groups", "2", "--kv-channels", "16", "--qk-layernorm", "--attention-output-gate",
              "--disable-bias-linear", "--untie-embeddings-and-output-weights",
              "--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "4",
              "--linear-num-key-heads", "2", "--linear-num-value-heads", "4", "--linear-key-head-dim", "16",
              "--linear-value-head-dim", "8", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size",
              "32", "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate", "--moe-aux-loss-coeff",
              "0.01"]
TEN = ["--max-steps", str(TINY[TINY.index("--max-steps") + 1])]  # the 10-step schedule a resumed run goes on in
reference_runs({"qwen3-next-5": QWEN3_NEXT, "qwen3-next-10": [*QWEN3_NEXT, *TEN]})

LAYOUTS = parity_layouts({f"qwen3-next-{name}": (2, [*QWEN3_NEXT, *flags]) for name, flags in {
    # the key heads (and their value heads) split over the tensor-parallel ranks; the experts too (etp = tp)
    "tp2-sp": ["--tp", "2", "--sequence-parallel"],
    "pp2": ["--pp", "2"],  # two linear-attention layers on each stage; the full attention on the last
    # each rank's two chunks: the convolution's halos and the recurrent states entering them from the other rank
    "cp2": ["--cp", "2"],
    "ep2-distributed-optimizer": ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"],
}.items()})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_qwen3_next_layouts_equal_single_process(parity, references, layout):
    parity.assert_matches(layout, references["qwen3-next-5"])


SAVED, RESUMED = "qwen3-next-saved", "qwen3-next-resumed"  # one process each: steps 1-5, then 6-10 from the save
parity_layouts({
    SAVED: (1, [*QWEN3_NEXT, *TEN, "--save-interval", "5", "--exit-interval", "5"]),
    RESUMED: (1, [*QWEN3_NEXT, *TEN, "--load", f"{{runs}}/{SAVED}/step_5"], (SAVED,)),
})


@pytest.mark.shared_runs(SAVED, RESUMED)
def test_qwen3_next_resumes_bitwise(parity, references):
    """Saved at step 5 and resumed: the losses and gradient norms are the uninterrupted run's, bit for bit (the
    linear-attention layers' parameters, A_log and dt_bias among them, and their optimizer states round-trip)."""
    train, valid, norms = references["qwen3-next-10"]
    saved_train, _, saved_norms = parity.curves(SAVED)
    got_train, got_valid, got_norms = parity.curves(RESUMED)
    assert saved_train + got_train == train and saved_norms + got_norms == norms
    assert got_valid == valid[1:]
