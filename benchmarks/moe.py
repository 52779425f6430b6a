"""Mixture of experts on the CPU: tokens/s against a dense model of the same active parameters, the token
dispatch's share of the step at ep 2, and the model states per rank at ep 1, 2, 4 against the estimate.

    python benchmarks/moe.py                   # all three, gloo ranks on the CPU
    python benchmarks/moe.py --write           # also update docs/benchmarks.md

1. One process: a dense GPT (MLP width F) and a MoE GPT whose every layer has E = 8 experts of width F / 2 with
   top-2 routing, so a token goes through the same MLP weights' count (the router's E x h aside): the active
   parameters are equal (both printed) while the MoE model holds 4x the MLP parameters. tokens/s: the median
   ``train_step`` after warm-up.
2. ep 2 over 2 gloo ranks (each its own samples): the step time and the time inside the dispatch's collectives
   (the all-to-alls of the tokens and their counts, alltoall; the all-gathers and reduce-scatters over the ep
   group, allgather), timed by wrapping ``torch.distributed``'s collectives (and the flat all-gather and
   reduce-scatter of ``megatron.tensor_parallel.mappings``) on the expert groups for this benchmark only
   (forward and backward; the gradient all-reduce is not counted). On one machine gloo's exchanges are memory
   copies and waits for the other rank: the share says how much of a CPU step the exchange takes here, not on
   a network.
3. ep 1, 2, 4 over 4 ranks with the optimizer sharded over them (ZeRO stage 1: the experts' states over their
   4 / ep expert-data-parallel ranks): what a rank holds after the steps (``measured_model_state_bytes``,
   largest over the ranks: parameters, fp32 gradients, fp32 masters, AdamW states) against
   ``rank_model_state_bytes``, the estimate tools/estimate_memory.py prints.

The models are built and stepped as ``pretrain_gpt.py`` does (``plan_sharding``, ``parallelize``,
``build_optimizer``, ``train_step``). 4 ranks on a 2-core machine oversubscribe it: their times are not shown.
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
FIELDS = ("parameters", "gradients", "master_weights", "optimizer_states")
COLLECTIVES = ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather")


def model_flags(args, moe: bool, ep: int = 1, extra: tuple[str, ...] = ()) -> list[str]:
    flags = ["--mock-data", "--device", "cpu", "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
             "--num-attention-heads", "4", "--max-seq-len", str(args.seq), "--max-position-embeddings", str(args.seq),
             "--vocab-size", str(args.vocab), "--micro-batch-size", str(args.micro_batch), "--swiglu",
             "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
             "--hidden-dropout-prob", "0", "--attention-probs-dropout-prob", "0"]
    if moe:
        flags += ["--ffn-hidden-size", str(args.ffn // 2), "--num-experts", "8", "--moe-router-topk", "2",
                  "--moe-aux-loss-coeff", "1e-2", "--expert-model-parallel-size", str(ep)]
    else:
        flags += ["--ffn-hidden-size", str(args.ffn)]
    return flags + list(extra)


def active_parameters(model, topk: int) -> tuple[int, int]:
    """(all parameters, those a token goes through: all but the experts, plus topk experts' worth)."""
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    first_experts = sum(p.numel() for n, p in model.named_parameters() if ".experts.0." in n)  # one per layer
    return total, total - experts + topk * first_experts


class CollectiveTimer:
    """Seconds spent in ``torch.distributed``'s collectives on ``groups`` while installed (this benchmark only)."""

    def __init__(self, groups):
        self.groups, self.seconds, self.saved = [g for g in groups if g is not None], 0.0, {}

    def __enter__(self):
        from megatron.tensor_parallel import mappings

        for owner, names in ((dist, COLLECTIVES), (mappings, ("_all_gather_flat", "_reduce_scatter_flat"))):
            for name in names:
                original = self.saved[owner, name] = getattr(owner, name)
                setattr(owner, name, self._timed(original))
        return self

    def _timed(self, original):
        def call(*a, **kw):
            if not any(kw.get("group") is g for g in self.groups):
                return original(*a, **kw)
            start = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - start
        return call

    def __exit__(self, *exc):
        for (owner, name), original in self.saved.items():
            setattr(owner, name, original)


def _build(flags: list[str], world: int, ps):
    from megatron.config import parse_config, validate
    from megatron.distributed.parallelize import plan_sharding
    from megatron.parallelize_gpt import build_model, parallelize_gpt
    from megatron.tensor_parallel import tensor_parallel_seed

    config = parse_config(flags)
    validate(config, world_size=world)
    tensor_parallel_seed(config.seed, ps.tp_rank, torch.device("cpu"))
    plan = plan_sharding(config, ps)
    model = build_model(config, meta_init=plan.meta_init)
    counts = active_parameters(model, config.model.moe_router_topk if config.model.num_experts else 0)
    run = parallelize_gpt(config, torch.device("cpu"), plan, model)
    model, buffer = run.model, run.buffer
    return config, model, buffer, run.optimizer, counts


def _steps(args, model, buffer, optimizer, batch, dp_group, timer=None) -> tuple[float, float]:
    """(median step seconds, median seconds in the timed collectives per step)."""
    from megatron.training import train_step
    from pretrain_gpt import forward_step

    times, inside = [], []
    for step in range(args.warmup + args.steps):
        if dist.is_initialized():
            dist.barrier()
        before, start = timer.seconds if timer else 0.0, time.perf_counter()
        train_step(forward_step, batch, model, buffer, optimizer, 1e-4, args.micro_batch, dp_group)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            inside.append((timer.seconds if timer else 0.0) - before)
    return statistics.median(times), statistics.median(inside)


def _batch(args, index: int):
    from megatron.data.loader import build_batch
    from megatron.data.mock_dataset import MockGPTDataset

    data = MockGPTDataset(1000, args.seq, args.vocab, seed=1)
    return build_batch([data[index * args.micro_batch + j] for j in range(args.micro_batch)], data.eod_id)


def one_process(args) -> list[dict]:
    from megatron import parallel_state

    torch.set_num_threads(args.threads)
    rows = []
    for name, moe in (("dense", False), ("MoE", True)):
        ps = parallel_state.initialize()
        config, model, buffer, optimizer, (total, active) = _build(model_flags(args, moe), 1, ps)
        step, _ = _steps(args, model, buffer, optimizer, _batch(args, 0), None)
        rows.append({"model": name, "total": total, "active": active, "step": step,
                     "tokens_per_s": args.micro_batch * args.seq / step})
    return rows


def _rank_main(rank: int, world: int, store_dir: str, args, queue) -> None:
    from megatron import parallel_state
    from megatron.memory.measure import measured_model_state_bytes
    from megatron.memory.model_states import rank_model_state_bytes

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "store"), world), rank=rank,
                            world_size=world)
    results = []
    if world == 2:  # the dispatch's share at ep 2
        for dispatcher in ("alltoall", "allgather"):
            ps = parallel_state.initialize(ep=2)
            flags = model_flags(args, True, 2, ("--moe-token-dispatcher-type", dispatcher))
            config, model, buffer, optimizer, _ = _build(flags, world, ps)
            with CollectiveTimer([ps.group("ep"), ps.group("ep_etp")]) as timer:
                step, inside = _steps(args, model, buffer, optimizer, _batch(args, rank), ps.group("data_parallel"),
                                      timer)
            values = torch.tensor([step, inside], dtype=torch.float64)
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
            results.append({"dispatcher": dispatcher, "step": values[0].item(), "dispatch": values[1].item(),
                            "tokens_per_s": world * args.micro_batch * args.seq / values[0].item()})
            parallel_state.destroy()
    else:  # model states per rank at ep 1, 2, 4, the optimizer sharded over the 4 ranks
        for ep in (1, 2, 4):
            ps = parallel_state.initialize(sharding=world, ep=ep)
            flags = model_flags(args, True, ep, ("--bf16", "--sharding", str(world), "--sharding-stage", "1"))
            config, model, buffer, optimizer, _ = _build(flags, world, ps)
            _steps(args, model, buffer, optimizer, _batch(args, rank), ps.group("data_parallel"))
            measured, predicted = measured_model_state_bytes(optimizer), rank_model_state_bytes(config)
            values = torch.tensor([getattr(measured, f) for f in FIELDS], dtype=torch.float64)
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
            results.append({"ep": ep, "measured": values.tolist(),
                            "predicted": [getattr(predicted, f) for f in FIELDS]})
            parallel_state.destroy()
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def ranks(world: int, args) -> list[dict]:
    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as store_dir:
        mp.start_processes(_rank_main, args=(world, store_dir, args, queue), nprocs=world, start_method="spawn")
    return queue.get()


def report(args, dense_moe: list[dict], dispatch: list[dict], memory: list[dict]) -> str:
    lines = [f"CPU, {args.threads} compute thread(s) per process; Llama-shaped GPT, {args.layers} layers, hidden "
             f"{args.hidden}, vocabulary {args.vocab}, sequences of {args.seq}, micro-batch {args.micro_batch}, fp32 "
             f"(memory: bf16); the MoE model: 8 experts of width {args.ffn // 2}, top-2, against a dense MLP of "
             f"width {args.ffn}; medians of {args.steps} steps after {args.warmup}.", "",
             "| model (one process) | parameters | active per token | s/step | tokens/s |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in dense_moe:
        lines.append(f"| {r['model']} | {r['total'] / 1e6:.2f}M | {r['active'] / 1e6:.2f}M | {r['step']:.3f} | "
                     f"{r['tokens_per_s']:,.0f} |")
    lines += ["", "| ep 2, 2 ranks, dispatcher | s/step | in the dispatch's collectives | share | "
                  "tokens/s (both ranks) |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in dispatch:
        lines.append(f"| {r['dispatcher']} | {r['step']:.3f} | {r['dispatch']:.3f} | "
                     f"{100 * r['dispatch'] / r['step']:.0f}% | {r['tokens_per_s']:,.0f} |")
    lines += ["", "| 4 ranks, ZeRO-1 | parameters MB | gradients MB | masters MB | AdamW MB | total MB | estimate MB |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in memory:
        m, p = r["measured"], r["predicted"]
        lines.append(f"| ep {r['ep']} | " + " | ".join(f"{x / MB:.2f}" for x in m) + f" | {sum(m) / MB:.2f} | "
                     f"{sum(p) / MB:.2f} |")
    return "\n".join(lines)


INTRO = ("`benchmarks/moe.py`: a MoE model against a dense model of the same active parameters in one process, "
         "the token dispatch's share of the step at ep 2 (alltoall and allgather), and the model states a rank "
         "holds at ep 1, 2 and 4 against the memory estimate (`rank_model_state_bytes`, what "
         "`tools/estimate_memory.py` prints). On the CPU the experts run one after another and the dispatch's "
         "all-to-alls are memory copies between processes of one machine: the figures say what the MoE layer "
         "costs here; on GPUs see \"Mixture of experts on a GPU\" above. The estimate counts each rank's "
         "E / ep experts and their states over the expert-data-parallel ranks: at ZeRO-1 over 4 ranks ep cuts the "
         "parameters and gradients, the masters and AdamW states being already spread over the 4 ranks.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="compute threads per process")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=1024, help="the dense MLP's width (each expert's: half)")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    body = report(args, one_process(args), ranks(2, args), ranks(4, args))
    print(body)
    if args.write:
        write_section("moe", "Mixture of experts on the CPU: active parameters, the dispatch, memory per ep rank",
                      "python benchmarks/moe.py " + " ".join(sys.argv[1:]), body, INTRO, replace_intro=True)


if __name__ == "__main__":
    main()
