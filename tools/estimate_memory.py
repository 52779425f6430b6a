"""Per-rank memory of a configuration, before launching it: model states, activations, temporaries.

    python tools/estimate_memory.py -c examples/configs/gpt_175b_mp8_pp16.yaml --device-memory-gb 80
    python tools/estimate_memory.py --num-layers 24 --hidden-size 2048 --bf16 --sharding 8 --terms

Takes the same configuration as pretrain_gpt.py, plus:

    --device-memory-gb G        usable memory of one device, GiB (2^30 bytes): prints the verdict; without
                                it, the verdict of pretrain_gpt.py's memory check on this machine (its
                                available RAM for a CPU run, shared by the run's ranks; GPU 0's free memory)
    --attention-kernel K        flash or math (default: what the run would use; see megatron/memory/attention.py)
    --terms                     the bytes of one micro-batch's saved activations on stage 0, term by term

Prints, for each pipeline stage, the bytes of parameters, fp32 gradients, fp32 master weights and
AdamW states one rank holds between steps and how much of it is on the device and on the CPU
(offload; megatron/memory/model_states.py); then the activations one micro-batch's forward saves for
the backward, the micro-batches the schedule keeps in flight, the largest temporary buffer and the
total with the model states of a step (megatron/memory/). Without pipelining one line reads
``activations per micro-batch: <value> <unit>``. Under context parallelism (``--context-parallel-size``)
every figure is one rank's, holding ``s / cp`` tokens of each sample; the activation header says how many. For a
MoE model the header names the expert grid (ep x etp x edp) and each rank's experts: the figures count its
E / ep experts cut over etp, their states over the edp ranks, the MoE layers' activations under uniform
routing and the token dispatch's buffers (megatron/memory/moe.py, docs/moe.md).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint import CheckpointError, resumed_config  # noqa: E402
from megatron.config import ConfigError, validate  # noqa: E402
from megatron.config.help import CONFIG_FLAGS_NOTE  # noqa: E402
from megatron.device import cuda_available  # noqa: E402
from megatron.memory import check, estimate  # noqa: E402
from megatron.memory.activations import activation_terms, attention_kernel, temporary_terms  # noqa: E402
from megatron.memory.model_states import (  # noqa: E402
    expert_grid,
    parameters_per_rank,
    rank_model_state_bytes,
    training_precision,
)
from megatron.tokenizer import TokenizerError, configured_tokenizer  # noqa: E402

GIB = 2**30
PROG = "estimate_memory.py"


def format_bytes(n: float) -> str:
    """``1.23 GiB``: two decimals in the largest binary unit below the value."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def build_parser() -> argparse.ArgumentParser:
    """The tool's own flags; the rest of the command line is the configuration (``resumed_config``)."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], epilog=CONFIG_FLAGS_NOTE,
                                allow_abbrev=False)  # --device is a config flag, not --device-memory-gb
    p.add_argument("--device-memory-gb", type=float, default=None, metavar="G",
                   help="Usable memory of one device, GiB (2^30 bytes): prints whether the run fits.")
    p.add_argument("--attention-kernel", choices=("flash", "math"), default=None,
                   help="Attention kernel of the activation estimate (default: what the run would use; see "
                        "megatron/memory/attention.py).")
    p.add_argument("--terms", action="store_true",
                   help="Also print the bytes of one micro-batch's saved activations on stage 0, term by term.")
    return p


def _tool_flags(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    return build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)


def _model_state_rows(config) -> None:
    d = config.distributed
    precision, sharding = training_precision(config), config.zero_shards
    cp = f" x cp {d.context_parallel_size} ({d.cp_comm_type})" if d.context_parallel_size > 1 else ""
    over = f", its shards spanning cp: {sharding} ranks" if config.shards_over_context_parallel else ""
    experts = ""
    if config.model.num_experts:
        ep, etp, edp = expert_grid(config)
        experts = (f"; experts: ep {ep} x etp {etp} x edp {edp}, {config.model.num_experts // ep} of "
                   f"{config.model.num_experts} per rank")
    print(f"tp {d.mp_degree}{cp} x pp {d.pp_degree} x dp {d.dp_degree} x sharding {d.sharding.sharding_degree} "
          f"(stage {d.sharding.sharding_stage}{over}), {precision}{experts}; GiB per rank:")
    print(f"{'stage':>5} {'params (M)':>11} {'parameters':>11} {'gradients':>10} {'master':>8} {'AdamW':>8} "
          f"{'device':>8} {'CPU':>8}")
    for stage in range(d.pp_degree):
        n = parameters_per_rank(config, d.mp_degree, d.pp_degree, stage)
        b = rank_model_state_bytes(config, stage)
        gib = [x / GIB for x in (b.parameters, b.gradients, b.master_weights, b.optimizer_states, b.device_total,
                                 b.cpu_total)]
        print(f"{stage:>5} {n / 1e6:>11.1f} {gib[0]:>11.2f} {gib[1]:>10.2f} {gib[2]:>8.2f} {gib[3]:>8.2f} "
              f"{gib[4]:>8.2f} {gib[5]:>8.2f}")
    if d.sharding.sharding_offload:
        print("master weights and AdamW states (and a copy of the gradient shard) are on the CPU")


def _describe(config, kernel: str) -> str:
    d = config.distributed
    recompute = "none"
    if config.use_recompute:
        recompute = config.recompute_granularity
        if config.recompute_method:
            recompute += f" ({config.recompute_method}, {config.recompute_num_layers} layers)"
    schedule = "no pipelining"
    if d.pp_degree > 1:
        name = f"interleaved 1f1b (vpp {d.virtual_pp_degree})" if d.virtual_pp_degree > 1 else d.pipeline_schedule
        schedule = f"{name} over {config.num_micro_batches} micro-batches"
    sp = ", sequence parallel" if d.sequence_parallel and d.mp_degree > 1 else ""
    seq, cp = config.dataset.max_seq_len, d.context_parallel_size
    local = f" ({seq // cp} on each rank: context parallel {cp}, {d.cp_comm_type})" if cp > 1 else ""
    packed = ", attention per packed document" if config.dataset.reset_attention_mask else ""
    return (f"micro-batch {config.batch_size.micro_batch_size} x {seq} tokens{local}, recompute "
            f"{recompute}{sp}{packed}, {schedule}, {kernel} attention on the {config.device}")


def _activation_rows(config, kernel: str | None) -> list:
    d = config.distributed
    print(f"\nactivations: {_describe(config, kernel or attention_kernel(config))}; GiB per rank:")
    print(f"{'stage':>5} {'per micro-batch':>15} {'in flight':>9} {'activations':>11} {'temporaries':>11} "
          f"{'model states':>12} {'total':>8}")
    estimates = [estimate(config, stage, kernel) for stage in range(d.pp_degree)]
    for e in estimates:
        flight = "+".join(str(k) for k in e.in_flight)
        print(f"{e.stage:>5} {e.activations_per_microbatch / GIB:>15.2f} {flight:>9} {e.activations / GIB:>11.2f} "
              f"{e.temporaries / GIB:>11.2f} {e.model_states / GIB:>12.2f} {e.total / GIB:>8.2f}")
    if d.pp_degree == 1:
        print(f"activations per micro-batch: {format_bytes(estimates[0].activations_per_microbatch)}")
    if config.compile:
        print("compile: the activations are eager mode's (torch.compile may save less)")
    return estimates


def _terms(config, kernel: str | None) -> None:
    print("\nstage 0, one micro-batch's saved activations by term (all layers):")
    for name, n in sorted(activation_terms(config, 0, None, kernel).items(), key=lambda kv: -kv[1]):
        print(f"  {name:<32} {format_bytes(n):>12}")
    print("stage 0, temporaries (the largest counts):")
    for name, n in temporary_terms(config, 0, kernel).items():
        print(f"  {name:<32} {format_bytes(n):>12}")


def _verdict(estimates: list, device_gib: float | None) -> None:
    worst = max(estimates, key=lambda e: e.total)
    need = f"stage {worst.stage} needs {format_bytes(worst.total)}"
    if device_gib is None:
        print(f"peak: {need} (give --device-memory-gb for a verdict)")
        return
    spare = device_gib * GIB - worst.total
    if spare >= 0:
        print(f"fits in {device_gib:g} GiB: {need}, {format_bytes(spare)} to spare")
    else:
        print(f"does not fit in {device_gib:g} GiB: {need}, {format_bytes(-spare)} over")


def _this_machine(config, world: int) -> None:
    """pretrain_gpt.py's memory check for this configuration here (megatron/memory/check.py): a CPU run's
    ranks all on this machine, a GPU run's rank 0 on GPU 0; nothing for a GPU run on a machine without one."""
    if config.device == "gpu" and not cuda_available():
        return
    _, line, _ = check.verdict(config, 0, world if config.device == "cpu" else 1)
    print(f"on this machine: {line.removeprefix('memory: ')}")


def main(argv: list[str] | None = None) -> int:
    tool, rest = _tool_flags(argv)
    try:
        config = resumed_config(rest)  # as pretrain_gpt.py: over a resumed run's saved configuration
        d = config.distributed
        world = ((d.dp_degree or 1) * d.mp_degree * d.pp_degree * d.sharding.sharding_degree
                 * d.context_parallel_size)
        tokenizer = configured_tokenizer(config.tokenizer, config.model.vocab_size)
        validate(config, world_size=world, cuda_available=config.device == "gpu",
                 tokenizer_vocab_size=None if tokenizer is None else tokenizer.vocab_size)
    except (ConfigError, CheckpointError, TokenizerError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    _model_state_rows(config)
    estimates = _activation_rows(config, tool.attention_kernel)
    if tool.terms:
        _terms(config, tool.attention_kernel)
    _verdict(estimates, tool.device_memory_gb)
    if tool.device_memory_gb is None:
        _this_machine(config, world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
