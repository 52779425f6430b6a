"""Tensor parallelism (tp 2): backward collectives overlapped with the matmuls or not, and the activation
memory of sequence parallelism with the column-parallel linears saving the shard or the gathered input.

    python benchmarks/tp_overlap.py                  # 2 ranks, gloo on the CPU
    python benchmarks/tp_overlap.py --write          # also update docs/benchmarks.md

Step time: the same GPT (tp 2, with and without sequence parallelism) trained with the column-parallel
layers' backward collectives asynchronous (``async_communication``, the default: the all-gather runs
behind the input-gradient matmul, the reduce-scatter or all-reduce behind the weight-gradient one) and
synchronous (``megatron.tensor_parallel.set_async_communication(model, False)``); steps of the variants
alternate, so background load affects them alike; medians are reported, with the time of those
collectives alone. On a CPU, gloo's threads compete with the compute for the same cores, so little of
the communication is hidden; on GPUs the collectives run on NCCL's stream beside the compute.

Activation memory: the bytes one micro-batch's forward saves for the backward (``saved_tensors_hooks``,
each storage once, parameters excluded), with the column-parallel linears as built (the sequence shard
saved) and patched back to the composition before the fix (all-gather, then ``F.linear``, which saves
the gathered input), and without sequence parallelism.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.report import write_section  # noqa: E402

INTRO = """`benchmarks/tp_overlap.py` runs two gloo ranks (tp 2) on this shared 2-core CPU. Step times: the
column-parallel layers' backward collectives asynchronous (the default) against synchronous
(`set_async_communication(model, False)`), steps of the variants interleaved in alternating order. Memory:
what one micro-batch's forward saves for the backward, with the sequence-parallel column-parallel linears
saving the shard (now) or the gathered input (the composition used before, patched in); those figures are
exact. Async can save at most the collectives' own time (a few percent of a step here); the differences
measured are of the order of the noise from the other jobs on the machine, of either sign from run to run:
no gain is measurable on this CPU. See docs/performance.md."""


def _gather_then_linear(self, x):
    """ColumnParallelLinear's forward before the fix: F.linear saves the gathered input."""
    from megatron.tensor_parallel import gather_from_sequence_region

    return F.linear(gather_from_sequence_region(x, self.group), self.weight, self.bias)


def _config(args: argparse.Namespace, sp: bool, store_dir: str):
    from megatron.config import parse_config, validate

    flags = ["--mock-data", "--device", "cpu", "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
             "--num-attention-heads", "8", "--max-seq-len", str(args.seq), "--max-position-embeddings",
             str(args.seq), "--vocab-size", "8192", "--micro-batch-size", str(args.micro_batch),
             "--global-batch-size", str(args.micro_batch * args.micro_batches), "--hidden-dropout-prob", "0",
             "--attention-probs-dropout-prob", "0", "--tp", "2", "--save", os.path.join(store_dir, "out")]
    config = parse_config(flags + (["--sequence-parallel"] if sp else []))
    validate(config, world_size=2)
    return config


def _saved_bytes(model, batch, micro_batch: int) -> tuple[int, int]:
    """(saved by the column-parallel linears, saved in all) by one micro-batch's forward."""
    from megatron.tensor_parallel import ColumnParallelLinear
    from pretrain_gpt import forward_step
    from tests.distributed.saved_bytes import SavedBytes

    micro = {k: v[:micro_batch] for k, v in batch.items()}
    with SavedBytes(model, owners=(ColumnParallelLinear,)) as saved:
        output, _ = forward_step(micro, model)
    del output
    return saved.by_owner.get(ColumnParallelLinear, 0), saved.total


def _time_collectives(args: argparse.Namespace, group, sp: bool) -> float:
    """Seconds per step of the column-parallel layers' backward collectives alone (2 layers per decoder
    layer, every micro-batch): all-gather of the shard + reduce-scatter of dX (sp), or all-reduce of dX."""
    from megatron.tensor_parallel.mappings import start_all_gather, start_all_reduce, start_reduce_scatter

    full = torch.randn(args.seq, args.micro_batch, args.hidden)
    shard = full[: args.seq // 2].clone()
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(2 * args.layers * args.micro_batches):
            if sp:
                start_all_gather(shard, group, async_op=False).wait()
                start_reduce_scatter(full, group, async_op=False).wait()
            else:
                start_all_reduce(full, group, async_op=False).wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_layer(args: argparse.Namespace, sp: bool) -> dict[bool, list[float]]:
    """Seconds of one ColumnParallelLinear(h, 4h) forward + backward on [s, b, h], async on and off,
    interleaved (the layer alone: no other compute to compete with its collectives but its own)."""
    from megatron import parallel_state
    from megatron.tensor_parallel import ColumnParallelLinear

    layer = ColumnParallelLinear(args.hidden, 4 * args.hidden, sequence_parallel=sp,
                                 group=parallel_state.get().group("tp"))
    x = torch.randn(args.seq // 2 if sp else args.seq, args.micro_batch, args.hidden, requires_grad=True)
    dy = torch.randn(args.seq, args.micro_batch, layer.output_size_per_partition)
    times = {True: [], False: []}
    for rep in range(args.layer_reps):
        for overlap in (True, False) if rep % 2 else (False, True):
            layer.async_communication = overlap
            dist.barrier()
            start = time.perf_counter()
            layer(x).backward(dy)
            times[overlap].append(time.perf_counter() - start)
    return times


def _rank_main(rank: int, world: int, store_dir: str, args: argparse.Namespace, queue) -> None:
    from megatron import parallel_state
    from megatron.data.loader import build_batch
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.distributed.parallelize import plan_sharding
    from megatron.parallelize_gpt import build_model, parallelize_gpt
    from megatron.tensor_parallel import ColumnParallelLinear, set_async_communication
    from megatron.training import train_step
    from pretrain_gpt import forward_step

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "store"), world), rank=rank,
                            world_size=world)
    ps = parallel_state.initialize(tp=2)
    data = MockGPTDataset(1000, args.seq, 8192, seed=1)
    n = args.micro_batch * args.micro_batches
    batch = build_batch([data[i] for i in range(n)], data.eod_id)
    result = {}
    variants = {}
    for sp in (False, True):
        config = _config(args, sp, store_dir)
        plan = plan_sharding(config, ps)
        run = parallelize_gpt(config, torch.device("cpu"), plan, build_model(config))
        model, buffer, _, optimizer = run.model, run.buffer, run.fully_sharded, run.optimizer
        for overlap in (True, False):
            variants[(sp, overlap)] = (model, buffer, optimizer)
        result[("saved", sp, "shard")] = _saved_bytes(model, batch, args.micro_batch)
        if sp:
            for module in model.modules():
                if isinstance(module, ColumnParallelLinear):
                    module.forward = types.MethodType(_gather_then_linear, module)
            result[("saved", sp, "gathered")] = _saved_bytes(model, batch, args.micro_batch)
            for module in model.modules():
                if isinstance(module, ColumnParallelLinear):
                    del module.forward  # back to the class's
    times = {key: [] for key in variants}
    for step in range(args.warmup + args.steps):
        order = list(variants.items())
        for (sp, overlap), (model, buffer, optimizer) in order if step % 2 else order[::-1]:  # no order bias
            set_async_communication(model, overlap)
            dist.barrier()
            start = time.perf_counter()
            train_step(forward_step, batch, model, buffer, optimizer, 1e-4, args.micro_batch)
            if step >= args.warmup:
                times[(sp, overlap)].append(time.perf_counter() - start)
    for key, values in times.items():
        result[("time",) + key] = values
    for sp in (False, True):
        result[("comm", sp)] = _time_collectives(args, ps.group("tp"), sp)
        for overlap, values in _time_layer(args, sp).items():
            result[("layer", sp, overlap)] = values
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def _times(values: list[float]) -> str:
    return f"{statistics.median(values):.4f} / {min(values):.4f}"


def _rows(r: dict, kind: str) -> list[str]:
    rows = []
    for sp in (False, True):
        on, off = r[(kind, sp, True)], r[(kind, sp, False)]
        saved = min(off) - min(on)
        name = "tp 2 + sequence parallel" if sp else "tp 2"
        collectives = "all-gather + reduce-scatter" if sp else "all-reduce"
        comm = f" {r[('comm', sp)]:.3f} |" if kind == "time" else ""
        rows.append(f"| {name} | {collectives} |{comm} {_times(off)} | {_times(on)} | "
                    f"{saved:+.4f} s ({100 * saved / min(off):+.1f}%) |")
    return rows


def _table(args: argparse.Namespace, r: dict) -> str:
    mb = 2**20
    col_shard, total_shard = r[("saved", True, "shard")]
    col_gathered, total_gathered = r[("saved", True, "gathered")]
    col_nosp, total_nosp = r[("saved", False, "shard")]
    return "\n".join([
        f"2 ranks (gloo, CPU, {args.threads} compute thread each), tp 2; fp32. Times are median / min in seconds, "
        "variants interleaved; the saving is taken on the minimum, the run least disturbed by the other "
        "processes of a shared machine. Gloo on the CPU shows little overlap: its threads and the matmuls "
        "share the same cores, and the most async can save is the collectives' own time.",
        "",
        f"One `ColumnParallelLinear({args.hidden}, {4 * args.hidden})`, forward + backward on "
        f"[{args.seq}, {args.micro_batch}, {args.hidden}], {args.layer_reps} repetitions:",
        "",
        "| layout | backward collectives | sync | async | saved by async (min) |",
        "| --- | --- | ---: | ---: | ---: |",
        *_rows(r, "layer"),
        "",
        f"Training step of a GPT with {args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
        f"{args.micro_batches} micro-batches of {args.micro_batch}, {args.steps} steps:",
        "",
        "| layout | backward collectives | those collectives alone, s/step | sync | async | saved by async (min) |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
        *_rows(r, "time"),
        "",
        "Saved for the backward by one micro-batch's forward, per rank (MB; each storage once, parameters "
        "excluded):",
        "",
        "| layout | column-parallel linears | whole model |",
        "| --- | ---: | ---: |",
        f"| tp 2, no sequence parallelism | {col_nosp / mb:.1f} | {total_nosp / mb:.1f} |",
        f"| tp 2 + sp, gathered input saved (before) | {col_gathered / mb:.1f} | {total_gathered / mb:.1f} |",
        f"| tp 2 + sp, shard saved (now) | {col_shard / mb:.1f} | {total_shard / mb:.1f} |",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--layer-reps", type=int, default=30, help="repetitions of the one-layer timing")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as store_dir:
        mp.start_processes(_rank_main, args=(2, store_dir, args, queue), nprocs=2, start_method="spawn")
    table = _table(args, queue.get())
    print(table)
    if args.write:
        write_section("tp_overlap", "Tensor parallelism: overlapped backward collectives, sequence-parallel memory",
                      "python benchmarks/tp_overlap.py " + " ".join(sys.argv[1:]), table, INTRO, replace_intro=True)


if __name__ == "__main__":
    main()
