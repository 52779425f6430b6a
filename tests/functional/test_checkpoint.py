"""Checkpoints: exact resume, resume under another layout, atomic saves, save on SIGTERM, bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.functional.launch import ROOT, TINY, losses, run

pytestmark = pytest.mark.slow

FOUR_LAYERS = [*TINY, "--num-layers", "4"]


def _train_saving(out, *layout, nproc):
    result = run(out, *FOUR_LAYERS, *layout, "--save-interval", "5", nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "latest").read_text() == "step_10"
    return losses(out)


def _resume(out, checkpoint, *layout, nproc):
    result = run(out, *FOUR_LAYERS, *layout, "--load", str(checkpoint), nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(out)


DROPOUT = ["--hidden-dropout-prob", "0.1", "--attention-probs-dropout-prob", "0.1", "--eval-freq", "3"]


@pytest.mark.parametrize("layout, nproc", [([], 1), (DROPOUT, 1), (["--tp", "2", "--pp", "2", *DROPOUT], 4),
                                           (["--sharding", "2", "--sharding-stage", "3", "--fp16"], 2)],
                         ids=["single", "single-dropout", "tp2-pp2-dropout", "sharding2-stage3-fp16"])
def test_resume_in_the_same_layout_is_bitwise_identical(tmp_path, layout, nproc):
    full = _train_saving(tmp_path / "full", *layout, nproc=nproc)
    resumed = _resume(tmp_path / "resumed", tmp_path / "full" / "step_5", *layout, nproc=nproc)
    # exactly: same masters, AdamW states, scaler, RNG streams (dropout; the save at step 5 is not an
    # evaluation step) and data position
    assert resumed == full[5:]


@pytest.mark.parametrize("saved, nproc_saved, loaded, nproc_loaded", [
    (["--tp", "2", "--pp", "2"], 4, ["--dp", "2"], 2),
    (["--dp", "2", "--sharding", "2", "--sharding-stage", "3"], 4, ["--tp", "2"], 2),
    (["--pp", "2", "--vpp", "2"], 2, [], 1),
], ids=["tp2-pp2-to-dp2", "dp2-sharding2-stage3-to-tp2", "pp2-vpp2-to-pp1"])
def test_resume_in_another_layout_continues_the_run(tmp_path, reference4, saved, nproc_saved, loaded, nproc_loaded):
    _train_saving(tmp_path / "saved", *saved, nproc=nproc_saved)
    resumed = _resume(tmp_path / "resumed", tmp_path / "saved" / "step_5", *loaded, nproc=nproc_loaded)
    # the uninterrupted single-process run, steps 6-10 (fp32 round-off of the other layouts only)
    assert resumed == pytest.approx(reference4[0][5:], rel=1e-5)


_KILL_DURING_SECOND_SAVE = """
import os, runpy, signal, sys, torch
real_save = torch.save
def save(obj, f, *args, **kwargs):
    real_save(obj, f, *args, **kwargs)
    if "step_10" in str(f):  # the first file of the second checkpoint is written: die as kill -9 would
        os.kill(os.getpid(), signal.SIGKILL)
torch.save = save
sys.argv = ["pretrain_gpt.py", *sys.argv[1:]]
runpy.run_path("pretrain_gpt.py", run_name="__main__")
"""


def test_a_save_killed_half_way_leaves_the_previous_checkpoint_loadable(tmp_path):
    out = tmp_path / "killed"
    killed = subprocess.run([sys.executable, "-c", _KILL_DURING_SECOND_SAVE, *FOUR_LAYERS, "--save", str(out),
                             "--save-interval", "5"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL
    assert (out / "latest").read_text() == "step_5" and not (out / "step_10").exists()
    assert (out / "step_10.tmp").is_dir()  # the partial save, never renamed into place
    full = _train_saving(tmp_path / "full", nproc=1)
    assert _resume(tmp_path / "resumed", out, nproc=1) == full[5:]  # the run folder resolves to step_5


def test_sigterm_finishes_the_step_saves_and_exits_0(tmp_path):
    out = tmp_path / "run"
    process = subprocess.Popen([sys.executable, str(ROOT / "pretrain_gpt.py"), *FOUR_LAYERS, "--max-steps", "100000",
                                "--eval-freq", "100000", "--save", str(out)], cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr[-3000:]
    step = len(losses(out))
    assert step >= 3 and (out / "latest").read_text() == f"step_{step}"
    assert "stop signal received" in stderr


@pytest.mark.parametrize("damage, message", [
    ("missing", "no checkpoint at"),
    ("truncated", "the checkpoint is incomplete or damaged"),
    ("other-model", "has shape [256, 128] in the checkpoint but [256, 64] in the model"),
])
def test_a_bad_checkpoint_is_refused_before_anything_is_written(tmp_path, damage, message):
    saved = tmp_path / "saved"
    result = run(saved, *TINY, "--max-steps", "2", "--save-interval", "2", *(
        ["--hidden-size", "128"] if damage == "other-model" else []))
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = saved / "step_2"
    if damage == "missing":
        checkpoint = tmp_path / "nowhere"
    if damage == "truncated":
        rank_file = checkpoint / "rank0.bin"
        rank_file.write_bytes(rank_file.read_bytes()[:1000])
    before = {p: p.stat().st_mtime_ns for p in saved.rglob("*")}
    out = tmp_path / "out"
    result = run(out, *TINY, "--load", str(checkpoint), nproc=2, timeout=120)
    assert result.returncode != 0  # torchrun reports the ranks' exit status 2 as a failure
    assert result.stderr.count(message) == 2  # every rank says why; none waits in a collective
    assert not (out / "metrics.jsonl").exists() and not (out / "config.yaml").exists()  # the run did not start
    assert {p: p.stat().st_mtime_ns for p in saved.rglob("*")} == before  # nothing overwritten
    assert not os.path.exists(out / "step_2")


def test_keep_last_checkpoints_and_finetune_from_weights_only(tmp_path):
    saved = tmp_path / "saved"
    result = run(saved, *TINY, "--save-interval", "2", "--keep-last-checkpoints", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in saved.glob("step_*")) == ["step_10", "step_8"]
    fresh = losses(saved)
    tuned = tmp_path / "tuned"
    result = run(tuned, *TINY, "--load", str(saved), "--finetune")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "weights only (finetune)" in result.stderr
    tuned_losses = losses(tuned)
    assert len(tuned_losses) == 10  # the step count starts again from zero, with a new optimizer
    assert tuned_losses[0] < fresh[0] - 0.1  # but from the trained weights


def test_resume_under_another_tp_repads_the_vocabulary(tmp_path):
    """Vocabulary 300 pads to 384 rows at tp 1 and to 512 at tp 2: the rows past 300 are padding."""
    vocab = ["--vocab-size", "300"]
    full = _train_saving(tmp_path / "tp1", *vocab, nproc=1)
    resumed = _resume(tmp_path / "tp2", tmp_path / "tp1" / "step_5", *vocab, "--tp", "2", nproc=2)
    assert resumed == pytest.approx(full[5:], rel=1e-5)


def test_exit_duration_saves_and_exits_0(tmp_path):
    out = tmp_path / "run"
    result = run(out, *TINY, "--max-steps", "100000", "--exit-duration-in-mins", "0.0001")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "exit_duration_in_mins (0.0001) reached: saving at step 1 and exiting" in result.stderr
    assert (out / "latest").read_text() == "step_1"
