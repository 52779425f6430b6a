"""Data-parallel gradient synchronisation: all-reduce overlapped with the backward vs after it.

    python benchmarks/dp_overlap.py                  # 2 ranks, gloo on the CPU
    python benchmarks/dp_overlap.py --write          # also update docs/benchmarks.md

Each rank trains the same small GPT on its half of the batch. Steps alternate between a
wrapper that starts each bucket's all-reduce as soon as the bucket's gradients are ready
(``overlap_grad_reduce``, the default) and one that all-reduces the whole buffer after the
backward, so background load affects both alike; the median step time of each is reported,
with the time of the all-reduce alone. On a CPU the communication threads compete with the
compute threads for the same cores, so the gain is smaller than on GPUs, where NCCL runs on
its own streams.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import write_section  # noqa: E402


def _parallelized(model, plan, config) -> tuple:
    """(model to train, buffer, optimizer) as the Trainer builds them, under ``plan``."""
    from megatron.parallelize_gpt import parallelize_gpt

    run = parallelize_gpt(config, torch.device("cpu"), plan, model)
    model, buffer = run.model, run.buffer
    return model, buffer, run.optimizer


def _rank_main(rank: int, world: int, store_dir: str, args: argparse.Namespace, queue) -> None:
    from megatron import parallel_state
    from megatron.config import parse_config, validate
    from megatron.data.loader import build_batch
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.distributed.parallelize import plan_sharding
    from megatron.parallelize_gpt import build_model
    from megatron.training import train_step
    from pretrain_gpt import forward_step

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "store"), world), rank=rank,
                            world_size=world)
    parallel_state.initialize()
    flags = ["--mock-data", "--device", "cpu", "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
             "--num-attention-heads", "8", "--max-seq-len", str(args.seq), "--max-position-embeddings",
             str(args.seq), "--vocab-size", "8192", "--micro-batch-size", str(args.micro_batch),
             "--global-batch-size", str(args.micro_batch * world), "--hidden-dropout-prob", "0",
             "--attention-probs-dropout-prob", "0", "--save", os.path.join(store_dir, "out")]
    config = parse_config(flags)
    validate(config, world_size=world)
    data = MockGPTDataset(1000, args.seq, 8192, seed=1)
    batch = build_batch([data[rank * args.micro_batch + j] for j in range(args.micro_batch)], data.eod_id)
    plan = plan_sharding(config, parallel_state.get())  # all-reduce over every rank
    variants = {}
    for bucket_mb in args.bucket_mb:
        bucketed = replace(plan, overlap=True, bucket_size=int(bucket_mb * 2**20 / 4))
        variants[f"overlap {bucket_mb:g}"] = _parallelized(build_model(config), bucketed, config)
    variants["after backward"] = _parallelized(build_model(config), replace(plan, overlap=False), config)
    times = {name: [] for name in variants}
    for step in range(args.warmup + args.steps):
        for name, (model, buffer, optimizer) in variants.items():
            dist.barrier()
            start = time.perf_counter()
            train_step(forward_step, batch, model, buffer, optimizer, 1e-4, args.micro_batch, dist.group.WORLD)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
    grads = buffer.grad_data
    comm = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(grads)
        comm.append(time.perf_counter() - start)
    if rank == 0:
        queue.put({"params": grads.numel(), **{k: statistics.median(v) for k, v in times.items()},
                   "all-reduce alone": statistics.median(comm)})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[4.0, 16.0, 40.0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as store_dir:
        mp.start_processes(_rank_main, args=(args.world, store_dir, args, queue), nprocs=args.world,
                           start_method="spawn")
    r = queue.get()
    after = r["after backward"]
    rows = [f"| after the backward | {after:.3f} | | |"]
    for mb in args.bucket_mb:
        t = r[f"overlap {mb:g}"]
        saved = after - t
        rows.append(f"| overlapped, {mb:g} MB buckets | {t:.3f} | {saved:+.3f} s | {100 * saved / after:+.1f}% |")
    table = "\n".join([
        f"{args.world} ranks (gloo, CPU, {args.threads} compute thread each); GPT {args.layers} layers, hidden "
        f"{args.hidden}, seq {args.seq}, micro batch {args.micro_batch} per rank; {r['params'] / 1e6:.1f}M fp32 "
        f"gradients ({r['params'] * 4 / 2**20:.0f} MB); one all-reduce of all of them alone: "
        f"{r['all-reduce alone']:.3f} s; median of {args.steps} steps, variants interleaved.",
        "",
        "| gradient all-reduce | s/step | saved | saved % |",
        "| --- | ---: | ---: | ---: |",
        *rows,
    ])
    print(table)
    if args.write:
        write_section("dp_overlap", "Data-parallel gradient sync: overlapped vs after the backward",
                      "python benchmarks/dp_overlap.py " + " ".join(sys.argv[1:]), table)

if __name__ == "__main__":
    main()
