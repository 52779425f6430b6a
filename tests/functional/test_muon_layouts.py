"""Muon (--optimizer muon / dist_muon) under tensor parallelism, the sharded optimizer, pipelining and expert
parallelism (a DeepSeek-V3-shaped model: MLA, MoE, MTP), against one process, and its momentum through a checkpoint
(docs/muon.md). The Newton-Schulz iterations run in fp32 here (--muon-fp32-matmul-prec high: fp32 on the CPU), so a
layout that orthogonalises the same whole matrices matches one process as AdamW's do."""

from __future__ import annotations

import pytest

from tests.functional.launch import FIVE, TINY, losses, parity_layouts, reference_runs, whole_share
from tests.functional.test_deepseek_layouts import DEEPSEEK

pytestmark = pytest.mark.slow

MUON = ["--optimizer", "muon", "--muon-fp32-matmul-prec", "high", "--muon-use-nesterov"]
# DeepSeek-V3's shape: multi-latent attention's down and up projections, the experts' and the router's matrices,
# the multi-token prediction module's, all stepped by Muon
reference_runs({"muon-5": [*FIVE, *MUON], "muon-10": [*TINY, *MUON], "muon-deepseek-5": [*DEEPSEEK, *MUON]})

# Whole matrices orthogonalised: the one-process update (distributed: its Gram matrices summed over the ranks, fp32
# round-off); the sharded optimizer gathers each bucket's update before orthogonalising it.
EQUAL = parity_layouts({
    "muon-tp2-duplicated": (2, [*FIVE, *MUON, *whole_share(), "--tp", "2", "--muon-tp-mode", "duplicated"]),
    "muon-tp2-distributed": (2, [*FIVE, *MUON, *whole_share(), "--tp", "2", "--muon-tp-mode", "distributed"]),
    "dist-muon-dp2": (2, [*FIVE, *MUON, "--optimizer", "dist_muon"]),
    "muon-sharding2-stage3": (2, [*FIVE, *MUON, "--sharding", "2", "--sharding-stage", "3"]),
})


DEEPSEEK_LAYOUTS = parity_layouts({
    "muon-deepseek-pp2": (2, [*DEEPSEEK, *MUON, "--pp", "2"]),  # MTP and the head on the last stage
    "dist-muon-deepseek-ep2": (2, [*DEEPSEEK, *MUON, "--optimizer", "dist_muon", "--expert-model-parallel-size", "2"]),
})


@pytest.mark.parametrize("layout", EQUAL)
def test_muon_layouts_equal_single_process(parity, references, layout):
    parity.assert_matches(layout, references["muon-5"])


@pytest.mark.parametrize("layout", DEEPSEEK_LAYOUTS)
def test_muon_with_mla_moe_and_mtp_under_pipelining_and_expert_parallelism(parity, references, layout):
    parity.assert_matches(layout, references["muon-deepseek-5"])


@pytest.mark.parametrize("layout", parity_layouts({"muon-tp2-blockwise": (
    2, [*FIVE, *MUON, *whole_share(), "--tp", "2", "--muon-tp-mode", "blockwise"])}))
def test_blockwise_is_not_the_one_process_update(parity, references, layout):
    """Blockwise (Megatron's default) orthogonalises each rank's block: by definition not one process's update of
    the whole matrix (tests/unit/test_muon.py checks it against a one-process emulation of the blocks). The first
    two steps' losses, before any update (the first step's learning rate is the warm-up's 0), are the same; the
    next ones are not."""
    got, want = parity.curves(layout)[0], references["muon-5"][0]
    assert got[:2] == pytest.approx(want[:2], rel=1e-5)
    assert all(abs(g - w) > 1e-5 * abs(w) for g, w in zip(got[2:], want[2:]))
    assert got[-1] < got[0]


def _save_then_resume(name: str, saved: tuple[int, list[str]], resumed: tuple[int, list[str]]) -> str:
    (nproc_saved, saved_args), (nproc_resumed, resumed_args) = saved, resumed
    parity_layouts({f"{name}-saved": (nproc_saved, [*saved_args, "--save-interval", "5"]),
                    name: (nproc_resumed, [*resumed_args, "--load", f"{{runs}}/{name}-saved/step_5"],
                           (f"{name}-saved",))})
    return name


# the default precision (bf16 iterations) and no Nesterov: resumed in the same layout, bitwise
SAME = _save_then_resume("resume-muon", (1, [*TINY, "--optimizer", "muon"]), (1, [*TINY, "--optimizer", "muon"]))
OTHER = _save_then_resume("resume-dist-muon-dp2-to-single", (2, [*TINY, *MUON, "--optimizer", "dist_muon"]),
                          (1, [*TINY, *MUON]))


@pytest.mark.parametrize("layout", [SAME])
def test_muon_resumes_bitwise(parity, layout):
    saved = parity.outcome(f"{layout}-saved").check()
    assert losses(parity.outcome(layout).check()) == losses(saved)[5:]


@pytest.mark.parametrize("layout", [OTHER])
def test_sharded_muon_momentum_resumes_in_one_process(parity, references, layout):
    """dist_muon's momentum pieces (cut over two ranks) read back whole by one process: the uninterrupted run's
    steps 6-10."""
    assert losses(parity.outcome(layout).check()) == pytest.approx(references["muon-10"][0][5:], rel=1e-5)


# MuonClip (--qk-clip, docs/muon.md): thresholds far under the tiny models' largest logits (~0.13 standard, ~0.06
# multi-latent), so that every head clips after every step. tp2: each rank clips its own heads; cp2 under dist_muon: the
# maxima over the ranks' queries, the masters' shards (over dp x cp) cut inside the QKV weight's rows; tp2 x cp2:
# multi-latent attention's query and key up-projections cut over the heads.
QK_CLIP = [*MUON, "--qk-clip", "--qk-clip-alpha", "0.4"]
MLA_CLIP = [*FIVE, *QK_CLIP, "--qk-clip-threshold", "0.01", "--multi-latent-attention", "--position-embedding-type",
            "rope", "--normalization", "RMSNorm", "--disable-bias-linear", "--q-lora-rank", "24", "--kv-lora-rank",
            "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--qk-layernorm"]
MHA_CLIP = [*FIVE, *QK_CLIP, "--qk-clip-threshold", "0.02"]
reference_runs({"muonclip-5": MHA_CLIP, "muonclip-mla-5": MLA_CLIP})
QK_CLIP_LAYOUTS = parity_layouts({
    "muonclip-tp2": (2, [*MHA_CLIP, *whole_share(), "--tp", "2", "--muon-tp-mode", "duplicated"]),
    "muonclip-cp2-dist-muon": (2, [*MHA_CLIP, "--cp", "2", "--optimizer", "dist_muon"]),
})
MLA_CLIP_LAYOUTS = parity_layouts({
    "muonclip-mla-tp2-cp2": (4, [*MLA_CLIP, *whole_share(), "--tp", "2", "--cp", "2", "--muon-tp-mode", "duplicated"]),
})


def _clips_as_one_process(parity, layout: str, reference: str, curves: tuple, threshold: float) -> None:
    """The layout's losses, gradient norms and logged largest logits are one process's; the clip works: the first
    step's largest logit (before any clip) is far above the threshold, every later one (one Muon step after a clip)
    near it."""
    parity.assert_matches(layout, curves)
    logits = [losses(parity.outcome(name).check(), key="max_attention_logit") for name in (layout, reference)]
    assert logits[0] == pytest.approx(logits[1], rel=1e-5)
    assert logits[1][0] > 4 * threshold and max(logits[1][1:]) < 2 * threshold


@pytest.mark.parametrize("layout", QK_CLIP_LAYOUTS)
def test_qk_clip_layouts_equal_single_process(parity, references, layout):
    _clips_as_one_process(parity, layout, "muonclip-5", references["muonclip-5"], 0.02)


@pytest.mark.parametrize("layout", MLA_CLIP_LAYOUTS)
def test_qk_clip_with_multi_latent_attention_under_tp_and_cp(parity, references, layout):
    _clips_as_one_process(parity, layout, "muonclip-mla-5", references["muonclip-mla-5"], 0.01)
