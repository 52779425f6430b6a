"""The layout planner's search (megatron/planner/, tools/plan_layout.py): every row's name and its flags describe
one layout (the configuration the flags make, through the real parser and validate, has the row's tp, cp, pp,
vpp, dp, sharding, offload, recompute, micro-batch, ep and etp); the shared validation gives the plans validating
each candidate gives; offload is costed (the CPU's AdamW, PCIe, the host's memory per node); --only / --exclude /
--no-offload / --no-cp; the planner_*.yaml flavour configurations. No model is built."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron.config import parse_config, validate
from megatron.distributed.sharding_rule import sharding_stage
from megatron.memory import estimate
from megatron.memory.model_states import rank_model_state_bytes
from megatron.planner import (
    GIB,
    Hardware,
    Layout,
    evaluate_layout,
    layout_config,
    layout_filters,
    plan_layouts,
)
from tests.functional.launch import program_module
from tests.unit.test_plan_layout import SMALL

ROOT = Path(__file__).resolve().parents[2]
EXPERTS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64"]
LONG = ["--max-seq-len", "4096", "--max-position-embeddings", "4096", "--attention-probs-dropout-prob", "0"]


plan_layout = program_module("tools/plan_layout.py")


def _name_axes(name: str) -> dict:
    """The layout a row's name (``tp2 cp2:p2p pp2 vpp2 dp1 ep2 etp1 zero3x2 offload mb1 rc:block2``) says."""
    axes = {"tp": None, "cp": 1, "cp_comm": None, "pp": None, "vpp": 1, "dp": None, "sharding": 1, "zero": None,
            "offload": False, "recompute": "off", "mb": None, "ep": 1, "etp": None}
    for token in name.split():
        if m := re.fullmatch(r"cp(\d+):(\w+)", token):
            axes["cp"], axes["cp_comm"] = int(m[1]), m[2]
        elif m := re.fullmatch(r"zero(\d)x(\d+)", token):
            axes["zero"], axes["sharding"] = int(m[1]), int(m[2])
        elif m := re.fullmatch(r"rc:(\w+)", token):
            axes["recompute"] = m[1]
        elif token == "offload":
            axes["offload"] = True
        elif m := re.fullmatch(r"(tp|pp|vpp|dp|mb|ep|etp)(\d+)", token):
            axes[m[1]] = int(m[2])
        else:
            raise AssertionError(f"unknown token {token!r} in {name!r}")
    axes["etp"] = axes["etp"] or axes["tp"]
    return axes


def _config_axes(config) -> dict:
    """The same axes read from a validated configuration."""
    d = config.distributed
    n = d.sharding.sharding_degree
    recompute = "off"
    if config.use_recompute:
        recompute = (f"block{config.recompute_num_layers}" if config.recompute_method == "block"
                     else config.recompute_granularity)
    return {"tp": d.mp_degree, "cp": d.context_parallel_size,
            "cp_comm": d.cp_comm_type if d.context_parallel_size > 1 else None, "pp": d.pp_degree,
            "vpp": d.virtual_pp_degree, "dp": d.dp_degree, "sharding": n,
            "zero": sharding_stage(n, d.sharding.sharding_stage) if n > 1 else None,
            "offload": d.sharding.sharding_offload, "recompute": recompute, "mb": config.batch_size.micro_batch_size,
            "ep": d.expert_model_parallel_size, "etp": d.expert_tensor_parallel_size or d.mp_degree}


@pytest.mark.parametrize("argv,devices", [(SMALL, 4), (SMALL + EXPERTS, 4), (SMALL + LONG, 4)],
                         ids=["dense", "moe", "cp"])
def test_every_rows_flags_make_the_layout_its_name_says(argv, devices, capsys):
    """Every row the tool lists (--all: the hidden ones too), its name against its flags given after the
    configuration's own, parsed and validated as pretrain_gpt.py would (before: ``zero3x8`` named --sharding 2
    under cp 4)."""
    cli = argv + ["--devices", str(devices), "--device-memory-gb", "1000", "--max-micro-batch", "1", "--all",
                  "--top", "100000", "--json", "--no-progress"]
    assert plan_layout.main(cli) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert len(rows) >= 10
    for row in rows:
        config = parse_config(argv + ["--device", "gpu", *row["layout"]["flags"].split()])
        validate(config, world_size=devices, cuda_available=True, training_data=False)
        assert _config_axes(config) == _name_axes(row["layout"]["name"]), (row["layout"]["name"],
                                                                          row["layout"]["flags"])
    names = " | ".join(row["layout"]["name"] for row in rows)
    assert argv is not SMALL + LONG or re.search(r"cp2:\w+ [^|]*zero\dx2", names)  # the names got these wrong
    assert argv is not SMALL + EXPERTS or re.search(r" ep[24] ", names)


@pytest.mark.parametrize("argv,devices,memory", [(SMALL + ["--global-batch-size", "12"], 6, 0.002),
                                                 (SMALL + EXPERTS, 4, 0.002), (SMALL + LONG, 4, 0.1)],
                         ids=["dense", "moe", "cp"])
def test_shared_validation_gives_the_plans_validating_each_layout_gives(argv, devices, memory):
    """The search validates one layout per validation key and derives its stage, offload and recompute variants
    (search.variant_config); validating every candidate gives the same plans, counts and smallest layout; and so
    does the search shared among two processes (planner.workers: each its own caches and pruning bound)."""
    hw = Hardware(devices=devices, devices_per_node=devices, device_memory_gb=memory)
    shared, each, forked = (plan_layouts(parse_config(argv), hw, max_micro_batch=2, share_validation=s, jobs=j)
                            for s, j in ((True, 1), (False, 1), (True, 2)))
    for other in (each, forked):
        assert other.plans == shared.plans and other.smallest == shared.smallest
        assert (other.considered, other.valid, other.host_rejected) == (shared.considered, shared.valid,
                                                                        shared.host_rejected)
    assert shared.plans and shared.valid > len(shared.plans)  # some fit, some do not
    assert devices != 6 or shared.considered > shared.valid  # tp 3 and 6 do not divide the heads
    for plan in shared.plans[::7]:  # the run's caches change no figure: each layout alone, nothing cached
        assert evaluate_layout(parse_config(argv), plan.layout, hw) == plan


def test_the_searchs_cached_figures_are_the_estimators():
    """The search caches a chunk's activations by its shape, a stage's temporary by the set of its chunks' shapes
    and the schedule's walk by the chunk bytes' ratio (planner.memory): every fitting layout's memory is still
    ``megatron.memory.estimate``'s at its worst stage, pipelines of several depths and interleavings, experts and
    block recompute among them."""
    argv = SMALL + EXPERTS + ["--num-layers", "8", "--global-batch-size", "16"]
    hw = Hardware(devices=8, devices_per_node=8, device_memory_gb=1000)
    result = plan_layouts(parse_config(argv), hw, max_micro_batch=2, max_vpp=4)
    assert {(p.layout.pp, p.layout.vpp) for p in result.plans} >= {(2, 2), (2, 4), (4, 2), (8, 1)}
    for plan in result.plans[::5]:
        config = layout_config(parse_config(argv), plan.layout, 8)
        worst = max((estimate(config, s) for s in range(plan.layout.pp)), key=lambda e: e.total)
        assert (plan.memory.total, plan.memory.activations, plan.memory.temporaries) == (
            worst.total, worst.activations, worst.temporaries), plan.layout.describe()


def test_offload_counts_the_cpu_adamw_pcie_and_the_hosts_memory():
    """Under offload the step adds the CPU AdamW over the rank's offloaded shard (its dense parameters over the
    ZeRO group, its experts over the expert-data-parallel ranks) at the Hardware's rate, and 8 bytes per parameter
    of it over PCIe; the host keeps 16 bytes per parameter per rank, times the ranks of a node."""
    base = parse_config(SMALL + EXPERTS)
    hw = Hardware(devices=4, devices_per_node=4, device_memory_gb=1000, cpu_cores_per_device=2,
                  cpu_adam_gparams_per_core=1e-6)  # 2000 parameters per second: a visible term
    layout = Layout(1, 1, 1, 1, 4, 2, True, "off", 2, ep=4, moe=True)
    plan = evaluate_layout(base, layout, hw)
    config = layout_config(base, layout, 4)
    states = rank_model_state_bytes(config)
    shard = states.master_weights // 4
    assert states.cpu_total == 16 * shard and plan.memory.host == states.cpu_total
    assert plan.host_per_node == 4 * states.cpu_total
    assert plan.time.cpu_optimizer == pytest.approx(shard / 2000)
    assert plan.time.offload == pytest.approx(8 * shard / 12e9)
    whole = evaluate_layout(base, Layout(1, 1, 1, 1, 4, 2, False, "off", 2, ep=4, moe=True), hw)
    assert plan.time.step == pytest.approx(whole.time.step + plan.time.offload + plan.time.cpu_optimizer)
    assert whole.time.cpu_optimizer == 0 and whole.host_per_node == 0
    small_host = Hardware(devices=4, devices_per_node=4, device_memory_gb=1000,
                          host_memory_gb=plan.host_per_node / GIB)  # less the 10% headroom: too little
    refused = evaluate_layout(base, layout, small_host)
    assert not refused.fits and "host memory per node" in refused.reason and "--host-memory-gb" in refused.reason
    result = plan_layouts(base, small_host, max_micro_batch=1)
    assert result.host_rejected > 0 and not any(p.layout.offload for p in result.plans)


def test_cli_shows_the_host_memory_and_refuses_what_the_host_cannot_hold(capsys):
    argv = SMALL + ["--devices", "2", "--device-memory-gb", "1000", "--max-micro-batch", "1", "--no-progress",
                    "--only", "offload=on", "--top", "3"]
    assert plan_layout.main(argv) == 0
    out = capsys.readouterr().out
    assert " host " in out and "cpu opt" in out and "host 1024 GiB per node" in out
    row = next(line for line in out.splitlines() if line.startswith("  1  "))
    assert " offload " in row and re.search(r" \d+\.\d  +\d", row)  # the host column: a figure, not "-"
    assert plan_layout.main(argv + ["--host-memory-gb", "0.000001"]) == 1
    out = capsys.readouterr().out
    assert "more fit their devices but not the host's memory" in out
    assert "no layout fits: the smallest on the devices" in out and "--host-memory-gb" in out


def test_only_exclude_no_offload_no_cp_narrow_the_search(capsys):
    base = parse_config(SMALL + LONG)
    hw = Hardware(devices=4, devices_per_node=4, device_memory_gb=1000)
    every = plan_layouts(base, hw, max_micro_batch=2)
    assert {p.layout.offload for p in every.plans} == {False, True} and {p.layout.cp for p in every.plans} > {1}
    narrow = plan_layouts(base, hw, max_micro_batch=2, filters=layout_filters(
        only=["tp=1,2", "recompute=off,full"], exclude=["zero=3", "mb=1"], no_offload=True, no_cp=True))
    assert narrow.plans and narrow.considered < every.considered
    for plan in narrow.plans:
        lay = plan.layout
        assert lay.tp in (1, 2) and lay.recompute in ("off", "full") and lay.zero != 3 and lay.micro_batch_size == 2
        assert not lay.offload and lay.cp == 1
    assert {p.layout for p in narrow.plans} == {p.layout for p in every.plans if p.layout in
                                                {q.layout for q in narrow.plans}}
    comm = plan_layouts(base, hw, max_micro_batch=1, filters=layout_filters(only=["cp-comm=a2a", "cp=2"]))
    assert {(p.layout.cp, p.layout.cp_comm) for p in comm.plans} == {(2, "a2a")}
    argv = SMALL + ["--devices", "2", "--no-progress"]
    assert plan_layout.main(argv + ["--only", "tpp=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown axis 'tpp'" in err
    assert "the axes are tp, cp, cp-comm, pp, vpp, dp, sharding, zero, offload, recompute, mb, ep, etp." in err
    assert plan_layout.main(argv + ["--exclude", "recompute=some"]) == 2
    assert "recompute takes off, core_attn, only_attn, full, block" in capsys.readouterr().err
    assert plan_layout.main(argv + ["--only", "tp"]) == 2
    assert "--only takes AXIS=V1,V2" in capsys.readouterr().err
    assert plan_layout.main(argv + ["--only", "tp=3"]) == 2  # nothing left: one line, what to do
    assert "let through is a valid run: widen them." in capsys.readouterr().err
    assert plan_layout.main(argv + ["--no-offload", "--top", "2"]) == 0
    assert " candidates (--exclude offload=on), " in capsys.readouterr().out


FLAVOURS = {  # config: (devices, filters keeping the search to a second)
    "planner_mixtral_8x7b.yaml": (8, ["--only", "tp=1", "--only", "pp=1", "--only", "cp=2", "--only", "mb=1"]),
    "planner_llama3_8b.yaml": (8, ["--only", "pp=1", "--only", "cp=1", "--only", "mb=1", "--only", "tp=1,2"]),
    "planner_llama3_70b.yaml": (64, ["--only", "tp=8", "--only", "pp=4", "--only", "cp=1", "--only", "mb=1",
                                     "--only", "vpp=1", "--only", "zero=1", "--only", "recompute=off,full"]),
    "planner_deepseek_v3.yaml": (256, ["--only", "tp=1", "--only", "pp=16", "--only", "cp=1", "--only", "mb=1",
                                       "--only", "vpp=1", "--only", "ep=16", "--only", "zero=1",
                                       "--only", "recompute=full"]),
}


@pytest.mark.parametrize("name", sorted(FLAVOURS))
def test_the_flavour_configs_parse_and_plan(name, capsys):
    """examples/configs/planner_*.yaml: the real parser and validate take each, and the planner finds layouts
    that fit on a sensible number of 80 GB devices (the search narrowed to keep the test short)."""
    devices, narrow = FLAVOURS[name]
    path = str(ROOT / "examples" / "configs" / name)
    config = parse_config(["-c", path])
    validate(config, world_size=1, cuda_available=True, training_data=False)
    assert plan_layout.main(["-c", path, "--devices", str(devices), "--no-progress", "--json", *narrow]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fit"] >= 1 and data["layouts"][0]["fits"]
    assert (data["layouts"][0]["layout"]["ep"] > 1) == bool(config.model.num_experts)


def test_the_worker_processes_cover_every_slice_once_and_a_failure_is_raised_not_lost():
    """planner.workers: the slices join whole blocks and cover them in order; ``map_slices`` returns every
    slice's result in slice order from forked processes (each told the results before it that it computed); a
    process that fails raises in the parent with its traceback, and no process is left behind."""
    import multiprocessing

    from megatron.planner import workers

    blocks = [(0, 3), (3, 4), (4, 10), (10, 11), (11, 20), (20, 21)]
    slices = workers.group(blocks, 3)
    assert [b for s in slices for b in blocks if s[0] <= b[0] and b[1] <= s[1]] == blocks
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:])) and slices[0][0] == 0 and slices[-1][1] == 21
    many = [(k, k + 1) for k in range(40)]
    seen = []
    results = workers.map_slices(lambda start, stop, before: (start, [r[0] for r in before]), many, 2,
                                 done=seen.append)
    assert [r[0] for r in results] == list(range(40)) and sum(seen) == 40
    assert all(earlier == sorted(earlier) and set(earlier) <= set(range(start)) for start, earlier in results)

    def fail(start, stop, before):
        if start == 17:
            raise ValueError("slice 17 is bad")
        return start

    before = set(multiprocessing.active_children())  # the suite's own pools are not the planner's
    with pytest.raises(RuntimeError, match="slice 17 is bad"):
        workers.map_slices(fail, many, 2)
    assert set(multiprocessing.active_children()) <= before
