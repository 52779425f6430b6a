"""End to end: ``python pretrain_gpt.py --mock-data --device cpu ...`` as a user runs it."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron.checkpoint.convert import open_checkpoint, read_tensors
from megatron.config import parse_config, to_dict, validate
from tests.functional.launch import run_here

REPO = Path(__file__).resolve().parents[2]

TINY = ["--mock-data", "--device", "cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--vocab-size", "128", "--max-seq-len", "32", "--max-position-embeddings", "32", "--global-batch-size", "16",
        "--eval-iters", "2"]

# The seeds' train log line, field for field, then optional extra ", key: value" fields.
LOG_LINE = re.compile(
    r"\[\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2},\d{3}\] \[    INFO\] - "
    r"global step (?P<step>\d+), epoch: (?P<epoch>\d+), batch: (?P<batch>\d+), loss: (?P<loss>\d+\.\d{9}), "
    r"avg_reader_cost: \d+\.\d{5} sec, avg_batch_cost: \d+\.\d{5} sec, speed: \d+\.\d{2} step/s, "
    r"ips_total: \d+ tokens/s, ips: \d+ tokens/s, learning rate: \d\.\d{5}e[+-]\d{2}"
    r"(?P<extras>(?:, [^,:]+: [^,]+)*)")


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "pretrain_gpt.py", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_pretrain_cli_end_to_end(tmp_path):
    out = tmp_path / "out"
    # lr 1e-2 decaying to 1e-3 over 50 steps: the loss falls from ~ln(128) = 4.85 to ~2.2 (ratio ~0.45)
    flags = TINY + ["--max-steps", "50", "--logging-freq", "1", "--lr", "1e-2", "--min-lr", "1e-3",
                    "--save", str(out)]
    started = time.time()
    proc = run_cli(*flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).splitlines()

    # train lines (validation/test lines read "... results at global step N | ...")
    train_lines = [line for line in lines if re.search(r" - global step \d+,", line)]
    assert len(train_lines) == 50
    parsed = []
    for line in train_lines:
        match = LOG_LINE.fullmatch(line)
        assert match, f"log line does not match the seed's format: {line!r}"
        parsed.append(match)
    steps = [int(m["step"]) for m in parsed]
    assert steps == list(range(1, 51))
    # the train set holds exactly max_steps global batches: one epoch, batch = step - 1
    assert all(int(m["epoch"]) == 0 and int(m["batch"]) == int(m["step"]) - 1 for m in parsed)
    losses = [float(m["loss"]) for m in parsed]
    # observed ratio ~0.45; 0.75 leaves a wide margin while demanding real learning
    assert losses[-1] < 0.75 * losses[0], losses
    assert any("grad norm: " in m["extras"] for m in parsed)
    # where the run is: max RSS (the CPU's peak), then elapsed and ETA, last; the ETA reaches 0 at the end
    for m in parsed:
        assert re.search(r", max RSS: \d+\.\d\d GB, elapsed: \d+:\d\d, ETA: \d+:\d\d$", m["extras"]), m["extras"]
    assert parsed[-1]["extras"].endswith("ETA: 0:00")
    assert any("validation results at global step 50" in line for line in lines)
    assert any("test results at global step 50" in line for line in lines)

    # metrics.jsonl: one train record per step plus the final valid and test records
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 51))
    for r, logged in zip(train, losses):
        assert {"step", "loss", "learning_rate", "grad_norm", "ips_total", "ips", "loss_scale", "tflops",
                "split"} <= r.keys()
        assert f"{r['loss']:.9f}" == f"{logged:.9f}"  # the log shows the recorded loss
        assert r["learning_rate"] >= 0 and r["grad_norm"] > 0 and r["ips_total"] > 0 and r["tflops"] > 0
        assert r["ips"] == r["ips_total"]  # one process
        assert r["loss_scale"] is None  # fp32: no loss scaling
    assert all(started <= r["time"] <= time.time() for r in records)  # when each record was written
    assert [r["time"] for r in records] == sorted(r["time"] for r in records)
    elapsed = [r["elapsed_s"] for r in train]
    assert elapsed == sorted(elapsed) and 0 < elapsed[0] < elapsed[-1] < time.time() - started
    # Each step trains at the schedule of the samples before it (Megatron-LM's): step 1 at warmup_init (0), the
    # warm-up being 0.01 x 50 x 16 = 8 samples; step 50 at 49 x 16 = 784 of the 800 decay samples, just above
    # min_lr (reached after the last step)
    assert train[0]["learning_rate"] == 0.0
    last = 1e-3 + 9e-3 * 0.5 * (1 + math.cos(math.pi * (784 - 8) / (800 - 8)))
    assert train[1]["learning_rate"] > train[-1]["learning_rate"] == pytest.approx(last)
    for split in ("valid", "test"):
        evals = [r for r in records if r["split"] == split]
        assert len(evals) == 1 and evals[0]["step"] == 50
        assert evals[0]["perplexity"] == pytest.approx(math.exp(evals[0]["loss"]), rel=1e-12)
        assert evals[0]["loss"] < losses[0]

    # config.yaml is the run's resolved configuration
    saved = parse_config(["-c", str(out / "config.yaml")])
    validate(saved, world_size=1, cuda_available=False)
    expected = parse_config(flags)
    validate(expected, world_size=1, cuda_available=False)
    assert to_dict(saved) == to_dict(expected)

    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)

    # --save and no --save-interval: the trained model is kept (Megatron-LM's final save), and loads
    assert (out / "latest").read_text().strip() == "step_50" and any("saved checkpoint" in line for line in lines)
    reader, common, config = open_checkpoint(str(out))
    try:
        params = read_tensors(reader)
    finally:
        reader.close()
    assert common["step"] == 50 and config.model.num_layers == 2
    assert params and all(torch.isfinite(t).all() for t in params.values())


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--use-recompute", "--recompute-granularity", "core_attn", "--no-save-at-end"],
                                   ["--bf16"]],
                         ids=["recompute-core-attn", "bf16"])
def test_pretrain_cli_variants(tmp_path, extra):
    """In this process (``run_here``): the command line itself is the end-to-end test's."""
    proc = run_here(*TINY, "--max-steps", "4", "--save", str(tmp_path), *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert len(re.findall(r"global step \d+,", output)) == 4
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in records if r["split"] != "save")
    saved = parse_config(["-c", str(tmp_path / "config.yaml")])  # the run used what was asked
    if "--bf16" in extra:
        assert saved.mix_precision.bf16 and saved.params_dtype_name == "bfloat16"
    else:
        assert saved.use_recompute and saved.recompute_granularity == "core_attn"
    assert (tmp_path / "latest").exists() == ("--no-save-at-end" not in extra)  # the final save, unless refused


@pytest.mark.slow
def test_a_configuration_error_under_torchrun_prints_one_line(tmp_path):
    """Every rank meets the same configuration error (here before any collective): rank 0 prints the one line, the
    other exits with the same status, quietly, when torchrun stops it (``pretrain_gpt._error``); no rank prints a
    traceback (torchrun's own report of the failed workers follows)."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "pretrain_gpt.py", *TINY, "--cp", "2", "--max-seq-len", "30", "--save", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert output.count("error:") == 1, output
    assert output.count("pretrain_gpt.py: error: --context-parallel-size 2 cuts each sample into 4 chunks") == 1
    assert len(re.findall(r"exitcode\s*: 2 ", output)) == 2, output  # both ranks, status 2 (none killed)
    assert "pretrain_gpt.py\", line" not in output  # no traceback through the script


def test_an_evaluation_global_batch_reads_the_same_samples_in_its_own_batches(tmp_path):
    """--eval-global-batch-size (Megatron-LM's): each evaluation reads eval_iters batches of that many samples; 4 of 8
    read the 32 validation samples that 2 of 16 read, so the validation loss is theirs (the sums' order aside)."""
    from tests.functional.launch import losses, run_here

    flags = [*TINY, "--max-steps", "2", "--eval-freq", "1000", "--global-batch-size", "16", "--micro-batch-size", "4"]
    whole = run_here(*flags, "--eval-iters", "2", "--save", str(tmp_path / "a"))
    halves = run_here(*flags, "--eval-iters", "4", "--eval-global-batch-size", "8", "--save", str(tmp_path / "b"))
    assert whole.returncode == 0 and halves.returncode == 0, halves.stderr[-2000:]
    (want,), (got,) = losses(tmp_path / "a", "valid"), losses(tmp_path / "b", "valid")
    assert losses(tmp_path / "a") == losses(tmp_path / "b")  # training is untouched
    assert got == pytest.approx(want, rel=1e-6) and got != losses(tmp_path / "a")[-1]
    refused = run_here(*flags, "--eval-global-batch-size", "6", "--save", str(tmp_path / "c"))
    assert refused.returncode != 0 and "eval_global_batch_size (6) must be a positive multiple of micro_batch_size" \
        in refused.stderr
