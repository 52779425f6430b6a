"""Measured per-rank model-state bytes match the accounting function (ZeRO stage 1)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron import parallel_state
from megatron.config import parse_config, validate
from megatron.model import build_model, num_parameters
from megatron.optimizer import build_optimizer
from megatron.optimizer.memory import model_state_bytes, parameters_per_rank
from tests.distributed.harness import run_distributed


def _measure(rank, world, precision, tp, stage=1):
    ps = parallel_state.initialize(tp=tp, sharding=world // tp)
    flags = ["--mock-data", "--device", "cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
             "4", "--vocab-size", "1000", "--max-seq-len", "32", "--max-position-embeddings", "32",
             "--tp", str(tp), "--sharding", str(world // tp), "--sharding-stage", str(stage)]
    if precision == "bf16":
        flags.append("--bf16")
    config = parse_config(flags)
    validate(config, world_size=world)
    model = build_model(config)
    optimizer = build_optimizer(model, config, ps.group("tp") if tp > 1 else None, ps.group("sharding"))
    buf = optimizer.buffer
    masters = 0 if precision == "fp32" else sum(m.numel() * m.element_size() for m in optimizer.masters)
    torch.manual_seed(0)
    for p in model.parameters():  # one step creates the AdamW states
        p.main_grad.copy_(torch.randn_like(p.main_grad))
    optimizer.step(1e-3)
    states = sum(t.numel() * t.element_size() for s in optimizer.inner.state.values() for t in s.values()
                 if torch.is_tensor(t) and t.numel() > 1)
    predicted = model_state_bytes(num_parameters(model), precision, ps.sharding_size, stage)
    dist.barrier()
    return {"params": num_parameters(model), "accounted_params": parameters_per_rank(config, tp),
            "measured": (buf.param_data.numel() * buf.param_data.element_size(),
                         (buf.grad_data.numel() + optimizer.shard_grad.numel()) * 4, masters, states),
            "predicted": (predicted.parameters, predicted.gradients, predicted.master_weights,
                          predicted.optimizer_states)}


@pytest.mark.parametrize("world, precision, tp, stage", [(2, "fp32", 1, 1), (2, "bf16", 1, 1), (4, "bf16", 1, 1),
                                                         (4, "fp32", 2, 1), (2, "bf16", 1, 2), (4, "fp32", 1, 2)])
def test_measured_bytes_match_accounting(world, precision, tp, stage):
    """Measured after a step: under stage 2 the full gradient buffer has been freed, only the shard stays."""
    for result in run_distributed(_measure, world, precision, tp, stage):
        assert result["accounted_params"] == result["params"]  # the analytic count is exact
        for measured, predicted in zip(result["measured"], result["predicted"]):
            # Within 5%: shards are padded to equal size, a few elements per group.
            assert measured == pytest.approx(predicted, rel=0.05, abs=0)
        sharded = result["predicted"][3]
        assert sharded == pytest.approx(8 * result["params"] / (world // tp), rel=0.05)  # states are 1/N
