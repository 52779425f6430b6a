"""Device helpers: the only module that calls ``torch.cuda``; what this machine can do fast.

``half_precision("bf16" | "fp16", device)`` says whether 16-bit matmuls beat fp32 here: on a CPU it
reads the flags of ``/proc/cpuinfo`` (AMX, AVX512-BF16, AVX512-FP16) and *measures* (a ~50 ms
matmul race, once per process), since a flag alone does not say whether oneDNN's 16-bit matmul
is faster. ``compile_problem(device)`` says whether torch.compile's default backend works here.
``python -m megatron.device --fastest-precision`` prints ``bf16`` or ``fp32`` (the example scripts
ask it), and the reason on stderr.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import resource
import sys
import time
from dataclasses import dataclass

import torch

from megatron.hardware import named_peak_tflops


def cuda_available() -> bool:
    return torch.cuda.is_available()


def get_device(kind: str, local_rank: int = 0) -> torch.device:
    if kind == "gpu":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def set_matmul_reduction(device: torch.device, bf16_reduced_precision: bool) -> None:
    """On a GPU, whether bf16 matmuls may reduce in reduced precision (PyTorch's default: yes; Megatron-LM's
    ``--disable-bf16-reduced-precision-matmul``: no). The CPU's matmuls have no such setting."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = bf16_reduced_precision


def collective_device(backend: str) -> torch.device:
    """Where a tensor for a collective of ``backend`` must live: this rank's GPU for NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wait_for_copies(device: torch.device) -> None:
    """Until the work queued on ``device``'s current stream (non-blocking copies included) is done."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def host_buffer(numel: int, device: torch.device) -> torch.Tensor:
    """An fp32 host buffer of ``numel`` elements to stage copies from ``device``: page-locked (pinned) when
    ``device`` is a GPU, so the copies run at full speed and asynchronously."""
    return torch.empty(numel, dtype=torch.float32, pin_memory=device.type == "cuda")


class CopyStream:
    """A side stream for copies between the device and host memory beside the compute (activation offload,
    ``megatron.ops.offload``). On the CPU there is no stream: the copies run in order and every method but
    ``host_bytes`` does nothing."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @staticmethod
    def host_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
        """A host buffer of ``nbytes`` bytes, page-locked when ``device`` is a GPU (asynchronous copies)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")

    def __enter__(self) -> CopyStream:
        """Work queued inside runs on the side stream, after what the compute stream has queued so far."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            self._context = torch.cuda.stream(self.stream)
            self._context.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stream is not None:
            self._context.__exit__(*exc)

    def done(self, *tensors: torch.Tensor):
        """An event marking the copies queued so far; ``tensors`` (the copies' sources, allocated on the compute
        stream) are not reused by the allocator before then."""
        if self.stream is None:
            return None
        for t in tensors:
            t.record_stream(self.stream)
        return self.stream.record_event()

    def after(self, event) -> None:
        """The side stream waits for ``event`` (another stream's copies) before what is queued on it next."""
        if event is not None:
            self.stream.wait_event(event)

    @staticmethod
    def wait(event, tensor: torch.Tensor) -> None:
        """The compute stream waits for ``event`` before using ``tensor`` (made on the side stream)."""
        if event is not None:
            current = torch.cuda.current_stream(tensor.device)
            current.wait_event(event)
            tensor.record_stream(current)


def with_index(device: torch.device) -> torch.device:
    """``device`` with its index: a bare ``cuda`` becomes this process's current GPU."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def free_memory_bytes(local_rank: int) -> int | None:
    """Free memory of GPU ``local_rank`` (its CUDA context, created here, already taken out); None where
    CUDA cannot say."""
    try:
        free, _ = torch.cuda.mem_get_info(local_rank)
    except (RuntimeError, AssertionError):
        return None
    return int(free)


# ----------------------------------------------------------------------------- random number generators

def rng_state(device: torch.device) -> torch.Tensor:
    """The state of ``device``'s default generator."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def seeded_rng_state(seed: int, device: torch.device) -> torch.Tensor:
    """The state a default generator of ``device`` has just after ``manual_seed(seed)``, without touching it."""
    if device.type == "cuda":
        saved = torch.cuda.get_rng_state(device)
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
        state = torch.cuda.get_rng_state(device)
        torch.cuda.set_rng_state(saved, device)
        return state
    return torch.Generator().manual_seed(seed).get_state()


def cuda_rng_state() -> torch.Tensor | None:
    """The current GPU's generator state, for a checkpoint; None when CUDA has not been used here."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.get_rng_state()
    return None


def set_cuda_rng_state(state: torch.Tensor) -> None:
    """Restore a checkpoint's GPU generator state (ignored where there is no GPU)."""
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def peak_tflops(device: torch.device) -> float | None:
    """Table value for known GPUs (16-bit dense peak, ``megatron.hardware``); None for the CPU and unknown devices."""
    return None if device.type != "cuda" else named_peak_tflops(device_name(device))


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_label(device: torch.device) -> str:
    """What ``peak_memory_bytes`` measures, as the log line names it."""
    return "max memory" if device.type == "cuda" else "max RSS"


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory (CUDA) or the process's peak resident set (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


# ----------------------------------------------------------------------------- 16-bit precision

# The /proc/cpuinfo flags of native 16-bit matmul units, by precision, strongest first (display name).
_HALF_FLAGS = {"bf16": (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16")),
               "fp16": (("amx_fp16", "AMX-FP16"), ("avx512_fp16", "AVX512-FP16"))}
# A 16-bit matmul must beat fp32's by this factor to count as native (a tie is not worth the precision).
NATIVE_SPEEDUP = 1.2
_DISABLE = {"bf16": "--no-bf16", "fp16": "--no-use-pure-fp16 (drop --fp16)"}


@dataclass(frozen=True)
class HalfPrecision:
    """What a 16-bit precision is worth on a device: ``speedup`` = fp32 matmul time / 16-bit matmul
    time (measured; nan where not measured), ``flags`` the CPU flags seen for it."""

    precision: str  # "bf16" or "fp16"
    native: bool
    speedup: float
    flags: tuple[str, ...] = ()

    def describe(self) -> str:
        """``bf16: native, AMX, matmul 6.0x faster than fp32``, ``bf16: emulated, 4.1x slower than fp32``."""
        p = self.precision
        if math.isnan(self.speedup):
            return f"{p}: {'native' if self.native else 'not supported'}"
        if self.native:
            units = dict(_HALF_FLAGS[p]).get(self.flags[0]) if self.flags else f"no {p} flag"
            return f"{p}: native, {units}, matmul {self.speedup:.1f}x faster than fp32"
        label = f"{' and '.join(self.flags)} present but" if self.flags else "emulated,"
        if self.speedup < 1.0:
            return f"{p}: {label} {1 / self.speedup:.1f}x slower than fp32"
        return f"{p}: {label} no faster than fp32 ({self.speedup:.2f}x)"

    def warning(self) -> str | None:
        """One line when this precision was asked for but runs slower than fp32 here, else None."""
        if self.native or math.isnan(self.speedup) or self.speedup >= 1.0:
            return None
        names = " or ".join(f for f, _ in _HALF_FLAGS[self.precision])
        why = f"{' and '.join(self.flags)} present, yet slower" if self.flags else f"no {names}: emulated"
        return (f"{self.precision} was asked for, but on this CPU its matmuls run {1 / self.speedup:.1f}x slower "
                f"than fp32's ({why}); pass {_DISABLE[self.precision]} to train in fp32, faster here")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of the first processor in ``/proc/cpuinfo``'s text (empty if none)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def judge_half_precision(precision: str, flags: set[str], fp32_s: float, half_s: float) -> HalfPrecision:
    """The decision from the flags and the measured matmul times (pure): native when the 16-bit
    matmul is at least ``NATIVE_SPEEDUP`` times faster than fp32's."""
    speedup = fp32_s / half_s if half_s > 0 else math.inf
    seen = tuple(f for f, _ in _HALF_FLAGS[precision] if f in flags)
    return HalfPrecision(precision, speedup >= NATIVE_SPEEDUP, speedup, seen)


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def matmul_race(half: torch.dtype, n: int = 384, budget_s: float = 0.05) -> tuple[float, float]:
    """(fp32 seconds, ``half`` seconds) of an ``n``-square matmul on the CPU: interleaved runs after a
    warm-up, at least 3 each and until ``budget_s`` has passed, each side's fastest run (other
    processes only ever slow a run down)."""
    generator = torch.Generator().manual_seed(0)  # never the global stream: dropout draws from it, on every rank alike
    a32, b32 = torch.randn(n, n, generator=generator), torch.randn(n, n, generator=generator)
    a16, b16 = a32.to(half), b32.to(half)
    best = {torch.float32: math.inf, half: math.inf}
    start, rounds = time.perf_counter(), 0
    while rounds < 4 or (time.perf_counter() - start < budget_s and rounds < 20):
        for a, b in ((a32, b32), (a16, b16)):
            t = time.perf_counter()
            torch.mm(a, b)
            if rounds:  # round 0 warms up (oneDNN builds its kernels)
                best[a.dtype] = min(best[a.dtype], time.perf_counter() - t)
        rounds += 1
    return best[torch.float32], best[half]


@functools.cache
def half_precision(precision: str, device_type: str = "cpu") -> HalfPrecision:
    """Whether ``precision`` ("bf16" or "fp16") is native on this machine's ``device_type``; on the
    CPU measured once per process (about 50 ms; more where the 16-bit matmul is slow)."""
    if device_type == "cuda":
        native = precision == "fp16" or torch.cuda.is_bf16_supported()
        return HalfPrecision(precision, native, math.nan)
    half = torch.bfloat16 if precision == "bf16" else torch.float16
    return judge_half_precision(precision, cpu_flags(_read_cpuinfo()), *matmul_race(half))


def describe_precision(device: torch.device, dtype_name: str) -> tuple[str, str | None]:
    """For the start-up line: (the device and what bf16 (and fp16, when asked for) is worth on it,
    e.g. ``cpu (bf16: native, AMX, matmul 6.0x faster than fp32)``; the warning when the asked
    16-bit ``dtype_name`` ("bfloat16", "float16" or "float32") is emulated and slower than fp32, else None)."""
    asked = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype_name)
    shown = [half_precision(p, device.type) for p in ("bf16", "fp16") if p == "bf16" or p == asked]
    warning = half_precision(asked, device.type).warning() if asked else None
    return f"{device_name(device)} ({'; '.join(h.describe() for h in shown)})", warning


def fastest_precision(device_type: str = "cpu") -> str:
    """"bf16" where bf16 is native on ``device_type``, else "fp32"."""
    return "bf16" if half_precision("bf16", device_type).native else "fp32"


def grouped_mm_fast(device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` has its own kernel on ``device`` (Hopper and Blackwell, compute capability 9 or
    10); elsewhere it falls back to a loop that waits for the device."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in (9, 10)


def fp8_problem(device: torch.device) -> str | None:
    """None when ``device`` has FP8 tensor cores (a CUDA GPU of compute capability 8.9 or newer); else why."""
    if device.type != "cuda":
        return "FP8 matmuls need an NVIDIA GPU; this run is on the CPU"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}; FP8 tensor cores need "
                f"8.9 or newer (Ada, Hopper, Blackwell)")
    return None


# ----------------------------------------------------------------------------- torch.compile


@functools.cache
def compile_problem(device_type: str = "cpu") -> str | None:
    """None when torch.compile's default backend compiles and runs a tiny function, forward and
    backward, on ``device_type`` here; else the reason, in one line (no C++ compiler, no Triton...).
    Once per process (a few seconds; the compiled kernel is cached on disk)."""
    x = torch.ones(8, device=device_type, requires_grad=True)
    inductor_log = logging.getLogger("torch._inductor")
    level = inductor_log.level
    inductor_log.setLevel(logging.CRITICAL + 1)  # a failure here is reported in one line, by the caller
    try:
        torch.compile(_compile_probe)(x).backward()
    except Exception as err:  # any failure means: run eager, and say why
        return first_line(err)
    finally:
        inductor_log.setLevel(level)
    return None


def _compile_probe(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() * 2.0).sum()


def first_line(err: BaseException, limit: int = 200) -> str:
    """``Type: message`` in one line of at most ``limit`` characters; for torch.compile's
    ``BackendCompilerFailed``, of the backend's own error (the cause, not the wrapper)."""
    err = getattr(err, "inner_exception", None) or err
    text = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    if not text.split(" ", 1)[0].endswith(":"):  # some messages already start with their cause's name
        text = f"{type(err).__name__}: {text}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron.device", description="What this machine does fast.")
    parser.add_argument("--fastest-precision", action="store_true",
                        help="print bf16 or fp32 (the faster training precision of this CPU); the reason on stderr")
    args = parser.parse_args(argv)
    bf16 = half_precision("bf16")
    if args.fastest_precision:
        print(fastest_precision())
        print(f"fastest precision: {fastest_precision()} ({bf16.describe()})", file=sys.stderr)
    else:
        print(bf16.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
