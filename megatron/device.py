"""Device helpers: the only module that calls ``torch.cuda``."""

from __future__ import annotations

import resource
import sys

import torch

# Dense bf16/fp16 tensor-core peak TFLOP/s of one device (no sparsity), for MFU.
_PEAK_TFLOPS_16BIT = {
    "H200": 989.0, "H100": 989.0, "A100": 312.0, "A800": 312.0, "H800": 989.0,
    "L40S": 362.0, "A10": 125.0, "L4": 121.0, "V100": 125.0, "B200": 2250.0,
}


def cuda_available() -> bool:
    return torch.cuda.is_available()


def get_device(kind: str, local_rank: int = 0) -> torch.device:
    if kind == "gpu":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def collective_device(backend: str) -> torch.device:
    """Where a tensor for a collective of ``backend`` must live: this rank's GPU for NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def peak_tflops(device: torch.device) -> float | None:
    """Table value for known GPUs (16-bit dense peak); None for the CPU and unknown devices."""
    name = device_name(device)
    for key, value in _PEAK_TFLOPS_16BIT.items():
        if key in name:
            return value
    return None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory (CUDA) or the process's peak resident set (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
