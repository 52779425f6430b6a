"""The check before a run: does one rank's predicted peak memory fit in what its device has?

``check_memory(config)`` runs on every rank before any process group exists (``pretrain_gpt.py``'s
``resolve``), each rank alone, so no rank can wait in a collective for one that stopped. It compares

- the need (``predicted_need``): at the worst pipeline stage of ``megatron.memory.estimate``, the model
  states of a step, the saved activations at the schedule's peak and the largest temporary. On the CPU
  the device is the host's RAM, so the need adds what lives there too: the offloaded states (ZeRO
  offload) and the process itself (Python, torch, the data loader: ``CPU_PROCESS_BYTES``);
- with what the device has (``available_bytes``): on a GPU the free memory of this rank's device
  (``megatron.device.free_memory_bytes`` of LOCAL_RANK: its CUDA context, created there, is already out of it);
  on the CPU this rank's share of the host's available RAM (MemAvailable, or less under a cgroup
  memory limit, over torchrun's LOCAL_WORLD_SIZE ranks) plus what the process already holds.

The need is a lower bound of the peak: the backward's activation gradients and the allocator's slack
are not in it (on the CPU they measured 5-35% of the activations and temporaries, more in bf16:
docs/performance.md, "The check before a run"), nor, on GPUs, the caching allocator's fragmentation.
So a run the check refuses cannot fit, and one that passes may still not: within ``TIGHT`` of the
available memory the start-up line is a warning.

Above the available memory the run stops with one line (a ``ConfigError``: exit status 2) naming the
need, its parts, what is available and what to change; ``--no-memory-check`` starts anyway. GPU runs
that offload (``sharding_offload``) are checked against the host's RAM too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatron.config import ConfigError
from megatron.config.schema import Config
from megatron.memory.estimate import estimate

GIB = 2**30
# The CPU training process beyond its model, activations and temporaries (Python, torch and its thread
# pools, the data loader, the logger, the checkpoint writer): measured 0.36 - 0.69 GiB (1.05 in bf16) of peak RSS on
# top of the estimate (0.36 for the 4-layer width-128 example); a lower bound.
CPU_PROCESS_BYTES = int(0.3 * GIB)
# A run that needs more than this fraction of the available memory starts with a warning.
TIGHT = 0.8


@dataclass(frozen=True)
class MemoryNeed:
    """One rank's predicted peak, bytes, at its worst pipeline ``stage``."""

    stage: int
    model_states: int  # of a step; on the CPU with the offloaded states
    activations: int  # saved for the backward, at the schedule's peak
    temporaries: int  # the largest transient buffer
    process: int  # CPU: the process itself (0 on GPUs)
    activations_per_microbatch: int
    micro_batch_size: int
    host_states: int = 0  # GPU with offload: the states in the host's RAM

    @property
    def total(self) -> int:
        return self.model_states + self.activations + self.temporaries + self.process


def predicted_need(config: Config) -> MemoryNeed:
    """The largest need over the pipeline stages of a validated ``config`` on its device."""
    cpu = config.device != "gpu"
    needs = []
    for stage in range(config.distributed.pp_degree):
        e = estimate(config, stage)
        needs.append(MemoryNeed(stage, e.model_states + (e.cpu if cpu else 0), e.activations, e.temporaries,
                                CPU_PROCESS_BYTES if cpu else 0, e.activations_per_microbatch,
                                config.batch_size.micro_batch_size, 0 if cpu else e.cpu))
    return max(needs, key=lambda n: (n.total, n.host_states))


# ---------------------------------------------------------------------------- what the device has


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _inactive_file(path: str, key: str) -> int:
    """The reclaimable page cache in a cgroup's memory.stat (counted in its usage, not a need)."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_available_bytes(root: str = "/sys/fs/cgroup") -> int | None:
    """What this process's cgroup memory limit leaves (limit - usage + its reclaimable page cache),
    None without a limit. cgroup v2 (``memory.max``) or v1 (``memory/memory.limit_in_bytes``)."""
    for limit_file, usage_file, stat_file, key in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
             "total_inactive_file")):
        limit = _read_int(os.path.join(root, limit_file))
        usage = _read_int(os.path.join(root, usage_file))
        if limit is None or usage is None or limit >= 1 << 60:  # v1 writes "no limit" as a huge number
            continue
        return max(0, limit - usage + _inactive_file(os.path.join(root, stat_file), key))
    return None


def host_available_bytes() -> int | None:
    """The RAM this machine can still give without swapping: MemAvailable (Linux), else psutil's
    ``available``, else the free pages (``os.sysconf``); under a cgroup memory limit at most what
    the limit leaves. None where nothing says."""
    available = _meminfo_available()
    if available is None:
        try:
            import psutil  # optional

            available = int(psutil.virtual_memory().available)
        except ImportError:
            try:
                available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            except (ValueError, OSError, AttributeError):
                available = None
    limited = cgroup_available_bytes()
    if limited is not None:
        available = limited if available is None else min(available, limited)
    return available


def process_rss_bytes() -> int:
    """This process's resident memory now (Linux ``/proc/self/statm``; 0 where unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return 0


def local_world_size() -> int:
    """The ranks on this machine: torchrun's LOCAL_WORLD_SIZE, 1 for a plain ``python`` launch."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    except ValueError:
        return 1


def available_bytes(device: str, local_rank: int = 0, local_ranks: int = 1) -> tuple[int | None, str]:
    """(bytes this rank can have, what they are, for the message): on a GPU its free memory; on the
    CPU its share of the host's available RAM over the ``local_ranks`` ranks on this machine, plus the
    RAM the process already holds (part of the need, not of MemAvailable). None where nothing says."""
    if device == "gpu":
        from megatron.device import free_memory_bytes  # torch, only for a GPU run

        free = free_memory_bytes(local_rank)
        return free, f"free on GPU {local_rank}" if free is not None else "GPU memory"
    host = host_available_bytes()
    if host is None:
        return None, "RAM"
    held = process_rss_bytes()
    share = f" over {local_ranks} ranks on this machine" if local_ranks > 1 else ""
    room = address_space_room()
    if room is not None and room < host // local_ranks:  # ulimit -v: an allocation past it fails whatever the RAM
        return room + held, (f"available (the address space left under this process's limit, ulimit -v, "
                             f"{_gib(room)} GiB, + {_gib(held)} GiB held by this process)")
    return host // local_ranks + held, (f"available (RAM available {_gib(host)} GiB{share}, + {_gib(held)} GiB held "
                                        f"by this process)")


def address_space_room(status: str = "/proc/self/status") -> int | None:
    """The virtual memory this process may still map under its ``RLIMIT_AS`` (``ulimit -v``), None without a limit
    or where the system does not say."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit == resource.RLIM_INFINITY:
            return None
        with open(status) as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (ImportError, OSError, StopIteration, ValueError):
        return None
    return max(0, limit - size)


# ---------------------------------------------------------------------------- the verdict


def _gib(n: int) -> str:
    """GiB, one decimal (two below 1 GiB)."""
    return f"{n / GIB:.1f}" if n >= GIB else f"{n / GIB:.2f}"


def describe_need(need: MemoryNeed) -> str:
    """``3.2 GiB per rank (model states 1.1, activations 1.9, temporaries 0.2)``, with the CPU process."""
    parts = [f"model states {_gib(need.model_states)}", f"activations {_gib(need.activations)}",
             f"temporaries {_gib(need.temporaries)}"] + ([f"process {_gib(need.process)}"] if need.process else [])
    where = f" on pipeline stage {need.stage}" if need.stage else ""
    return f"{_gib(need.total)} GiB per rank{where} ({', '.join(parts)})"


def suggestions(config: Config, need: MemoryNeed) -> str:
    """What to change, with the activations of one micro-batch."""
    b, cp = need.micro_batch_size, config.distributed.context_parallel_size
    per_micro_batch = f"{_gib(need.activations_per_microbatch)} GiB of activations per micro-batch of {b}" + (
        f" at context parallel {cp}" if cp > 1 else "")
    m = config.model
    experts = ([f"--expert-model-parallel-size (each rank holds num_experts / ep of the {m.num_experts} experts)"]
               if m.num_experts and config.distributed.expert_model_parallel_size < m.num_experts else [])
    others = (["--use-recompute"] if not config.use_recompute else []) + experts + [
        "ZeRO sharding (--sharding-degree N --sharding-stage 1|2|3"
        + (", --sharding-offload)" if config.device == "gpu" else ")"),
        "--tp / --pp / --context-parallel-size", "a shorter --max-seq-len or a smaller model"]
    if b > 1:
        return f"lower --micro-batch-size ({per_micro_batch}), or use {', '.join(others)}"
    return f"{per_micro_batch}: use {', '.join(others)}"


def refusal(config: Config, need: MemoryNeed, available: int, what: str) -> str | None:
    """The error line when ``need`` exceeds ``available`` bytes, else None."""
    if need.total <= available:
        return None
    eager = " (eager mode's activations: --compile may save less)" if config.compile else ""
    return (f"not enough memory: the run needs at least {describe_need(need)}{eager}, but {_gib(available)} GiB is "
            f"{what}; {suggestions(config, need)}; or pass --no-memory-check to start anyway.")


def verdict(config: Config, local_rank: int = 0, local_ranks: int = 1) -> tuple[bool, str, bool]:
    """(fits, the line, tight) for this rank of a validated ``config`` on this machine: the refusal
    (``not enough memory: ...``) when its predicted peak exceeds what its device has (or a GPU run's
    offloaded states the host's RAM), else ``memory: predicted peak ...``; ``tight`` above ``TIGHT``
    of the available memory. Fits where the device does not say what it has."""
    need = predicted_need(config)
    available, what = available_bytes(config.device, local_rank, local_ranks)
    tight = False
    if available is None:
        line = f"memory: predicted peak {describe_need(need)}; not checked: this machine does not say its free {what}"
    else:
        error = refusal(config, need, available, what)
        if error:
            return False, error, False
        line = f"memory: predicted peak {describe_need(need)} of {_gib(available)} GiB {what}"
        tight = need.total > TIGHT * available
    if need.host_states:  # a GPU run's offloaded states: the host's RAM, shared by this machine's ranks
        host = host_available_bytes()
        if host is not None and need.host_states > host // local_ranks:
            error = (f"not enough host memory for the offloaded states: {_gib(need.host_states)} GiB per rank, but "
                     f"{_gib(host // local_ranks)} GiB of RAM is available per rank ({local_ranks} on this machine); "
                     f"use a larger --sharding-degree or --no-sharding-offload, or pass --no-memory-check to start "
                     f"anyway.")
            return False, error, False
        line += f"; offloaded states {_gib(need.host_states)} GiB in RAM"
    if tight:
        line += (f"; little to spare: the prediction is a lower bound (no activation gradients, no allocator "
                 f"slack); if the run is killed: {suggestions(config, need)}")
    return True, line, tight


def check_memory(config: Config, rank: int | None = None, local_rank: int | None = None,
                 local_ranks: int | None = None) -> str | None:
    """Raise ``ConfigError`` (one line) when this rank's predicted peak exceeds what its device has;
    else return the start-up line (``memory: predicted peak ...``), which rank 0 logs: info, or a
    warning above ``TIGHT`` of the available memory; None with ``--no-memory-check``. The ranks
    default to torchrun's environment (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE)."""
    from megatron.metrics import get_logger

    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
    local_ranks = local_world_size() if local_ranks is None else local_ranks
    log = get_logger()
    if not config.memory_check:
        if rank == 0:
            log.info("memory: not checked (--no-memory-check)")
        return None
    fits, line, tight = verdict(config, local_rank, local_ranks)
    if not fits:
        raise ConfigError(line)
    if rank == 0:
        (log.warning if tight else log.info)(line)
    return line
