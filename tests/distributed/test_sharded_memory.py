"""Measured per-rank model-state bytes match the accounting function (ZeRO stages 1-3, offload; a MoE model's
experts per ep rank, their states over the expert-data-parallel ranks), and stage 3 never holds more than two
decoder layers' full parameters at once."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron import parallel_state
from megatron.config import parse_config, validate
from megatron.data.loader import build_batch
from megatron.data.mock_dataset import MockGPTDataset
from megatron.distributed.parallelize import parallelize, plan_sharding
from megatron.memory.measure import measured_model_state_bytes
from megatron.memory.model_states import model_state_bytes, parameters_per_rank
from megatron.model import num_parameters
from megatron.optimizer import build_optimizer
from megatron.parallelize_gpt import build_model
from megatron.tensor_parallel import tensor_parallel_seed
from megatron.training import train_step
from pretrain_gpt import forward_step
from tests.distributed.harness import run_distributed

FIELDS = ("parameters", "gradients", "master_weights", "optimizer_states", "cpu_gradients")


def _measure(rank, world, precision, tp, stage, offload, layers=2):
    ps = parallel_state.initialize(tp=tp, sharding=world // tp)
    flags = ["--mock-data", "--device", "cpu", "--num-layers", str(layers), "--hidden-size", "64",
             "--num-attention-heads", "4", "--vocab-size", "1000", "--max-seq-len", "32",
             "--max-position-embeddings", "32", "--micro-batch-size", "2", "--tp", str(tp),
             "--sharding", str(world // tp), "--sharding-stage", str(stage)]
    flags += ["--bf16"] if precision == "bf16" else []
    flags += ["--sharding-offload"] if offload else []
    config = parse_config(flags)
    validate(config, world_size=world)
    tensor_parallel_seed(config.seed, ps.tp_rank, torch.device("cpu"))
    plan = plan_sharding(config, ps)
    model = build_model(config, meta_init=plan.meta_init)
    num_params = num_parameters(model)
    built_on_meta = all(p.is_meta for p in model.parameters())
    model, buffer, fully_sharded = parallelize(model, plan)
    optimizer = build_optimizer(buffer, plan, config)
    data = MockGPTDataset(64, 32, 1000, seed=rank // tp)
    batch = build_batch([data[i] for i in range(4)], data.eod_id)
    train_step(forward_step, batch, model, buffer, optimizer, 1e-3, 2)  # creates the AdamW states
    measured = measured_model_state_bytes(optimizer)
    predicted = model_state_bytes(num_params, precision, ps.sharding_size, stage, offload)
    on_cpu = [t.device.type == "cpu" for t in [optimizer.master_data, *(
        t for s in optimizer.inner.state.values() for t in s.values() if torch.is_tensor(t))] if t is not None]
    result = {"params": num_params, "accounted_params": parameters_per_rank(config, tp),
              "measured": [getattr(measured, f) for f in FIELDS], "predicted": [getattr(predicted, f) for f in FIELDS],
              "offloaded_on_cpu": all(on_cpu), "built_on_meta": built_on_meta}
    if fully_sharded is not None:
        result.update(peak_layers=fully_sharded.peak_gathered_layers,
                      num_layer_buckets=len(fully_sharded.layer_buckets),
                      gathered_after_step=sum(b.numel for b in buffer.buckets if b.gathered))
    dist.barrier()
    return result


CASES = [(2, "fp32", 1, 1, False), (2, "bf16", 1, 1, False), (4, "bf16", 1, 1, False), (4, "fp32", 2, 1, False),
         (2, "bf16", 1, 2, False), (4, "fp32", 1, 2, False), (2, "bf16", 1, 3, False), (4, "bf16", 1, 3, False),
         (4, "fp32", 2, 3, False), (2, "bf16", 1, 2, True), (4, "fp32", 1, 3, True), (4, "bf16", 1, 3, True)]


@pytest.mark.parametrize("world, precision, tp, stage, offload", CASES,
                         ids=[f"w{w}-{p}-tp{t}-stage{s}{'-offload' if o else ''}" for w, p, t, s, o in CASES])
def test_measured_bytes_match_accounting(world, precision, tp, stage, offload):
    """Measured after a train step: the full gradients (stage 2, 3) and parameters (stage 3) are freed."""
    for result in run_distributed(_measure, world, precision, tp, stage, offload):
        assert result["accounted_params"] == result["params"]  # the analytic count is exact
        for name, measured, predicted in zip(FIELDS, result["measured"], result["predicted"]):
            # Within 5%: every bucket is padded to a multiple of N, a few elements each.
            assert measured == pytest.approx(predicted, rel=0.05, abs=0), name
        states = result["predicted"][3]
        assert states == pytest.approx(8 * result["params"] / (world // tp), rel=0.05)  # states are 1/N
        if offload:
            assert result["offloaded_on_cpu"]
        # Stage 3 builds the model on the meta device and initialises it bucket by bucket into the shards.
        assert result["built_on_meta"] == (stage == 3)
        if stage == 3:
            assert result["gathered_after_step"] == 0  # between steps only the shards exist


def test_stage3_holds_at_most_two_layers():
    """Over a forward and backward of six layers, at most the layer in use and the prefetched one
    are gathered (plus the embedding and final norm, used at both ends)."""
    for result in run_distributed(_measure, 2, "fp32", 1, 3, False, 6):
        assert result["num_layer_buckets"] == 6
        assert result["peak_layers"] == 2


def test_accounting_follows_the_zero_paper():
    """2 + 2 + 12 bytes per parameter, sharded 1/N from the stage that shards each state (bf16
    parameters; the gradients are fp32 here, 4 bytes rather than ZeRO's 2)."""
    p, n = 1_000_000, 4
    full = model_state_bytes(p, "bf16")
    assert (full.parameters, full.gradients, full.master_weights + full.optimizer_states) == (2 * p, 4 * p, 12 * p)
    stages = [model_state_bytes(p, "bf16", n, stage) for stage in (1, 2, 3)]
    assert [s.total for s in stages] == [6 * p + 12 * p // n, 2 * p + 16 * p // n, 18 * p // n]
    offloaded = model_state_bytes(p, "bf16", n, 2, offload=True)
    assert offloaded.device_total == 2 * p + 4 * p // n
    assert offloaded.cpu_total == 16 * p // n
    assert model_state_bytes(p, "bf16", n, 2).device_total - offloaded.device_total == 12 * p // n


def _count(rank, world, extra):
    ps = parallel_state.initialize(pp=world)
    config = parse_config(["--mock-data", "--device", "cpu", "--num-layers", "4", "--hidden-size", "32",
                           "--num-attention-heads", "4", "--vocab-size", "1000", "--pp", str(world), *extra])
    validate(config, world_size=world)
    model = build_model(config)
    return num_parameters(model), parameters_per_rank(config, 1, world, ps.pp_rank)


PIPELINE_CUTS = [["--pipeline-partition", "1,3"], ["--vpp", "2", "--global-batch-size", "4", "--micro-batch-size", "2"]]


@pytest.mark.parametrize("extra", PIPELINE_CUTS, ids=["partition", "vpp"])
def test_parameters_per_rank_follows_the_pipeline_cut(extra):
    for built, accounted in run_distributed(_count, 2, extra):
        assert accounted == built


def _measure_moe(rank, world, ep, sharding, stage):
    """A MoE model at ep over ``world`` ranks (dp x sharding): what the rank holds against the accounting."""
    from megatron.memory.model_states import parameter_split, rank_model_state_bytes

    ps = parallel_state.initialize(sharding=sharding, ep=ep)
    config = parse_config(["--mock-data", "--device", "cpu", "--num-layers", "2", "--hidden-size", "64",
                           "--num-attention-heads", "4", "--vocab-size", "1000", "--max-seq-len", "32",
                           "--max-position-embeddings", "32", "--micro-batch-size", "2", "--bf16", "--num-experts", "4",
                           "--expert-model-parallel-size", str(ep), "--sharding", str(sharding), "--sharding-stage",
                           str(stage)])
    validate(config, world_size=world)
    plan = plan_sharding(config, ps)
    model = build_model(config, meta_init=plan.meta_init)
    experts = sum(p.numel() for p in model.parameters() if getattr(p, "expert_parallel", False))
    split = (num_parameters(model) - experts, experts)
    model, buffer, _ = parallelize(model, plan)
    optimizer = build_optimizer(buffer, plan, config)
    data = MockGPTDataset(64, 32, 1000, seed=rank)
    train_step(forward_step, build_batch([data[i] for i in range(4)], data.eod_id), model, buffer, optimizer, 1e-3, 2)
    measured, predicted = measured_model_state_bytes(optimizer), rank_model_state_bytes(config)
    dist.barrier()
    return (split, parameter_split(config), [getattr(measured, f) for f in FIELDS],
            [getattr(predicted, f) for f in FIELDS])


@pytest.mark.parametrize("world, ep, sharding, stage", [(2, 2, 1, 1), (4, 2, 2, 1), (4, 2, 4, 2), (4, 4, 4, 3)],
                         ids=["ep2-dp2", "ep2-dp2x2-zero1", "ep2-zero2x4", "ep4-zero3x4"])
def test_expert_states_match_accounting(world, ep, sharding, stage):
    """Each rank holds E / ep experts; without sharding their whole states, with it their states over all the
    expert-data-parallel ranks (world / ep), the dense ones over the sharding group (dp x sharding: the experts
    over dp x sharding / ep)."""
    for built, accounted, measured, predicted in run_distributed(_measure_moe, world, ep, sharding, stage):
        assert accounted == built  # exact
        for name, m, p in zip(FIELDS, measured, predicted):
            assert m == pytest.approx(p, rel=0.05, abs=0), name  # every bucket padded to a multiple of N
