"""Mixture-of-experts configuration (docs/moe.md): Megatron-LM's --moe-* flags as our config, and every setting
that is not built, or not meaningful, refused in one line (at validation, and through pretrain_gpt.py)."""

from __future__ import annotations

import pytest

from megatron.config import ConfigError, parse_config, validate
from tests.functional.launch import run_here
from tests.unit.test_moe import E, moe_config


def test_flags_are_megatrons():
    config = moe_config("--moe-layer-freq", "([1]*1)*1", "--moe-router-topk", "1", "--moe-aux-loss-coeff", "1e-2",
                        "--moe-token-dispatcher-type", "allgather", "--moe-grouped-gemm",
                        "--expert-model-parallel-size", "1", "--moe-router-dtype", "fp64",
                        "--moe-shared-expert-overlap")
    m = config.model
    assert (m.num_experts, m.moe_router_topk, m.moe_aux_loss_coeff, m.moe_ffn_hidden_size) == (E, 1, 1e-2, 24)
    assert config.distributed.expert_model_parallel_size == 1


@pytest.mark.parametrize("flags, message", [
    (["--expert-model-parallel-size", "3"], "num_experts (4) must be divisible by expert_model_parallel_size (3)"),
    (["--expert-model-parallel-size", "4"], "(4 x 1) must divide the 1 ranks of a pipeline stage"),
    (["--expert-tensor-parallel-size", "5"], "(1 x 5) must divide the 1 ranks"),
    (["--moe-router-topk", "5"], "moe_router_topk (5) must be from 1 to num_experts (4)"),
    (["--moe-router-topk", "0"], "moe_router_topk must be at least 1, got 0"),
    (["--moe-layer-freq", "[1,0]"], "needs num_layers (1) entries"),
    (["--moe-expert-capacity-factor", "0"], "moe_expert_capacity_factor must be positive"),
    (["--moe-pad-expert-input-to-capacity"], "needs a capacity"),
    (["--moe-router-enable-expert-bias"], "needs --moe-router-score-function sigmoid"),
    (["--moe-aux-loss-coeff", "-1"], "moe_aux_loss_coeff must be >= 0"),
    (["--moe-router-num-groups", "2"], "takes both --moe-router-num-groups and --moe-router-group-topk"),
    (["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"], "moe_router_num_groups (3) must divide "
                                                                        "num_experts (4)"),
    (["--moe-router-num-groups", "2", "--moe-router-group-topk", "3"], "moe_router_group_topk (3) must be at most "
                                                                        "moe_router_num_groups (2)"),
    (["--moe-router-topk", "1", "--moe-router-num-groups", "2", "--moe-router-group-topk", "2"],
     "moe_router_topk (1) must be at least moe_router_group_topk (2)"),
    (["--moe-router-topk", "3", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1"],
     "moe_router_topk (3) exceeds the experts of the 1 chosen groups (1 x 2)"),
    (["--moe-router-topk-scaling-factor", "0"], "moe_router_topk_scaling_factor must be positive"),
    (["--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0.1"],
     "sinkhorn load balancing has no auxiliary loss: set --moe-aux-loss-coeff 0"),
    (["--moe-router-load-balancing-type", "sinkhorn", "--moe-expert-capacity-factor", "1"],
     "sinkhorn routing does not take a capacity"),
    (["--moe-router-load-balancing-type", "aux_loss", "sinkhorn", "--moe-aux-loss-coeff", "0.1", "0"],
     "a list combines losses only (aux_loss, seq_aux_loss, global_aux_loss): give sinkhorn or none alone"),
    (["--moe-router-load-balancing-type", "aux_loss,global_aux_loss", "--moe-aux-loss-coeff", "0.1"],
     "moe_aux_loss_coeff gives 1 coefficient(s) for the 2 load-balancing types aux_loss, global_aux_loss"),
    (["--moe-aux-loss-coeff", "0.1", "0.2"], "moe_aux_loss_coeff gives 2 coefficients for the one load-balancing"),
    (["--moe-router-load-balancing-type", "aux_loss", "aux_loss", "--moe-aux-loss-coeff", "0.1", "0.2"],
     "lists a type twice"),
    (["--moe-input-jitter-eps", "0"], "moe_input_jitter_eps must be positive"),
    (["--moe-shared-expert-gate"], "moe_shared_expert_gate gates the shared expert: give "
                                   "--moe-shared-expert-intermediate-size too"),
])
def test_refusals_are_one_line(flags, message):
    with pytest.raises(ConfigError) as err:
        moe_config(*flags)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_refusals_through_pretrain_gpt():
    proc = run_here("--mock-data", "--device", "cpu", "--num-experts", "4", "--expert-model-parallel-size", "2")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: expert_model_parallel_size x expert_tensor_parallel_size (2 x 1) must divide the 1 "
        "ranks of a pipeline stage (mp_degree x context_parallel_size x dp_degree x sharding_degree): the experts are "
        "laid out over the same ranks."]
    dense = parse_config(["--mock-data", "--expert-model-parallel-size", "2"])
    with pytest.raises(ConfigError, match="give --num-experts too"):
        validate(dense, world_size=2)
    proc = run_here("--mock-data", "--num-experts", "4", "--moe-shared-expert-gate")
    assert proc.returncode == 2 and "moe_shared_expert_gate gates the shared expert" in proc.stderr
