"""Muon (megatron/optimizer/muon.py) against a plain reference written from the paper and Megatron-LM's source: the
Newton-Schulz iteration, the scale modes, the update (decoupled weight decay, momentum, Nesterov, the QKV split),
which parameters it steps, its tensor-parallel modes at tp2 (blockwise against a one-process emulation of the
blocks), and its settings' checks."""

from __future__ import annotations

import pytest
import torch

from megatron import parallel_state
from megatron.config import ConfigError, parse_config, validate
from megatron.distributed.parallelize import ShardingPlan, parallelize
from megatron.optimizer import build_optimizer
from megatron.optimizer.muon import (
    QUINTIC,
    MuonSettings,
    is_muon_param,
    matmul_precision,
    newton_schulz,
    orthogonalize,
    scale_factor,
)
from megatron.parallelize_gpt import build_model
from megatron.tensor_parallel.layers import shard_full_tensor
from tests.distributed.harness import run_distributed

TINY = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "200",
        "--max-seq-len", "16", "--max-position-embeddings", "64", "--hidden-dropout", "0", "--attention-dropout", "0")
GQA_SWIGLU = ("--swiglu", "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear")
FP32 = ("--optimizer", "muon", "--muon-fp32-matmul-prec", "high", "--grad-clip", "0")


def make_config(*argv: str, world_size: int = 1):
    config = parse_config(["--mock-data", "--device", "cpu", *argv])
    validate(config, world_size=world_size, cuda_available=False)
    return config


def reference_ns(g: torch.Tensor, steps: int) -> torch.Tensor:
    """Jordan's quintic Newton-Schulz, written plainly in float64: X = G / ||G||_F on the wide orientation, then
    X <- a X + b (X X^T) X + c (X X^T)^2 X."""
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm()
    for i in range(steps):
        a, b, c = QUINTIC[i % 5]
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return (x.T if tall else x).float()


def reference_update(u: torch.Tensor, settings: MuonSettings, qkv: bool = False) -> torch.Tensor:
    """The scaled orthogonalised update of a whole matrix; a QKV weight's query, key and value rows of every group
    orthogonalised apart."""
    def one(block):
        rows, cols = block.shape
        scale = {"spectral": max(rows, cols) ** 0.5, "unit_rms_norm": (rows / cols) ** 0.5,
                 "shape_scaling": max(1, rows / cols) ** 0.5}[settings.scale_mode]
        return reference_ns(block, settings.steps) * scale * settings.extra_scale

    if not (qkv and settings.qkv_split):
        return one(u)
    q, k, v = settings.qkv_split
    grouped = u.view(-1, q + k + v, u.shape[1])
    parts = [grouped[:, :q], grouped[:, q:q + k], grouped[:, q + k:]]
    done = [one(p.reshape(-1, u.shape[1])).view(grouped.shape[0], -1, u.shape[1]) for p in parts]
    return torch.cat(done, dim=1).view(u.shape)


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)])
def test_newton_schulz_matches_the_reference_and_orthogonalises(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    with matmul_precision("high"):
        got = newton_schulz(g, 5, "high")
    torch.testing.assert_close(got, reference_ns(g, 5), rtol=1e-5, atol=2e-6)
    singular = torch.linalg.svdvals(got)
    assert singular.min() > 0.6 and singular.max() < 1.25  # U S' V^T: S' noisy around 1 (the quintic's band)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    assert float((got * (u @ vh)).sum() / (u @ vh).norm() ** 2) == pytest.approx(1.0, abs=0.1)


def test_medium_precision_iterates_in_bf16():
    g = torch.randn(16, 48, generator=torch.Generator().manual_seed(1))
    x = (g / g.norm()).to(torch.bfloat16)
    for i in range(5):  # each matmul's result rounded to bf16, as the reference's bf16 tensors do
        a, b, c = QUINTIC[i]
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, alpha=c, beta=b), x, alpha=1.0, beta=a)
    with matmul_precision("medium"):
        assert torch.equal(newton_schulz(g, 5, "medium"), x.float())
    assert torch.get_float32_matmul_precision() == "highest"  # restored


def test_scale_modes():
    assert scale_factor(64, 16, "spectral") == 8.0
    assert scale_factor(64, 16, "unit_rms_norm") == 2.0 and scale_factor(16, 64, "unit_rms_norm") == 0.5
    assert scale_factor(64, 16, "shape_scaling") == 2.0 and scale_factor(16, 64, "shape_scaling") == 1.0


def test_qkv_split_orthogonalises_queries_keys_and_values_apart():
    settings = MuonSettings(steps=5, precision="high", qkv_split=(8, 4, 4))  # 2 groups: [q 8 | k 4 | v 4] rows each
    u = torch.randn(32, 24, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(orthogonalize(u, settings, is_qkv=True), reference_update(u, settings, qkv=True),
                               rtol=1e-5, atol=1e-5)
    whole = MuonSettings(steps=5, precision="high", qkv_split=None)
    torch.testing.assert_close(orthogonalize(u, whole, is_qkv=True), reference_update(u, whole), rtol=1e-5, atol=1e-5)


def test_muon_steps_the_layer_matrices_and_adamw_the_rest():
    """Megatron's rule: 2-D and not the word embedding or the output layer (learned position embeddings, the router
    and the experts included); norms, biases, the embedding and the head stay AdamW's."""
    config = make_config(*TINY, "--untie-embeddings-and-output-weights", "--num-experts", "2", "--optimizer", "muon")
    names = {n for n, p in build_model(config).named_parameters() if is_muon_param(n, p)}
    assert "layers.0.self_attention.query_key_value.weight" in names
    assert {"layers.0.mlp.router.weight", "layers.0.mlp.experts.1.dense_h_to_4h.weight"} <= names
    assert "embedding.position_embeddings.weight" in names
    assert not names & {"embedding.word_embeddings.weight", "output_layer.weight", "final_layernorm.weight"}
    assert all(n.endswith("weight") and "norm" not in n for n in names)


def _grads(model, seed: int) -> None:
    """Every parameter's main gradient: its slice of a full tensor drawn by name (the same at every layout)."""
    for i, (_, p) in enumerate(sorted(model.named_parameters())):
        full = torch.randn(tuple(getattr(p, "full_shape", p.shape)), generator=torch.Generator().manual_seed(seed + i))
        p.main_grad.copy_(shard_full_tensor(full, p))


def _train(config, steps: int = 2) -> dict[str, torch.Tensor]:
    """``steps`` Muon/AdamW steps of the built model (lr 0.02, weight decay 0.1) on fixed gradients."""
    model = build_model(config)
    plan = ShardingPlan()
    buffer = parallelize(model, plan).buffer
    optimizer = build_optimizer(buffer, plan, config)
    for step in range(steps):
        _grads(model, seed=100 * step)
        assert optimizer.step(0.02, 0.1).applied
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_the_update_is_the_reference_muon_step():
    """Two steps from a built model: W <- W - lr wd W; M <- beta M + (1 - beta) G; U = (1 - beta) G + beta M
    (Nesterov); W <- W - lr scale NS(U); the fused QKV weight split by groups."""
    config = make_config(*TINY, *GQA_SWIGLU, *FP32, "--muon-use-nesterov", "--muon-momentum", "0.8")
    settings = MuonSettings.from_config(config)
    assert settings.qkv_split == (32, 16, 16)
    start = {n: p.detach().clone() for n, p in build_model(config).named_parameters()}
    got = _train(config)
    model = build_model(config)
    params = dict(model.named_parameters())
    for name in (n for n, p in params.items() if is_muon_param(n, p)):
        w, m = start[name].clone(), torch.zeros_like(start[name])
        for step in range(2):
            g = _full_grad(model, name, 100 * step)
            w = w - 0.02 * 0.1 * w
            m = 0.8 * m + 0.2 * g
            w = w - 0.02 * reference_update(0.2 * g + 0.8 * m, settings, qkv="query_key_value" in name)
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=name)


def _full_grad(model, name: str, seed: int) -> torch.Tensor:
    index = sorted(n for n, _ in model.named_parameters()).index(name)
    p = dict(model.named_parameters())[name]
    return torch.randn(tuple(p.shape), generator=torch.Generator().manual_seed(seed + index))


def test_adamw_parameters_step_as_under_adam():
    """Muon leaves the other parameters to the same AdamW (the same moments, decay and step)."""
    muon = _train(make_config(*TINY, *FP32))
    adam = _train(make_config(*TINY, "--grad-clip", "0"))
    for name, p in build_model(make_config(*TINY)).named_parameters():
        assert torch.equal(muon[name], adam[name]) != is_muon_param(name, p), name


def _tp2_rank(rank: int, world_size: int, argv: tuple[str, ...]) -> dict:
    torch.set_num_threads(1)
    parallel_state.initialize(tp=2)
    results = {}
    for mode in ("blockwise", "duplicated", "distributed"):
        config = make_config(*argv, "--tp", "2", "--muon-tp-mode", mode, world_size=2)
        results[mode] = {n: (p.partition_dim if getattr(p, "tensor_model_parallel", False) else None, value)
                         for n, p in build_model(config).named_parameters()
                         for value in [_train(config, steps=1)[n]]}
    return results


def test_tp2_modes_against_one_process():
    """duplicated: the one-process update; distributed: the same within fp32 round-off; blockwise: each rank's block
    orthogonalised and scaled by its own shape, i.e. one process applying Muon to the blocks (emulated here)."""
    argv = (*TINY, *GQA_SWIGLU, *FP32)
    config = make_config(*argv)
    settings = MuonSettings.from_config(config)
    single = _train(config, steps=1)
    model = build_model(config)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ranks = run_distributed(_tp2_rank, 2, argv)
    for rank, result in enumerate(ranks):
        for mode, params in result.items():
            for name, (dim, shard) in params.items():
                want = single[name] if dim is None else single[name].chunk(2, dim=dim)[rank]
                if mode == "blockwise" and dim is not None and is_muon_param(name, start[name]):
                    w, g = start[name].chunk(2, dim=dim)[rank], _full_grad(model, name, 0).chunk(2, dim=dim)[rank]
                    w = w - 0.02 * 0.1 * w
                    want = w - 0.02 * reference_update(0.1 * g, settings, qkv="query_key_value" in name)
                torch.testing.assert_close(shard, want, rtol=1e-5, atol=1e-6, msg=f"{mode} {name} rank {rank}")


@pytest.mark.parametrize("flags, message", [
    (("--muon-num-ns-steps", "3"), "muon_num_ns_steps must be a positive multiple of 5"),
    (("--muon-momentum", "1"), "muon_momentum must be in [0, 1), got 1.0."),
    (("--muon-extra-scale-factor", "0"), "muon_extra_scale_factor must be a positive number, got 0.0."),
])
def test_bad_settings_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        make_config(*TINY, "--optimizer", "muon", *flags)


def test_megatron_flags():
    config = make_config(*TINY, "--optimizer", "dist_muon", "--muon-no-split-qkv", "--muon-tp-mode", "duplicated",
                         world_size=2)
    assert config.distributed.use_distributed_optimizer and config.distributed.sharding.sharding_degree == 2
    assert not config.optimizer.muon.muon_split_qkv and config.optimizer.muon.muon_tp_mode == "duplicated"
    assert MuonSettings.from_config(config).qkv_split is None
