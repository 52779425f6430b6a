"""List the parallel layouts of a model that fit on N devices, ranked by an estimated step time.

    python tools/plan_layout.py -c examples/configs/gpt_1.3b_single_card.yaml --devices 1 --gpu V100 \\
        --device-memory-gb 32
    python tools/plan_layout.py -c examples/configs/gpt_175b_mp8_pp16.yaml --devices 128 --gpu A100 --top 5
    python tools/plan_layout.py --num-layers 24 --hidden-size 2048 --bf16 --global-batch-size 64 --devices 8 --json

Takes the same configuration as pretrain_gpt.py (its layout, micro-batch size and recompute are what
the planner varies; the global batch and the rest are kept). Every candidate (tp, context parallelism
(cp and its communication type), pp, vpp, dp, sharding degree and stage, offload, recompute, micro-batch
size; for a MoE model the expert-parallel size and the experts' tensor-parallel size) is validated as a run
would be; its memory per
device is megatron.memory.estimate at its worst pipeline stage (model states + activations + the
largest temporary), its step time a documented model, every term printed (megatron/planner/). The
best layout's pretrain_gpt.py flags are printed under the table. Under offload the CPU's AdamW is timed and the
host memory of a node checked (--host-memory-gb). --only AXIS=V1,V2 / --exclude AXIS=V1,V2 (and --no-offload,
--no-cp) narrow the search. --jobs N processes share the candidates (default: the usable cores not busy with other
work). Progress goes to stderr (a bar on a terminal, a line every few seconds otherwise).
Exit status: 0 with a list, 1 when no layout fits, 2 on bad input.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron import cpu_threads  # noqa: E402
from megatron.config import Config, ConfigError, parse_config, validate  # noqa: E402
from megatron.config.help import CONFIG_FLAGS_NOTE  # noqa: E402
from megatron.planner import (  # noqa: E402
    AXES,
    GIB,
    Hardware,
    Plan,
    PlanResult,
    configured_layout,
    evaluate_layout,
    gpu_peak_tflops,
    layout_filters,
    non_dominated,
    plan_layouts,
    rank_key,
)
from megatron.progress import Progress  # noqa: E402
from megatron.tokenizer import TokenizerError, configured_tokenizer  # noqa: E402

PROG = "plan_layout.py"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False,
                                epilog=f"{CONFIG_FLAGS_NOTE} --peak-tflops overrides the --gpu table. Times are "
                                       "estimates: see megatron/planner/time_model.py.")
    p.add_argument("--devices", type=int, required=True, help="Number of devices (GPUs).")
    p.add_argument("--devices-per-node", type=int, default=None, help="GPUs per node; default min(devices, 8).")
    p.add_argument("--device-memory-gb", type=float, default=80.0,
                   help="Memory of one device in GiB (2^30 bytes); a layout's estimate must fit in (1 - "
                        "--memory-headroom) of it (default 80).")
    p.add_argument("--gpu", default="A100", help="GPU name for the peak TFLOP/s (megatron/hardware.py's table of "
                                                 "dense 16-bit peaks; default A100: 312).")
    p.add_argument("--efficiency", type=float, default=0.5,
                   help="Fraction of the peak the matmuls achieve (default 0.5).")
    p.add_argument("--intra-node-gbps", type=float, default=150.0,
                   help="GB/s (10^9 bytes) per device within a node, NVLink (default 150).")
    p.add_argument("--inter-node-gbps", type=float, default=12.5,
                   help="GB/s per device across nodes (default 12.5: one 100 Gb/s NIC per device).")
    p.add_argument("--pcie-gbps", type=float, default=12.0,
                   help="GB/s between a device and the CPU, for offload (default 12: PCIe 3.0 x16).")
    p.add_argument("--host-memory-gb", type=float, default=1024.0,
                   help="Host memory of one node in GiB, for offload: the offloaded optimizer states of its ranks "
                        "(16 bytes per parameter of each rank's shard) must fit in (1 - --memory-headroom) of it "
                        "(default 1024: a DGX A100's 1 TB).")
    p.add_argument("--cpu-cores-per-device", type=float, default=4.0,
                   help="Host CPU cores stepping one device's offloaded optimizer (default 4).")
    p.add_argument("--cpu-adam-gparams-per-core", type=float, default=0.4,
                   help="10^9 parameters per second one core's fused CPU AdamW updates, for offload (default 0.4; "
                        "see megatron/planner/time_model.py).")
    p.add_argument("--memory-headroom", type=float, default=0.1,
                   help="Fraction of the device memory kept free for what the estimate leaves out (CUDA context, "
                        "activation gradients, allocator slack; default 0.1).")
    p.add_argument("--attention-kernel", choices=("flash", "math"), default=None,
                   help="Attention kernel of the activation estimate: flash (default on GPUs: no s x s "
                        "probabilities kept) or math (a non-fused kernel keeps them, as the seeds' Paddle did).")
    p.add_argument("--max-micro-batch", type=int, default=8,
                   help="Largest micro-batch size tried (powers of two up to it; default 8).")
    p.add_argument("--max-vpp", type=int, default=8,
                   help="Largest number of interleaved model chunks per pipeline stage tried (default 8).")
    p.add_argument("--only", action="append", default=[], metavar="AXIS=V1,V2",
                   help=f"Consider only the layouts whose AXIS is one of the values; repeatable. Axes: "
                        f"{', '.join(AXES)} (zero: the ZeRO stage, 0 unsharded; sharding: its degree; offload: on/off; "
                        f"recompute: off, core_attn, only_attn, full, block; cp-comm: p2p, all_gather, a2a).")
    p.add_argument("--exclude", action="append", default=[], metavar="AXIS=V1,V2",
                   help="Leave out the layouts whose AXIS is one of the values; repeatable; axes as --only.")
    p.add_argument("--no-offload", action="store_true", help="No optimizer offload (--exclude offload=on).")
    p.add_argument("--no-cp", action="store_true", help="No context parallelism (--only cp=1).")
    p.add_argument("--no-progress", action="store_true", help="No progress report on stderr.")
    p.add_argument("--jobs", type=int, default=None,
                   help="Processes that share the candidates (default: as --cpu-threads chooses for a run: "
                        "OMP_NUM_THREADS or MEGATRON_CPU_THREADS if set, else the usable cores not busy with "
                        "other work). The result is the same whatever the number.")
    p.add_argument("--top", type=int, default=10, help="Layouts shown (default 10).")
    p.add_argument("--all", action="store_true",
                   help="Also show the layouts another one beats or equals on step time, memory and micro-batch "
                        "size (hidden by default).")
    p.add_argument("--json", action="store_true", help="Print one JSON object instead of the table.")
    return p


def _hardware(args: argparse.Namespace, peak_tflops: float | None) -> Hardware:
    """The devices and constants of the flags; ConfigError (one line, exit 2) on a bad value."""
    try:
        return _checked_hardware(args, peak_tflops)
    except ValueError as err:
        raise ConfigError(str(err) + ".") from None


def _checked_hardware(args: argparse.Namespace, peak_tflops: float | None) -> Hardware:
    for name in ("devices", "top", "max_micro_batch", "max_vpp"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
    for name in ("device_memory_gb", "intra_node_gbps", "inter_node_gbps", "pcie_gbps", "host_memory_gb",
                 "cpu_cores_per_device", "cpu_adam_gparams_per_core"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0 < args.efficiency <= 1:
        raise ValueError(f"--efficiency must be in (0, 1], got {args.efficiency}")
    if not 0 <= args.memory_headroom < 1:
        raise ValueError(f"--memory-headroom must be in [0, 1), got {args.memory_headroom}")
    if peak_tflops is not None and peak_tflops <= 0:
        raise ValueError(f"--peak-tflops must be positive, got {peak_tflops}")
    per_node = args.devices_per_node or min(args.devices, 8)
    if per_node < 1:
        raise ValueError(f"--devices-per-node must be at least 1, got {per_node}")
    return Hardware(args.devices, per_node, args.device_memory_gb, peak_tflops or gpu_peak_tflops(args.gpu),
                    args.efficiency, args.intra_node_gbps, args.inter_node_gbps, args.pcie_gbps,
                    args.memory_headroom, args.host_memory_gb, args.cpu_cores_per_device,
                    args.cpu_adam_gparams_per_core)


def _filters(args: argparse.Namespace):
    """The --only / --exclude / --no-offload / --no-cp filters; ConfigError (one line, exit 2) on a bad one."""
    try:
        return layout_filters(args.only, args.exclude, args.no_offload, args.no_cp)
    except ValueError as err:
        raise ConfigError(str(err) + ".") from None


def _base_config(rest: list[str], devices: int) -> tuple[Config, Config | None, int | None, str | None]:
    """(the configuration as parsed, with its global batch; the same validated under the layout it names,
    on ``devices`` when it leaves dp to be derived, or None; its tokenizer's vocabulary size; why the
    layout it names is no run). A global batch that only that layout determines must be valid there."""
    config = parse_config(rest)
    d = config.distributed
    world = devices if d.dp_degree is None else (d.dp_degree * d.mp_degree * d.pp_degree * d.sharding.sharding_degree
                                                 * d.context_parallel_size)
    tokenizer = configured_tokenizer(config.tokenizer, config.model.vocab_size)
    vocab = None if tokenizer is None else tokenizer.vocab_size
    resolved = parse_config(rest)
    try:
        validate(resolved, world_size=world, cuda_available=True, tokenizer_vocab_size=vocab, training_data=False)
    except ConfigError as err:
        if config.batch_size.global_batch_size is None:
            raise
        return config, None, vocab, str(err)
    config.batch_size.global_batch_size = resolved.batch_size.global_batch_size
    return config, resolved, vocab, None


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / GIB:.1f}"


def _seconds(x: float) -> str:
    """Three decimals; a tiny model's sub-millisecond terms in scientific notation."""
    return f"{x:.3f}" if x == 0 or x >= 0.01 else f"{x:.1e}"


def _precision(config) -> str:
    return "bf16" if config.mix_precision.bf16 else "fp16" if config.mix_precision.use_pure_fp16 else "fp32"


def _counts(result: PlanResult, shown: list[Plan]) -> str:
    """``34416 candidates, 34416 valid, 4092 fit``, with what the filters left out, the layouts the host's memory
    refused and those hidden as dominated."""
    hidden = len(result.plans) - len(shown)
    line = f"{result.considered} candidates"
    if result.filters:
        line += f" ({' '.join(f.describe() for f in result.filters)})"
    line += f", {result.valid} valid, {len(result.plans)} fit"
    if hidden:
        line += f", {hidden} of them beaten or equalled on time, memory and micro-batch by another (--all shows them)"
    if result.host_rejected:
        line += f"; {result.host_rejected} more fit their devices but not the host's memory (offload)"
    return line


def render_table(result: PlanResult, shown: list[Plan], hw: Hardware, config, top: int) -> str:
    """The header (model, devices, the time model's constants, counts) and one row per layout."""
    m = config.model
    usable = hw.memory_bytes / GIB
    lines = [f"GPT {m.num_layers} layers x hidden {m.hidden_size}, global batch {config.batch_size.global_batch_size}"
             f" x {config.dataset.max_seq_len} tokens, {_precision(config)}; {hw.devices} device(s), "
             f"{hw.devices_per_node} per node, {hw.device_memory_gb:g} GiB each ({usable:.1f} usable: headroom "
             f"{hw.headroom:g}), host {hw.host_memory_gb:g} GiB per node",
             f"time model (an estimate, not a measurement): peak {hw.peak_tflops:g} TFLOP/s x efficiency "
             f"{hw.efficiency:g}; intra-node {hw.intra_node_gbps:g} GB/s, inter-node {hw.inter_node_gbps:g} GB/s, "
             f"PCIe {hw.pcie_gbps:g} GB/s; CPU AdamW {hw.cpu_adam_params_per_s:.2g} params/s per device"
             + ("; fp32 training: the peak is the 16-bit one unless --peak-tflops gives fp32's"
                if _precision(config) == "fp32" else ""),
             _counts(result, shown)]
    if shown:
        lines.append(f"model FLOPs per step {shown[0].time.model_flops:.3e}; memory in GiB per device (worst "
                     f"stage), host: GiB per node of offloaded states; times in s per step")
    moe = bool(m.num_experts)  # the ep comm column
    header = (f"{'#':>3}  {'layout':<44} {'states':>6} {'activ':>6} {'temp':>5} {'total':>6} {'host':>6}  "
              f"{'compute':>8} {'tp comm':>8} {'cp comm':>8}" + (f" {'ep comm':>8}" if moe else "")
              + f" {'dp exp':>7} {'bubble':>7} {'p2p':>6} {'offload':>7} {'cpu opt':>7} {'step':>8}")
    lines += ["", header] if shown else []
    for rank, plan in enumerate(shown[:top], 1):
        mem, t = plan.memory, plan.time
        host = _gib(plan.host_per_node) if plan.layout.offload else "-"
        lines.append(f"{rank:>3}  {plan.layout.describe():<44} {_gib(mem.model_states):>6} {_gib(mem.activations):>6}"
                     f" {_gib(mem.temporaries):>5} {_gib(mem.total):>6} {host:>6}  {_seconds(t.compute):>8} "
                     f"{_seconds(t.tp_comm):>8} {_seconds(t.cp_comm):>8}"
                     + (f" {_seconds(t.ep_comm):>8}" if moe else "") + f" {_seconds(t.dp_exposed):>7} "
                     f"{_seconds(t.bubble):>7} {_seconds(t.p2p):>6} {_seconds(t.offload):>7} "
                     f"{_seconds(t.cpu_optimizer):>7} {_seconds(t.step):>8}")
    if shown:
        lines.append(f"flags of #1: {shown[0].layout.flags()}")
    return "\n".join(lines)


def configured(base: Config, resolved: Config | None, why_not: str | None, hw: Hardware, vocab: int | None,
               kernel: str | None, result: PlanResult) -> tuple[Plan | None, int | None, str]:
    """The configuration's own layout: its plan (None if it is no run on these devices), its rank among
    the layouts that fit (None if it does not fit) and a line saying so."""
    if resolved is None:
        return None, None, f"the configuration's own layout is not a run on {hw.devices} device(s): {why_not}"
    layout = configured_layout(resolved)
    try:
        plan = evaluate_layout(base, layout, hw, vocab, kernel, complete=True)
    except ConfigError as err:
        return None, None, f"the configuration's own layout, {layout.describe()}, is not a run on {hw.devices} " \
                           f"device(s): {err}"
    rank = 1 + bisect.bisect_left(result.plans, rank_key(plan), key=rank_key) if plan.fits else None  # plans sorted
    where = f"rank {rank} of the {len(result.plans)} that fit" if plan.fits else "does not fit" + (
        f": {plan.reason}" if plan.reason else "")
    return plan, rank, (f"the configuration's own layout, {layout.describe()}: {plan.memory.total / GIB:.1f} GiB, "
                        f"{_seconds(plan.time.step)} s per step: {where}")


def no_fit_message(result: PlanResult, hw: Hardware) -> str:
    mem, layout = result.smallest.memory, result.smallest.layout
    if result.smallest.reason:
        return (f"no layout fits: the smallest on the devices, {layout.describe()} ({mem.total / GIB:.1f} GiB per "
                f"device), is refused because {result.smallest.reason}; give the hosts' real memory "
                f"(--host-memory-gb), or try more devices (--devices) or devices with more memory")
    need = f"{'' if mem.estimated else 'at least '}{mem.total / GIB:.1f} GiB"
    return (f"no layout fits in {hw.memory_bytes / GIB:.1f} GiB per device ({hw.device_memory_gb:g} less the "
            f"headroom): the smallest requirement is {need}, with {layout.describe()}. Recompute, ZeRO stages 1-3 "
            f"and offload were tried; try more devices (--devices), devices with more memory, a shorter sequence "
            f"or a smaller model")


def main(argv: list[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        hw = _hardware(args, parse_config(rest).peak_tflops)
        filters = _filters(args)
        jobs = cpu_threads.choose(args.jobs)
        config, resolved, vocab, why_not = _base_config(rest, hw.devices)
        with Progress("plan_layout", unit="layouts", interval=5.0, enabled=not args.no_progress,
                      summary=False) as progress:
            result = plan_layouts(config, hw, vocab, max_micro_batch=args.max_micro_batch, max_vpp=args.max_vpp,
                                  kernel=args.attention_kernel, filters=filters, progress=progress,
                                  jobs=jobs.threads)
        if not result.valid and filters:
            raise ConfigError(f"no layout of this model on {hw.devices} device(s) that --only / --exclude / "
                              f"--no-offload / --no-cp let through is a valid run: widen them.")
        if not result.valid:
            raise ConfigError(f"no layout of this model on {hw.devices} device(s) is a valid run: "
                              + (why_not or "try another device count"))
    except (ConfigError, TokenizerError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    shown = result.plans if args.all else non_dominated(result.plans)
    own, own_rank, own_line = configured(config, resolved, why_not, hw, vocab, args.attention_kernel, result)
    if args.json:
        print(json.dumps({"hardware": dataclasses.asdict(hw), "usable_bytes": hw.memory_bytes,
                          "usable_host_bytes": hw.host_memory_bytes,
                          "global_batch_size": config.batch_size.global_batch_size,
                          "filters": [f.describe() for f in result.filters],
                          "considered": result.considered, "valid": result.valid, "fit": len(result.plans),
                          "host_rejected": result.host_rejected,
                          "shown": len(shown),
                          "layouts": [{"rank": i, **p.to_dict()} for i, p in enumerate(shown[:args.top], 1)],
                          "smallest": None if result.smallest is None else result.smallest.to_dict(),
                          "configured": {"rank": own_rank, "note": own_line,
                                         **({} if own is None else own.to_dict())}}, indent=1))
    else:
        print(render_table(result, shown, hw, config, args.top))
        print(own_line)
        if not result.plans:
            print(no_fit_message(result, hw))
    return 0 if result.plans else 1


if __name__ == "__main__":
    sys.exit(main())
