"""ZeRO stages 1, 2, 3 and CPU offload vs plain data parallel: per-rank model-state bytes and step time.

    python benchmarks/zero.py                  # 2 and 4 ranks, gloo on the CPU
    python benchmarks/zero.py --write          # also update docs/benchmarks.md

Stage 0 is plain data parallelism (sharding 1, dp = world): every rank holds every parameter,
gradient, fp32 master weight and AdamW state. With sharding = world (N ranks): stage 1 gives each
rank 1/N of the master weights and AdamW states (it steps its slice and all-gathers the updated
parameters); stage 2 also keeps only 1/N of the gradients between backwards (reduce-scattered per
bucket, the full buffer freed); stage 3 also keeps only 1/N of the parameters, gathering each
decoder layer just before its forward and backward and freeing it after. Offload keeps the master
weights and AdamW states on the CPU, with a CPU copy of the gradient shard that the step reads.

The model, optimizer and wrapping are built as ``pretrain_gpt.py`` builds them
(``plan_sharding``, ``parallelize``, ``build_optimizer``) and stepped with ``megatron.training.train_step``.
Each rank measures what it holds after the timed steps (``measured_model_state_bytes``: parameter
and gradient buffers and shards, the master copy, the AdamW state tensors, the CPU gradient copy),
the median ``train_step`` time and, under stage 3, the most decoder layers gathered at once; the
totals are compared with ``model_state_bytes`` and with the ZeRO paper's mixed-precision formula.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import write_section  # noqa: E402

MB = 2**20
# (stage, offload); stage 0 is plain data parallelism
VARIANTS = [(0, False), (1, False), (2, False), (3, False), (2, True), (3, True)]
FIELDS = ("parameters", "gradients", "master_weights", "optimizer_states", "cpu_gradients")


def _rank_main(rank: int, world: int, store_dir: str, args: argparse.Namespace, queue) -> None:
    from megatron import parallel_state
    from megatron.config import parse_config, validate
    from megatron.data.loader import build_batch
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.distributed.parallelize import plan_sharding
    from megatron.memory.measure import measured_model_state_bytes
    from megatron.model import num_parameters
    from megatron.parallelize_gpt import build_model, parallelize_gpt
    from megatron.tensor_parallel import tensor_parallel_seed
    from megatron.training import train_step
    from pretrain_gpt import forward_step

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "store"), world), rank=rank,
                            world_size=world)
    data = MockGPTDataset(1000, args.seq, args.vocab, seed=1)
    batch = build_batch([data[rank * args.micro_batch + j] for j in range(args.micro_batch)], data.eod_id)
    results = []
    for sharding in (1, world):  # stage 0: dp = world; stages 1-3: sharding = world
        ps = parallel_state.initialize(sharding=sharding)
        dp_group = ps.group("data_parallel") if ps.data_parallel_size > 1 else None
        for stage, offload in VARIANTS:
            if (stage == 0) != (sharding == 1):
                continue
            for precision in args.precisions:
                flags = ["--mock-data", "--device", "cpu", "--num-layers", str(args.layers), "--hidden-size",
                         str(args.hidden), "--num-attention-heads", "8", "--max-seq-len", str(args.seq),
                         "--max-position-embeddings", str(args.seq), "--vocab-size", str(args.vocab),
                         "--micro-batch-size", str(args.micro_batch), "--global-batch-size",
                         str(args.micro_batch * world), "--hidden-dropout-prob", "0",
                         "--attention-probs-dropout-prob", "0", "--sharding", str(sharding), "--sharding-stage",
                         str(max(stage, 1)), "--save", os.path.join(store_dir, "out")]
                flags += ["--bf16"] if precision == "bf16" else []
                flags += ["--sharding-offload"] if offload else []
                config = parse_config(flags)
                validate(config, world_size=world)
                tensor_parallel_seed(config.seed, ps.tp_rank, torch.device("cpu"))
                plan = plan_sharding(config, ps)
                model = build_model(config, meta_init=plan.meta_init)
                num_params = num_parameters(model)
                run = parallelize_gpt(config, torch.device("cpu"), plan, model)
                model, buffer, fully_sharded, optimizer = run.model, run.buffer, run.fully_sharded, run.optimizer
                times = []
                for step in range(args.warmup + args.steps):
                    dist.barrier()
                    start = time.perf_counter()
                    train_step(forward_step, batch, model, buffer, optimizer, 1e-4, args.micro_batch, dp_group)
                    if step >= args.warmup:
                        times.append(time.perf_counter() - start)
                measured = measured_model_state_bytes(optimizer)
                peak = fully_sharded.peak_gathered_layers if fully_sharded is not None else -1
                # every rank should hold the same amount (shards are padded to equal size): report the largest
                sizes = torch.tensor([getattr(measured, f) for f in FIELDS] + [statistics.median(times), peak],
                                     dtype=torch.float64)
                dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
                values = sizes.tolist()
                results.append({"stage": stage, "offload": offload, "precision": precision, "ranks": world,
                                "num_params": num_params, **dict(zip(FIELDS, values)), "step": values[-2],
                                "peak_layers": int(values[-1]) if stage == 3 else None})
                del model, buffer, optimizer, fully_sharded
            dist.barrier()
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def _predicted(r: dict):
    from megatron.memory.model_states import model_state_bytes

    n = r["ranks"] if r["stage"] >= 1 else 1
    return model_state_bytes(r["num_params"], r["precision"], sharding=n, stage=max(r["stage"], 1),
                             offload=r["offload"])


def _paper(r: dict) -> tuple[float, float]:
    """(device, CPU) bytes by the ZeRO papers' mixed-precision accounting: 2Psi fp16 parameters, 2Psi
    fp16 gradients, 12Psi fp32 master weights and Adam states, each divided by N from the stage that
    shards it; ZeRO-Offload moves the gradient shard and the 12Psi/N to the CPU."""
    psi, stage = r["num_params"], r["stage"]
    n = r["ranks"] if stage >= 1 else 1
    params = 2 * psi / n if stage >= 3 else 2 * psi
    grads = 2 * psi / n if stage >= 2 else 2 * psi
    states = 12 * psi / n if stage >= 1 else 12 * psi
    return (params, grads + states) if r["offload"] else (params + grads + states, 0.0)


def _deviation(r: dict) -> float:
    """Largest relative gap between a measured field and its prediction."""
    p = _predicted(r)
    gaps = [abs(r[f] - getattr(p, f)) / getattr(p, f) if getattr(p, f) else float(r[f] != 0) for f in FIELDS]
    return max(gaps)


def _table(rows: list[dict], precision: str) -> str:
    lines = ["| stage | offload | ranks | params MB | grads MB | master MB | AdamW MB | CPU grads MB | device MB | "
             "CPU MB | predicted device / CPU MB | ZeRO paper device / CPU MB | peak layers | s/step |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if r["precision"] != precision:
            continue
        p = _predicted(r)
        on_device = r["parameters"] + r["gradients"]
        on_cpu = r["master_weights"] + r["optimizer_states"] + r["cpu_gradients"] if r["offload"] else 0
        if not r["offload"]:
            on_device += r["master_weights"] + r["optimizer_states"]
        paper_device, paper_cpu = _paper(r)
        peak = "-" if r["peak_layers"] is None else str(r["peak_layers"])
        lines.append(f"| {r['stage']} | {'yes' if r['offload'] else 'no'} | {r['ranks']} | "
                     f"{r['parameters'] / MB:.1f} | {r['gradients'] / MB:.1f} | {r['master_weights'] / MB:.1f} | "
                     f"{r['optimizer_states'] / MB:.1f} | {r['cpu_gradients'] / MB:.1f} | {on_device / MB:.1f} | "
                     f"{on_cpu / MB:.1f} | {p.device_total / MB:.1f} / {p.cpu_total / MB:.1f} | "
                     f"{paper_device / MB:.1f} / {paper_cpu / MB:.1f} | {peak} | {r['step']:.3f} |")
    return "\n".join(lines)


INTRO = (
    "`benchmarks/zero.py` builds the model, optimizer and data-parallel wrapping as `pretrain_gpt.py` does "
    "(`plan_sharding`, `parallelize`, `build_optimizer`), steps it with `train_step` on 2 and 4 gloo ranks, and "
    "counts what each rank holds after the timed steps (`measured_model_state_bytes`). Stage 0 is plain data "
    "parallelism (sharding 1, dp = world: gradients all-reduced, every rank holds everything). The ZeRO stages "
    "run with sharding = world (N ranks). Stage 1 shards the optimizer: each rank keeps fp32 master weights and "
    "AdamW states for 1/N of the buffer, steps that slice and all-gathers the updated parameters. Stage 2 also "
    "shards the gradients: each bucket's gradients are reduce-scattered into a 1/N shard (as the bucket "
    "completes in the backward when `overlap_grad_reduce` is on, the GPU default; after the backward on the CPU, "
    "as here) and the full gradient buffer is freed until the next backward. Stage 3 also shards the "
    "parameters: between steps a rank holds only its 1/N slice; each decoder layer is all-gathered just before "
    "its forward (the next one prefetched) and freed after it, gathered again when its gradient arrives in the "
    "backward, and once its gradients are in they are reduce-scattered and its full parameters and gradients "
    "freed, every micro-batch; so at most two layers are gathered at once (the *peak layers* column, counted by "
    "`FullyShardedParameters`), plus the embeddings and final norm, gathered from the start of the forward to "
    "the end of the backward. Offload (`--sharding-offload`, here on top of stages 2 and 3) keeps "
    "the fp32 master weights (also in fp32 training) and the AdamW states on the CPU, with a CPU copy of the "
    "gradient shard that the step reads; the updated parameters are copied back to the device. The table "
    "splits each offload row into device and CPU bytes, but on this machine the device is the CPU: offload only "
    "adds copies and saves no memory in any real sense; the split is the accounting a GPU run would see.\n\n"
    "The measured figures match `model_state_bytes` up to the padding of each bucket to a multiple of N (and "
    "AdamW's scalar step counters, left out). The ZeRO paper's mixed-precision formula is 2Psi + 2Psi + 12Psi "
    "for stage 0, with the 12Psi divided by N from stage 1, the gradients' 2Psi from stage 2 and the "
    "parameters' 2Psi from stage 3; for offload the paper's column follows ZeRO-Offload, which moves the "
    "gradient shard and the 12Psi/N to the CPU. This project keeps fp32 main gradients (4Psi, as Megatron-LM "
    "does) where the paper counts fp16 ones (2Psi), and under offload keeps the gradient shard on the device "
    "as well as its CPU copy; in fp32 training there is no separate master copy unless offloaded (the "
    "parameters are the masters), and the paper's formula, being for mixed precision, is shown unchanged. The "
    "figures are those held between steps: during the backward the full gradient buffer exists under stages 2 "
    "and 3 (micro-batches accumulate into it), and under stage 3 the gathered layers. 4 ranks on this 2-core "
    "machine oversubscribe the cores, so step times at 4 ranks are indicative only, and even at 2 ranks they "
    "vary by tens of percent from run to run; the gain of sharding is memory, paid for in communication "
    "(stage 3 gathers every layer twice per micro-batch) and, with offload, in copies.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    parser.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    rows = []
    for world in args.worlds:
        queue = mp.get_context("spawn").SimpleQueue()
        with tempfile.TemporaryDirectory() as store_dir:
            mp.start_processes(_rank_main, args=(world, store_dir, args, queue), nprocs=world, start_method="spawn")
        rows.extend(queue.get())
    psi = rows[0]["num_params"]
    deviation = max(_deviation(r) for r in rows)
    parts = [
        f"gloo ranks on the CPU, {args.threads} compute thread each; GPT {args.layers} layers, hidden {args.hidden}, "
        f"vocab {args.vocab}, seq {args.seq}, micro batch {args.micro_batch} per rank; Psi = {psi / 1e6:.2f}M "
        f"parameters. Per-rank MB (2^20 bytes) measured after the timed steps (largest over the ranks); device MB: "
        f"parameters + gradients (+ master weights and AdamW states unless offloaded); CPU MB (offload): master "
        f"weights + AdamW states + CPU gradient copy; predicted: `model_state_bytes` (largest gap between a "
        f"measured and a predicted field: {100 * deviation:.2f}%); ZeRO paper: 2Psi + 2Psi + 12Psi, sharded as "
        f"above; peak layers: the most decoder layers gathered at once (stage 3); s/step: median of {args.steps} "
        f"`train_step`s after {args.warmup} warm-up (slowest rank)."]
    for precision in args.precisions:
        parts += ["", f"**{precision}**", "", _table(rows, precision)]
    body = "\n".join(parts)
    print(body)
    if deviation > 0.05:
        print(f"warning: measured differs from model_state_bytes by {100 * deviation:.1f}%", file=sys.stderr)
    if args.write:
        write_section("zero", "ZeRO stages 1, 2, 3 and CPU offload: per-rank model-state memory",
                      "python benchmarks/zero.py " + " ".join(sys.argv[1:]), body, INTRO, replace_intro=True)


if __name__ == "__main__":
    main()
