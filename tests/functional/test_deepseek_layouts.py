"""A scaled-down DeepSeek-V3 shape reproduces its single-process losses and gradient norms (within 1e-5; fp32,
dropout off) under tensor parallelism with sequence parallelism, pipelining, and expert x tensor parallelism (ZeRO
and recompute treat its parameters and layers as any other's). The shape: multi-latent attention
(query and key/value LoRA ranks, their RMSNorms, a decoupled rotary part with YaRN's frequencies and
concentration), one dense first layer, then fine-grained experts with a shared expert of its own width under
DeepSeek-V3's router (sigmoid with pre-softmax, expert bias, group-limited, scaled probabilities).

Multi-token prediction is not built yet; context parallelism and the KV cache are refused for multi-latent
attention (tests/unit/test_mla.py)."""

from __future__ import annotations

import pytest

from tests.functional.launch import FIVE, parity_layouts, reference_runs

pytestmark = pytest.mark.slow

DEEPSEEK = [*FIVE, "--num-layers", "4", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
            "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--multi-latent-attention",
            "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
            "--v-head-dim", "12", "--qk-layernorm", "--rotary-scaling-factor", "4", "--mscale", "0.9",
            "--mscale-all-dim", "0.9", "--original-max-position-embeddings", "8",
            "--num-experts", "4", "--moe-layer-freq", "([0]*1+[1]*3)", "--moe-ffn-hidden-size", "32",
            "--moe-shared-expert-intermediate-size", "48", "--moe-router-topk", "2", "--moe-router-score-function",
            "sigmoid", "--moe-router-pre-softmax", "--moe-router-enable-expert-bias", "--moe-router-num-groups", "2",
            "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5", "--moe-router-bias-update-rate",
            "0.01", "--moe-aux-loss-coeff", "0.01", "--moe-router-load-balancing-type", "seq_aux_loss"]
reference_runs({"deepseek-5": DEEPSEEK})

LAYOUTS = parity_layouts({f"deepseek-{name}": (n, [*DEEPSEEK, *flags]) for name, (n, flags) in {
    "tp2-sp": (2, ["--tp", "2", "--sequence-parallel"]),
    "pp2": (2, ["--pp", "2"]),
    "ep2-tp2-sp": (4, ["--tp", "2", "--sequence-parallel", "--dp", "2", "--expert-model-parallel-size", "2"]),
}.items()})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_deepseek_shape_losses_equal_single_process(parity, references, layout):
    parity.assert_matches(layout, references["deepseek-5"])
