"""Process start-up: torchrun's environment, the default process group, the rank grid."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from megatron import parallel_state
from megatron.config.schema import Config
from megatron.parallel_state import ParallelState


def launch_env() -> tuple[int, int, int]:
    """(world size, rank, local rank) as set by torchrun; (1, 0, 0) for a plain ``python`` launch."""
    return int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))


def initialize_distributed(config: Config, timeout_minutes: float = 10.0) -> ParallelState:
    """Join the default group (NCCL on GPUs, gloo on the CPU; env:// rendezvous from torchrun)
    and build every parallel group. The config must already be validated on every rank."""
    world_size, rank, _ = launch_env()
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if config.device == "gpu" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    d = config.distributed
    return parallel_state.initialize(tp=d.mp_degree, pp=d.pp_degree, dp=d.dp_degree,
                                     sharding=d.sharding.sharding_degree, timeout_minutes=timeout_minutes)


def shutdown() -> None:
    parallel_state.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
