"""FP8 matmuls (megatron/tensor_parallel/fp8.py) on the CPU, where torch's ``_scaled_mm`` is emulated: each
matmul equals the fp32 product of its operands cast to FP8 and back (the forward and both gradients, in both
formats); a model trained with them stays within 1% of the fp32 loss; the configuration's checks. The layouts'
parity (tp, sequence parallelism, split tokens) is tests/distributed/test_tensor_parallel.py's."""

from __future__ import annotations

import math

import pytest
import torch

import pretrain_gpt
from megatron import device as dev
from megatron.config import ConfigError, parse_config, validate
from megatron.data.loader import build_batch
from megatron.data.mock_dataset import MockGPTDataset
from megatron.distributed.parallelize import ShardingPlan, parallelize
from megatron.optimizer import build_optimizer
from megatron.parallelize_gpt import build_model
from megatron.tensor_parallel import FP8Recipe, enable_fp8
from megatron.tensor_parallel.fp8 import amax, cast, fp8_linear, scale_for
from megatron.training import train_step

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def through_fp8(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` cast to FP8 with its own amax's scale and back: what the matmul multiplies (test_fp8_gpu.py's too)."""
    scale = scale_for(amax(t, ()), dtype)
    return cast(t, scale, dtype).float() / scale


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_each_matmul_is_the_product_of_its_operands_cast_to_fp8(fmt):
    torch.manual_seed(0)
    x = (3 * torch.randn(6, 4, 32)).requires_grad_()
    w = torch.randn(48, 32).requires_grad_()
    dy = torch.randn(6, 4, 48)
    y = fp8_linear(x, w, FP8Recipe(fmt))
    y.backward(dy)
    x2, g2 = x.detach().reshape(-1, 32), dy.reshape(-1, 48)
    grad = through_fp8(g2, E5M2 if fmt == "hybrid" else E4M3)
    torch.testing.assert_close(y.detach().reshape(-1, 48), through_fp8(x2, E4M3) @ through_fp8(w.detach(), E4M3).t())
    torch.testing.assert_close(x.grad.reshape(-1, 32), grad @ through_fp8(w.detach(), E4M3))
    torch.testing.assert_close(w.grad, grad.t() @ through_fp8(x2, E4M3))
    exact = x2 @ w.detach().t()  # and FP8 is FP8: close to the fp32 product, not equal
    error = ((y.detach().reshape(-1, 48) - exact).norm() / exact.norm()).item()
    assert 1e-3 < error < 0.05


def test_the_formats_differ_in_the_gradient_only():
    torch.manual_seed(1)
    x, w, dy = torch.randn(16, 32), torch.randn(16, 32), torch.randn(16, 16)
    results = {}
    for fmt in ("hybrid", "e4m3"):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_linear(xx, ww, FP8Recipe(fmt))
        y.backward(dy)
        results[fmt] = (y.detach(), xx.grad)
    assert torch.equal(results["hybrid"][0], results["e4m3"][0])
    assert not torch.equal(results["hybrid"][1], results["e4m3"][1])


def test_zeros_and_huge_values_stay_finite():
    x = torch.zeros(16, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    y = fp8_linear(x, w, FP8Recipe())
    y.backward(torch.ones_like(y))
    assert torch.equal(y, torch.zeros_like(y)) and torch.isfinite(x.grad).all() and torch.equal(w.grad, 0 * w.grad)
    big = torch.full((16, 32), 1e30)
    assert torch.isfinite(fp8_linear(big, w.detach(), FP8Recipe())).all()


def test_a_tensor_of_tiny_values_casts_without_nan():
    """An amax under 1e-12 counts as 1e-12: the scale stays finite, and the zeros beside a tiny value stay 0."""
    x = torch.zeros(16, 32)
    x[0, 0] = 1e-37
    y = fp8_linear(x, torch.randn(16, 32), FP8Recipe())
    assert torch.isfinite(y).all()


def _tiny(steps: int, fp8: bool) -> list[float]:
    config = parse_config(["--mock-data", "--device", "cpu", "--num-layers", "2", "--hidden-size", "64",
                           "--num-attention-heads", "4", "--max-seq-len", "64", "--max-position-embeddings", "64",
                           "--vocab-size", "512", "--micro-batch-size", "4", "--global-batch-size", "4",
                           "--hidden-dropout-prob", "0", "--attention-probs-dropout-prob", "0", "--lr", "3e-3"])
    validate(config)
    torch.manual_seed(0)
    model = build_model(config)
    if fp8:
        assert enable_fp8(model, FP8Recipe("hybrid")) == 8  # QKV, attention out, fc1 and fc2 of each of 2 layers
    model, buffer, _ = parallelize(model, ShardingPlan())
    optimizer = build_optimizer(buffer, ShardingPlan(), config)
    data = MockGPTDataset(1000, 64, 512, seed=1)
    losses = []
    for step in range(steps):
        batch = build_batch([data[step * 4 + j] for j in range(4)], data.eod_id)
        losses.append(train_step(pretrain_gpt.forward_step, batch, model, buffer, optimizer, 3e-3, 4)[0])
    return losses


def test_a_model_trained_in_fp8_stays_within_one_percent_of_fp32():
    plain, fp8 = _tiny(30, False), _tiny(30, True)
    assert plain[-1] < plain[0] - 0.5  # it learns
    assert fp8 != plain and all(math.isfinite(v) for v in fp8)
    assert abs(fp8[-1] - plain[-1]) / plain[-1] < 0.01


def _gpu_config(*argv: str):
    config = parse_config(["--mock-data", "--device", "gpu", "--bf16", "--num-layers", "2", "--hidden-size", "64",
                           "--num-attention-heads", "4", "--max-seq-len", "64", "--max-position-embeddings", "64",
                           "--vocab-size", "512", "--micro-batch-size", "2", "--global-batch-size", "2", *argv])
    return config, validate(config, cuda_available=True)


@pytest.mark.parametrize("argv,message", [
    (["--fp8-recipe", "delayed"], "--fp8-recipe delayed: delayed scaling (an amax history) is not built here; "
                                  "--fp8-recipe tensorwise is"),
    (["--fp8-recipe", "mxfp8"], "--fp8-recipe mxfp8: MXFP8 (32-element blocks, Blackwell's compute capability 10.0)"),
    (["--fp8-param-gather"], "--fp8-param-gather is not built here"),
    (["--hidden-size", "72", "--num-attention-heads", "4"], "--fp8-format: FP8 matmuls need sizes that are multiples "
                                                          "of 16, and hidden_size is 72"),
    (["--max-seq-len", "60", "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size",
      "1"], "the tokens of a micro-batch (micro_batch_size x max_seq_len / context_parallel_size) is 60"),
])
def test_what_fp8_cannot_run_is_refused_in_one_line(argv, message):
    with pytest.raises(ConfigError) as err:
        _gpu_config("--fp8-format", "hybrid", *argv)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("argv,message", [
    (["--fp8-recipe", "delayed"], "--fp8-recipe delayed: delayed scaling (an amax history) is not built here"),
    (["--fp8-recipe", "blockwise"], "--fp8-recipe blockwise: blockwise scaling (1x128 / 128x128 blocks) is not built"),
    (["--fp8-param-gather"], "--fp8-param-gather is not built here"),
    (["-o", "fp8_param_gather=True"], "--fp8-param-gather is not built here"),
    (["--train-iters", "10", "--fp8-recipe", "delayed"], "--fp8-recipe delayed: delayed scaling"),
])
def test_what_is_not_built_is_refused_without_fp8_format_too(argv, message):
    """docs/fp8.md lists these as refused: FP8 off does not make them silently accepted (it did)."""
    with pytest.raises(ConfigError) as err:
        _gpu_config(*argv)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_megatrons_default_recipe_without_fp8_is_no_refusal():
    """A Megatron-LM command line carries its default recipe (delayed), unused while FP8 is off."""
    config, _ = _gpu_config("--train-iters", "10")
    assert config.mix_precision.fp8_format is None and config.mix_precision.fp8_recipe == "delayed"


def test_the_size_checks_follow_the_layers_the_model_has():
    """Multi-latent attention has no QKV layer but a key-value up-projection of heads x (qk_head_dim + v_head_dim);
    a model whose every layer is MoE has no dense MLP (its experts stay in bf16)."""
    mla = ["--multi-latent-attention", "--position-embedding-type", "rope", "--kv-lora-rank", "32",
           "--qk-head-dim", "24", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--num-attention-heads", "1"]
    with pytest.raises(ConfigError, match="the keys' and values' up-projection / mp_degree is 40"):
        _gpu_config("--fp8-format", "hybrid", *mla)
    _gpu_config("--fp8-format", "hybrid", "--num-experts", "4", "--ffn-hidden-size", "40")  # every layer MoE
    with pytest.raises(ConfigError, match="ffn_hidden_size / mp_degree is 40"):
        _gpu_config("--fp8-format", "hybrid", "--ffn-hidden-size", "40")


def test_a_megatron_command_line_without_a_recipe_asks_for_delayed_scaling_and_is_told():
    """Megatron-LM's --fp8-recipe defaults to delayed, which is not built: its command line says which to pass."""
    with pytest.raises(ConfigError, match=r"^--fp8-recipe delayed: .* --fp8-recipe tensorwise is"):
        _gpu_config("--train-iters", "10", "--fp8-format", "hybrid")
    config, _ = _gpu_config("--train-iters", "10", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")
    assert config.mix_precision.fp8_recipe == "tensorwise"


def test_delayed_scalings_history_flags_are_taken_with_a_line_saying_they_do_nothing():
    config, warnings = _gpu_config("--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
                                   "--fp8-amax-compute-algo", "max")
    assert config.mix_precision.fp8_recipe == "tensorwise"
    assert any(w.startswith("--fp8-amax-history-len and --fp8-amax-compute-algo shape delayed scaling")
               for w in warnings)


def test_a_device_without_fp8_tensor_cores_is_refused_when_the_model_is_built():
    assert dev.fp8_problem(torch.device("cpu")) == "FP8 matmuls need an NVIDIA GPU; this run is on the CPU"
    config, _ = _gpu_config("--fp8-format", "e4m3")
    with pytest.raises(ConfigError, match=r"^--fp8-format: FP8 matmuls need an NVIDIA GPU; this run is on the CPU; "
                                          r"drop --fp8-format"):
        build_model(config, "cpu")
