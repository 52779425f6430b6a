"""What the device helpers say about this machine: the CPU's flags, whether bf16 / fp16 is native
(decided from injected matmul timings), the start-up description and warning, the scripts' tool."""

from __future__ import annotations

import math

import pytest
import torch

from megatron import device as dev

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu vme sse sse2 avx2 avx512f avx512_bf16 avx512_vnni
bogomips\t: 5192.30

processor\t: 1
flags\t\t: fpu vme
"""


def test_cpu_flags_are_those_of_the_first_processor():
    assert dev.cpu_flags(CPUINFO) == {"fpu", "vme", "sse", "sse2", "avx2", "avx512f", "avx512_bf16", "avx512_vnni"}
    assert dev.cpu_flags("Features\t: fp asimd bf16\n") == {"fp", "asimd", "bf16"}  # Arm's key
    assert dev.cpu_flags("") == set()


@pytest.mark.parametrize("flags, fp32_ms, half_ms, native, text", [
    ({"amx_bf16", "avx512_bf16"}, 10.0, 1.0, True, "bf16: native, AMX, matmul 10.0x faster than fp32"),
    ({"avx512_bf16"}, 2.0, 1.0, True, "bf16: native, AVX512-BF16, matmul 2.0x faster than fp32"),
    ({"avx512_bf16"}, 1.0, 0.9, False, "bf16: avx512_bf16 present but no faster than fp32 (1.11x)"),
    ({"avx512_bf16"}, 1.0, 1.3, False, "bf16: avx512_bf16 present but 1.3x slower than fp32"),
    ({"avx2"}, 1.0, 4.1, False, "bf16: emulated, 4.1x slower than fp32"),
])
def test_native_is_decided_by_the_measured_matmuls(flags, fp32_ms, half_ms, native, text):
    """The flags are reported; the measurement decides: at least 1.2x fp32's speed is native."""
    result = dev.judge_half_precision("bf16", flags, fp32_ms / 1e3, half_ms / 1e3)
    assert result.native is native and result.describe() == text
    assert result.flags == tuple(f for f in ("amx_bf16", "avx512_bf16") if f in flags)  # the strongest first


def test_the_warning_says_how_much_slower_and_what_to_pass():
    bf16 = dev.judge_half_precision("bf16", {"avx2"}, 1e-3, 4.1e-3)
    assert bf16.warning() == ("bf16 was asked for, but on this CPU its matmuls run 4.1x slower than fp32's "
                              "(no amx_bf16 or avx512_bf16: emulated); pass --no-bf16 to train in fp32, faster here")
    fp16 = dev.judge_half_precision("fp16", set(), 1e-3, 2e-3)
    assert "2.0x slower" in fp16.warning() and "--no-use-pure-fp16" in fp16.warning()
    assert dev.judge_half_precision("bf16", set(), 1e-3, 0.95e-3).warning() is None  # not faster, not slower
    assert dev.judge_half_precision("bf16", {"amx_bf16"}, 1e-3, 1e-4).warning() is None


def fixed(native: bool, speedup: float, flags: tuple[str, ...] = ()):
    return lambda precision, device_type="cpu": dev.HalfPrecision(precision, native, speedup, flags)


def test_start_up_description_and_warning(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(dev, "half_precision", fixed(True, 6.0, ("amx_bf16",)))
    assert dev.describe_precision(cpu, "float32") == ("cpu (bf16: native, AMX, matmul 6.0x faster than fp32)", None)
    assert dev.describe_precision(cpu, "bfloat16")[1] is None
    monkeypatch.setattr(dev, "half_precision", fixed(False, 0.25))
    described, warning = dev.describe_precision(cpu, "bfloat16")
    assert described == "cpu (bf16: emulated, 4.0x slower than fp32)"
    assert warning.startswith("bf16 was asked for, but on this CPU its matmuls run 4.0x slower")
    described, warning = dev.describe_precision(cpu, "float16")  # fp16 asked: described too
    assert described == "cpu (bf16: emulated, 4.0x slower than fp32; fp16: emulated, 4.0x slower than fp32)"
    assert warning.startswith("fp16 was asked for")
    assert dev.describe_precision(cpu, "float32")[1] is None  # fp32 asked: nothing to warn about


@pytest.mark.parametrize("native, word", [(True, "bf16"), (False, "fp32")])
def test_fastest_precision_tool(monkeypatch, capsys, native, word):
    """``python -m megatron.device --fastest-precision``: one word on stdout, the reason on stderr."""
    monkeypatch.setattr(dev, "half_precision", fixed(native, 2.0 if native else 0.5))
    assert dev.main(["--fastest-precision"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{word}\n" and err.startswith(f"fastest precision: {word} (bf16: ")


def test_this_machine_is_measured_once():
    """The real measurement: a finite speedup, cached for the process."""
    first = dev.half_precision("bf16", "cpu")
    assert math.isfinite(first.speedup) and first.speedup > 0
    assert dev.half_precision("bf16", "cpu") is first


def test_first_line_names_the_backend_error_not_its_wrapper():
    inner = RuntimeError("InvalidCxxCompiler: No working C++ compiler found\n\nSet TORCHDYNAMO_VERBOSE=1")
    wrapped = torch._dynamo.exc.BackendCompilerFailed(lambda: None, inner, None)
    assert dev.first_line(wrapped) == "InvalidCxxCompiler: No working C++ compiler found"
    assert dev.first_line(ValueError("bad\nvalue")) == "ValueError: bad"
    assert len(dev.first_line(ValueError("x" * 500))) == 200


def test_the_precision_probe_leaves_the_global_rng_alone():
    """The matmul race runs on rank 0 only: drawing from the global stream would give rank 0 other dropout
    masks than its tensor-parallel peers (and a resumed run other masks than the uninterrupted one)."""
    import torch

    from megatron import device as dev

    torch.manual_seed(3)
    before = torch.get_rng_state()
    dev.matmul_race(torch.bfloat16, n=16, budget_s=0.0)
    assert torch.equal(torch.get_rng_state(), before)


def test_megatrons_bf16_matmul_flag_sets_torchs_reduction_on_gpus_only():
    """--disable-bf16-reduced-precision-matmul: bf16 matmuls on a GPU reduce in fp32 only (PyTorch's global switch,
    settable without a GPU); a CPU device leaves the switch alone."""
    from megatron.config import parse_config

    assert parse_config(["--mock-data", "--disable-bf16-reduced-precision-matmul"]).mix_precision \
        .disable_bf16_reduced_precision_matmul
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction
    try:
        dev.set_matmul_reduction(torch.device("cpu"), not before)
        assert matmul.allow_bf16_reduced_precision_reduction == before
        dev.set_matmul_reduction(torch.device("cuda", 0), False)
        assert matmul.allow_bf16_reduced_precision_reduction is False
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before
