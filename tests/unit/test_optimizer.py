"""Loss scalers, clipping and the mixed-precision optimizer (the schedules: test_lr_schedule.py)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from megatron.config.schema import OptimizerConfig
from megatron.distributed.parallelize import ShardingPlan, parallelize
from megatron.optimizer import ConstantGradScaler, DynamicGradScaler, MixedPrecisionOptimizer
from megatron.optimizer.clip_grads import clip_grads, global_grad_norm

# ---------------------------------------------------------------- loss scalers


def test_dynamic_scaler_backoff_hysteresis_1():
    scaler = DynamicGradScaler(1024.0, hysteresis=1, growth_interval=1000)
    scaler.update(True)
    assert scaler.scale == 512.0
    scaler.update(True)
    assert scaler.scale == 256.0


def test_dynamic_scaler_backoff_hysteresis_2():
    scaler = DynamicGradScaler(1024.0, hysteresis=2, growth_interval=1000)
    scaler.update(True)
    assert scaler.scale == 1024.0  # first overflow tolerated
    scaler.update(True)
    assert scaler.scale == 512.0
    scaler.update(True)  # hysteresis is only restored by a growth
    assert scaler.scale == 256.0


def test_dynamic_scaler_growth_after_clean_steps():
    scaler = DynamicGradScaler(8.0, hysteresis=2, growth_interval=3)
    for _ in range(2):
        scaler.update(False)
    assert scaler.scale == 8.0
    scaler.update(False)
    assert scaler.scale == 16.0
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 32.0
    # an overflow resets the clean-step count
    scaler.update(False)
    scaler.update(False)
    scaler.update(True)
    assert scaler.scale == 32.0  # hysteresis 2 tolerates it
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 32.0
    scaler.update(False)
    assert scaler.scale == 64.0


def test_dynamic_scaler_growth_restores_hysteresis():
    scaler = DynamicGradScaler(8.0, hysteresis=2, growth_interval=1)
    scaler.update(True)
    scaler.update(False)  # growth: 16, hysteresis back to 2
    assert scaler.scale == 16.0
    scaler.update(True)
    assert scaler.scale == 16.0


def test_dynamic_scaler_min_scale_floor():
    scaler = DynamicGradScaler(4.0, min_scale=1.5, hysteresis=1)
    scaler.update(True)
    assert scaler.scale == 2.0
    for _ in range(5):
        scaler.update(True)
        assert scaler.scale == 1.5


def test_dynamic_scaler_state_dict_round_trip():
    a = DynamicGradScaler(64.0, hysteresis=2, growth_interval=4)
    for found_inf in (False, False, True, False):
        a.update(found_inf)
    b = DynamicGradScaler(1.0, hysteresis=2, growth_interval=4)
    b.load_state_dict(a.state_dict())
    for found_inf in (True, False, False, False, False, True):
        a.update(found_inf)
        b.update(found_inf)
        assert a.scale == b.scale


def test_constant_scaler_never_changes():
    scaler = ConstantGradScaler(128.0)
    for found_inf in [True] * 5 + [False] * 3000:
        scaler.update(found_inf)
    assert scaler.scale == 128.0


# ---------------------------------------------------------------- clipping


def _random_grads(dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g).to(dtype) for shape in [(7, 5), (13,), (3, 4, 2), (1,)]]


@pytest.mark.parametrize("max_norm", [0.5, 3.0, 1e3])
def test_clip_matches_torch(max_norm):
    grads = _random_grads()
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = global_grad_norm(grads)
    # fp32 sums in a different order: a few ulps apart
    torch.testing.assert_close(norm, expected_norm, rtol=1e-6, atol=0)
    clip_grads(grads, max_norm, norm)
    for g, p in zip(grads, params):
        torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=1e-7)
    if max_norm > float(norm):
        assert torch.equal(torch.cat([g.flatten() for g in grads]),
                           torch.cat([g.flatten() for g in _random_grads()]))
    else:
        clipped = global_grad_norm(grads)
        assert float(clipped) == pytest.approx(max_norm, rel=1e-5)


def test_clip_disabled_and_low_precision_norm():
    grads = _random_grads()
    clip_grads(grads, 0.0, torch.tensor(1e9))
    assert all(torch.equal(a, b) for a, b in zip(grads, _random_grads()))
    bf16 = _random_grads(torch.bfloat16)
    norm = global_grad_norm(bf16)
    assert norm.dtype == torch.float32
    # accumulated in fp32: equals the fp32 norm of the same (bf16-rounded) values
    torch.testing.assert_close(norm, torch.linalg.vector_norm(torch.cat([g.float().flatten() for g in bf16])),
                               rtol=1e-6, atol=0)


# ---------------------------------------------------------------- the optimizer


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def _optimizer(model: nn.Module, cfg: OptimizerConfig, scaler=None) -> MixedPrecisionOptimizer:
    """The optimizer over ``model`` on one rank: its buffer built by ``parallelize`` (nothing sharded)."""
    plan = ShardingPlan()
    _, buffer, _ = parallelize(model, plan)
    return MixedPrecisionOptimizer(buffer, plan, cfg, scaler)


def _model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return Tiny().to(dtype)


def _inputs(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    return ((model(x.to(dtype)).float() - y) ** 2).mean()


def test_fp32_matches_torch_adamw():
    cfg = OptimizerConfig(weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, grad_clip=0.0)
    model = _model()
    ref = copy.deepcopy(model)
    opt = _optimizer(model, cfg)
    decay = [p for p in ref.parameters() if p.ndim >= 2]
    no_decay = [p for p in ref.parameters() if p.ndim < 2]
    assert len(decay) == 2 and len(no_decay) == 4
    ref_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=0.0, betas=(0.8, 0.95), eps=1e-6)
    for step, (x, y) in enumerate(_inputs(), start=1):
        lr = 1e-2 * step
        opt.zero_grad()
        _loss(model, x, y).backward()
        ref_opt.zero_grad()
        _loss(ref, x, y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
        for group in ref_opt.param_groups:
            group["lr"] = lr
        result = opt.step(lr)
        ref_opt.step()
        assert result.applied
        assert result.grad_norm == pytest.approx(float(ref_norm), rel=1e-5)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            # fused vs foreach AdamW kernels round differently: a few fp32 ulps (seen: 3e-8)
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
    moved = [not torch.equal(p, q) for p, q in zip(model.parameters(), _model().parameters())]
    assert all(moved)


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_scheduled_weight_decay_reaches_adamw_and_spares_biases_and_norms(offload):
    """step(lr, weight_decay) decays the weight matrices by that step's rate (torch AdamW, decoupled), on the
    device and offloaded; biases and LayerNorm parameters never decay, whatever the rate."""
    cfg = OptimizerConfig(weight_decay=0.5, adam_epsilon=1e-6, grad_clip=0.0)
    model, ref = _model(), _model()
    plan = ShardingPlan(offload=offload)
    _, buffer, _ = parallelize(model, plan)
    opt = MixedPrecisionOptimizer(buffer, plan, cfg)
    decay = [p for p in ref.parameters() if p.ndim >= 2]
    no_decay = [p for p in ref.parameters() if p.ndim < 2]
    ref_opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=0.0, eps=1e-6)
    for (x, y), wd in zip(_inputs(), (0.0, 0.3, 2.0)):
        opt.zero_grad()
        _loss(model, x, y).backward()
        ref_opt.zero_grad()
        _loss(ref, x, y).backward()
        ref_opt.param_groups[0].update(lr=1e-2, weight_decay=wd)
        ref_opt.param_groups[1].update(lr=1e-2)
        assert opt.step(1e-2, weight_decay=wd).applied
        ref_opt.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
    rates = {g["decays"]: g["weight_decay"] for g in opt.inner.param_groups}
    assert rates == {True: 2.0, False: 0.0}


def test_grad_clipping_applied():
    cfg = OptimizerConfig(weight_decay=0.0, grad_clip=1e-3)
    model = _model()
    opt = _optimizer(model, cfg)
    x, y = _inputs(1)[0]
    _loss(model, x, y).backward()
    result = opt.step(1e-3)
    assert result.grad_norm > 1e-3  # the norm before clipping is reported
    assert float(global_grad_norm(opt.main_grads())) == pytest.approx(1e-3, rel=1e-4)


def test_fp16_overflow_skips_step():
    cfg = OptimizerConfig(grad_clip=1.0)
    model = _model(torch.float16)
    scaler = DynamicGradScaler(2.0**40, hysteresis=1)
    opt = _optimizer(model, cfg, scaler)
    before = [p.detach().clone() for p in model.parameters()]
    masters_before = [m.detach().clone() for m in opt.masters]
    x, y = _inputs(1)[0]
    (_loss(model, x, y) * opt.loss_scale).backward()  # 2**40 overflows fp16 gradients
    assert not torch.isfinite(opt.buffer.grad_data).all()
    result = opt.step(1e-2)
    assert result.applied is False and result.grad_norm is None
    assert scaler.scale == 2.0**39
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(torch.equal(m, b) for m, b in zip(opt.masters, masters_before))
    # a clean step after the skip is applied and moves the parameters
    scaler.scale = 1024.0
    opt.zero_grad()
    (_loss(model, x, y) * opt.loss_scale).backward()
    result = opt.step(1e-2)
    assert result.applied and math.isfinite(result.grad_norm)
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.dtype == torch.float16 for p in model.parameters())
    # the fp16 parameters are the fp32 masters rounded to fp16
    assert torch.equal(opt.buffer.param_data, torch.cat([m.flatten() for m in opt.masters]).half())


def test_fp16_unscaled_grad_norm():
    model = _model(torch.float16)
    ref = _model(torch.float16).float()  # the same fp16-rounded weights, in fp32
    opt = _optimizer(model, OptimizerConfig(grad_clip=0.0), ConstantGradScaler(256.0))
    x, y = _inputs(1)[0]
    (_loss(model, x, y) * opt.loss_scale).backward()
    _loss(ref, x, y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
    result = opt.step(1e-3)
    # fp16 forward/backward vs fp32: a few fp16 roundings (unit roundoff 2**-11 = 4.9e-4; seen 1.2e-4)
    assert result.grad_norm == pytest.approx(float(ref_norm), rel=2e-3)


def test_bf16_main_grads_accumulate_in_fp32():
    model = _model(torch.bfloat16)
    opt = _optimizer(model, OptimizerConfig())
    twin = _model(torch.bfloat16)  # the same bf16 weights, without the buffer
    ref32 = _model(torch.bfloat16).float()
    batches = _inputs(2)
    for x, y in batches:
        _loss(model, x, y).backward()
        _loss(ref32, x, y).backward()
    bf16_sum = [torch.zeros_like(p, dtype=torch.float32) for p in twin.parameters()]
    for x, y in batches:
        twin.zero_grad()
        _loss(twin, x, y).backward()
        for acc, p in zip(bf16_sum, twin.parameters()):
            acc += p.grad.float()
    for (name, p), exact, q in zip(model.named_parameters(), bf16_sum, ref32.parameters()):
        assert p.dtype == torch.bfloat16 and p.grad is None
        assert p.main_grad.dtype == torch.float32
        # the fp32 sum of the two bf16 gradients, not rounded to bf16 in between
        torch.testing.assert_close(p.main_grad, exact, rtol=0, atol=0, msg=name)
        # against an fp32 model: bf16 keeps 8 significant bits (unit roundoff 2**-8) and the forward and
        # backward round several times, so allow 4 bf16 ulps of the tensor's scale (seen: ~1.3 ulps)
        err = (p.main_grad - q.grad).abs().max()
        assert err <= 2.0**-6 * q.grad.abs().max(), name
    opt.zero_grad()
    assert all(not p.main_grad.any() for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_non_finite_gradient_norm_skips_the_step_without_a_scaler(dtype):
    model = _model(dtype)
    opt = _optimizer(model, OptimizerConfig(grad_clip=1.0))
    masters_before = [m.detach().clone() for m in opt.masters]
    x, y = _inputs(1)[0]
    _loss(model, x, y).backward()
    next(model.parameters()).main_grad[0] = float("nan")
    result = opt.step(1e-2)
    assert result.applied is False and result.grad_norm is None
    assert all(torch.equal(m, b) for m, b in zip(opt.masters, masters_before))
