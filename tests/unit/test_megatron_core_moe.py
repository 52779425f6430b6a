"""NVIDIA's Megatron Core (``megatron-core``, the test extra's pinned version) as an independent reference: its
``GPTModel`` given our weights (through ``megatron.checkpoint.megatron_lm.core_names``) gives our logits, and after a
backward of the same objective every parameter's gradient, within 1e-5 of the largest magnitude of the tensor.

- The Llama-shaped mixture of experts (rope, RMSNorm, SwiGLU, 2 key/value groups, no biases, untied head; layer 0
  a MoE layer of 4 experts, top-2 softmax router, Switch aux loss with coefficient 0.1, Megatron Core's
  ``allgather`` dispatcher; layer 1 a dense MLP). The objective, on both sides, is the mean per-token
  language-model loss plus the coefficient times the aux loss (each side's aux-loss scaler set to 1); the aux loss
  each side records for the log is compared too, and the aux loss's part of the router's gradient is checked to be
  far above the tolerance. Variants: a shared expert, z-loss and ``seq_aux_loss``; softmax-then-top-1 with a
  capacity (``probs``, padded), these two through our ``alltoall`` dispatcher; the sigmoid router with the expert
  bias and ``aux_loss``; DeepSeek-V3's router (sigmoid with pre-softmax, expert bias, group-limited, scaled) and a
  group-limited, scaled softmax router; ``--qk-layernorm`` (Qwen3-MoE's attention).
- The GPT-2 shape (learned positions, LayerNorm, GELU, biases, tied head), dense; and with GELU experts, no biases;
  and with ``--qk-layernorm`` (a LayerNorm, weight and bias, on each head's queries and keys; with rope, under
  which the key norm's bias changes the scores: without it, softmax cancels it and its gradient is 0, rounding).

Not compared (docs/moe.md says why): ``--moe-token-drop-policy position``, experts or a shared expert with biases.

Megatron Core runs on the CPU in this process as ../shared/MEGATRON_CORE_ON_CPU.md measured: a one-process gloo
group, its model-parallel state of size 1, and three CUDA assumptions patched for the module's tests (the current
device, the RNG tracker's ``fork`` and ``te_general_gemm``); the causal mask is passed explicitly (its default
mask is built on CUDA). The fixture restores the patches and the default RNG's state, and destroys the group and
both parallel states after.

``megatron-core`` installs ``megatron/core`` into site-packages' ``megatron`` folder, which this project's own
``megatron`` package shadows: the fixture adds that folder to our package's search path for these tests.
"""

from __future__ import annotations

import pytest
import torch

from megatron import moe
from megatron.checkpoint.megatron_lm.core_names import from_megatron_core
from tests.unit.megatron_core_reference import (
    CORE_WARNINGS,
    LLAMA,
    MOE,
    TOLERANCE,
    assert_close_to_scale,
    build_pair,
    core_forward,
    megatron_core,
    tokens_and_labels,
)

pytestmark = CORE_WARNINGS


@pytest.fixture(scope="module")
def mcore():
    with megatron_core() as env:
        yield env


def compare(mcore, *flags):
    config, ours, theirs = build_pair(mcore, *flags)
    tokens, labels = tokens_and_labels()
    with torch.no_grad():
        assert_close_to_scale(core_forward(theirs, tokens), ours(tokens), "logits")
    # the same objective: mean LM loss + coefficient x aux loss (each side's aux-loss gradient scale 1)
    moe.set_aux_loss_scale(1.0)
    mcore["scaler"].set_loss_scale(torch.tensor(1.0))
    moe.before_step(ours, micro_batches=1, dp_group=None, loss_scale=1.0)
    mcore["tracker"].clear_aux_losses_tracker()
    ours(tokens, labels=labels).mean().backward()
    core_forward(theirs, tokens, labels).mean().backward()
    swiglu = bool(config.model.swiglu)
    theirs_grads = dict(from_megatron_core(n, p.grad, swiglu) for n, p in theirs.named_parameters())
    ours_grads = {n: p.grad for n, p in ours.named_parameters()}
    assert set(theirs_grads) == set(ours_grads)
    for name, grad in ours_grads.items():
        assert_close_to_scale(theirs_grads[name], grad, f"the gradient of {name}")
    return ours, theirs


def test_llama_moe_logits_and_gradients_equal_megatron_cores(mcore):
    ours, _ = compare(mcore, *LLAMA, *MOE)
    layer = ours.layers["0"].mlp
    assert isinstance(layer, moe.MoELayer) and not isinstance(ours.layers["1"].mlp, moe.MoELayer)
    # the log's load_balancing_loss (before its coefficient; one MoE layer) and Megatron Core's record of it
    logged = float(mcore["tracker"].get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"][0])
    ours_logged = moe.after_step(ours, applied=False)["load_balancing_loss"]
    assert abs(ours_logged - logged) <= TOLERANCE * logged, (ours_logged, logged)
    # the aux loss's part of the router's gradient is far above the tolerance: the comparison counted it
    tokens, labels = tokens_and_labels()
    with_aux = layer.router.weight.grad.clone()
    ours.zero_grad()
    moe.set_aux_loss_scale(0.0)
    ours(tokens, labels=labels).mean().backward()
    moe.set_aux_loss_scale(1.0)
    assert float((with_aux - layer.router.weight.grad).abs().max()) > 100 * TOLERANCE * float(with_aux.abs().max())


ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]  # ours through the other dispatcher (theirs: allgather)


@pytest.mark.parametrize("flags", [
    [*ALLTOALL, "--moe-shared-expert-intermediate-size", "12", "--moe-ffn-hidden-size", "8",
     "--moe-z-loss-coeff", "0.01", "--moe-router-load-balancing-type", "seq_aux_loss"],
    [*ALLTOALL, "--moe-router-pre-softmax", "--moe-router-topk", "1", "--moe-expert-capacity-factor", "0.5",
     "--moe-token-drop-policy", "probs", "--moe-pad-expert-input-to-capacity"],  # 4 experts x 2 kept of 16 tokens
    ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"],
    # DeepSeek-V3's router: sigmoid (with pre-softmax, as its configurations set), expert bias, 2 groups of 2
    # experts each token choosing its best group, the probabilities scaled
    ["--moe-router-score-function", "sigmoid", "--moe-router-pre-softmax", "--moe-router-enable-expert-bias",
     "--moe-router-num-groups", "2", "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5"],
    [*ALLTOALL, "--moe-router-num-groups", "2", "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor",
     "1.5"],
    ["--qk-layernorm"],  # Qwen3-MoE's attention: RMSNorm on each head's queries and keys
    # Qwen2-MoE's gated shared expert; two losses at once, the global one's counts over the batch
    [*ALLTOALL, "--moe-shared-expert-intermediate-size", "12", "--moe-shared-expert-gate",
     "--moe-router-load-balancing-type", "aux_loss", "global_aux_loss", "--moe-aux-loss-coeff", "0.1", "0.05"],
    # Sinkhorn routing (training: the balanced choice), top-1 (sigmoid probabilities) and top-2 with a z-loss
    ["--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0", "--moe-router-topk", "1"],
    [*ALLTOALL, "--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0", "--moe-z-loss-coeff",
     "0.01"],
], ids=["alltoall_shared_expert_z_loss_seq_aux_loss", "alltoall_pre_softmax_top1_capacity",
        "sigmoid_expert_bias_aux_loss", "deepseek_v3_router", "softmax_group_limited_scaled", "qk_layernorm",
        "alltoall_gated_shared_expert_aux_and_global_aux", "sinkhorn_top1", "alltoall_sinkhorn_top2_z_loss"])
def test_llama_moe_variants_equal_megatron_cores(mcore, flags):
    compare(mcore, *LLAMA, *MOE, *flags)


@pytest.mark.parametrize("flags", [[], [*MOE, "--moe-layer-freq", "[0,1]", "--disable-bias-linear"],
                                   ["--qk-layernorm", "--position-embedding-type", "rope"]],
                         ids=["dense", "moe_without_biases", "dense_rope_qk_layernorm"])
def test_gpt2_shape_equals_megatron_cores(mcore, flags):
    compare(mcore, *flags)
