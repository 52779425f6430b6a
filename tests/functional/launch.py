"""Run pretrain_gpt.py in one process or under torchrun and read back its per-step losses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# fp32, no dropout, mock data: any layout must reproduce the single-process losses.
TINY = ["--mock-data", "--device", "cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--vocab-size", "256", "--max-seq-len", "32", "--max-position-embeddings", "32", "--global-batch-size", "16",
        "--micro-batch-size", "4", "--max-steps", "10", "--lr", "3e-3", "--hidden-dropout-prob", "0",
        "--attention-probs-dropout-prob", "0", "--eval-freq", "5", "--eval-iters", "2", "--logging-freq", "1",
        "--num-workers", "0", "--grad-clip", "0.3"]  # the gradient norm is ~0.5-0.8: clipping is active


def run(out: Path, *args: str, nproc: int = 1, timeout: float = 300) -> subprocess.CompletedProcess:
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc-per-node", str(nproc)]
    return subprocess.run([*launcher, str(ROOT / "pretrain_gpt.py"), *args, "--save", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def run_ranks(out: Path, *args: str, nproc: int, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Start ``nproc`` ranks as torchrun would (its environment variables), but without torchrun, whose
    agent kills the other ranks as soon as one exits: each rank runs to its own end, so a test can
    check what every rank said."""
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
               "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "pretrain_gpt.py"), *args, "--save", str(out)],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        finally:
            for other in procs:
                if other.poll() is None and proc.returncode is None:
                    other.kill()
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return results


def losses(out: Path, split: str = "train", key: str = "loss") -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in records if r["split"] == split]


def curves(out: Path) -> tuple[list[float], list[float], list[float]]:
    """(train losses, validation losses, gradient norms) of a finished run."""
    return losses(out), losses(out, "valid"), losses(out, key="grad_norm")


def assert_matches_reference(out: Path, reference: tuple, *args: str, nproc: int) -> None:
    """Run ``args`` on ``nproc`` processes and compare every step with the single-process reference.

    Relative 1e-5: a parallel layout sums the same products in another order (fp32 round-off,
    ~1e-7 observed), which Adam carries forward over the steps."""
    import pytest

    result = run(out, *args, nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    for got, want in zip(curves(out), reference):
        assert len(got) == len(want)
        assert got == pytest.approx(want, rel=1e-5)
