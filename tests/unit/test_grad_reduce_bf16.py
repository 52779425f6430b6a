"""--grad-reduce-in-bf16 in one process: bf16 gradient buffers (the plan's ``grad_dtype``), micro-batches accumulated
in bf16 in place, the optimizer's step on exact fp32 copies (its norm and clipping in fp32), the memory accounting's
2 bytes a gradient, and the flag refused without bf16. The reductions in bf16 over ranks:
tests/distributed/test_grad_reduce_bf16.py; parity with one process: tests/functional/test_sharding.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron import parallel_state
from megatron.config import ConfigError, parse_config, validate
from megatron.config.schema import OptimizerConfig
from megatron.distributed.parallelize import ShardingPlan, parallelize, plan_sharding
from megatron.memory.model_states import model_state_bytes, rank_model_state_bytes, step_transient_bytes
from megatron.optimizer import MixedPrecisionOptimizer

GPT = ["--mock-data", "--device", "cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--vocab-size", "100", "--max-seq-len", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
       "--global-batch-size", "4"]


def _config(*flags: str, world: int = 1):
    config = parse_config([*GPT, *flags])
    validate(config, world_size=world)
    return config


@pytest.mark.parametrize("flags", [[], ["--fp16"]], ids=["fp32", "fp16"])
def test_the_flag_needs_bf16(flags):
    with pytest.raises(ConfigError, match="grad_reduce_in_bf16 keeps the gradients in bf16, which needs bf16 training; "
                                          "add --bf16 or drop --grad-reduce-in-bf16"):
        _config("--grad-reduce-in-bf16", *flags)


def test_the_plan_makes_bf16_buffers_and_counts_buckets_in_bf16_bytes():
    ps = parallel_state.initialize()
    plain, flagged = plan_sharding(_config("--bf16"), ps), plan_sharding(_config("--bf16", "--grad-reduce-in-bf16"), ps)
    assert (plain.grad_dtype, flagged.grad_dtype) == (torch.float32, torch.bfloat16)
    assert flagged.bucket_size == 2 * plain.bucket_size  # --bucket-size-mb counts bytes of gradients
    _, buffer, _ = parallelize(_model(torch.bfloat16), replace_dtype(ShardingPlan(), torch.bfloat16))
    assert buffer.grad_dtype == buffer.grad_data.dtype == torch.bfloat16
    assert all(b.grad_data.dtype == torch.bfloat16 for b in buffer.buckets)


def replace_dtype(plan: ShardingPlan, dtype: torch.dtype) -> ShardingPlan:
    from dataclasses import replace

    return replace(plan, grad_dtype=dtype)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def _model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return Tiny().to(dtype)


def _inputs(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x.to(torch.bfloat16)).float() - y) ** 2).mean()


def test_micro_batches_accumulate_in_bf16_in_place():
    """autograd adds each micro-batch's bf16 gradient into the bf16 main grad itself (``param.grad`` is its view):
    the running sum rounded to bf16 after every addition, as Megatron's bf16 buffer accumulates."""
    model, twin = _model(torch.bfloat16), _model(torch.bfloat16)
    parallelize(model, replace_dtype(ShardingPlan(), torch.bfloat16))
    batches = _inputs(3)
    for x, y in batches:
        _loss(model, x, y).backward()
    running = [None] * len(list(twin.parameters()))
    for x, y in batches:
        twin.zero_grad()
        _loss(twin, x, y).backward()
        running = [p.grad.clone() if r is None else r.add_(p.grad) for r, p in zip(running, twin.parameters())]
    for (name, p), want in zip(model.named_parameters(), running):
        assert p.main_grad.dtype == torch.bfloat16 and p.grad is p.main_grad, name
        assert torch.equal(p.main_grad, want), name


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_the_step_upcasts_bf16_grads_exactly(offload):
    """The step from bf16 main grads is the step from fp32 main grads holding the same values, bit for bit: the norm
    (fp32), the clipping (active here) and AdamW all run on exact fp32 copies, which last for the step only."""
    cfg = OptimizerConfig(weight_decay=0.1, grad_clip=0.05)
    low, high = _model(torch.bfloat16), _model(torch.bfloat16)
    plans = ShardingPlan(offload=offload, grad_dtype=torch.bfloat16), ShardingPlan(offload=offload)
    optimizers = [MixedPrecisionOptimizer(parallelize(m, plan)[1], plan, cfg) for m, plan in zip((low, high), plans)]
    for x, y in _inputs(3):
        for opt in optimizers:
            opt.zero_grad()
        _loss(low, x, y).backward()
        for p, q in zip(low.parameters(), high.parameters()):
            q.main_grad.copy_(p.main_grad)  # the same values, held in fp32
        results = [opt.step(1e-2) for opt in optimizers]
        assert results[0] == results[1] and results[0].grad_norm > cfg.grad_clip
        assert all(torch.equal(a, b) for a, b in zip(optimizers[0].masters, optimizers[1].masters))
        assert all(torch.equal(p, q) for p, q in zip(low.parameters(), high.parameters()))
        assert all(m.grad is None for m in optimizers[0].masters) != offload  # offload: the CPU copy stays
    assert all(p.main_grad.dtype == torch.bfloat16 for p in low.parameters())


def _measured_after_a_step(config):
    """What the optimizer of ``config``'s model holds after one training step, in one process."""
    from megatron.data.loader import build_batch
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.memory.measure import measured_model_state_bytes
    from megatron.optimizer import build_optimizer
    from megatron.parallelize_gpt import build_model
    from megatron.training import train_step
    from pretrain_gpt import forward_step

    ps = parallel_state.initialize()
    plan = plan_sharding(config, ps)
    model, buffer, _ = parallelize(build_model(config), plan)
    optimizer = build_optimizer(buffer, plan, config)
    data = MockGPTDataset(8, 16, 100, seed=0)
    train_step(forward_step, build_batch([data[i] for i in range(4)], data.eod_id), model, buffer, optimizer, 1e-3, 2)
    return measured_model_state_bytes(optimizer)


def test_the_memory_accounting_counts_two_bytes_a_gradient():
    """The estimate with the flag: gradients 2 bytes an element, stage 2's transient full buffer too; and what the
    optimizer holds after a step is what the estimate says."""
    n = 1000
    assert model_state_bytes(n, "bf16", grad_bytes=2).gradients == 2 * n
    assert model_state_bytes(n, "bf16", 4, 2, grad_bytes=2).gradients == 2 * n // 4
    plain, flagged = _config("--bf16"), _config("--bf16", "--grad-reduce-in-bf16")
    assert 2 * rank_model_state_bytes(flagged).gradients == rank_model_state_bytes(plain).gradients
    sharded = ["--sharding", "2", "--sharding-stage", "2"]
    assert 2 * step_transient_bytes(_config("--bf16", "--grad-reduce-in-bf16", *sharded, world=2)) == \
        step_transient_bytes(_config("--bf16", *sharded, world=2))
    assert _measured_after_a_step(flagged) == rank_model_state_bytes(flagged)


@pytest.mark.parametrize("momentum, per_element", [("0.9", 4), ("0", 0)])
def test_the_memory_accounting_counts_sgd_momentum(momentum, per_element):
    """SGD keeps one fp32 momentum an element (none without momentum), as the estimate counts and the step holds."""
    config = _config("--bf16", "--optimizer", "sgd", "--sgd-momentum", momentum)
    predicted = rank_model_state_bytes(config)
    assert predicted.optimizer_states == per_element * predicted.master_weights // 4
    assert _measured_after_a_step(config) == predicted


def test_sgd_momentum_out_of_range_is_refused():
    with pytest.raises(ConfigError, match=r"sgd_momentum must be in \[0, 1\) \(0: plain SGD\), got 1.5"):
        _config("--optimizer", "sgd", "--sgd-momentum", "1.5")
