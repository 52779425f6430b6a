"""The project's SGD (megatron.optimizer.sgd, Megatron-LM's --optimizer sgd) against torch.optim.SGD: the kernel alone,
and through the mixed-precision optimizer parameter by parameter (weight decay on the matrices only, as Megatron's
parameter groups set it), on the device and offloaded; its momentum as checkpoint pieces."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from megatron.config.schema import OptimizerConfig
from megatron.distributed.parallelize import ShardingPlan, parallelize
from megatron.optimizer import MixedPrecisionOptimizer
from megatron.optimizer.sgd import SGD


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in ((7, 5), (13,), (3, 4, 2), (1,))]


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_the_steps_equal_torch_sgd_bitwise(momentum):
    """Five steps with a changing learning rate and weight decay, two groups (one without decay), one parameter
    without a gradient: bit for bit torch.optim.SGD's update and momentum buffers."""
    mine, theirs = _tensors(0), _tensors(0)
    frozen = len(mine) - 1
    opt = SGD([{"params": mine[:2], "weight_decay": 0.1, "decays": True}, {"params": mine[2:], "weight_decay": 0.0}],
              lr=0.0, momentum=momentum)
    ref = torch.optim.SGD([{"params": theirs[:2], "weight_decay": 0.1}, {"params": theirs[2:], "weight_decay": 0.0}],
                          lr=0.0, momentum=momentum)
    for step in range(1, 6):
        grads = _tensors(step)
        for params in (mine, theirs):
            for i, (p, g) in enumerate(zip(params, grads)):
                p.grad = None if i == frozen else g.clone()
        for group in opt.param_groups + ref.param_groups:
            group["lr"] = 0.05 * step
        opt.param_groups[0]["weight_decay"] = ref.param_groups[0]["weight_decay"] = 0.1 * step
        opt.step()
        ref.step()
        assert all(torch.equal(p, q) for p, q in zip(mine, theirs)), step
        for p, g in zip(mine[:frozen], grads):
            assert torch.equal(p.grad, g)  # the gradients are left as they were
    assert mine[frozen] not in opt.state and torch.equal(mine[frozen], _tensors(0)[frozen])
    for p, q in zip(mine[:frozen], theirs[:frozen]):
        assert float(opt.state[p]["step"]) == 5.0
        if momentum:
            assert torch.equal(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])
        else:
            assert set(opt.state[p]) == {"step"}  # plain SGD keeps no buffer, as torch's
    assert opt.param_groups[0]["decays"] is True


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def _inputs(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_the_optimizer_steps_every_parameter_as_torch_sgd(offload):
    """--optimizer sgd through the mixed-precision optimizer: each parameter as torch.optim.SGD steps it, with the
    scheduled weight decay on the matrices and none on biases and norms (Megatron's groups), clipping off."""
    torch.manual_seed(0)
    model = Tiny()
    ref = copy.deepcopy(model)
    plan = ShardingPlan(offload=offload)
    _, buffer, _ = parallelize(model, plan)
    opt = MixedPrecisionOptimizer(buffer, plan, OptimizerConfig(optimizer="sgd", sgd_momentum=0.8, weight_decay=0.1,
                                                                grad_clip=0.0))
    decay = [p for p in ref.parameters() if p.ndim >= 2]
    ref_opt = torch.optim.SGD([{"params": decay}, {"params": [p for p in ref.parameters() if p.ndim < 2],
                                                   "weight_decay": 0.0}], lr=0.0, momentum=0.8)
    for step, (x, y) in enumerate(_inputs(4), start=1):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        ref_opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ref_opt.param_groups[0].update(lr=0.1 * step, weight_decay=0.05 * step)
        ref_opt.param_groups[1].update(lr=0.1 * step)
        assert opt.step(0.1 * step, weight_decay=0.05 * step).applied
        ref_opt.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), (step, name)
    states = [opt.inner.state[m] for m in opt.masters]
    assert all(set(s) == {"step", "momentum_buffer"} and float(s["step"]) == 4 for s in states)


def test_the_momentum_is_a_checkpoint_piece_kind():
    """Checkpoints write every state tensor of a kind they know: SGD's momentum_buffer is one (Muon's momentum's
    kind), and a state made at a resumed step (``adam_state``) carries it to be filled."""
    from megatron.checkpoint import KINDS

    model = Tiny()
    plan = ShardingPlan()
    _, buffer, _ = parallelize(model, plan)
    opt = MixedPrecisionOptimizer(buffer, plan, OptimizerConfig(optimizer="sgd"))
    state = opt.adam_state(opt.masters[0], 7)
    assert float(state["step"]) == 7 and "momentum_buffer" in KINDS
    assert [kind for kind in KINDS[1:] if kind in state] == ["momentum_buffer"]
    assert state["momentum_buffer"].shape == opt.masters[0].shape and not state["momentum_buffer"].any()
