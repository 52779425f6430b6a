"""Training with a checkpoint every N steps: throughput without saves, with synchronous saves and with
``--async-save``, each save's cost (``save_blocked_s``, ``save_total_s`` from metrics.jsonl) and the save time
against the disk's write bandwidth. Run by ``python benchmarks/checkpoint.py --saves [--write]``.

A GPT of about 30M parameters (8 layers, hidden 512, vocabulary 8192) is trained by ``pretrain_gpt.main``
in this process, three times, on mock data: without checkpoints, saving every ``--every`` steps, and the same
with ``--async-save``. *s / step* is the wall time between the first and the last step's log records over the
steps between them (saves included: what a save costs the run). The disk's bandwidth is measured by writing a
file of the checkpoint's size in 4 MiB blocks and fsync'ing it, in the same folder; *at disk speed* is the
checkpoint's size over that bandwidth (what no save can beat).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

MB = 2**20
MODEL = ["--mock-data", "--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8",
         "--vocab-size", "8192", "--max-seq-len", "128", "--max-position-embeddings", "128", "--micro-batch-size",
         "4", "--global-batch-size", "4", "--hidden-dropout-prob", "0", "--attention-probs-dropout-prob", "0",
         "--eval-iters", "0", "--logging-freq", "1", "--num-workers", "0", "--no-save-at-end",
         "--keep-last-checkpoints", "2"]


def _records(out: str) -> tuple[list[dict], list[dict]]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [r for r in records if r["split"] == "train"], [r for r in records if r["split"] == "save"]


def _train(out: str, device: str, steps: int, flags: list[str]) -> dict:
    import pretrain_gpt

    status = pretrain_gpt.main([*MODEL, "--device", device, "--max-steps", str(steps), "--eval-freq",
                                str(steps + 1), *flags, "--save", out])
    if status != 0:
        raise SystemExit(f"checkpoint_saves: the run {flags} exited with status {status}")
    train, saves = _records(out)
    per_step = (train[-1]["elapsed_s"] - train[0]["elapsed_s"]) / (len(train) - 1)
    steps_saved = sorted(int(d.removeprefix("step_")) for d in os.listdir(out) if d.startswith("step_"))
    size = 0
    if steps_saved:
        folder = os.path.join(out, f"step_{steps_saved[-1]}")
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    return {"per_step": per_step, "saves": saves, "size": size}


def disk_bandwidth(folder: str, size: int) -> float:
    """Bytes per second of writing ``size`` bytes in 4 MiB blocks, fsync included."""
    block = os.urandom(4 * MB)
    path = os.path.join(folder, "bandwidth.bin")
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(size // len(block), 1)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    os.remove(path)
    return max(size, len(block)) / seconds


def run(device: str, steps: int, every: int) -> tuple[str, bool]:
    """The markdown body and whether async saves blocked training for at most 25% of their total time."""
    root = tempfile.mkdtemp(prefix="ckpt_saves_", dir=os.environ.get("CKPT_BENCH_DIR"))
    try:
        plain = _train(os.path.join(root, "plain"), device, steps, [])
        sync = _train(os.path.join(root, "sync"), device, steps, ["--save-interval", str(every)])
        shutil.rmtree(os.path.join(root, "sync"))
        asynchronous = _train(os.path.join(root, "async"), device, steps, ["--save-interval", str(every),
                                                                          "--async-save"])
        bandwidth = disk_bandwidth(root, asynchronous["size"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    size = asynchronous["size"]
    lines = ["| run | s / step | saves | blocked s (sum) | total s (sum) | blocked / total | mean save s | "
             "at disk speed s |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    ratio = None
    for name, result in (("no checkpoints", plain), ("sync saves", sync), ("--async-save", asynchronous)):
        saves = result["saves"]
        blocked, total = sum(r["save_blocked_s"] for r in saves), sum(r["save_total_s"] for r in saves)
        if name == "--async-save":
            ratio = blocked / total
        cells = [f"{result['per_step']:.3f}", str(len(saves))]
        cells += [f"{blocked:.2f}", f"{total:.2f}", f"{blocked / total:.0%}", f"{total / len(saves):.2f}",
                  f"{size / bandwidth:.2f}"] if saves else ["", "", "", "", ""]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    ok = ratio is not None and ratio <= 0.25
    body = "\n".join([
        f"GPT 8 layers, hidden 512, vocabulary 8192, seq 128, global batch 4, fp32, {steps} steps, a save every "
        f"{every} steps, device {device}; a checkpoint is {size / MB:.0f} MB on disk ({size / 12e6:.1f}M "
        f"parameters: fp32 weights and two AdamW states); the disk writes "
        f"{bandwidth / MB:.0f} MB/s (fsync'ed). Async saves blocked training for {ratio:.0%} of their total time "
        f"({'at most 25%: as promised' if ok else 'MORE than 25%'}).", "", *lines])
    return body, ok


if __name__ == "__main__":  # a module of benchmarks/checkpoint.py, not a script of its own
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="checkpoint_saves.py", description=__doc__.splitlines()[0],
                                     epilog="Not run on its own: python benchmarks/checkpoint.py --saves [--write].")
    parser.parse_args()
    sys.exit("checkpoint_saves.py: run python benchmarks/checkpoint.py --saves [--write].")
