"""A scaled-down DeepSeek-V3 shape reproduces its single-process losses, multi-token prediction losses and gradient
norms (within 1e-5; fp32, dropout off) under tensor parallelism with sequence parallelism, expert x tensor
parallelism (the experts over the tensor-parallel ranks), context parallelism with each communication type (a2a
with the experts over the context-parallel ranks), pipelining, and a checkpoint saved under pipelining resumes under
expert parallelism with ZeRO-3 as the uninterrupted run goes on. Every layout takes 2 ranks (on 2 cores a 4-rank
launch costs about twice as much per run; the experts cut over tp as well, etp = tp, are
tests/functional/test_moe_layouts.py's, the multi-latent attention layer at cp 2 x tp 2 + sp and with packed
documents tests/distributed/test_context_parallel_attention.py's). The shape: multi-latent attention (query and
key/value LoRA ranks, their RMSNorms, a decoupled rotary part with YaRN's frequencies and concentration), one dense
first layer, then fine-grained experts with a shared expert of its own width under DeepSeek-V3's router (sigmoid with
pre-softmax, expert bias, group-limited, scaled probabilities), and one multi-token prediction module (on the last
pipeline stage)."""

from __future__ import annotations

import pytest

from tests.functional.launch import FIVE, TINY, losses, parity_layouts, reference_runs, whole_share

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
            "0.01", "--moe-aux-loss-coeff", "0.01", "--moe-router-load-balancing-type", "seq_aux_loss",
            "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3"]
TEN = ["--max-steps", str(TINY[TINY.index("--max-steps") + 1])]  # the 10-step schedule a resumed run goes on in
# the layouts below (tp, cp: no data parallelism, no pipelining) and their reference take the global batch in one
# micro-batch (``whole_share``: a MoE model's auxiliary losses are per micro-batch)
reference_runs({"deepseek-5": [*DEEPSEEK, *whole_share()], "deepseek-10": [*DEEPSEEK, *TEN]})

LAYOUTS = parity_layouts({f"deepseek-{name}": (n, [*DEEPSEEK, *whole_share(), *flags]) for name, (n, flags) in {
    "tp2-sp": (2, ["--tp", "2", "--sequence-parallel"]),
    # the experts split over the tensor-parallel ranks (etp 1, DeepSeek-V3's layout), the rest of the layer over tp
    "tp2-sp-etp1-ep2": (2, ["--tp", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
                            "--expert-model-parallel-size", "2"]),
    "cp2-p2p": (2, ["--cp", "2", "--cp-comm-type", "p2p"]),
    "cp2-all_gather": (2, ["--cp", "2", "--cp-comm-type", "all_gather"]),
    "cp2-a2a-ep2": (2, ["--cp", "2", "--cp-comm-type", "a2a", "--expert-model-parallel-size", "2"]),
    # Megatron-LM's layout string: the multi-token prediction layer with the head on a stage without decoder layers
    "pp2-layout-mtp": (2, ["--pp", "2", "--pipeline-model-parallel-layout", "Etttt|mL"]),
}.items()})

SAVED = "deepseek-pp2-saved"  # steps 1-5 of the 10-step schedule under pipelining, the MTP module on the last stage
RESUMED = "deepseek-ep2-zero3-resumed"  # steps 6-10 with the experts and every state sharded over 2 ranks
parity_layouts({
    SAVED: (2, [*DEEPSEEK, *TEN, "--pp", "2", "--save-interval", "5", "--exit-interval", "5"]),
    RESUMED: (2, [*DEEPSEEK, *TEN, "--sharding", "2", "--sharding-stage", "3", "--expert-model-parallel-size", "2",
                  "--load", f"{{runs}}/{SAVED}/step_5"], (SAVED,)),
})


def mtp_losses(parity, name: str) -> list[float]:
    """Every step's multi-token prediction loss (one module: one per step)."""
    return [value for step in losses(parity.outcome(name).check(), key="mtp_loss") for value in step]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_deepseek_shape_losses_equal_single_process(parity, references, layout):
    parity.assert_matches(layout, references["deepseek-5"])
    assert mtp_losses(parity, layout) == pytest.approx(mtp_losses(parity, "deepseek-5"), rel=1e-5)


@pytest.mark.shared_runs(SAVED, RESUMED)
def test_deepseek_shape_resumes_under_another_layout(parity, references):
    """Saved at step 5 under pp 2, resumed under ep 2 with ZeRO-3: every step's losses (the language model's and
    multi-token prediction's) and gradient norm are the uninterrupted single-process run's."""
    train, valid, norms = references["deepseek-10"]
    saved_train, _, saved_norms = parity.curves(SAVED)  # (it exits at step 5, before that step's validation)
    got_train, got_valid, got_norms = parity.curves(RESUMED)
    assert saved_train + got_train == pytest.approx(train, rel=1e-5)
    assert saved_norms + got_norms == pytest.approx(norms, rel=1e-5)
    assert got_valid == pytest.approx(valid[1:], rel=1e-5)
    mtp = mtp_losses(parity, SAVED) + mtp_losses(parity, RESUMED)
    assert mtp == pytest.approx(mtp_losses(parity, "deepseek-10"), rel=1e-5)
