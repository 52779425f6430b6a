"""Checkpoint save and load: per-rank peak extra host memory, wall time and size on disk.

    python benchmarks/checkpoint.py            # 4 gloo ranks on the CPU, then 1 rank
    python benchmarks/checkpoint.py --write    # also update docs/benchmarks.md
    python benchmarks/checkpoint.py --saves [--write]   # training with saves every N steps, sync vs --async-save
                                                        # (benchmarks/checkpoint_saves.py), and the disk's bandwidth

A GPT of about 110M parameters is built as ``pretrain_gpt.py`` builds it (``plan_sharding``,
``parallelize``, ``build_optimizer``, as the Trainer does) on 4 gloo ranks with sharding 4, stage 1
and then stage 3, stepped once with ``megatron.training.train_step`` (so the AdamW states exist)
and saved with ``save_checkpoint``. Each checkpoint is then loaded with ``load_checkpoint`` into a freshly built
model and optimizer (no AdamW states yet, as when a run resumes) under the same layout and under
others: tp 2 x sharding 2 (stage 1 and stage 3) and a single rank.

Memory: before each save or load, ``gc.collect()`` and ``malloc_trim(0)`` (so the allocator
returns freed memory and the baseline is what the rank really holds), then VmRSS is read from
``/proc/self/status`` and the high-water mark reset by writing 5 to ``/proc/self/clear_refs``; after
it, VmHWM is read: peak minus baseline is the extra resident memory the operation needed at its
worst. Where ``clear_refs`` cannot be written, a thread samples VmRSS every 5 ms instead. The same
thread always samples RssAnon (anonymous memory: tensors), since VmRSS also counts the pages of the
checkpoint files that a load memory-maps and reads (clean page-cache pages, dropped under memory
pressure). The figures are compared with the rank's shard (its fp32 master weights and two AdamW
states: what the rank owns) and with the whole model's fp32 weights and AdamW states (what a gather
of the model would need).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import write_section  # noqa: E402

MB = 2**20
SAVES = [1, 3]  # sharding-4 stages saved (tp 1)
# (saved stage, world, tp, sharding, stage) of every load
LOADS = [(1, 4, 1, 4, 1), (3, 4, 1, 4, 3), (3, 4, 2, 2, 1), (3, 4, 2, 2, 3), (1, 4, 2, 2, 3), (3, 1, 1, 1, 1)]


def _status() -> dict[str, int]:
    """The kB fields of /proc/self/status, in bytes."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                values[key] = int(parts[0]) * 1024
    return values


def _mapped(status: dict[str, int]) -> int:
    """Resident file-backed and shared pages (memory-mapped files)."""
    return status["RssFile"] + status.get("RssShmem", 0)


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak extra resident memory over a block: VmHWM after clear_refs (else VmRSS sampled every
    5 ms), and RssAnon sampled every 5 ms."""

    def __enter__(self) -> PeakMemory:
        gc.collect()
        _malloc_trim()
        base = _status()
        self.base_rss, self.base_anon, self.base_file = base["VmRSS"], base["RssAnon"], _mapped(base)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm = True
        except OSError:
            self.hwm = False
        self.max_rss, self.max_anon, self.max_file = self.base_rss, self.base_anon, self.base_file
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._update(_status())
            self._stop.wait(0.005)

    def _update(self, s: dict[str, int]) -> None:
        self.max_rss, self.max_anon = max(self.max_rss, s["VmRSS"]), max(self.max_anon, s["RssAnon"])
        self.max_file = max(self.max_file, _mapped(s))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        s = _status()
        self._update(s)
        self.peak = (s["VmHWM"] if self.hwm else self.max_rss) - self.base_rss
        self.peak_anon, self.peak_file = self.max_anon - self.base_anon, self.max_file - self.base_file


def _config(args, world: int, tp: int, sharding: int, stage: int, ps, out: str):
    from megatron.config import parse_config, validate

    flags = ["--mock-data", "--device", "cpu", "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
             "--num-attention-heads", str(args.heads), "--max-seq-len", str(args.seq), "--max-position-embeddings",
             str(args.seq), "--vocab-size", str(args.vocab), "--micro-batch-size", "1", "--global-batch-size",
             str(ps.data_parallel_size), "--hidden-dropout-prob", "0", "--attention-probs-dropout-prob", "0",
             "--tp", str(tp), "--sharding", str(sharding), "--sharding-stage", str(stage), "--save", out]
    flags += ["--bf16"] if args.precision == "bf16" else []
    config = parse_config(flags)
    validate(config, world_size=world)
    return config


def _build(args, world: int, tp: int, sharding: int, stage: int, out: str):
    """(ps, config, model, buffer, optimizer) as pretrain_gpt.py builds them."""
    from megatron import parallel_state
    from megatron.distributed.parallelize import plan_sharding
    from megatron.parallelize_gpt import build_model, parallelize_gpt
    from megatron.tensor_parallel import tensor_parallel_seed

    ps = parallel_state.initialize(tp=tp, sharding=sharding)
    config = _config(args, world, tp, sharding, stage, ps, out)
    tensor_parallel_seed(config.seed, ps.tp_rank, torch.device("cpu"))
    plan = plan_sharding(config, ps)
    run = parallelize_gpt(config, torch.device("cpu"), plan, build_model(config, meta_init=plan.meta_init))
    model, buffer = run.model, run.buffer
    return ps, config, model, buffer, run.optimizer


@torch.no_grad()
def _checksum(model, optimizer, ps) -> list[float]:
    """(sum, sum of squares) of the masters and of both AdamW states over the whole model, each
    element counted once (the pieces a save writes), summed over the ranks."""
    from megatron.checkpoint import KINDS, owned_pieces

    sums = torch.zeros(2 * len(KINDS), dtype=torch.float64)
    if ps.dp_rank == 0:
        for _, p, lo, hi, master, offset in owned_pieces(model, optimizer, ps):
            if getattr(p, "tied_copy", False) or not (getattr(p, "tensor_model_parallel", False) or ps.tp_rank == 0):
                continue
            state = optimizer.inner.state.get(master, {})
            for i, kind in enumerate(KINDS):
                source = master if kind == "param" else state.get(kind)
                if source is not None:
                    x = source[offset:offset + hi - lo].double()
                    sums[2 * i] += x.sum()
                    sums[2 * i + 1] += (x * x).sum()
    if dist.is_initialized():
        dist.all_reduce(sums)
    return sums.tolist()


def _into(result: dict, fn) -> None:
    result.update(fn())


def _shard_bytes(optimizer) -> int:
    """This rank's fp32 master weights and two AdamW states."""
    return 12 * sum(hi - lo for _, lo, hi, _ in optimizer.pieces())


def _measure(label: str, fn, ps) -> dict:
    if dist.is_initialized():
        dist.barrier()
    with PeakMemory() as mem:
        start = time.perf_counter()
        fn()
        if dist.is_initialized():
            dist.barrier()
        seconds = time.perf_counter() - start
    return {"label": label, "rank": ps.rank, "peak": mem.peak, "peak_anon": mem.peak_anon,
            "peak_file": mem.peak_file, "hwm": mem.hwm,
            "seconds": seconds}


def _rank_main(rank: int, world: int, store_dir: str, ckpt_root: str, args: argparse.Namespace, queue) -> None:
    from megatron.checkpoint import load_checkpoint, save_checkpoint
    from megatron.data.loader import build_batch
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.training import train_step
    from pretrain_gpt import forward_step

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "store"), world), rank=rank,
                            world_size=world)
    rows = []
    if world > 1:
        for stage in SAVES:
            ps, config, model, buffer, optimizer = _build(args, world, 1, world, stage, store_dir)
            data = MockGPTDataset(100, args.seq, args.vocab, seed=1)
            batch = build_batch([data[ps.data_parallel_rank]], data.eod_id)
            dp_group = ps.group("data_parallel") if ps.data_parallel_size > 1 else None
            train_step(forward_step, batch, model, buffer, optimizer, 1e-4, 1, dp_group)  # creates the AdamW states
            out = os.path.join(ckpt_root, f"stage{stage}")
            save = partial(save_checkpoint, out, 1, model, optimizer, ps, config,
                           {"consumed_samples": 0, "skipped_steps": 0})
            row = _measure(f"save sharding {world} stage {stage}", save, ps)
            row.update(kind="save", saved=stage, shard=_shard_bytes(optimizer),
                       checksum=_checksum(model, optimizer, ps),
                       io=os.path.getsize(os.path.join(out, "step_1", f"rank{rank}.bin")))
            rows.append(row)
            del model, buffer, optimizer
    for saved, load_world, tp, sharding, stage in LOADS:
        if load_world != world:
            continue
        ps, config, model, buffer, optimizer = _build(args, world, tp, sharding, stage, store_dir)
        where = f"{world} rank{'s' if world > 1 else ''}" + (f", tp {tp} x sharding {sharding}" if world > 1 else "")
        label = f"load stage-{saved} save on {where}" + (f", stage {stage}" if sharding > 1 else "")
        path = os.path.join(ckpt_root, f"stage{saved}")
        loaded: dict = {}
        load = partial(load_checkpoint, path, model, optimizer, ps, config)
        row = _measure(label, partial(_into, loaded, load), ps)
        row.update(kind="load", saved=saved, shard=_shard_bytes(optimizer), checksum=_checksum(model, optimizer, ps),
                   io=loaded["bytes_read"])
        rows.append(row)
        del model, buffer, optimizer
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        queue.put([r for rank_rows in gathered for r in rank_rows])
    dist.destroy_process_group()


def _spawn(world: int, ckpt_root: str, args) -> list[dict]:
    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as store_dir:
        mp.start_processes(_rank_main, args=(world, store_dir, ckpt_root, args, queue), nprocs=world,
                           start_method="spawn")
    return queue.get()


def _disk_bytes(step_dir: str) -> int:
    return sum(os.path.getsize(os.path.join(step_dir, f)) for f in os.listdir(step_dir))


def _sizes(step_dir: str) -> tuple[int, str, int]:
    """(parameters in the model, the largest parameter's name and size) from a checkpoint's metadata."""
    from megatron.checkpoint import CheckpointReader

    reader = CheckpointReader(step_dir)
    sizes = {name: math.prod(reader.global_shape(name)) for name in reader.names}
    largest = max(sizes, key=sizes.get)
    return sum(sizes.values()), largest, sizes[largest]


def _table(rows: list[dict], full_bytes: int) -> tuple[str, list[str]]:
    lines = ["| operation | ranks | shard MB | written / read MB | peak extra MB (VmHWM) | anon MB (sampled) | "
             "file-mapped MB (sampled) | VmHWM / shard | VmHWM / full model | anon / shard | s | checksum |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    saved_sums = {r["saved"]: r["checksum"] for r in rows if r["kind"] == "save"}
    problems = []
    for label in dict.fromkeys(r["label"] for r in rows):
        group = sorted((r for r in rows if r["label"] == label), key=lambda r: r["rank"])
        first = group[0]
        ok = all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)
                 for a, b in zip(first["checksum"], saved_sums[first["saved"]]))
        if not ok:
            problems.append(f"{label}: checksum differs from the saved model")
        if not first["hwm"]:
            problems.append(f"{label}: clear_refs not writable, VmRSS sampled every 5 ms")
        per_rank = {key: " / ".join(f"{r[key] / MB:.0f}" for r in group) for key in ("peak", "peak_anon", "peak_file")}
        worst = {key: max(r[key] for r in group) for key in ("shard", "io", "peak", "seconds")}
        lines.append(f"| {label} | {len(group)} | {worst['shard'] / MB:.0f} | {worst['io'] / MB:.0f} | "
                     f"{per_rank['peak']} | {per_rank['peak_anon']} | {per_rank['peak_file']} | "
                     f"{max(r['peak'] / r['shard'] for r in group):.2f} | {worst['peak'] / full_bytes:.2f} | "
                     f"{max(r['peak_anon'] / r['shard'] for r in group):.2f} | {worst['seconds']:.2f} | "
                     f"{'matches' if ok else 'DIFFERS'} |")
    return "\n".join(lines), problems


INTRO = (
    "`benchmarks/checkpoint.py` measures what `save_checkpoint` and `load_checkpoint` cost each rank in host "
    "memory and time, for a GPT several times larger than one rank's shard. The model, optimizer and wrapping "
    "are built as `pretrain_gpt.py` builds them (`plan_sharding`, `parallelize`, `build_optimizer`) on 4 gloo "
    "ranks with sharding 4 (stage 1, then stage 3), stepped once with `train_step` so that the AdamW states exist, and "
    "saved. Each checkpoint is then loaded into a freshly built model and optimizer (no AdamW states yet, as "
    "when a run resumes): under the layout it was saved in, under tp 2 x sharding 2 (stages 1 and 3) and on a "
    "single rank. Memory is per rank (each rank is a process): before the operation the script runs "
    "`gc.collect()` and `malloc_trim(0)`, reads VmRSS from `/proc/self/status` and resets the high-water mark "
    "(`echo 5 > /proc/self/clear_refs`); after it, VmHWM minus that VmRSS is the extra resident memory at the "
    "operation's worst moment (where `clear_refs` is not writable, VmRSS sampled every 5 ms instead). VmRSS "
    "counts two kinds of pages, so a thread also samples, every 5 ms, RssAnon (anonymous memory: tensors) and "
    "RssFile + RssShmem (pages of memory-mapped files, here the checkpoint files a load reads). *Shard* is the "
    "rank's fp32 master weights and two AdamW states (12 bytes per element of its optimizer shard); *full "
    "model* is the same for the whole model: what gathering the model on one rank would need, and the size of "
    "the checkpoint on disk. Times are wall seconds from a barrier before to a barrier after (slowest rank); "
    "the files go to a local disk and are read back while still in the page cache, and 4 ranks share 2 cores. "
    "*Checksum*: the sum and sum of squares of the masters and both AdamW states over the whole model, each "
    "element counted once, after the load against the saved run's.\n\n"
    "**Save.** Each rank streams the pieces it writes (its shard, cut at parameter boundaries) into its raw "
    "fp32 rank file one piece at a time, so the extra memory is a few MB (the largest piece), under stage 1 and "
    "stage 3 alike; no rank ever holds the whole model, and the rank files add up to the full model (each "
    "element written once).\n\n"
    "**Load.** The load creates the AdamW states (two thirds of the shard) and fills them piece by piece: a "
    "piece is read with a seek and a read of its bytes, nothing is memory-mapped, so no file pages stay "
    "resident (*file-mapped* is 0). When the tensor-parallel cut is the same (every load from tp 1 here, "
    "whatever the sharding degree or stage), a rank reads only the saved pieces overlapping its own: *read* is "
    "about its shard. When the cut differs (tp 1 -> tp 2), each parameter's global tensor is reassembled, one "
    "at a time, and sliced; a rank then reads the whole tensor of each parameter it owns a piece of (*read* "
    "above its shard). Peak extra memory stays between about 1.4 and 2 shards (the new AdamW states, the "
    "temporaries of one parameter and freed memory glibc keeps), never near the full model; on a single rank "
    "the shard is the whole model, as it must be.")


SAVES_INTRO = (
    "`benchmarks/checkpoint.py --saves` (`benchmarks/checkpoint_saves.py`) trains a GPT of about 30M parameters "
    "three times in one process: without checkpoints, saving every 2 steps, and saving every 2 steps with "
    "`--async-save`. Each save's `save_blocked_s` (training stopped: the staging copy and the seal at a step "
    "boundary, or the whole save when synchronous) and `save_total_s` (until the checkpoint was sealed) come "
    "from metrics.jsonl. The disk's write bandwidth is measured by writing and fsync'ing a file of the "
    "checkpoint's size in the same folder. The script exits 1 when async saves blocked training for more than "
    "25% of their total time."
    " On this machine the 2 cores are shared by the training step and the writer thread (its CRC-32s and "
    "copies into the page cache), so the steps that overlap a write are slower and the throughput gains less "
    "than the blocked time says; with the step on a GPU the writer competes for less (not measured here).")


def _saves(args) -> int:
    from benchmarks.checkpoint_saves import run

    body, ok = run(args.device, args.steps, args.every)
    print(body)
    if args.write:
        write_section("checkpoint-saves", "Checkpoints every N steps: sync vs --async-save",
                      "python benchmarks/checkpoint.py " + " ".join(sys.argv[1:]), body, SAVES_INTRO,
                      replace_intro=True)
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--no-single", action="store_true", help="skip the single-rank load")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--saves", action="store_true", help="instead: training throughput with a save every "
                        "--every steps, sync vs --async-save, and the save time against the disk's bandwidth")
    parser.add_argument("--every", type=int, default=2, help="with --saves: steps between saves")
    parser.add_argument("--steps", type=int, default=20, help="with --saves: steps of each run")
    parser.add_argument("--device", default="cpu", choices=["cpu", "gpu"], help="with --saves")
    args = parser.parse_args()
    if args.saves:
        return _saves(args)
    started = time.perf_counter()
    ckpt_root = tempfile.mkdtemp(prefix="ckpt_bench_", dir=os.environ.get("CKPT_BENCH_DIR"))
    try:
        rows = _spawn(4, ckpt_root, args)
        if not args.no_single:
            rows += _spawn(1, ckpt_root, args)
        step_dirs = {stage: os.path.join(ckpt_root, f"stage{stage}", "step_1") for stage in SAVES}
        disk = {stage: _disk_bytes(d) for stage, d in step_dirs.items()}
        numel, largest, largest_numel = _sizes(step_dirs[SAVES[0]])
    finally:
        shutil.rmtree(ckpt_root, ignore_errors=True)
    full = 12 * numel
    table, problems = _table(rows, full)
    on_disk = ", ".join(f"stage-{stage} save {disk[stage] / MB:.0f} MB" for stage in SAVES)
    body = "\n".join([
        f"GPT {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, seq {args.seq}, {args.precision} "
        f"parameters (fp32 masters): {numel / 1e6:.1f}M parameters; full model (fp32 weights + 2 AdamW states) "
        f"{full / MB:.0f} MB; largest parameter `{largest}`, {largest_numel / 1e6:.1f}M elements, "
        f"{12 * largest_numel / MB:.0f} MB with its AdamW states. On disk: {on_disk}. gloo ranks on the CPU, "
        f"{args.threads} compute thread each, torch {torch.__version__}; run took "
        f"{time.perf_counter() - started:.0f} s. MB = 2^20 bytes. *Shard*: the rank's fp32 masters and AdamW "
        f"states; *written / read*: the rank's file (save) or the checkpoint bytes the load read (counted by "
        f"the reader); *peak extra* (VmHWM), *anon* and "
        f"*file-mapped* (peak RssAnon and RssFile + RssShmem over the baseline, sampled every 5 ms): per rank, "
        f"rank 0 / 1 / 2 / 3; shard, written / read and the ratios: the largest rank; s: the slowest rank.",
        "", table])
    print(body)
    for problem in problems:
        print("warning:", problem, file=sys.stderr)
    if args.write:
        write_section("checkpoint", "Checkpoint save and load: per-rank peak host memory and time",
                      "python benchmarks/checkpoint.py " + " ".join(sys.argv[1:]), body, INTRO, replace_intro=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
