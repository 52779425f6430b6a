"""The rank grid against hand-written tables (and Megatron Core's hierarchical cp levels)."""

import math

import numpy as np
import pytest

from megatron import parallel_state
from megatron.parallel_state import coordinates, rank_grid


def test_tp2_pp2_dp2():
    grid = rank_grid(8, tp=2, pp=2, dp=2)
    assert grid["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid["data_parallel"] == grid["dp"]
    assert grid["sharding"] == [[r] for r in range(8)]
    assert grid["model_parallel"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert grid["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_tp2_sharding2_dp2():
    grid = rank_grid(8, tp=2, dp=2, sharding=2)
    assert grid["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid["sharding"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid["data_parallel"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid["model_parallel"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid["embedding"] == [[r] for r in range(8)]


def test_tp2_cp2_dp2_is_megatrons_order():
    """tp fastest, then cp, then dp: a ring of neighbouring tp blocks; the cp ranks sum gradients with dp."""
    grid = rank_grid(8, tp=2, cp=2, dp=2)
    assert grid["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid["dp"] == grid["data_parallel"] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # dp x cp replicas
    assert grid["model_parallel"] == grid["tp"]  # the gradient norm is not summed over cp (replicas)
    assert [coordinates(r, 2, 1, 2, 1, 2)["cp"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_cp2_with_sharding2_keeps_shards_apart_from_the_ring():
    grid = rank_grid(8, tp=2, cp=2, sharding=2)
    assert grid["sharding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # ZeRO shards: same cp coordinate
    assert grid["dp"] == grid["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]  # a shard's replicas: its ring
    assert grid["data_parallel"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_tp8_pp16_is_the_seed_layout():
    grid = rank_grid(128, tp=8, pp=16)
    assert grid["tp"][0] == list(range(8))  # one node
    assert grid["pp"][0] == list(range(0, 128, 8))
    assert grid["embedding"][0] == [0, 120]
    assert len(grid["model_parallel"]) == 1


def test_coordinates_and_partitions():
    for sizes in [(2, 2, 2, 1, 1), (4, 1, 2, 1, 1), (1, 3, 2, 2, 1), (2, 2, 1, 3, 1), (2, 2, 1, 2, 2), (1, 1, 2, 1, 4)]:
        tp, pp, dp, sh, cp = sizes
        world = tp * pp * dp * sh * cp
        grid = rank_grid(world, tp, pp, dp, sh, cp)
        for name in ("tp", "cp", "pp", "dp", "sharding", "data_parallel", "model_parallel"):
            assert sorted(r for g in grid[name] for r in g) == list(range(world)), name  # a partition
        for r in range(world):
            c = coordinates(r, tp, pp, dp, sh, cp)
            assert r == c["tp"] + tp * (c["cp"] + cp * (c["sharding"] + sh * (c["dp"] + dp * c["pp"])))


def _megatron_levels(ranks: list[int], sizes: list[int]) -> list[list[list[int]]]:
    """Megatron Core's ``create_hierarchical_groups`` (its einops pattern in numpy): level i's groups are
    ``rearrange(ranks, "(l s u) -> (l u) s")``, u the product of the sizes before it, s its size, l of those after."""
    levels = []
    for i, size in enumerate(sizes):
        u, rest = math.prod(sizes[:i]), math.prod(sizes[i + 1:])  # u and l of the pattern
        levels.append(np.array(ranks).reshape(rest, size, u).transpose(0, 2, 1).reshape(rest * u, size).tolist())
    return levels


def test_hierarchical_cp_levels():
    """a2a+p2p's levels of each cp group: the inner, neighbouring cp ranks; the outer, cp ranks ``inner`` apart."""
    grid = rank_grid(4, cp=4, cp_inner=2)
    assert grid["cp_inner"] == [[0, 1], [2, 3]] and grid["cp_outer"] == [[0, 2], [1, 3]]
    grid = rank_grid(8, tp=2, cp=4, cp_inner=2)  # tp fastest: each cp group is every second rank
    assert grid["cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid["cp_inner"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid["cp_outer"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert "cp_inner" not in rank_grid(4, cp=4) and "cp_outer" not in rank_grid(4, cp=4)  # built for a2a+p2p only
    with pytest.raises(ValueError, match="must divide cp"):
        rank_grid(4, cp=4, cp_inner=3)


@pytest.mark.parametrize("sizes", [(1, 8, 1, 1, 2), (2, 4, 2, 1, 2), (1, 6, 1, 2, 3), (2, 8, 1, 1, 4), (1, 4, 2, 1, 1),
                                   (1, 4, 1, 2, 4)])
def test_hierarchical_cp_levels_are_megatron_cores(sizes):
    """Every (tp, cp, dp, pp, inner): the levels of each cp group are Megatron Core's, over every rank."""
    tp, cp, dp, pp, inner = sizes
    grid = rank_grid(tp * cp * dp * pp, tp=tp, cp=cp, dp=dp, pp=pp, cp_inner=inner)
    wanted = [_megatron_levels(ranks, [inner, cp // inner]) for ranks in grid["cp"]]
    assert grid["cp_inner"] == sorted(g for levels in wanted for g in levels[0])
    assert grid["cp_outer"] == sorted(g for levels in wanted for g in levels[1])


def test_wrong_world_size():
    with pytest.raises(ValueError):
        rank_grid(6, tp=4)


def test_single_process_state():
    state = parallel_state.get()
    assert state.world_size == 1 and state.tp_size == 1 and state.is_first_stage and state.is_last_stage
    assert state.group("tp") is None and state.data_parallel_size == 1


def test_sharded_optimizer_spans_the_cp_ranks():
    """With shard_over_cp (a sharded optimizer under cp, as Megatron-LM's distributed optimizer spans dp x cp) the
    ZeRO shard group is sharding x cp and the replicas of a shard are the dp ranks alone."""
    grid = rank_grid(8, tp=2, cp=2, sharding=2, shard_over_cp=True)
    assert grid["sharding"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid["dp"] == [[r] for r in range(8)]
    grid = rank_grid(8, tp=1, cp=2, dp=2, sharding=2, shard_over_cp=True)
    assert grid["sharding"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and grid["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_a_distributed_optimizer_at_cp_shards_over_it():
    from megatron.config import parse_config, validate

    config = parse_config(["--mock-data", "--device", "cpu", "--hidden-size", "64", "--num-attention-heads", "4",
                           "--max-seq-len", "32", "--attention-dropout", "0", "--cp", "2",
                           "--use-distributed-optimizer"])
    validate(config, world_size=4)
    assert (config.distributed.dp_degree, config.distributed.sharding.sharding_degree) == (1, 2)
    assert config.shards_over_context_parallel and config.zero_shards == 4
    plain = parse_config(["--mock-data", "--device", "cpu", "--hidden-size", "64", "--num-attention-heads", "4",
                          "--max-seq-len", "32", "--attention-dropout", "0", "--cp", "2"])
    validate(plain, world_size=4)
    assert not plain.shards_over_context_parallel and plain.zero_shards == 1  # no sharding asked: cp ranks replicas


def test_experts_fold_over_the_ranks_of_a_stage():
    """Megatron-LM's MoE parallel folding: within a pipeline stage the tp x cp x dp ranks are re-cut as
    etp x ep x edp, etp fastest."""
    grid = rank_grid(8, tp=2, dp=4, ep=2, etp=1)
    assert grid["etp"] == [[r] for r in range(8)]
    assert grid["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # etp 1 under tp 2: a tp pair holds different experts
    assert grid["edp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid["ep_etp"] == grid["ep"]
    grid = rank_grid(8, tp=2, dp=2, pp=2, ep=2)  # etp defaults to tp
    assert grid["etp"] == grid["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]  # never across pipeline stages
    assert grid["edp"] == [[0], [1], [2], [3], [4], [5], [6], [7]]
    assert grid["ep_etp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rank_grid(4, cp=2, dp=2, ep=4)["ep"] == [[0, 1, 2, 3]]  # the context-parallel ranks hold experts too
    assert rank_grid(4, tp=2, cp=2)["tp_cp"] == [[0, 1, 2, 3]]


@pytest.mark.parametrize("sizes", [dict(tp=2, dp=2, ep=2), dict(dp=4, ep=4), dict(tp=2, cp=2, dp=2, ep=2, etp=1),
                                   dict(tp=4, dp=2, pp=2, ep=2, etp=2), dict(sharding=2, dp=2, ep=2)])
def test_every_expert_group_partitions_the_ranks(sizes):
    world = 1
    for key in ("tp", "cp", "dp", "pp", "sharding"):
        world *= sizes.get(key, 1)
    grid = rank_grid(world, **sizes)
    ep, etp = sizes["ep"], sizes.get("etp", sizes.get("tp", 1))
    expected = {"etp": etp, "ep": ep, "ep_etp": ep * etp, "edp": world // sizes.get("pp", 1) // (ep * etp)}
    for name, size in expected.items():
        assert sorted(r for g in grid[name] for r in g) == list(range(world)) and {len(g) for g in grid[name]} == {size}


def test_experts_must_divide_a_stage():
    with pytest.raises(ValueError, match="does not divide the 4 ranks of a pipeline stage"):
        rank_grid(8, tp=2, dp=2, pp=2, ep=3, etp=1)
