"""Checks that need a CUDA GPU, run on one before a release (not part of the suite, which runs on CPUs):

- resume: a run cut at step 5 (``--exit-interval``) and resumed gives the uninterrupted run's losses, with dropout,
  in bf16 and fp32: the checkpoint's RNG files (JSON, format 4) carry the CUDA generator state;
- sigterm: SIGTERM to the run's whole process group, data-loader workers included, saves and exits 0; the step
  folder holds no pickle;
- fp16: a dynamic-loss-scale run trains without the all-zero-gradient warning;
- sampling: generation on the GPU at extreme settings (temperature 1e-300, top_k 10^9) and the sampler on CUDA
  logits whose padding rows are 1e4 return real vocabulary ids only.

    python benchmarks/gpu_checks.py --out gpu-checks   # prints a JSON summary; the logs go to --out

The figures of a run are in docs/benchmarks.md ("Checks on a GPU")."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--mock-data", "--device", "gpu", "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
        "--vocab-size", "250", "--max-seq-len", "64", "--max-position-embeddings", "64", "--global-batch-size", "16",
        "--micro-batch-size", "4", "--lr", "3e-3", "--hidden-dropout-prob", "0.1", "--attention-probs-dropout-prob",
        "0.1", "--eval-freq", "5", "--eval-iters", "2", "--logging-freq", "1", "--num-workers", "2",
        "--max-steps", "10"]


def train(out: str, name: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "pretrain_gpt.py", *TINY, *args], cwd=ROOT, capture_output=True, text=True)
    with open(os.path.join(out, f"{name}.log"), "w") as f:
        f.write(done.stdout + done.stderr)
    return done


def losses(folder: str) -> list:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if r["split"] == "train"]


def check_resume(out: str, work: str) -> dict:
    result = {}
    for flag, tag in (("--bf16", "bf16"), ("--no-bf16", "fp32")):
        full, cut = os.path.join(work, f"full_{tag}"), os.path.join(work, f"cut_{tag}")
        train(out, f"full_{tag}", flag, "--save", full)
        train(out, f"first_{tag}", flag, "--save", cut, "--exit-interval", "5")
        resumed = train(out, f"resumed_{tag}", flag, "--save", cut, "--load", cut)
        result[f"resume_{tag}_bitwise"] = resumed.returncode == 0 and losses(full) == losses(cut)
    with open(os.path.join(work, "cut_bf16", "step_5", "rank0.rng.json")) as f:
        result["rng_file_has_cuda_state"] = "cuda" in json.load(f)
    return result


def check_sigterm(out: str, work: str) -> dict:
    folder = os.path.join(work, "term")
    run = subprocess.Popen([sys.executable, "pretrain_gpt.py", *TINY, "--bf16", "--max-steps", "100000", "--eval-freq",
                            "100000", "--save", folder], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    metrics, deadline = os.path.join(folder, "metrics.jsonl"), time.time() + 240
    while time.time() < deadline and not (os.path.exists(metrics) and len(open(metrics).read().splitlines()) >= 3):
        time.sleep(0.1)
    os.killpg(run.pid, signal.SIGTERM)
    _, err = run.communicate(timeout=240)
    with open(os.path.join(out, "sigterm.log"), "w") as f:
        f.write(err[-20000:])
    latest = open(os.path.join(folder, "latest")).read() if os.path.exists(os.path.join(folder, "latest")) else None
    files = sorted(os.listdir(os.path.join(folder, latest))) if latest else []
    return {"sigterm_exit_status": run.returncode, "sigterm_latest": latest,
            "sigterm_worker_died": "killed by signal" in err, "step_folder_files": files,
            "no_pickle_in_checkpoint": not any(f.endswith(".pt") for f in files)}


def check_fp16(out: str, work: str) -> dict:
    done = train(out, "fp16", "--fp16", "--save", os.path.join(work, "fp16"))
    return {"fp16_exit_status": done.returncode, "fp16_zero_gradient_warning": "gradient norm of 0" in done.stderr}


def check_sampling(out: str, work: str) -> dict:
    import torch

    sys.path.insert(0, ROOT)
    from megatron.inference import SamplingParams
    from megatron.inference.sampling import RowState, VocabShard, choose

    ckpt = os.path.join(work, "sample")
    train(out, "sample_run", "--max-steps", "2", "--save", ckpt)
    done = subprocess.run([sys.executable, "tools/generate.py", "--load", ckpt, "--device", "gpu", "--dtype", "bf16",
                           "--tokenizer-type", "NullTokenizer", "--prompt", "1 2 3", "--max-new-tokens", "32",
                           "--temperature", "1e-300", "--top-k", "1000000000", "--ignore-eos", "--output-format",
                           "jsonl", "--seed", "3"], cwd=ROOT, capture_output=True, text=True)
    tokens = json.loads(done.stdout.splitlines()[-1])["tokens"] if done.returncode == 0 else None
    shard, padding = VocabShard(0, 384, 300), []
    logits = torch.randn(3, 384, device="cuda")
    logits[:, 300:] = 1e4
    logits[2, :300] = -float("inf")
    for params in ({"temperature": 1e-300, "top_k": 10**9}, {"temperature": 1e300, "top_k": 1000}, {"top_p": 1e-9}):
        rows = [RowState(SamplingParams(**params), [1], torch.Generator().manual_seed(s)) for s in range(3)]
        padding += [t for t in choose(logits, rows, shard).tokens if t >= 300]
    return {"generate_exit_status": done.returncode,
            "generated_ids_in_vocabulary": tokens is not None and all(0 <= t < 250 for t in tokens),
            "cuda_sampler_padding_ids": padding}


CHECKS = {"resume": check_resume, "sigterm": check_sigterm, "fp16": check_fp16, "sampling": check_sampling}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_checks.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-checks", help="Folder for the logs and results.json.")
    parser.add_argument("--checks", nargs="+", choices=tuple(CHECKS), default=list(CHECKS))
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for name in args.checks:
            results.update(CHECKS[name](args.out, work))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
