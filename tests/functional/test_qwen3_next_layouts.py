"""A scaled-down Qwen3-Next (Megatron-LM's flags: ``--experimental-attention-variant gated_delta_net``, three Gated
DeltaNet layers then one gated full-attention layer, zero-centred norms, partial rotary embeddings, QK-norm, a MoE with
a gated shared expert) on packed documents reproduces its single-process losses (within 1e-5; fp32, dropout off) under
tensor parallelism with sequence parallelism, pipelining, and expert parallelism with the distributed optimizer.
(Context parallelism of the linear-attention layers is not built yet: docs/hybrid.md.)"""

from __future__ import annotations

import pytest

from tests.functional.launch import FIVE, parity_layouts, reference_runs

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
reference_runs({"qwen3-next-5": QWEN3_NEXT})

LAYOUTS = parity_layouts({f"qwen3-next-{name}": (2, [*QWEN3_NEXT, *flags]) for name, flags in {
    # the key heads (and their value heads) split over the tensor-parallel ranks; the experts too (etp = tp)
    "tp2-sp": ["--tp", "2", "--sequence-parallel"],
    "pp2": ["--pp", "2"],  # two linear-attention layers on each stage; the full attention on the last
    "ep2-distributed-optimizer": ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"],
}.items()})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_qwen3_next_layouts_equal_single_process(parity, references, layout):
    parity.assert_matches(layout, references["qwen3-next-5"])
