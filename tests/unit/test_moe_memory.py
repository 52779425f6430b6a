"""The memory estimate and the planner with experts (megatron/memory/moe.py, megatron/memory/model_states.py,
megatron/planner/): a MoE layer's saved activations against what saved_tensors_hooks measure (to the byte, one
process), the model states of one process against what its optimizer holds (to the byte), and with expert
parallelism by arithmetic: E / ep experts per rank split over etp, their states sharded over the expert-data-
parallel ranks, the dispatch buffers, the all-to-all's time, the planner's ep. No run trains."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from megatron import parallel_state
from megatron.config import parse_config, validate
from megatron.memory import estimate
from megatron.memory.activations import activation_terms, temporary_terms
from megatron.memory.model_states import (
    expert_grid,
    layer_split,
    model_state_bytes,
    parameter_split,
    parameters_per_rank,
    rank_model_state_bytes,
    step_transient_bytes,
)
from megatron.memory.moe import moe_dims
from megatron.parallelize_gpt import build_model
from megatron.planner import Hardware, Layout, layout_time, plan_layouts
from tests.unit.test_activation_memory import LLAMA, RECOMPUTE, make_config, measured_bytes

MOE = ("--num-experts", "4", "--moe-router-topk", "2")
ACTIVATION_CASES = {
    "gelu": (),
    "llama-bf16-shared": (*LLAMA, "--bf16", "--moe-shared-expert-intermediate-size", "32"),
    "aux-z": ("--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"),
    "seq-aux": ("--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01"),
    "sigmoid-bias-aux": ("--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                         "--moe-aux-loss-coeff", "0.01"),
    "pre-softmax-fp64": ("--moe-router-pre-softmax", "--moe-router-dtype", "fp64"),
    "pattern-width-top1": ("--moe-layer-freq", "[1,0,1]", "--moe-ffn-hidden-size", "48", "--moe-router-topk", "1"),
    "only-attn": RECOMPUTE["only_attn"],
}


@pytest.mark.parametrize("case", list(ACTIVATION_CASES))
def test_moe_layer_activations_equal_measurement(case):
    """Every expert on one rank: the rows the experts compute sum to k T whatever the routing, so the prediction
    is exact (before: every MoE layer was counted as the dense MLP)."""
    config = make_config(*MOE, *ACTIVATION_CASES[case])
    terms = activation_terms(config)
    assert "router" in terms and "experts" in terms
    assert measured_bytes(config) == sum(terms.values()), terms


# --------------------------------------------------------------------------- model states

SMALL = ["--mock-data", "--device", "cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--vocab-size", "100", "--max-seq-len", "16", "--micro-batch-size", "2", "--num-experts", "4",
         "--moe-ffn-hidden-size", "24", "--moe-layer-freq", "[0,1]"]


def small_config(*flags: str, world: int = 1):
    config = parse_config([*SMALL, *flags])
    validate(config, world_size=world)
    return config


def with_experts(config, ep: int, etp: int | None = None, world: int = 8):
    """``config`` at expert-parallel size ``ep`` (and etp), validated."""
    config = copy.deepcopy(config)
    config.distributed.expert_model_parallel_size, config.distributed.expert_tensor_parallel_size = ep, etp
    validate(config, world_size=world, cuda_available=config.device == "gpu", training_data=False)
    return config


@pytest.mark.parametrize("flags", [[], ["--bf16", "--swiglu", "--disable-bias-linear",
                                        "--moe-shared-expert-intermediate-size", "16"]], ids=["fp32", "bf16-swiglu"])
def test_one_process_model_states_are_what_the_optimizer_holds(flags):
    from megatron.data.loader import build_batch
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.distributed.parallelize import parallelize, plan_sharding
    from megatron.memory.measure import measured_model_state_bytes
    from megatron.optimizer import build_optimizer
    from megatron.training import train_step
    from pretrain_gpt import forward_step

    ps = parallel_state.initialize()
    config = small_config(*flags)
    plan = plan_sharding(config, ps)
    model, buffer, _ = parallelize(build_model(config), plan)
    optimizer = build_optimizer(buffer, plan, config)
    data = MockGPTDataset(8, 16, 100, seed=0)
    train_step(forward_step, build_batch([data[i] for i in range(2)], data.eod_id), model, buffer, optimizer, 1e-3,
               1)
    assert measured_model_state_bytes(optimizer) == rank_model_state_bytes(config)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert parameter_split(config) == (sum(p.numel() for p in model.parameters()) - experts, experts)


def _expert_sizes(config) -> tuple[int, int]:
    """(split over etp, replicated) elements of one expert of the built model: fc1's weight and bias and fc2's
    weight are split, fc2's bias replicated."""
    parallel_state.initialize()
    expert = {n.split(".experts.0.")[1]: p.numel() for n, p in build_model(config).named_parameters()
              if ".experts.0." in n}
    assert set(expert) == {"dense_h_to_4h.weight", "dense_h_to_4h.bias", "dense_4h_to_h.weight", "dense_4h_to_h.bias"}
    return sum(expert.values()) - expert["dense_4h_to_h.bias"], expert["dense_4h_to_h.bias"]


@pytest.mark.parametrize("ep, etp", [(2, None), (4, None), (2, 2), (4, 1)])
def test_each_rank_holds_its_experts_split_over_etp(ep, etp):
    """E / ep experts per rank, fc1 and fc2 split over etp (fc2's bias replicated), the dense part unchanged
    (before: every expert counted on every rank)."""
    base = small_config("--tp", "2", "--dp", "4", world=8)
    dense, experts = parameter_split(base, 2)
    split, replicated = _expert_sizes(small_config())
    config = with_experts(base, ep, etp)
    assert expert_grid(config) == (ep, etp or 2, 8 // (ep * (etp or 2)))
    assert parameter_split(config, 2) == (dense, 4 // ep * (split // (etp or 2) + replicated))
    assert experts == 4 * (split // 2 + replicated)  # ep 1: every expert, split over tp
    assert layer_split(config, 2, 1) == (layer_split(base, 2, 1)[0], 4 // ep * (split // (etp or 2) + replicated))
    assert parameters_per_rank(config, 1, ep=1, etp=1) == sum(parameter_split(small_config()))  # the whole model


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_expert_states_are_sharded_over_every_expert_data_parallel_rank(stage):
    """tp 1 x dp 2 x sharding 4 at ep 2: the dense states over the 4 sharding ranks, the experts' over all 4
    edp = 8 / 2 ranks (no expert replicas); without sharding every rank keeps its experts' whole states."""
    sharded = with_experts(small_config("--bf16", "--dp", "2", "--sharding", "4", "--sharding-stage", str(stage),
                                        world=8), 2)
    dense, experts = parameter_split(sharded)
    assert expert_grid(sharded) == (2, 1, 4)
    expected = model_state_bytes(dense, "bf16", 4, stage) + model_state_bytes(experts, "bf16", 4, stage)
    assert rank_model_state_bytes(sharded) == expected
    shard = -(-experts // 4)
    assert model_state_bytes(experts, "bf16", 4, stage).optimizer_states == 8 * shard
    if stage == 2:  # the full gradient buffers during the backward, beyond the shards
        assert step_transient_bytes(sharded) == 4 * (dense + experts - -(-dense // 4) - shard)
    replicated = with_experts(small_config("--bf16", "--dp", "8", world=8), 2)
    full = rank_model_state_bytes(replicated)
    assert full == model_state_bytes(dense, "bf16") + model_state_bytes(experts, "bf16")
    assert (full.master_weights, full.optimizer_states) == (4 * (dense + experts), 8 * (dense + experts))


def test_estimate_and_memory_check_count_the_experts_per_ep_rank():
    from megatron.memory.check import predicted_need

    base = small_config("--bf16", "--dp", "4", "--sharding", "2", world=8)
    one, four = estimate(base), estimate(with_experts(base, 4))
    _, experts = parameter_split(base)
    # the experts' states over every edp rank: ep 1 all of them over 8, ep 4 a quarter over 8 / 4 = 2
    saved = model_state_bytes(experts, "bf16", 8).total - model_state_bytes(experts // 4, "bf16", 2).total
    assert one.model_states - four.model_states == saved
    assert predicted_need(base).model_states - predicted_need(with_experts(base, 4)).model_states == saved


# --------------------------------------------------------------------------- tokens under expert parallelism

def test_expert_parallel_activations_and_dispatch_buffers_follow_uniform_routing():
    """Each rank routes its n / tp tokens and its experts compute k T etp rows (uniform routing); the dispatch's
    buffers are the temporaries: alltoall 2 R h d, allgather 2 T ep etp h d; one rank has none."""
    one = make_config(*MOE)
    n, h, d, k = 2 * 16, 64, 4, 2
    assert "expert dispatch" not in temporary_terms(one)
    assert activation_terms(one)["expert inputs"] == 3 * k * n * h * d  # three MoE layers, every expert here
    base = make_config(*MOE, "--tp", "2", "--dp", "2", world_size=4)
    for ep, etp, dispatcher in [(1, None, "alltoall"), (2, None, "alltoall"), (2, 1, "alltoall"),
                                (2, None, "allgather")]:
        config = copy.deepcopy(base)
        config.model.moe_token_dispatcher_type = dispatcher
        config = with_experts(config, ep, etp, world=4)
        T, rows = n // 2, k * (n // 2) * (etp or 2)
        terms = activation_terms(config)
        assert terms["expert inputs"] == 3 * rows * h * d
        assert terms["router"] == 3 * (8 * T * k + 4 * T * k)
        assert terms["experts"] == 3 * 2 * rows * (64 * 4 // (etp or 2)) * d
        buffers = 2 * T * ep * (etp or 2) * h * d if dispatcher == "allgather" else 2 * rows * h * d
        assert temporary_terms(config)["expert dispatch"] == buffers
    assert moe_dims(make_config()) is None and "router" not in activation_terms(make_config())


def test_the_time_model_counts_the_dispatch():
    """ep 2 x etp 1 under tp 2, alltoall: per MoE layer and micro-batch 4 exchanges of (ep - 1) / ep of the
    k T h a bytes of the rank's pairs; without expert parallelism none."""
    base = parse_config([*SMALL, "--bf16", "--global-batch-size", "8", "--micro-batch-size", "2", "--tp", "2",
                         "--dp", "2", "--device", "gpu"])
    validate(base, world_size=4, cuda_available=True, training_data=False)
    hw = Hardware(devices=4, devices_per_node=4)
    one = parse_config([*SMALL, "--bf16", "--global-batch-size", "8", "--micro-batch-size", "2", "--dp", "4",
                        "--device", "gpu"])
    validate(one, world_size=4, cuda_available=True, training_data=False)
    assert layout_time(one, hw).ep_comm == 0  # no exchange: every expert on every rank, tp 1
    timed = layout_time(with_experts(base, 2, 1, world=4), hw)
    pairs = 2 * (2 * 16 // 2) * 32 * 2  # k T h a, T = b s / tp
    assert timed.ep_comm == pytest.approx(2 * 1 * 4 * (1 / 2) * pairs / 150e9)  # 2 micro-batches x 1 MoE layer
    assert timed.step > layout_time(base, hw).step - layout_time(base, hw).dp_exposed


def test_layouts_name_ep_and_etp():
    layout = Layout(2, 1, 1, 4, 1, 1, False, "off", 1, True, ep=4, etp=1, moe=True)
    assert "dp4 ep4 etp1 " in layout.describe() + " "
    assert "--expert-model-parallel-size 4 --expert-tensor-parallel-size 1" in layout.flags()
    assert "--expert-model-parallel-size 1 --expert-tensor-parallel-size 2" in dataclasses.replace(
        layout, ep=1, etp=0).flags()
    assert "expert" not in Layout(2, 1, 1, 4, 1, 1, False, "off", 1).flags()
    config = layout.apply(small_config())
    assert (config.distributed.expert_model_parallel_size, config.distributed.expert_tensor_parallel_size) == (4, 1)


MIXTRAL = ["--mock-data", "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
           "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8", "--swiglu",
           "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
           "--disable-bias-linear", "--vocab-size", "32000", "--max-seq-len", "1024", "--max-position-embeddings",
           "4096", "--bf16", "--num-experts", "8", "--moe-router-topk", "2", "--global-batch-size", "64",
           "--hidden-dropout-prob", "0", "--attention-probs-dropout-prob", "0"]


def test_the_planner_proposes_expert_parallelism_for_mixtral_8x7b():
    """Mixtral-8x7B shaped (1024-token samples, batch 64: a short search) on 8 80 GB GPUs: the best layout splits
    the experts (ep 8: an eighth of the 45B expert parameters per rank), faster than every layout at ep 1, which
    needs tp and pp to fit (before: no ep was searched)."""
    result = plan_layouts(parse_config(MIXTRAL), Hardware(devices=8), max_micro_batch=1, max_vpp=1)
    best = result.plans[0]
    assert best.layout.ep > 1
    assert best.time.step < min(p.time.step for p in result.plans if p.layout.ep == 1)
    assert f"--expert-model-parallel-size {best.layout.ep}" in best.layout.flags()


def test_the_memory_checks_refusal_of_a_moe_run_suggests_expert_parallelism():
    from megatron.memory.check import predicted_need, refusal

    config = small_config("--dp", "4", world=4)
    line = refusal(config, predicted_need(config), 1, "available")
    assert "--expert-model-parallel-size (each rank holds num_experts / ep of the 4 experts)" in line
    assert "--expert-model-parallel-size" not in refusal(with_experts(config, 4, world=4),
                                                         predicted_need(with_experts(config, 4, world=4)), 1, "x")
    dense = parse_config(SMALL[:-6])
    validate(dense)
    assert "expert" not in refusal(dense, predicted_need(dense), 1, "available")


def test_estimate_memory_prints_the_expert_grid_and_the_ranks_experts():
    from tests.functional.launch import run_tool_here

    proc = run_tool_here("tools/estimate_memory.py", *SMALL, "--dp", "4", "--expert-model-parallel-size", "2",
                         "--device-memory-gb", "1")
    assert proc.returncode == 0, proc.stderr
    assert "experts: ep 2 x etp 1 x edp 2, 2 of 4 per rank; GiB per rank:" in proc.stdout
