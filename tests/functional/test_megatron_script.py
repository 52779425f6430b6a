"""Megatron-LM functional-test command lines, scaled down, train here unchanged and resume.

Each is its ``FUNCTIONAL`` entry with the environment's paths filled in (the tiny BPE corpus) and only its sizes
scaled to this machine (layers, widths, experts, sequence, batch, steps); every other flag is as Megatron's test
gives it, but FP8's (refused on a CPU, in one line: the last test). One parallel size is scaled down: the MTP
config's --expert-model-parallel-size 4, to 2, since ep 4 under tp 2 x pp 2 takes 8 ranks (a stage's tp x dp
ranks hold the experts) and this suite runs on 2 cores; all its other sizes (tp 2, pp 2, vpp 4, etp 1, sequence
parallel) are Megatron's. The runs join the suite's shared launches: the 4-rank one, and the 2-rank one for
Megatron-LM's Qwen3-30B-A3B and gpt-oss lines, scaled to 2 ranks.
"""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import pytest
import yaml

from megatron.optimizer.lr_schedule import OptimizerParamSchedule
from tests.functional.launch import parity_layouts, run_here
from tests.unit.megatron_example_scripts import EXAMPLE_GPT_OSS, EXAMPLE_QWEN3_30B_A3B
from tests.unit.megatron_flag_sets import FUNCTIONAL

pytestmark = pytest.mark.slow

LLAMA = "gpt3_mcore_reruns_resume"
# Megatron-LM's Llama-shaped GPT (RMSNorm, SwiGLU, GQA, RoPE, untied, no biases, distributed optimizer,
# pipeline 2): its sizes scaled to this machine, every other flag as Megatron's test gives it.
SCALED = {"--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "128", "--num-attention-heads": "4",
          "--num-query-groups": "2", "--kv-channels": "16", "--seq-length": "32", "--max-position-embeddings": "32",
          "--global-batch-size": "8", "--micro-batch-size": "2", "--train-iters": "6"}

# Megatron-LM's two DeepSeek-like tests: multi-latent attention (q/kv LoRA, decoupled rope, YaRN), QK norms, the
# DeepSeek-V3 router (sigmoid, expert bias, 4 groups choosing 2, top-4 scaled by 2), shared experts, dense first
# layers (--moe-layer-freq), the sequence-level aux loss; the first with multi-token prediction at tp 2 x pp 2 x vpp
# 4 (sequence parallel, etp 1), the second under Megatron FSDP (ZeRO-3 here) at ep 2.
MTP = "gpt3_mcore_te_tp2_pp2_ep4_etp1_mtp_resume_torch_dist_fp8"
PROXY = "deepseek_proxy_fsdp_ep2_fsdp2"
_MLA = {"--hidden-size": "64", "--ffn-hidden-size": "128", "--num-attention-heads": "4", "--seq-length": "32",
        "--max-position-embeddings": "32", "--moe-ffn-hidden-size": "32", "--moe-shared-expert-intermediate-size": "32",
        "--q-lora-rank": "32", "--kv-lora-rank": "16", "--qk-head-dim": "16", "--qk-pos-emb-head-dim": "8",
        "--v-head-dim": "16", "--micro-batch-size": "2"}
DEEPSEEK = {
    # 8 layers: one per virtual stage (pp 2 x vpp 4), the first dense as Megatron's; ep 4 needs 8 ranks (the
    # experts' ranks are a stage's tp x dp), so ep 2 on the 4 ranks of tp 2 x pp 2. The first run exits at
    # step 2 (--exit-interval, saving), the second, otherwise the same, resumes there.
    MTP: {**_MLA, "--num-layers": "8", "--moe-layer-freq": "([0]*1+[1]*7)", "--num-experts": "16",
          "--expert-model-parallel-size": "2", "--global-batch-size": "8", "--train-iters": "4",
          "--exit-interval": "4", "--save-interval": "2"},
    # 8 layers, 3 dense, 8 experts as Megatron's; on 4 ranks: ZeRO-3 over dp 4, the experts over ep 2 x edp 2
    PROXY: {**_MLA, "--num-experts": "8", "--global-batch-size": "16", "--train-iters": "4",
            "--exit-interval": "4"},
}
# Megatron-LM's Qwen3-30B-A3B model config and its gpt-oss training script (tests/unit/megatron_example_scripts.py),
# scaled to 2 ranks (they join the suite's shared 2-rank launch): Qwen3's tp 4 to 1 (ep 2 over the 2 data-parallel
# ranks), gpt-oss's pp 8 (one stage per GPU of its 8) to 2, its window of 127 keys to 15 of a 64-token sequence
QWEN3 = "qwen3_30b_a3b_moe"  # examples/rl/model_configs/qwen3_30b_a3b_moe.sh
GPT_OSS = "gptoss_02_train"  # examples/gptoss/02_train.sh
SCRIPTS = {**FUNCTIONAL, QWEN3: EXAMPLE_QWEN3_30B_A3B, GPT_OSS: EXAMPLE_GPT_OSS}
OPEN_MODELS = {
    QWEN3: {"--tensor-model-parallel-size": "1", "--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "128",
            "--num-attention-heads": "4", "--kv-channels": "16", "--num-query-groups": "2", "--seq-length": "32",
            "--max-position-embeddings": "32", "--num-experts": "8", "--moe-router-topk": "2",
            "--moe-ffn-hidden-size": "32", "--vocab-size": "512", "--global-batch-size": "2", "--train-iters": "2"},
    GPT_OSS: {"--num-layers": "4", "--hidden-size": "64", "--ffn-hidden-size": "128", "--num-attention-heads": "8",
              "--num-query-groups": "4", "--seq-length": "64", "--max-position-embeddings": "64",
              "--window-size": "15,0", "--moe-ffn-hidden-size": "128", "--vocab-size": "1024",
              "--global-batch-size": "8", "--train-samples": "16", "--lr-decay-samples": "15",
              "--pipeline-model-parallel-size": "2"},
}
NPROC = 4  # the fewest the MTP one's tp 2 x pp 2 takes; the others' data-parallel ranks
# (flag, how many values it takes): refused on this machine, and dropped from the runs that train
FP8 = {"--fp8-format": 1, "--fp8-recipe": 1, "--fp8-param-gather": 0, "--fp8-amax-compute-algo": 1,
       "--fp8-amax-history-len": 1}


def _command_line(name: str, corpus_dir: Path, out: Path, scaled: dict[str, str], **changes: str) -> list[str]:
    """``SCRIPTS[name]`` with its paths (the corpus unless it trains on mock data, ``out`` for the checkpoints) and
    its sizes filled in."""
    text = SCRIPTS[name]
    for placeholder, path in {"${CHECKPOINT_SAVE_PATH}": out, "${CHECKPOINT_LOAD_PATH}": out,
                              "${CHECKPOINT_PATH}": out, "${TENSORBOARD_PATH}": out / "tb",
                              "${DATA_CACHE_PATH}": out.parent / "cache"}.items():
        text = text.replace(placeholder, str(path))
    argv = shlex.split(text)
    data = {"--data-path": corpus_dir / "data" / "c_text_document", "--vocab-file": corpus_dir / "tok" / "vocab.json",
            "--merge-file": corpus_dir / "tok" / "merges.txt"}
    for flag, value in {**({} if "--mock-data" in argv else data), **scaled, **changes}.items():
        argv[argv.index(flag) + 1] = str(value)
    return argv


def _without_fp8(argv: list[str]) -> list[str]:
    kept, i = [], 0
    while i < len(argv):
        if argv[i] in FP8:
            i += 1 + FP8[argv[i]]
            continue
        kept.append(argv[i])
        i += 1
    return kept


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _shared_line(name: str, scaled: dict[str, str], **changes: str) -> list[str]:
    """A run of the shared 4-rank launch: the command line with the corpus and its checkpoint folder named by the
    shared runs' placeholders ("{corpus}", "{runs}/<name>-ckpt"), its FP8 flags dropped."""
    line = _command_line(name, Path("{corpus}"), Path("{runs}") / f"{name}-ckpt", scaled, **changes)
    if "--save" not in line:  # the proxy's (Megatron's test saves nothing)
        line += ["--save", f"{{runs}}/{name}-ckpt"]
    return [*_without_fp8(line), "--device", "cpu"]


# Every 4-rank run of this module, in the suite's shared 4-rank launch: the Llama command line to step 6, then the
# same with --train-iters 8; the DeepSeek-like ones, the MTP one to --exit-interval 2, then the same to 4, then the
# FSDP proxy. Each pair shares its checkpoint folder (<the command line's name>-ckpt): the second resumes there.
RUNS = {"llama-first": (_shared_line(LLAMA, SCALED),),
        "llama-second": (_shared_line(LLAMA, SCALED, **{"--train-iters": "8"}), ("megatron-llama-first",)),
        "mtp-first": (_shared_line(MTP, DEEPSEEK[MTP], **{"--exit-interval": "2"}),),
        "mtp-resumed": (_shared_line(MTP, DEEPSEEK[MTP]), ("megatron-mtp-first",)),
        "proxy": (_shared_line(PROXY, DEEPSEEK[PROXY]),)}
SHARED = parity_layouts({f"megatron-{run}": (NPROC, *case) for run, case in RUNS.items()})


@pytest.fixture
def runs(parity):
    """(the folder of every run's checkpoint folder, {run: its outcome})."""
    return parity.root, {run: parity.outcome(f"megatron-{run}") for run in RUNS}


@pytest.mark.shared_runs(*SHARED)
def test_megatron_llama_command_line_trains_and_resumes(runs):
    """The command line trains (pp 2 x dp 2, the distributed optimizer over the 2); the same with a longer
    --train-iters, launched again, resumes from the checkpoint --save wrote at the end."""
    root, outcomes = runs
    first, second, out = outcomes["llama-first"], outcomes["llama-second"], root / f"{LLAMA}-ckpt"
    first.check()
    log = first.log + first.stdout
    assert "accepted, no effect here: --deterministic-mode, --manual-gc, --use-mcore-models" in log
    assert "Megatron-LM command line" in log
    train = [r for r in _records(out) if r["split"] == "train"][:6]  # the first run's (the second adds 7-8)
    assert [r["step"] for r in train] == list(range(1, 7))
    # Megatron-LM's schedule for these flags: no warm-up (--lr-warmup-samples 0), its default linear decay to
    # its default min_lr 0 over --train-iters; iteration k trains at the rate after k - 1 iterations.
    assert [r["learning_rate"] for r in train] == pytest.approx([3e-4 * (1 - k / 6) for k in range(6)], rel=1e-6)
    assert all(r["consumed_samples"] == 8 * r["step"] for r in train)
    # the same command line with a longer --train-iters resumes from the checkpoint --save wrote at the end
    second.check()
    assert "resuming at step 6" in second.log + second.stdout
    assert [r["step"] for r in _records(out) if r["split"] == "train"] == list(range(1, 9))


def _assert_trained(records: list[dict], steps: int) -> None:
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    losses = [r["loss"] for r in train]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0] - 0.02, losses


@pytest.mark.shared_runs(*SHARED)
@pytest.mark.parametrize("name", DEEPSEEK)
def test_megatron_deepseek_command_line_trains(runs, name):
    """Every flag but FP8's is taken (implemented, or accepted with its line at start) and the run trains: finite
    losses that fall; the MTP one (at ep 2: the module's docstring says why) resumes at its checkpoint and goes on
    with Megatron-LM's schedule and its data."""
    root, outcomes = runs
    first = outcomes["proxy" if name == PROXY else "mtp-first"]
    first.check()
    log = first.log + first.stdout
    assert "accepted, no effect here: --attention-backend unfused," in log
    assert "--moe-permute-fusion" in log and "--logging-level" in log  # --no-check-for-nan-...: the rerun machine's
    records = _records(root / f"{name}-ckpt")
    if name == PROXY:
        assert ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params: ZeRO stage 3 over the "
                "whole data-parallel group here" in log)
        assert "world size 4 (dp 1, tp 1, pp 1, sharding 4, ZeRO stage 3, ep 2, etp 1)" in log
        _assert_trained(records, 4)
        return
    resumed = outcomes["mtp-resumed"]
    resumed.check()
    assert "resuming at step 2" in resumed.log + resumed.stdout
    _assert_trained(records, 4)
    train = [r for r in records if r["split"] == "train"]
    assert all(len(r["mtp_loss"]) == 1 and math.isfinite(r["mtp_loss"][0]) for r in train)
    # Megatron-LM's schedule over the 4 iterations, warm-up 1% of them, cosine to --min-lr, across the resume
    gbs = 8
    assert all(r["consumed_samples"] == gbs * r["step"] for r in train)
    schedule = OptimizerParamSchedule(1.5e-4, 1e-5, warmup=0.01 * 4 * gbs, decay=4 * gbs)
    assert [r["learning_rate"] for r in train] == pytest.approx([schedule.lr(k * gbs) for k in range(4)], rel=1e-6)


@pytest.mark.parametrize("name", DEEPSEEK)
def test_megatron_deepseek_command_line_with_fp8_stops_with_one_line(corpus, tmp_path, name):
    """With its FP8 flags the command line stops before anything starts: one line naming them and the GPU FP8
    needs, exit status 2."""
    result = run_here(*_command_line(name, corpus, tmp_path / "ckpt", DEEPSEEK[name]), "--device", "cpu")
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "pretrain_gpt.py: error: --fp8-format needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9 or "
        "newer"), lines[0]
    assert "Traceback" not in result.stderr and not (tmp_path / "ckpt").exists()


OPEN_RUNS = parity_layouts({f"megatron-{name}": (2, [*_without_fp8(_command_line(name, Path("."), Path("{runs}") /
                                                                                f"{name}-ckpt", scaled)), "--device",
                                                     "cpu"]) for name, scaled in OPEN_MODELS.items()})


@pytest.mark.shared_runs(*OPEN_RUNS)
@pytest.mark.parametrize("name", OPEN_MODELS)
def test_megatron_open_model_scripts_train(parity, name):
    """Megatron-LM's Qwen3-30B-A3B config and gpt-oss script, scaled down, train with no flag refused but FP8's
    (tested above for the DeepSeek-like lines; the gpt-oss script's are dropped here): every step's loss finite, the
    model the flags describe (QK-norm; gpt-oss's window, sinks, quick GeGLU and YaRN, --enable-gpt-oss's)."""
    run, root = parity.outcome(f"megatron-{name}"), parity.root
    run.check()
    log = run.log + run.stdout
    assert "not available here" not in log and "accepted, no effect here:" in log
    records = [r for r in _records(root / f"{name}-ckpt") if r["split"] == "train"]
    steps = [1, 2] if name == GPT_OSS else [2]  # Qwen3's config logs at Megatron's default interval (100)
    assert [r["step"] for r in records] == steps and all(math.isfinite(r["loss"]) for r in records)
    saved = yaml.safe_load((root / f"{name}-ckpt" / "config.yaml").read_text())
    model = saved["Model"]
    if name == QWEN3:
        assert model["qk_layernorm"] and saved["Distributed"]["expert_model_parallel_size"] == 2
    else:
        want = {"window_size": "15,0", "window_attn_skip_freq": "2", "softmax_type": "learnable", "quick_geglu": True,
                "glu_linear_offset": 1.0, "activation_func_clamp_value": 7.0, "position_embedding_type": "yarn",
                "rotary_scaling_factor": 32.0, "original_max_position_embeddings": 131072,
                "yarn_correction_range_round_to_int": False}
        assert {key: model[key] for key in want} == want
