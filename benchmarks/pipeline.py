"""Pipeline bubble of 1F1B and interleaved 1F1B: measured on real processes, and simulated.

    python benchmarks/pipeline.py                    # pp = 2 gloo ranks on the CPU, then the simulator
    python benchmarks/pipeline.py --write            # also update docs/benchmarks.md

**Measured** (pp = 2 processes, gloo, CPU, one compute thread each: this machine has 2 cores, so more
ranks would time-share cores and measure the OS scheduler rather than the pipeline). Each rank builds
its stage of the same GPT with ``build_model`` twice: one stage (1F1B, vpp 1) and two model chunks
(interleaved 1F1B, vpp 2), and runs ``forward_backward_pipelining`` (the real table executor with p2p)
on ``m`` micro-batches; steps alternate over every (m, schedule), so background load hits all alike.

* busy time of a rank: the sum of the wall times of its F and B computes. F is timed around the model
  call in this script's ``forward_step``; B around each call into the autograd engine: this process
  (only) replaces ``Variable._execution_engine`` by a timing proxy, which ``torch.autograd.backward``
  and direct engine calls both go through (one call per backward action of the executor). A step's
  compute times, in order, line up with the compute actions of the rank's table.
* step wall time: ``dist.barrier()``, start the clock, the schedule, ``dist.barrier()``, stop the clock
  (the optimizer step is not part of the pipeline and not timed).
* bubble = 1 - busy / wall on each rank, averaged over the ranks and over the steps after warm-up.
* time in p2p of a rank: inside ``p2p.communicate`` (posting a ``batch_isend_irecv``) plus waiting on the
  handles it returns; this process wraps ``p2p.communicate``, which the executor looks up at each call.
  It includes waiting for data that is not ready yet (the pipeline's fill and drain).

Beside it: the formula (pp-1)/(m+pp-1), or (pp-1)/(vpp*m+pp-1) for interleaved, which assumes equal
stages and free communication; and a *replay* of the same tables with the per-action compute times
measured in that step and zero-cost communication (buffered sends, receives wait for the matching send,
as ``schedule_tables.simulate`` models them). Theory -> replay is the cost of unequal stages (the first
holds the embedding, the last the LM head and the loss) and of jitter; replay -> measured is what the
computes do not account for: the cost of each p2p exchange on the critical path, Python between actions,
and the barrier. It is shown per ``batch_isend_irecv`` call ("excess ms per exchange"), beside the time
of one exchange between otherwise idle ranks.

**Simulated** (no processes): ``schedule_tables.simulate`` with F = 1, B = 2 and free communication, for
pp 4, 8, 16; plus, per schedule, the simulator's peak number of micro-batches in flight per rank
(forwarded, not yet backwarded: the bound on stored activations): GPipe m, 1F1B min(pp - rank, m),
interleaved counted in model chunks (each 1/vpp of a stage).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import write_section  # noqa: E402
from megatron.pipeline_parallel import schedule_tables as st  # noqa: E402

SCHEDULES = (("1F1B", 1), ("interleaved", 2))  # (name, vpp) measured on processes


def theory(pp: int, m: int, vpp: int = 1) -> float:
    return (pp - 1) / (vpp * m + pp - 1)


def tables_for(pp: int, m: int, vpp: int, gpipe: bool = False) -> list[list[st.Action]] | None:
    """Every rank's table, or None where the schedule does not apply (interleaved needs m % pp == 0)."""
    if gpipe:
        return [st.gpipe(pp, r, m) for r in range(pp)]
    if vpp == 1:
        return [st.one_f_one_b(pp, r, m) for r in range(pp)]
    return None if m % pp else [st.interleaved_one_f_one_b(pp, r, m, vpp) for r in range(pp)]


def replay(tables: list[list[st.Action]], durations: list[list[float]], pp: int,
           vpp: int) -> tuple[float, float]:
    """(bubble, makespan) of the tables executed with the given compute times (per rank, in table order) and free
    communication: a send never blocks, a receive waits for its matching send (``simulate``'s model)."""
    last = pp * vpp - 1
    pc, ci, t, busy = [0] * pp, [0] * pp, [0.0] * pp, [0.0] * pp
    done, sent = {}, {}
    while any(pc[r] < len(tables[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while pc[r] < len(tables[r]):
                a = tables[r][pc[r]]
                v = a.chunk * pp + r
                if a.kind in st.COMPUTE:
                    dep = (a.kind, a.micro_batch, v - 1 if a.kind == "F" else v + 1)
                    if 0 <= dep[2] <= last and dep not in done:
                        break
                    cost = durations[r][ci[r]]
                    ci[r] += 1
                    t[r] = done[(a.kind, a.micro_batch, v)] = max(t[r], done.get(dep, 0.0)) + cost
                    busy[r] += cost
                elif a.kind.startswith("SEND"):
                    sent[(a.kind[-1], a.micro_batch, v)] = t[r]
                else:
                    key = (a.kind[-1], a.micro_batch, v - 1 if a.kind == "RECV_F" else v + 1)
                    if key not in sent:
                        break
                    t[r] = max(t[r], sent[key])
                pc[r] += 1
                moved = True
        if not moved:
            raise st.DeadlockError("replay: no rank can progress")
    return 1.0 - sum(busy) / (pp * max(t)), max(t)


class _TimedEngine:
    """Stands in for the autograd engine (``Variable._execution_engine``) and appends the wall time of
    each outermost ``run_backward`` to ``durations``. ``torch.autograd.backward`` and a direct engine
    call both go through it, so each B action is timed however the executor starts its backward."""

    def __init__(self, engine, durations: list[float]):
        self._engine, self._durations, self._depth = engine, durations, 0

    def run_backward(self, *args, **kwargs):
        start = time.perf_counter()
        self._depth += 1
        try:
            return self._engine.run_backward(*args, **kwargs)
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._durations.append(time.perf_counter() - start)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


class _TimedWork:
    """A p2p work handle whose ``wait()`` adds its wall time to ``totals[0]``."""

    def __init__(self, work, totals: list[float]):
        self._work, self._totals = work, totals

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._totals[0] += time.perf_counter() - start

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def _timed_communicate(communicate, totals: list[float]):
    """``p2p.communicate`` adding the time spent posting, and later waiting for, each exchange to ``totals[0]``."""

    def timed(*args, **kwargs):
        start = time.perf_counter()
        buffers, works = communicate(*args, **kwargs)
        totals[0] += time.perf_counter() - start
        return buffers, [_TimedWork(work, totals) for work in works]

    return timed


def _rank_main(rank: int, world: int, store_dir: str, args: argparse.Namespace, queue) -> None:
    from megatron import parallel_state
    from megatron.config import parse_config, validate
    from megatron.data.loader import build_batch, split_micro_batches
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.parallelize_gpt import build_model
    from megatron.pipeline_parallel import p2p
    from megatron.pipeline_parallel.schedules import forward_backward_pipelining
    from pretrain_gpt import loss_fn

    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "store"), world), rank=rank,
                            world_size=world)
    ps = parallel_state.initialize(pp=world)
    models = {}
    for name, vpp in SCHEDULES:
        flags = ["--mock-data", "--device", "cpu", "--num-layers", str(args.layers), "--hidden-size",
                 str(args.hidden), "--num-attention-heads", "8", "--max-seq-len", str(args.seq),
                 "--max-position-embeddings", str(args.seq), "--vocab-size", str(args.vocab), "--micro-batch-size",
                 str(args.micro_batch), "--global-batch-size", str(args.micro_batch * world), "--pp", str(world),
                 "--vpp", str(vpp), "--hidden-dropout-prob", "0", "--attention-probs-dropout-prob", "0",
                 "--save", os.path.join(store_dir, "out")]
        config = parse_config(flags)
        validate(config, world_size=world)
        models[name] = build_model(config)
    data = MockGPTDataset(max(args.m) * args.micro_batch, args.seq, args.vocab, seed=1)
    batch = build_batch([data[i] for i in range(max(args.m) * args.micro_batch)], data.eod_id)
    micro_batches = split_micro_batches(batch, args.micro_batch)

    actions: list[float] = []  # durations of this step's computes, in execution (= table) order

    def forward_step(micro_batch: dict, model: torch.nn.Module):
        start = time.perf_counter()
        output = model(micro_batch["tokens"], micro_batch["position_ids"], labels=micro_batch["labels"])
        actions.append(time.perf_counter() - start)
        return output, partial(loss_fn, micro_batch["loss_mask"])

    engine_owner = torch.autograd.variable.Variable
    engine = engine_owner._execution_engine
    engine_owner._execution_engine = _TimedEngine(engine, actions)  # this benchmark process only
    p2p_time = [0.0]  # this step's time inside p2p.communicate and the waits on its handles
    communicate = p2p.communicate
    p2p.communicate = _timed_communicate(communicate, p2p_time)  # the executor looks it up at each call
    shape = (args.seq, args.micro_batch, args.hidden)
    runs = {(m, name): [] for m in args.m for name, _ in SCHEDULES}
    for step in range(args.warmup + args.steps):
        for m in args.m:
            mbs = micro_batches[:m]
            num_tokens = float(sum(mb["loss_mask"].sum() for mb in mbs))
            for name, _ in SCHEDULES:
                model = models[name]
                model.zero_grad(set_to_none=False)
                actions.clear()
                p2p_time[0] = 0.0
                dist.barrier()
                start = time.perf_counter()
                forward_backward_pipelining(forward_step, mbs, model, num_tokens, ps=ps, schedule="1f1b",
                                            shape=shape, dtype=torch.float32, device=torch.device("cpu"))
                dist.barrier()
                wall = time.perf_counter() - start
                if step >= args.warmup:
                    runs[(m, name)].append({"wall": wall, "busy": sum(actions), "p2p": p2p_time[0],
                                               "actions": list(actions)})
    engine_owner._execution_engine = engine
    p2p.communicate = communicate
    # Communication alone, both ranks otherwise idle: one activation from rank 0 to the last rank and back
    # (half the round trip), and one barrier.
    tensor, ping, barrier = torch.randn(shape), [], []
    for _ in range(args.warmup + 20):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(tensor, world - 1)
            dist.recv(tensor, world - 1)
        elif rank == world - 1:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)
        ping.append((time.perf_counter() - start) / 2)
        start = time.perf_counter()
        dist.barrier()
        barrier.append(time.perf_counter() - start)
    runs["ping"] = statistics.median(ping[args.warmup:])
    runs["barrier"] = statistics.median(barrier[args.warmup:])
    queue.put((rank, runs))
    dist.destroy_process_group()


def _exchanges(table: list[st.Action]) -> int:
    """Number of ``batch_isend_irecv`` calls the executor makes for a table (runs of communication actions)."""
    return sum(a.kind in st.COMM and (i == 0 or table[i - 1].kind not in st.COMM) for i, a in enumerate(table))


def measure(args: argparse.Namespace) -> str:
    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as store_dir:
        mp.start_processes(_rank_main, args=(args.world, store_dir, args, queue), nprocs=args.world,
                           start_method="spawn")
    per_rank = dict(queue.get() for _ in range(args.world))
    pp = args.world
    rows = []
    f_ms = {r: [] for r in range(pp)}
    b_ms = {r: [] for r in range(pp)}

    def per(steps: list, key: str) -> str:
        return " / ".join(f"{statistics.mean(ranks[r][key] for ranks in steps):.3f}" for r in range(pp))

    for m in args.m:
        for name, vpp in SCHEDULES:
            tables = tables_for(pp, m, vpp)
            computes = [[a for a in tables[r] if a.kind in st.COMPUTE] for r in range(pp)]
            steps = [[per_rank[r][(m, name)][i] for r in range(pp)] for i in range(args.steps)]
            if any(len(ranks[r]["actions"]) != len(computes[r]) for ranks in steps for r in range(pp)):
                raise RuntimeError(f"m={m} {name}: the timed computes do not match the table's F and B actions")
            bubbles = [statistics.mean(1 - s["busy"] / s["wall"] for s in ranks) for ranks in steps]
            replays = [replay(tables, [s["actions"] for s in ranks], pp, vpp) for ranks in steps]
            for ranks in steps if vpp == 1 else ():
                for r, s in enumerate(ranks):
                    for a, d in zip(computes[r], s["actions"]):
                        (f_ms if a.kind == "F" else b_ms)[r].append(1e3 * d)
            wall = statistics.mean(ranks[0]["wall"] for ranks in steps)
            makespan = statistics.mean(span for _, span in replays)
            excess = 1e3 * (wall - makespan) / max(_exchanges(t) for t in tables)
            label = name if vpp == 1 else f"{name} (vpp {vpp})"
            rows.append(f"| {m} | {label} | {wall:.3f} | {per(steps, 'busy')} | {per(steps, 'p2p')} | {makespan:.3f} "
                        f"| {excess:.2f} | **{statistics.mean(bubbles):.3f}** (±{statistics.pstdev(bubbles):.3f}) | "
                        f"{statistics.mean(bubble for bubble, _ in replays):.3f} | {theory(pp, m, vpp):.3f} |")
    per_stage = ", ".join(f"rank {r} F {statistics.median(f_ms[r]):.1f} ms / B {statistics.median(b_ms[r]):.1f} ms"
                          for r in range(pp))
    kb = 4 * args.seq * args.micro_batch * args.hidden / 2**10
    return "\n".join([
        f"**Measured**: pp = {pp} processes (gloo, CPU, {args.threads} compute thread each; this machine has 2 "
        f"cores, so more ranks would measure the CPU scheduler, not the pipeline); GPT {args.layers} layers, hidden "
        f"{args.hidden}, seq {args.seq}, vocab {args.vocab}, micro batch {args.micro_batch}, fp32; mean over "
        f"{args.steps} steps after {args.warmup} warm-up steps and over the ranks (± : standard deviation over "
        f"steps); every (m, schedule) alternates within each step. 1F1B compute per micro-batch and whole stage "
        f"(median): {per_stage}. Communication alone (ranks otherwise idle): one activation ({kb:g} KB) rank 0 -> "
        f"rank {pp - 1} {1e3 * per_rank[0]['ping']:.2f} ms (half a round trip), one barrier "
        f"{1e3 * per_rank[0]['barrier']:.2f} ms.",
        "",
        "| m | schedule | step s | busy s per rank | in p2p s per rank | replay step s | excess ms per exchange | "
        "measured bubble | replay bubble | formula |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        "busy = the rank's F and B compute time; in p2p = time inside `p2p.communicate` and waiting on its handles "
        "(data dependencies included); step = wall time between a barrier before and one after the schedule; "
        "measured bubble = 1 - busy / step. Replay = the same tables re-timed with each step's measured compute "
        "times and free communication; excess = (step - replay step) / `batch_isend_irecv` calls per rank. "
        "Formula = (pp-1)/(m+pp-1), interleaved (pp-1)/(vpp*m+pp-1).",
    ])


def simulated(ms: list[int]) -> str:
    rows = []
    for pp in (4, 8, 16):
        for m in ms:
            cells = []
            for vpp in (1, 2, 4):
                tables = tables_for(pp, m, vpp)
                if tables is None:
                    cells += ["—", "—"]
                    continue
                bubble = st.simulate(tables, pp, vpp, backward_cost=2.0)["bubble_fraction"]
                cells += [f"{bubble:.3f}", f"{theory(pp, m, vpp):.3f}"]
            rows.append(f"| {pp} | {m} | " + " | ".join(cells) + " |")
    memory = []
    for pp, m in ((2, 16), (4, 16), (8, 16)):
        for name, vpp, gpipe in (("GPipe", 1, True), ("1F1B", 1, False), ("interleaved", 2, False),
                                 ("interleaved", 4, False)):
            tables = tables_for(pp, m, vpp, gpipe)
            result = st.simulate(tables, pp, vpp, backward_cost=2.0)
            peak = result["peak_in_flight"]
            if gpipe:
                assert peak == [m] * pp
            elif vpp == 1:
                assert peak == [min(pp - r, m) for r in range(pp)]
            label = name if vpp == 1 else f"{name} vpp {vpp}"
            unit = "micro-batches" if vpp == 1 else "chunks"
            memory.append(f"| {pp} | {m} | {label} | {result['bubble_fraction']:.3f} | {', '.join(map(str, peak))} "
                          f"{unit} | {peak[0] / vpp:g} |")
    return "\n".join([
        "**Simulated** (`schedule_tables.simulate`, no processes: F = 1, B = 2, free communication, equal stages). "
        "Bubble = 1 - sum(busy) / (pp x makespan); — : the interleaved schedule needs m % pp == 0.",
        "",
        "| pp | m | 1F1B sim | (pp-1)/(m+pp-1) | vpp 2 sim | (pp-1)/(2m+pp-1) | vpp 4 sim | (pp-1)/(4m+pp-1) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        "**Activation memory** (simulated): peak number of micro-batches in flight (forwarded, not yet backwarded) "
        "per rank, rank 0 first: GPipe m, 1F1B min(pp - rank, m); interleaved counts model chunks, each 1/vpp of a "
        "stage's activations.",
        "",
        "| pp | m | schedule | bubble (sim) | peak in flight per rank | rank 0 peak, in whole-stage activations |",
        "| ---: | ---: | --- | ---: | --- | ---: |",
        *memory,
    ])


INTRO = """`benchmarks/pipeline.py` measures the pipeline bubble (the share of a step a rank spends not
computing) of the 1F1B and interleaved 1F1B schedules, executed by `run_pipeline_table` with real model
chunks and gloo p2p, and sets it beside the textbook formula and beside `schedule_tables.simulate`.
Only pp = 2 is measured on processes: this machine has 2 CPU cores, one compute thread per rank, and
more ranks than cores would time-share them, so the figures would measure the OS scheduler rather than
the pipeline. Larger pipelines (pp 4, 8, 16) are simulated only, and labelled so. The script's
docstring says how busy time, step time and p2p time are taken.

The formula assumes equal stages and free communication; neither holds here, and the table splits the
gap in two. *Unequal stages*: the last stage also runs the LM head and the loss (column "busy"), so the
first stage idles even in the steady state; the replay (the same tables re-timed with each step's
measured compute times and free communication) sits above the formula by that much, a floor that more
micro-batches do not remove. *Communication on the critical path*: the rest, step minus replay step,
divided by the number of `batch_isend_irecv` calls, is the cost of one exchange to the busier last
stage: milliseconds, against a fraction of a millisecond for the same exchange between idle ranks.
gloo moves the bytes with its own threads, which here share the 2 cores with the 2 compute threads (as
in the data-parallel benchmark above). The interleaved schedule makes about twice as many exchanges
(2m + 3 against m + 1 at pp = 2) around half-size computes, so on this machine it gives back most
of the advantage the formula promises it, and all of it at m = 16. With NCCL, communication runs on
its own streams and the measured bubble should come close to the replay; not measured here, as that
needs one GPU per stage."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, help="pipeline ranks (keep <= CPU cores)")
    parser.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--m", type=int, nargs="+", default=[2, 4, 8, 16], help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.world < 2 or any(m < 1 or m % args.world for m in args.m):
        parser.error("need --world >= 2 and every --m a positive multiple of --world (the interleaved schedule)")
    if args.layers % (2 * args.world):
        parser.error("--layers must be divisible by 2 x --world (two model chunks per rank)")
    start = time.perf_counter()
    text = measure(args) + "\n\n" + simulated(args.m)
    print(text)
    print(f"\n({time.perf_counter() - start:.0f} s)")
    if args.write:
        write_section("pipeline", "Pipeline bubble: 1F1B and interleaved 1F1B",
                      "python benchmarks/pipeline.py " + " ".join(sys.argv[1:]), text, INTRO)


if __name__ == "__main__":
    main()
