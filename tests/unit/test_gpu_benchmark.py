"""benchmarks/gpu.py, the script a session with a GPU runs, at toy size on the CPU (``--device cpu``): every piece
runs and reports its figures, so that the device's minutes go to measuring, not to fixing the script."""

from __future__ import annotations

import json
import math

import pytest

from tests.functional.launch import program_module

pytestmark = pytest.mark.slow


def test_every_piece_runs_at_toy_size_on_the_cpu(tmp_path, capsys):
    pytest.importorskip("transformers")  # the peer
    gpu = program_module("benchmarks/gpu.py")
    assert gpu.main(["--device", "cpu", "--out", str(tmp_path), "--steps", "1", "--warmup", "1"]) == 0
    table = capsys.readouterr().out
    saved = json.loads((tmp_path / "results.json").read_text())
    results, environment = saved["results"], saved["environment"]
    assert environment["device"] == "cpu" and environment["steps"] == 1
    assert set(results) == {"peak", "models", "peer", "moe", "fp8", "cp_kernel", "activation_offload"}  # gpu_tests:
    # a device's only
    assert results["peak"]["tflops"] > 0

    runs = {**results["models"], **results["peer"], **{f"llama-4l {k}": results["moe"][k] for k in ("dense", "moe")}}
    assert set(results["models"]) == {"345m bf16", "345m fp16", "1.3b bf16 recompute", "1.3b bf16",
                                      "1.3b fp16 recompute"}
    assert set(results["peer"]) == {"345m hf-gpt2", "1.3b hf-gpt2"}
    for name, run in runs.items():
        assert "error" not in run, (name, run)
        tokens = run["tokens_s"] * run["step_s"]
        assert tokens == pytest.approx(2 * 64), name  # the toy batch x sequence
        assert 0 < run["mfu"] < 1.5 and math.isfinite(run["loss"]), name
        assert abs(run["loss"] - math.log(512)) < 0.5, name  # the toy vocabulary's, after a step from the start
        assert name in table
    for name in results["models"]:
        assert results["models"][name]["estimate_gib"] > 0 and results["models"][name]["memory_gib"] is None
    assert results["moe"]["moe_vs_dense"] > 0
    assert results["fp8"]["refused"].startswith("--fp8-format needs an NVIDIA GPU with FP8 tensor cores")  # a CPU
    cp = results["cp_kernel"]
    assert cp["kernel"] == "the CPU's fused flash kernel" and cp["speedup"] > 0 and cp["length"] == 256
    assert "FP8: refused: --fp8-format needs an NVIDIA GPU" in table and "Context-parallel block kernel" in table
