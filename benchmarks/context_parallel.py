"""Context parallelism: step time and saved activation bytes per rank at cp 1, 2 and 4 for each communication
type (p2p ring, all_gather, a2a), with and without packed documents, and the ring's transfer / compute overlap
measured by turning it off.

    python benchmarks/context_parallel.py            # cp 1, 2, 4: gloo ranks on the CPU
    python benchmarks/context_parallel.py --write    # also update docs/benchmarks.md

For each cp size one group of ``cp`` gloo ranks (``parallel_state.initialize(cp=cp)``) builds the model as
training does (``parse_config`` / ``validate``, ``build_model``, ``parallelize_gpt``: the gradients summed over
dp x cp) once per communication type, and trains it with ``train_step`` on one micro-batch of ``--seq``
tokens from the mock data, cut by ``build_batch`` into the rank's two load-balanced chunks. Packed samples
are the same mock tokens with end-of-document tokens placed so that documents are 300-1000 tokens long,
attended per document (``reset_attention_mask``: ``document_ids`` given to the model).

- Step time: every variant of a cp size steps in turn, the order reversed every step so that background
  load affects them alike; after ``--warmup`` steps, each step's time is the slowest rank's (each rank
  starts it after a barrier), and the median over ``--steps`` is reported.
- Ring overlap: ``megatron.context_parallel.attention.RING_OVERLAP["enabled"] = False`` makes the ring wait
  for each key/value transfer before the block's compute, in the forward and the backward (the backward's
  dK/dV transfer follows the block's compute either way). The p2p model steps with it on
  and off, interleaved; attention alone (``attend`` forward + backward on [1, heads, s / cp, head dim]
  tensors, as the model gives them) is timed the same way, beside the ring's transfers alone.
- Saved bytes: what one micro-batch's forward saves for the backward on each rank
  (``megatron.memory.measure``'s saved-tensor hooks, each storage once, parameters excluded).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.report import write_section  # noqa: E402

COMM_TYPES = ("p2p", "all_gather", "a2a")

INTRO = """`benchmarks/context_parallel.py` trains a tiny GPT on one sequence of 4096 tokens split over cp gloo ranks,
built as `pretrain_gpt.py` builds it (`--cp`, `--cp-comm-type`; cp 1 is the reference: one process, no split),
on plain samples and on packed ones (documents of 300-1000 tokens, attention kept inside each: `--reset-
attention-mask`), and measures the ring's transfer / compute overlap by turning it off. **This machine has 2
cores:** at cp 2 each rank has a core (when the other jobs on the machine leave it one), at cp 4 four ranks
share two cores, so cp 4's wall times measure how work and communication are split, not a speed-up; the CPU-
seconds columns count the work, which the machine's load changes much less. Each rank runs one compute thread
(`torch.set_num_threads(1)`, as the other gloo benchmarks here).

What the tables show. *Memory* (exact, independent of the machine): the saved activations per rank fall as 1/cp
with p2p and all_gather, whose output is allocated in the queries' [s, b, heads, head dim] memory order as cp
1's fused kernel writes its own (the output projection's `permute` + `reshape` is then a view). a2a keeps one
copy per layer more (its output comes back from the all-to-all in [b, heads, s, head dim] order, so the reshape
copies it): 0.528 at cp 2. Packed samples have that copy at cp 1 too (the documents' results are concatenated),
so there p2p and all_gather go below 1/cp. *Time*: wall medians move with the other jobs on this machine (its
load average is given); the minima are the least disturbed runs, and the CPU seconds depend on the load much
less. cp 2 halves each rank's work (CPU s, busiest rank) for some extra in all (the block merges, the transfers,
each rank's optimizer step and the gradient sum over the cp ranks). The ring's key/value transfers alone are
1-3% of a step at cp 2 and cp 4 (the last column of the overlap table), so overlapping them can save at most
that: with and without overlap the step and attention times differ by less than the noise of this shared CPU. No
communication type is far from another here; on GPUs the choice is about bandwidth and head counts
(docs/context_parallel.md), which a CPU run cannot show."""


# ------------------------------------------------------------------------------------------------ data

def _samples(args: argparse.Namespace, packed: bool) -> tuple[list[np.ndarray], int]:
    """``--micro-batch`` mock samples of seq + 1 tokens, and the end-of-document id. Packed: the mock data's own
    end-of-document tokens (every ~128 tokens) replaced, and new ones ending documents of 300-1000 tokens."""
    from megatron.data.mock_dataset import MockGPTDataset

    data = MockGPTDataset(16, args.seq, args.vocab, seed=1)
    samples = [data[i].copy() for i in range(args.micro_batch)]
    if packed:
        rng = np.random.default_rng(7)
        for sample in samples:
            sample[sample == data.eod_id] = 0
            end = -1
            while (end := end + int(rng.integers(300, 1001))) < len(sample):
                sample[end] = data.eod_id
    return samples, data.eod_id


def _batch(args: argparse.Namespace, packed: bool, cp_rank: int, cp_size: int) -> dict:
    from megatron.data.loader import build_batch

    samples, eod = _samples(args, packed)
    return build_batch(samples, eod, reset_position_ids=packed, reset_attention_mask=packed, cp_rank=cp_rank,
                       cp_size=cp_size)


def _documents(args: argparse.Namespace) -> list[int]:
    """The document lengths of the first packed sample (its seq input tokens)."""
    samples, eod = _samples(args, True)
    ends = [i + 1 for i, t in enumerate(samples[0][:-1].tolist()) if t == eod]
    starts = [0] + ends
    return [b - a for a, b in zip(starts, ends + [args.seq]) if b > a]


# ------------------------------------------------------------------------------------------------ ranks

def _config(args: argparse.Namespace, cp: int, comm: str, store_dir: str):
    from megatron.config import parse_config, validate

    flags = ["--mock-data", "--device", "cpu", "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
             "--num-attention-heads", str(args.heads), "--max-seq-len", str(args.seq), "--max-position-embeddings",
             str(args.seq), "--vocab-size", str(args.vocab), "--micro-batch-size", str(args.micro_batch),
             "--global-batch-size", str(args.micro_batch), "--hidden-dropout-prob", "0",
             "--attention-probs-dropout-prob", "0", "--no-bf16", "--cp", str(cp), "--cp-comm-type", comm,
             "--save", os.path.join(store_dir, "out")]
    config = parse_config(flags)
    validate(config, world_size=cp)
    return config


def _set_overlap(enabled: bool) -> None:
    """The ring's transfer / compute overlap on or off (off: each transfer waited for before the block)."""
    from megatron.context_parallel import attention

    attention.RING_OVERLAP["enabled"] = enabled


def _variants(cp: int) -> list[tuple[str, bool, bool]]:
    """(communication type, packed, ring overlap) of every variant timed at this cp size."""
    if cp == 1:
        return [("p2p", False, True), ("p2p", True, True)]
    return ([(comm, False, True) for comm in COMM_TYPES] + [("p2p", False, False)]
            + [(comm, True, True) for comm in COMM_TYPES])


class _Clock:
    """Wall and CPU seconds (this process, every thread: gloo's included) since it was made."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def _attention_times(args: argparse.Namespace, ps, comm_types) -> dict:
    """Seconds of ``attend`` forward + backward alone, per (communication type, overlap), interleaved; and of
    the ring's transfers alone (those of one forward + backward, one after the other)."""
    from megatron.context_parallel import attention
    from megatron.context_parallel.attention import AttentionPlan, attend, exchange

    length, hd = args.seq // ps.cp_size, args.hidden // args.heads
    gen = torch.Generator().manual_seed(ps.cp_rank)
    qkv = torch.randn(length, args.micro_batch, args.heads, 3, hd, generator=gen, requires_grad=True)
    dout = torch.randn(args.micro_batch, args.heads, length, hd, generator=gen)
    group = ps.group("cp") if ps.cp_size > 1 else None
    cases = [(comm, True) for comm in comm_types] + ([("p2p", False)] if ps.cp_size > 1 else [])
    times = {case: [] for case in cases}
    for rep in range(args.attention_warmup + args.attention_reps):
        for comm, overlap in cases if rep % 2 else cases[::-1]:
            _set_overlap(overlap)
            plan = AttentionPlan(ps.cp_size, ps.cp_rank, group, comm, None, exchange=exchange)
            dist.barrier()
            clock = _Clock()
            q, k, v = (qkv[:, :, :, i].permute(1, 2, 0, 3) for i in range(3))  # views, as the model gives them
            attend(q, k, v, plan).backward(dout)
            if rep >= args.attention_warmup:
                times[(comm, overlap)].append(clock.read())
            qkv.grad = None
    _set_overlap(True)
    result = {("attention",) + case: values for case, values in times.items()}
    if ps.cp_size > 1:
        plan = AttentionPlan(ps.cp_size, ps.cp_rank, group, "p2p", None, exchange=exchange)
        kv = qkv.detach()[:, :, :, 1:].permute(3, 1, 2, 0, 4).contiguous()  # [2, b, heads, s / cp, hd], as sent
        transfers = []
        for rep in range(args.attention_warmup + args.attention_reps):
            dist.barrier()
            clock = _Clock()
            for _ in range(3 * ps.cp_size - 2):  # forward: cp - 1 key/value; backward: cp - 1 key/value, cp dK/dV
                attention._Transfer(kv, plan).received()
            if rep >= args.attention_warmup:
                transfers.append(clock.read())
        result[("transfers",)] = transfers
    return result


def _rank_main(rank: int, world: int, store_dir: str, args: argparse.Namespace, queue) -> None:
    from megatron import parallel_state
    from megatron.memory.measure import measure_microbatch
    from megatron.parallelize_gpt import build_model, parallelize_gpt
    from megatron.training import train_step
    from pretrain_gpt import forward_step

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "store"), world), rank=rank,
                            world_size=world)
    ps = parallel_state.initialize(cp=world)
    variants = _variants(world)
    comm_types = sorted({comm for comm, _, _ in variants}, key=COMM_TYPES.index)
    batches = {packed: _batch(args, packed, ps.cp_rank, ps.cp_size) for packed in (False, True)}
    models, result = {}, {}
    for comm in comm_types:
        config = _config(args, world, comm, store_dir)
        torch.manual_seed(1234)
        model = build_model(config).train()
        for packed in (False, True):
            if (comm, packed, True) in variants:
                result[("saved", comm, packed)] = measure_microbatch(model, forward_step, batches[packed])
        models[comm] = parallelize_gpt(config, torch.device("cpu"), None, model)
    times = {variant: [] for variant in variants}
    for step in range(args.warmup + args.steps):
        for variant in variants if step % 2 else variants[::-1]:  # no order bias
            comm, packed, overlap = variant
            _set_overlap(overlap)
            m = models[comm]
            dist.barrier()
            clock = _Clock()
            train_step(forward_step, batches[packed], m.model, m.buffer, m.optimizer, 1e-4, args.micro_batch,
                       m.dp_group)
            if step >= args.warmup:
                times[variant].append(clock.read())
    _set_overlap(True)
    result.update({("step",) + variant: values for variant, values in times.items()})
    result.update(_attention_times(args, ps, comm_types))
    queue.put((rank, result))
    dist.destroy_process_group()


def run_cp(args: argparse.Namespace, cp: int) -> dict:
    """Every rank's results at context-parallel size ``cp``, combined: a list of (wall, CPU) seconds becomes,
    per step, {"wall": the slowest rank's, "cpu": the busiest rank's, "cpu_all": the sum over ranks}; saved
    bytes are kept per rank."""
    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as store_dir:
        mp.start_processes(_rank_main, args=(cp, store_dir, args, queue), nprocs=cp, start_method="spawn")
    per_rank = dict(queue.get() for _ in range(cp))
    combined = {}
    for key in per_rank[0]:
        values = [per_rank[r][key] for r in range(cp)]
        if key[0] == "saved":
            combined[key] = values
            continue
        steps = list(zip(*values))  # per step: every rank's (wall, cpu)
        combined[key] = {"wall": [max(w for w, _ in step) for step in steps],
                         "cpu": [max(c for _, c in step) for step in steps],
                         "cpu_all": [sum(c for _, c in step) for step in steps]}
    return combined


# ------------------------------------------------------------------------------------------------ report

def _cpu() -> str:
    """The CPU as /proc/cpuinfo names it, its cores, and whether it has bf16 units."""
    info = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    model = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    family = re.search(r"^cpu family\s*:\s*(\d+)\s*^model\s*:\s*(\d+)", info, re.M)
    flags = re.search(r"^flags\s*:(.*)$", info, re.M)
    flags = set(flags.group(1).split()) if flags else set()
    bf16 = ", ".join(f"{name} {'yes' if name in flags else 'no'}" for name in ("avx512_bf16", "amx_bf16"))
    name = model.group(1) if model else platform.machine()
    if family:
        name += f" (family {family.group(1)}, model {family.group(2)})"
    simd = "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else "no avx2"
    return f"{name}, {os.cpu_count()} cores, {simd}, {bf16}"


def _med(r: dict, key: tuple, which: str = "wall") -> float:
    return statistics.median(r[key][which])


def _wall(r: dict, key: tuple, scale: float = 1.0, digits: int = 3) -> str:
    return f"{scale * _med(r, key):.{digits}f} / {scale * min(r[key]['wall']):.{digits}f}"


def _table(args: argparse.Namespace, results: dict[int, dict], load: tuple[float, float]) -> str:
    mb = 2**20
    ref = results[1]
    rows = []
    for packed in (False, True):
        ref_saved = max(ref[("saved", "p2p", packed)])
        for cp, r in results.items():
            for comm in COMM_TYPES if cp > 1 else ("p2p",):
                key = ("step", comm, packed, True)
                if key in r:
                    saved = max(r[("saved", comm, packed)])
                    rows.append(f"| {'packed' if packed else 'plain'} | {cp} | {comm if cp > 1 else '— (cp 1)'} | "
                                f"{_wall(r, key)} | {_med(r, key, 'cpu'):.3f} | {_med(r, key, 'cpu_all'):.3f} | "
                                f"{saved / mb:.1f} | {saved / ref_saved:.3f} |")
    overlap_rows, attention_rows = [], []
    sdpa = ("attention", "p2p", True)
    attention_rows.append(f"| 1 | one fused causal kernel (no split) | {_wall(ref, sdpa, 1000, 1)} | "
                          f"{1000 * _med(ref, sdpa, 'cpu'):.1f} | {1000 * _med(ref, sdpa, 'cpu_all'):.1f} |")
    for cp, r in results.items():
        if cp == 1:
            continue
        on, off = ("step", "p2p", False, True), ("step", "p2p", False, False)
        paired = statistics.median(a - b for a, b in zip(r[off]["wall"], r[on]["wall"]))  # the same step's pair
        bound = args.layers * 2 * (cp - 1) / (3 * cp - 2) * _med(r, ("transfers",))  # the key/value transfers
        overlap_rows.append(f"| {cp} | {_wall(r, off)} | {_wall(r, on)} | "
                            f"{paired:+.3f} s ({100 * paired / _med(r, off):+.1f}%) | "
                            f"{bound:.3f} s ({100 * bound / _med(r, off):.1f}%) |")
        transfers = ("transfers",)
        attention_rows.append(f"| {cp} | ring transfers alone ({3 * cp - 2} exchanges) | "
                              f"{_wall(r, transfers, 1000, 1)} | {1000 * _med(r, transfers, 'cpu'):.1f} | "
                              f"{1000 * _med(r, transfers, 'cpu_all'):.1f} |")
        for comm, overlap in (("p2p", False), ("p2p", True), ("all_gather", True), ("a2a", True)):
            key = ("attention", comm, overlap)
            name = f"p2p, overlap {'on' if overlap else 'off'}" if comm == "p2p" else comm
            attention_rows.append(f"| {cp} | {name} | {_wall(r, key, 1000, 1)} | {1000 * _med(r, key, 'cpu'):.1f} | "
                                  f"{1000 * _med(r, key, 'cpu_all'):.1f} |")
    docs = _documents(args)
    hd = args.hidden // args.heads
    return "\n".join([
        f"GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocabulary {args.vocab}, fp32, "
        f"dropout 0; one micro-batch of {args.micro_batch} x {args.seq} tokens per step (`train_step`: forward, "
        f"backward, gradient sum over the cp ranks, optimizer); gloo on {_cpu()}; torch {torch.__version__}; "
        f"{args.threads} compute thread per rank (`torch.set_num_threads({args.threads})`). Load average of the "
        f"shared machine (1 min) before / after the run: {load[0]:.1f} / {load[1]:.1f}. Median of {args.steps} "
        f"steps after {args.warmup} warm-up, variants interleaved; wall = the slowest rank's (median / min); CPU "
        f"= process CPU seconds (gloo's threads included) of the busiest rank and summed over the ranks: the work "
        f"and its split, whatever else the machine runs. Packed samples: {len(docs)} documents of "
        f"{min(docs)}-{max(docs)} tokens. Saved bytes: what one micro-batch's forward saves for the backward "
        "(`megatron.memory.measure`), the largest rank's, parameters excluded.",
        "",
        "| samples | cp | communication | step s, wall | CPU s, busiest rank | CPU s, all ranks | saved MB per rank "
        "| vs cp 1 |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        "The ring's overlap (p2p, plain samples): each key/value transfer waited for before the block's "
        "compute (`RING_OVERLAP[\"enabled\"] = False`) against overlapped with it (the default), training "
        "steps interleaved, wall seconds median / min. Saved: the median over steps of (no overlap - overlap) "
        "within each step's pair. The most overlap can save: the key/value transfers alone (cp - 1 in the "
        "forward and cp - 1 in the backward per layer, timed alone below; the dK/dV transfers follow the "
        "compute either way):",
        "",
        "| cp | no overlap | overlap | saved by overlap | the most it can save |",
        "| ---: | ---: | ---: | ---: | ---: |",
        *overlap_rows,
        "",
        f"Attention alone: `attend` forward + backward on q, k, v [{args.micro_batch}, {args.heads}, "
        f"{args.seq} / cp, {hd}] fp32 (views of one QKV tensor, as the model gives them), {args.attention_reps} "
        "repetitions, ms; the ring's transfers alone: the "
        "key/value exchanges of one forward + backward (cp - 1, cp - 1 and cp dK/dV), one after the other:",
        "",
        "| cp | attention | wall ms (median / min) | CPU ms, busiest rank | CPU ms, all ranks |",
        "| ---: | --- | ---: | ---: | ---: |",
        *attention_rows,
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="context-parallel sizes (1 first)")
    parser.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--attention-reps", type=int, default=12, help="repetitions of the attention-only timing")
    parser.add_argument("--attention-warmup", type=int, default=2)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.cp[0] != 1:
        parser.error("--cp must start with 1 (the reference)")
    load = os.getloadavg()[0]
    results = {cp: run_cp(args, cp) for cp in args.cp}
    table = _table(args, results, (load, os.getloadavg()[0]))
    print(table)
    if args.write:
        write_section("context_parallel", "Context parallelism: step time, saved bytes, the ring's overlap",
                      "python benchmarks/context_parallel.py " + " ".join(sys.argv[1:]), table, INTRO,
                      replace_intro=True)


if __name__ == "__main__":
    main()
