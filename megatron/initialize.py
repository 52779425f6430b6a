"""Process start-up: torchrun's environment, the default process group, the rank grid.

Two things here exist so that no failure is silent: every collective gets the configured
``distributed_timeout_minutes`` (a rank whose peer is gone fails after it instead of waiting
forever), and a worker launched by torchrun dies with its launcher (``die_with_launcher``), so a
killed ``torchrun`` never leaves ranks training as orphans.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import os
import signal
import sys
import threading
import time

import torch.distributed as dist

from megatron import parallel_state
from megatron.config import ConfigError
from megatron.config.schema import Config
from megatron.parallel_state import ParallelState

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_POLL_SECONDS = 1.0  # the fallback's check interval, where prctl is not available


_LAUNCH_HINT = ("launch with torchrun (it sets WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for each "
                "process), or unset them for a one-process run")


def launch_env() -> tuple[int, int, int]:
    """(world size, rank, local rank) as set by torchrun; (1, 0, 0) for a plain ``python`` launch.

    The variables are checked here, the one reader, before any rendezvous: a value that is not an integer,
    RANK or LOCAL_RANK out of range, WORLD_SIZE > 1 without RANK, LOCAL_RANK, MASTER_ADDR or MASTER_PORT (set
    by hand, without torchrun) is a ConfigError at once, instead of ``init_process_group`` waiting for ranks
    that never come and ending in a traceback."""
    env = os.environ
    given: dict[str, int] = {}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        if name in env:
            try:
                given[name] = int(env[name].strip())
            except ValueError:
                raise ConfigError(f"environment variable {name}={env[name]!r} is not an integer; {_LAUNCH_HINT}."
                                  ) from None
    world, rank, local = given.get("WORLD_SIZE", 1), given.get("RANK", 0), given.get("LOCAL_RANK", 0)
    if world < 1:
        raise ConfigError(f"environment variable WORLD_SIZE={world} must be at least 1; {_LAUNCH_HINT}.")
    if not 0 <= rank < world:
        raise ConfigError(f"environment variable RANK={rank} is not a rank of WORLD_SIZE={world} (0..{world - 1}); "
                          f"{_LAUNCH_HINT}.")
    local_world = given.get("LOCAL_WORLD_SIZE", world)
    if not 0 <= local < min(world, local_world):
        raise ConfigError(f"environment variable LOCAL_RANK={local} is not a rank of this node (0.."
                          f"{min(world, local_world) - 1}); {_LAUNCH_HINT}.")
    if world > 1 and not dist.is_initialized():
        missing = [name for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
        if missing:
            verb = "is" if len(missing) == 1 else "are"
            raise ConfigError(f"WORLD_SIZE={world} is set but {' and '.join(missing)} {verb} not: the processes could "
                              f"not find each other; {_LAUNCH_HINT}.")
        port = env["MASTER_PORT"].strip()
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"environment variable MASTER_PORT={env['MASTER_PORT']!r} is not a port number "
                              f"(1..65535); {_LAUNCH_HINT}.")
    return world, rank, local


def local_ranks() -> int:
    """The launch's ranks on this node (torchrun's LOCAL_WORLD_SIZE; 1 for a plain ``python`` launch)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1  # launch_env has already refused a value that is not an integer


def launched_by_torchrun() -> bool:
    """torchrun (and the launchers like it) sets LOCAL_RANK and WORLD_SIZE for each worker it starts."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def _set_parent_death_signal(sig: int) -> bool:
    """Ask Linux to send ``sig`` to this process when the thread that started it exits; False where
    prctl is not available (not Linux, no libc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int, sig: int, interval: float) -> None:
    while os.getppid() == parent:
        time.sleep(interval)
    os.kill(os.getpid(), sig)


def die_with_launcher(sig: int = getattr(signal, "SIGKILL", signal.SIGTERM)) -> str:
    """Make this worker receive ``sig`` (default SIGKILL) as soon as its launcher process dies.

    Why: torchrun starts each worker in a session of its own, so ``kill -9`` of torchrun (or of the
    job step that ran it) reaches no worker; without this they keep training, and holding the
    devices, as orphans. SIGKILL rather than SIGTERM: SIGTERM would start a coordinated save that
    needs every rank, and with the launcher gone nobody supervises it. Linux: ``prctl(PR_SET_PDEATHSIG)``
    (torchrun's agent starts its workers from its main thread, so the signal comes when the
    launcher process ends, not before). Elsewhere: a daemon thread that polls ``os.getppid()``
    every second. Returns which mechanism was installed: "prctl" or "poll".
    """
    parent = os.getppid()
    how = "prctl" if _set_parent_death_signal(sig) else "poll"
    if how == "prctl" and os.getppid() != parent:  # the launcher died between the two calls: no signal will come
        os.kill(os.getpid(), sig)
    if how == "poll":
        threading.Thread(target=_watch_parent, args=(parent, sig, PARENT_POLL_SECONDS), name="parent-watch",
                         daemon=True).start()
    return how


def initialize_distributed(config: Config, timeout_minutes: float | None = None) -> ParallelState:
    """Join the default group (NCCL on GPUs, gloo on the CPU; env:// rendezvous from torchrun)
    and build every parallel group. The config must already be validated on every rank.

    ``timeout_minutes`` (default ``distributed.distributed_timeout_minutes``) bounds every collective
    and point-to-point operation of the default group and of every parallel group."""
    if timeout_minutes is None:
        timeout_minutes = config.distributed.distributed_timeout_minutes
    if launched_by_torchrun():
        die_with_launcher()
    world_size, rank, _ = launch_env()
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if config.device == "gpu" else "gloo"
        try:
            dist.init_process_group(backend, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(minutes=timeout_minutes))
        except dist.DistError as err:  # the others never came (variables set by hand), or the address is wrong
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            why = (str(err).splitlines() or [type(err).__name__])[0].rstrip(".")
            raise ConfigError(f"rank {rank} of WORLD_SIZE={world_size} could not meet the other processes at {where} "
                              f"within distributed_timeout_minutes ({timeout_minutes:g}): {why}; start every rank "
                              f"(torchrun --nproc-per-node N, on each node), or unset WORLD_SIZE for a one-process run."
                              ) from None
    d = config.distributed
    cp_inner = d.hierarchical_context_parallel_sizes[0] if d.cp_comm_type == "a2a+p2p" else None  # its groups only
    return parallel_state.initialize(tp=d.mp_degree, pp=d.pp_degree, dp=d.dp_degree,
                                     sharding=d.sharding.sharding_degree, timeout_minutes=timeout_minutes,
                                     cp=d.context_parallel_size, shard_over_cp=config.shards_over_context_parallel,
                                     ep=d.expert_model_parallel_size, etp=d.expert_tensor_parallel_size,
                                     cp_inner=cp_inner)


def shutdown() -> None:
    parallel_state.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
