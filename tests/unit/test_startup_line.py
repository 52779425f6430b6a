"""The start-up line names every axis of the layout and the whole model's size (a first-hour report: under
expert parallelism it said "world size 2 (dp 1, tp 1, pp 1, sharding 2)", no ep, and only rank 0's share)."""

from __future__ import annotations

from types import SimpleNamespace

from megatron.config import parse_config, validate
from megatron.memory.model_states import parameters_per_rank
from megatron.pretrain import _axes, _parameters_shown

MOE = ["--mock-data", "--device", "cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--vocab-size", "128", "--num-experts", "4", "--global-batch-size", "4", "--micro-batch-size", "1"]


def grid(**sizes):
    axes = dict(dp_size=1, tp_size=1, pp_size=1, sharding_size=1, cp_size=1, ep_size=1, etp_size=1,
                shard_over_cp=False, shard_group_size=1)
    return SimpleNamespace(**{**axes, **sizes})


def test_every_axis_is_named():
    config = parse_config([*MOE, "--sharding", "2", "--expert-model-parallel-size", "2"])
    validate(config, world_size=2, cuda_available=False)
    want = "dp 1, tp 1, pp 1, sharding 2, ZeRO stage 1, ep 2, etp 1"
    assert _axes(grid(sharding_size=2, ep_size=2), config, 1) == want
    dense = parse_config(["--mock-data", "--device", "cpu", "--dp", "2"])
    validate(dense, world_size=2, cuda_available=False)
    assert _axes(grid(dp_size=2), dense, 1) == "dp 2, tp 1, pp 1, sharding 1"  # no experts, no ZeRO: as before


def test_under_expert_parallelism_the_whole_model_is_counted():
    config = parse_config([*MOE, "--expert-model-parallel-size", "2", "--dp", "2"])
    validate(config, world_size=2, cuda_available=False)
    whole = parameters_per_rank(config, ep=1, etp=1)
    shown = _parameters_shown(config, 1000, grid(dp_size=2, ep_size=2))
    assert shown == (f"0.00M parameters on rank 0 (tp rank 0, pipeline stage 0, ep rank 0) of {whole / 1e6:.2f}M in "
                     f"the model")
