"""Scaled-down Qwen3-MoE and gpt-oss shapes reproduce their single-process losses and gradient norms (within 1e-5;
fp32, dropout off) under tensor parallelism with sequence parallelism, pipelining, context parallelism with each
communication type and expert parallelism, every run on packed documents with per-document attention (mock
documents of 12 tokens on average, ``--reset-attention-mask --reset-position-ids --eod-mask-loss``). Every layout
takes 2 ranks (on 2 cores a 4-rank launch costs about twice as much per run).

- Qwen3-MoE: grouped-query attention with QK-norm (per-head RMSNorm of queries and keys), no linear biases, a dense
  first layer then 4 experts, top 2 renormalised (transformers' ``norm_topk_prob``), no shared expert.
- gpt-oss: a sliding window of 5 keys in the first layer and full attention in the second (``--window-attn-skip-freq
  2``), learnable attention sinks, YaRN rotary embeddings (the ramp unrounded), linear biases everywhere (attention,
  the experts, the router) and the experts' clamped quick GeGLU with its offset. Under cp 2 a rank's chunks are 8 of
  the 32 tokens: the window of 5 is shorter than a chunk (p2p, a2a); a second reference with a window of 11, longer
  than a chunk, runs under all_gather.
"""

from __future__ import annotations

import pytest

from tests.functional.launch import FIVE, parity_layouts, reference_runs, whole_share

pytestmark = pytest.mark.slow

PACKED = ["--mock-document-length", "12", "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
QWEN3_MOE = [*FIVE, *PACKED, "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
             "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "24", "--qk-layernorm",
             "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--num-experts", "4",
             "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "[0,1]",
             "--moe-aux-loss-coeff", "0.01"]
GPT_OSS = [*FIVE, *PACKED, "--position-embedding-type", "yarn", "--rotary-base", "150000", "--rotary-scaling-factor",
           "4", "--original-max-position-embeddings", "8", "--no-yarn-correction-range-round-to-int", "--normalization",
           "RMSNorm", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
           "--untie-embeddings-and-output-weights", "--quick-geglu", "--glu-linear-offset", "1",
           "--activation-func-clamp-value", "7", "--window-size", "5,0", "--window-attn-skip-freq", "2",
           "--softmax-type", "learnable", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
           "--moe-aux-loss-coeff", "0.01"]
WIDE = [*GPT_OSS, "--window-size", "11,0"]  # a window longer than a cp 2 chunk (8 tokens)
# the layouts but pp 2 take the global batch in one micro-batch (``whole_share``), and so do their references (a MoE
# model's auxiliary losses are per micro-batch); pp 2 pipelines 4 micro-batches against the 4-micro-batch reference
reference_runs({"qwen3-moe-5": QWEN3_MOE, "qwen3-moe-5-whole": [*QWEN3_MOE, *whole_share()], "gpt-oss-5": GPT_OSS,
                "gpt-oss-5-whole": [*GPT_OSS, *whole_share()], "gpt-oss-wide-5": [*WIDE, *whole_share()]})


def _whole(name: str) -> list[str]:
    return [] if name == "pp2" else whole_share()

QWEN3_LAYOUTS = parity_layouts({f"qwen3-moe-{name}": (2, [*QWEN3_MOE, *_whole(name), *flags]) for name, flags in {
    "tp2-sp": ["--tp", "2", "--sequence-parallel"],  # the experts over the tensor-parallel ranks too (etp = tp)
    "pp2": ["--pp", "2"],
    "cp2-p2p-ep2": ["--cp", "2", "--cp-comm-type", "p2p", "--expert-model-parallel-size", "2"],
    "cp2-all_gather": ["--cp", "2", "--cp-comm-type", "all_gather"],
    "cp2-a2a": ["--cp", "2", "--cp-comm-type", "a2a"],
}.items()})
GPT_OSS_LAYOUTS = parity_layouts({f"gpt-oss-{name}": (2, [*GPT_OSS, *_whole(name), *flags]) for name, flags in {
    "tp2-sp-etp1-ep2": ["--tp", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
                        "--expert-model-parallel-size", "2"],
    "pp2": ["--pp", "2"],
    "cp2-p2p": ["--cp", "2", "--cp-comm-type", "p2p"],
    "cp2-a2a-ep2": ["--cp", "2", "--cp-comm-type", "a2a", "--expert-model-parallel-size", "2"],
}.items()})
WIDE_LAYOUTS = parity_layouts({"gpt-oss-wide-cp2-all_gather": (2, [*WIDE, *whole_share(), "--cp", "2",
                                                                   "--cp-comm-type", "all_gather"])})


@pytest.mark.parametrize("layout", QWEN3_LAYOUTS)
def test_qwen3_moe_losses_equal_single_process(parity, references, layout):
    parity.assert_matches(layout, references["qwen3-moe-5" if layout.endswith("-pp2") else "qwen3-moe-5-whole"])


@pytest.mark.parametrize("layout", GPT_OSS_LAYOUTS)
def test_gpt_oss_losses_equal_single_process(parity, references, layout):
    parity.assert_matches(layout, references["gpt-oss-5" if layout.endswith("-pp2") else "gpt-oss-5-whole"])


@pytest.mark.parametrize("layout", WIDE_LAYOUTS)
def test_gpt_oss_window_longer_than_a_chunk_equals_single_process(parity, references, layout):
    parity.assert_matches(layout, references["gpt-oss-wide-5"])


def test_the_window_and_the_documents_change_the_model(references):
    """The runs above would agree without the window or the documents doing anything: the two windows give
    other losses."""
    assert references["gpt-oss-5-whole"][0] != pytest.approx(references["gpt-oss-wide-5"][0], rel=1e-4)
