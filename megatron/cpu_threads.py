"""How many threads a run on the CPU computes with: one place decides, and the start-up line says why.

torch's default is one intra-op thread per core of the machine, whatever else runs there. On a shared
machine that is the slowest choice: every parallel region waits for its slowest thread, and a thread whose
core is busy with another process waits a whole scheduler slice (a 2-core machine with one busy process
trains ~2.5x faster on one thread than on two). So, first match wins:

1. ``--cpu-threads N`` (the config key ``cpu_threads``);
2. ``OMP_NUM_THREADS=N``, which torch has already applied (torchrun sets it to 1 for several ranks per node:
   one compute thread per rank);
3. the environment variable ``MEGATRON_CPU_THREADS=N``: a fixed count for the runs of a shell or a test suite
   where neither of the above gives one, without touching what torchrun sets for its ranks;
4. otherwise, the cores this process may use (its CPU affinity, capped by a cgroup CPU quota) shared among
   the launch's ranks on this node, less the cores other processes keep busy now (measured from
   ``/proc/stat`` over a quarter of a second: busy and stolen time), at least one.

The automatic choice is made once per process (a second run in the same process reuses it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable

from megatron.config.cli import ConfigError

ENV = "MEGATRON_CPU_THREADS"
SAMPLE_S = 0.25


@dataclasses.dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str  # why, for the start-up line

    def describe(self) -> str:
        plural = "s" if self.threads != 1 else ""
        return f"{self.threads} compute thread{plural} ({self.reason})"


def _cgroup_quota_cores(path: str = "/sys/fs/cgroup/cpu.max") -> float | None:
    """The cgroup v2 CPU quota in cores ("max" or no file: None)."""
    try:
        quota, period = open(path).read().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def usable_cores() -> list[int]:
    """The CPUs this process may run on, capped by a cgroup quota (the lowest-numbered ones are kept)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    quota = _cgroup_quota_cores()
    if quota is not None:
        cores = cores[:max(1, math.floor(quota))]
    return cores


def _cpu_times(stat: str, cores: list[int]) -> tuple[int, int]:
    """(busy, total) jiffies of ``cores`` from /proc/stat's per-CPU lines; busy counts stolen time, not idle/iowait."""
    busy = total = 0
    wanted = {f"cpu{c}" for c in cores}
    for line in stat.splitlines():
        fields = line.split()
        if fields and fields[0] in wanted:
            values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
            total += sum(values)
            busy += sum(values) - values[3] - values[4]
    return busy, total


def _read_stat() -> str | None:
    try:
        with open("/proc/stat") as f:
            return f.read()
    except OSError:
        return None


def busy_cores(cores: list[int], read_stat: Callable[[], str | None] = _read_stat,
               sleep: Callable[[float], None] = time.sleep, sample_s: float = SAMPLE_S) -> float | None:
    """How many of ``cores`` other processes keep busy now (this one sleeps while it measures); None where
    /proc/stat cannot be read."""
    before = read_stat()
    sleep(sample_s)
    after = read_stat()
    if before is None or after is None:
        return None
    (b0, t0), (b1, t1) = _cpu_times(before, cores), _cpu_times(after, cores)
    if t1 <= t0:
        return None
    return len(cores) * (b1 - b0) / (t1 - t0)


def _positive(value: str, name: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"{name}={value!r} is not a positive whole number of threads; set it to 1 or more, or "
                         "unset it to let the run choose")
    return n


def decide(cores: int, busy: float | None, local_ranks: int = 1) -> ThreadChoice:
    """The automatic choice: ``cores`` usable, ``busy`` of them kept busy by other processes (None: unknown),
    shared among ``local_ranks`` ranks on this node; at least one thread."""
    share = max(1, cores // local_ranks)
    per = f" per rank of {local_ranks} on this node" if local_ranks > 1 else ""
    if busy is None:
        return ThreadChoice(share, f"{cores} cores usable{per}; --cpu-threads N to choose")
    free = max(1, math.floor(cores - busy + 0.5) // local_ranks)
    return ThreadChoice(min(share, free), f"{cores} cores usable{per}, {busy:.1f} busy with other work; "
                                          "--cpu-threads N to choose")


@functools.cache
def _automatic(local_ranks: int) -> ThreadChoice:
    cores = usable_cores()
    return decide(len(cores), busy_cores(cores), local_ranks)


def choose(requested: int | None, local_ranks: int = 1, environ: dict[str, str] | None = None) -> ThreadChoice:
    """The thread count by the rules of this module's docstring (``local_ranks``: the launch's ranks on this
    node). Raises ConfigError (a ValueError), in one sentence, for a bad count."""
    environ = os.environ if environ is None else environ
    if requested is not None:
        return ThreadChoice(_positive(str(requested), "--cpu-threads"), "--cpu-threads")
    if environ.get("OMP_NUM_THREADS"):
        by = ", as torchrun sets it for several ranks per node" if local_ranks > 1 else ""
        return ThreadChoice(_positive(environ["OMP_NUM_THREADS"], "OMP_NUM_THREADS"), f"OMP_NUM_THREADS{by}")
    if environ.get(ENV):
        return ThreadChoice(_positive(environ[ENV], ENV), ENV)
    return _automatic(max(1, local_ranks))


def apply(requested: int | None, local_ranks: int = 1) -> ThreadChoice:
    """Choose and set torch's intra-op thread count; returns the choice for the start-up line. (Only this imports
    torch: ``choose`` also serves the layout planner's worker count, which runs without it.)"""
    import torch

    choice = choose(requested, local_ranks)
    if torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)
    return choice
