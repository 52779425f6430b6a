"""The project's AdamW (megatron.optimizer.adamw) against torch.optim.AdamW, kernel for kernel."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from megatron.optimizer.adamw import AdamW, has_fused_kernel


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in ((7, 5), (13,), (3, 4, 2), (1,))]


def _groups(params: list[torch.Tensor]) -> list[dict]:
    return [{"params": params[:2], "weight_decay": 0.1, "decays": True}, {"params": params[2:], "weight_decay": 0.0}]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_the_steps_equal_torch_adamw_with_the_same_kernel(fused):
    """Five steps with a changing learning rate and weight decay, two groups, one parameter without a gradient:
    the fused path is bit-for-bit torch's fused AdamW, the foreach path torch's foreach AdamW within an ulp."""
    mine, theirs = _tensors(0), _tensors(0)
    frozen = len(mine) - 1  # no gradient: neither optimizer touches it or creates its state
    opt = AdamW(_groups(mine), lr=0.0, betas=(0.8, 0.95), eps=1e-6, fused=fused)
    ref = torch.optim.AdamW(_groups(theirs), lr=0.0, betas=(0.8, 0.95), eps=1e-6, fused=fused, foreach=not fused)
    for step in range(1, 6):
        grads = _tensors(step)
        for params in (mine, theirs):
            for i, (p, g) in enumerate(zip(params, grads)):
                p.grad = None if i == frozen else g.clone()
        for group in opt.param_groups + ref.param_groups:
            group["lr"] = 1e-2 * step
            if group.get("decays"):
                group["weight_decay"] = 0.1 * step
        opt.step()
        ref.step()
        for p, q in zip(mine, theirs):
            if fused:
                assert torch.equal(p, q)
            else:
                torch.testing.assert_close(p, q, rtol=2e-7, atol=1e-8)
    assert mine[frozen] not in opt.state and torch.equal(mine[frozen], _tensors(0)[frozen])
    for p, q in zip(mine[:frozen], theirs[:frozen]):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], ref.state[q][key], rtol=2e-7, atol=1e-12)
        assert opt.state[p]["step"].dtype == torch.float32 and float(opt.state[p]["step"]) == 5.0
    assert opt.param_groups[0]["decays"] is True  # a group's own keys are kept


def test_a_state_made_before_the_first_step_starts_from_its_step():
    """A resumed run creates the state at the checkpoint's step: the bias corrections continue from there."""
    p, q = torch.ones(4), torch.ones(4)
    opt = AdamW([{"params": [p]}], lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    ref = torch.optim.AdamW([q], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, fused=True)
    p.grad, q.grad = torch.full((4,), 0.5), torch.full((4,), 0.5)
    ref.step()
    ref.step()
    state = opt.state_for(p, step=2)
    state["exp_avg"].copy_(ref.state[q]["exp_avg"])
    state["exp_avg_sq"].copy_(ref.state[q]["exp_avg_sq"])
    p.copy_(q)
    ref.step()
    opt.step()
    assert torch.equal(p, q) and float(state["step"]) == 3.0


def test_fused_is_refused_on_a_device_without_the_kernel():
    assert has_fused_kernel(torch.device("cpu")) and not has_fused_kernel(torch.device("meta"))
    with pytest.raises(ValueError, match="no fused AdamW kernel for meta tensors: pass fused=False"):
        AdamW([{"params": [torch.empty(2, device="meta")]}], lr=1e-3, betas=(0.9, 0.95), eps=1e-8)


def test_building_and_stepping_the_optimizer_leaves_torch_dynamo_unimported():
    """torch.optim's optimizers import torch._dynamo (about 2 s of CPU) on their first call; every training
    process builds one, so the project's does not."""
    script = textwrap.dedent("""
        import sys
        import torch
        from megatron.config.schema import OptimizerConfig
        from megatron.distributed.parallelize import ShardingPlan, parallelize
        from megatron.optimizer import MixedPrecisionOptimizer
        model = torch.nn.Linear(4, 3)
        plan = ShardingPlan()
        _, buffer, _ = parallelize(model, plan)
        opt = MixedPrecisionOptimizer(buffer, plan, OptimizerConfig(grad_clip=1.0))
        model(torch.ones(2, 4)).sum().backward()
        assert opt.step(1e-3).applied
        print("dynamo imported:", "torch._dynamo" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "dynamo imported: False"
