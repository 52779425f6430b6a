"""tools/plan_layout.py and megatron/planner.py: only valid layouts, the memory side is the estimator's (and
memory.py's model states), layouts over the limit are dropped, the time terms move the way the model says,
the seed's 1.3B single-card case, the CLI's table, --json and errors. No model is built."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.config import ConfigError, parse_config, validate
from megatron.memory import estimate
from megatron.memory.activations import in_flight_at_peak
from megatron.memory.model_states import model_state_bytes, parameters_per_rank
from megatron.planner import (
    GIB,
    Hardware,
    Layout,
    configured_layout,
    layout_config,
    layout_memory,
    layout_time,
    non_dominated,
    plan_layouts,
    walked_micro_batches,
)
from tests.functional.launch import program_module

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--max-seq-len", "32", "--max-position-embeddings", "32", "--vocab-size", "512", "--global-batch-size", "8",
         "--micro-batch-size", "8", "--bf16"]


plan_layout = program_module("tools/plan_layout.py")


def _base(argv: list[str]):
    return parse_config(argv)


def test_only_layouts_that_validate_are_listed():
    base = _base(SMALL + ["--global-batch-size", "12"])
    hw = Hardware(devices=6, devices_per_node=6, device_memory_gb=1000)
    result = plan_layouts(base, hw)
    assert result.plans and len(result.plans) == result.valid < result.considered
    for plan in result.plans:
        validate(plan.layout.apply(base), world_size=6, cuda_available=True, training_data=False)
    assert not any(p.layout.tp in (3, 6) for p in result.plans)  # 4 heads: tp 3 or 6 is refused
    with pytest.raises(ConfigError, match="must divide Model.num_attention_heads"):
        layout_config(base, Layout(3, 1, 1, 2, 1, 1, False, "off", 2, True), 6)
    assert {p.layout.tp for p in result.plans} == {1, 2}
    assert {p.layout.pp for p in result.plans} == {1, 2, 3}  # 3 stages of 4 layers: 2, 1, 1


def test_memory_is_the_estimators_worst_stage_and_memory_py_model_states():
    base = _base(SMALL)
    hw = Hardware(devices=4, devices_per_node=4, device_memory_gb=1000)
    layout = Layout(1, 2, 1, 1, 2, 2, False, "off", 2)  # pp 2 x sharding 2 (stage 2), 2 micro-batches
    config = layout_config(base, layout, 4)
    memory = layout_memory(config, hw.memory_bytes)
    per_stage = [estimate(config, s) for s in range(2)]
    worst = max(range(2), key=lambda s: per_stage[s].total)
    assert (memory.stage, memory.total) == (worst, per_stage[worst].total)
    assert (memory.activations, memory.temporaries) == (per_stage[worst].activations, per_stage[worst].temporaries)
    assert memory.model_states == per_stage[worst].model_states  # between steps + stage 2's full gradients
    n = parameters_per_rank(config, 1, 2, worst)  # what tools/estimate_memory.py prints as "device"
    assert per_stage[worst].model_states_between_steps == model_state_bytes(n, "bf16", 2, 2).device_total
    assert memory.model_states > model_state_bytes(n, "bf16", 2, 2).device_total
    listed = [p for p in plan_layouts(base, hw).plans if p.layout == layout]
    assert listed and listed[0].memory == memory


def test_a_layout_over_the_limit_is_excluded():
    base = _base(SMALL)
    everything = plan_layouts(base, Hardware(devices=2, devices_per_node=2, device_memory_gb=1000)).plans
    largest = max(everything, key=lambda p: p.memory.total)
    hw = Hardware(devices=2, devices_per_node=2, device_memory_gb=(largest.memory.total - 1) / GIB / 0.9)
    assert hw.memory_bytes == pytest.approx(largest.memory.total - 1)  # less the 10% headroom
    kept = plan_layouts(base, hw).plans
    assert largest.layout not in {p.layout for p in kept}
    assert kept and all(p.memory.total <= hw.memory_bytes for p in kept)
    assert len(kept) < len(everything)
    shown = non_dominated(kept)
    assert set(shown) <= set(kept) and len(shown) < len(kept)
    for plan in kept:  # each hidden layout is beaten or equalled on time, memory and micro-batch by one shown
        assert plan in shown or any(
            s.time.step <= plan.time.step and round(s.memory.total / GIB, 1) <= round(plan.memory.total / GIB, 1)
            and s.layout.micro_batch_size >= plan.layout.micro_batch_size for s in shown)


def test_interleaved_peak_is_walked_on_a_shorter_schedule():
    """walked_micro_batches: the schedule walk on fewer micro-batches finds the same held sets."""
    base = _base(SMALL + ["--num-layers", "12", "--micro-batch-size", "1"])
    for pp, vpp in ((2, 2), (2, 3), (3, 2), (4, 3)):
        for m in range(pp, 10 * pp + 1, pp):
            base.batch_size.global_batch_size = m
            config = layout_config(base, Layout(1, pp, vpp, 1, 1, 1, False, "off", 1), pp)
            walked = walked_micro_batches(config)
            if walked == m:
                continue
            short = layout_config(dataclasses.replace(base, batch_size=dataclasses.replace(
                base.batch_size, global_batch_size=walked)), Layout(1, pp, vpp, 1, 1, 1, False, "off", 1), pp)
            for stage in range(pp):
                for weights in ([1] * vpp, [5] + [1] * (vpp - 1), [1] * (vpp - 1) + [7], list(range(1, vpp + 1))):
                    assert in_flight_at_peak(config, stage, weights) == in_flight_at_peak(short, stage, weights)


def test_ranking_follows_the_documented_terms():
    base = _base(SMALL + ["--num-layers", "8", "--global-batch-size", "64"])
    hw = Hardware(devices=16, devices_per_node=8, device_memory_gb=1000)
    dp16 = layout_config(base, Layout(1, 1, 1, 16, 1, 1, False, "off", 4), 16)
    slow, fast = layout_time(dp16, hw), layout_time(dp16, dataclasses.replace(hw, inter_node_gbps=25.0))
    assert fast.dp_comm == pytest.approx(slow.dp_comm / 2) and fast.dp_exposed < slow.dp_exposed
    assert fast.step < slow.step
    within = layout_config(base, Layout(1, 1, 1, 8, 1, 1, False, "off", 4), 8)  # one node: NVLink only
    assert layout_time(within, dataclasses.replace(hw, devices=8)).dp_comm < slow.dp_comm
    few, many = (layout_time(layout_config(base, Layout(1, 2, 1, 8, 1, 1, False, "off", mb), 16), hw)
                 for mb in (4, 1))
    assert (few.micro_batches, many.micro_batches) == (2, 8)  # (pp - 1) / m of the stage's time
    assert many.bubble == pytest.approx((many.compute + many.tp_comm) / 8) and many.bubble < few.bubble
    vpp = layout_time(layout_config(base, Layout(1, 2, 2, 8, 1, 1, False, "off", 1), 16), hw)
    assert vpp.bubble == pytest.approx(many.bubble / 2)
    full = layout_time(layout_config(base, Layout(1, 1, 1, 16, 1, 1, False, "full", 4), 16), hw)
    assert 1.25 < full.hardware_flops / full.model_flops <= 4 / 3 and full.compute > slow.compute
    offload = layout_time(layout_config(base, Layout(1, 1, 1, 2, 8, 2, True, "off", 4), 16), hw)
    assert offload.offload > 0 and slow.offload == 0


def test_seed_1_3b_single_card_needs_recompute_on_a_32_gb_v100():
    base = _base(["-c", str(ROOT / "examples/configs/gpt_1.3b_single_card.yaml")])
    hw = Hardware(devices=1, devices_per_node=1, device_memory_gb=32, peak_tflops=125)
    result = plan_layouts(base, hw)
    seed = Layout(1, 1, 1, 1, 1, 1, False, "full", 8)  # FleetX: fp16 + recompute, 26.0GB
    assert seed in {p.layout for p in result.plans}
    assert any(p.layout.recompute != "off" for p in result.plans)
    assert not any(p.layout.recompute == "off" and p.layout.micro_batch_size == 8 and not p.layout.offload
                   for p in result.plans)
    assert base.mix_precision.use_pure_fp16
    assert seed not in {p.layout for p in non_dominated(result.plans)[:8]}  # faster layouts exist in the model


def test_cli_prints_the_table_and_json(capsys):
    argv = SMALL + ["--micro-batch-size", "2", "--devices", "4", "--device-memory-gb", "16", "--top", "3"]
    assert plan_layout.main(argv) == 0
    out = capsys.readouterr().out
    assert "an estimate, not a measurement" in out and "step" in out
    rows = [line for line in out.splitlines() if line.strip()[:2] in ("1 ", "2 ", "3 ")]
    assert len(rows) == 3 and all(" tp" in r for r in rows)
    assert plan_layout.main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [entry["rank"] for entry in data["layouts"]] == [1, 2, 3]
    first = data["layouts"][0]
    assert set(first["time"]) >= {"compute", "tp_comm", "dp_exposed", "bubble", "p2p", "offload", "step"}
    assert first["memory"]["total"] <= 16 * GIB * 0.9 and data["hardware"]["devices"] == 4
    assert data["configured"]["layout"]["name"] == "tp1 pp1 dp4 mb2" and data["configured"]["rank"] >= 1


_WITHOUT_TORCH = """
import runpy, sys

class NoTorch:  # any import of torch fails: the planner must not need it
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"the layout planner imported {name}")

sys.meta_path.insert(0, NoTorch())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_the_planner_runs_without_importing_torch():
    """torch's import is ~2 s of the planner's start-up, and forking the search's workers with it loaded costs
    more: the planner, the memory estimate and the rules they read (``sharding_rule``, ``layer_split``,
    ``attention.tiling``, ``hardware``) are standard library only."""
    argv = SMALL + ["--devices", "4", "--device-memory-gb", "16", "--top", "2", "--no-progress"]
    done = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, str(ROOT / "tools/plan_layout.py"), *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "an estimate, not a measurement" in done.stdout


def test_the_seeds_config_is_estimate_memorys_figure(capsys):
    config = ["-c", str(ROOT / "examples/configs/gpt_1.3b_single_card.yaml")]
    assert plan_layout.main(config + ["--devices", "1", "--device-memory-gb", "32", "--json"]) == 0
    total = json.loads(capsys.readouterr().out)["configured"]["memory"]["total"]
    spec = importlib.util.spec_from_file_location("estimate_memory", ROOT / "tools" / "estimate_memory.py")
    estimate_memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(estimate_memory)
    assert estimate_memory.main(config) == 0
    assert f" {total / GIB:.2f}\n" in capsys.readouterr().out  # its stage-0 total


def test_cli_places_the_configurations_own_layout(capsys):
    assert plan_layout.main(SMALL + ["--devices", "1", "--device-memory-gb", "16"]) == 0
    assert "the configuration's own layout, tp1 pp1 dp1 mb8: " in capsys.readouterr().out
    assert plan_layout.main(SMALL + ["--dp", "2", "--micro-batch-size", "4", "--devices", "4"]) == 0
    assert "is not a run on 4 device(s)" in capsys.readouterr().out


def test_cli_errors_and_no_fit(capsys):
    assert plan_layout.main(SMALL + ["--devices", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--devices must be at least 1" in err
    assert plan_layout.main(SMALL + ["--devices", "2", "--gpu", "Z9"]) == 2
    assert "unknown GPU" in capsys.readouterr().err
    assert plan_layout.main(SMALL + ["--devices", "2", "--no-such-flag"]) == 2
    assert plan_layout.main(SMALL + ["--devices", "2", "--device-memory-gb", "0.0001"]) == 1
    out = capsys.readouterr().out
    assert "no layout fits in 0.0 GiB per device (0.0001 less the headroom): the smallest requirement is" in out
    assert "more devices" in out


# ---------------------------------------------------------------------------- context parallelism

NO_ATTENTION_DROPOUT = ["--attention-probs-dropout-prob", "0"]
LLAMA_7B = ["-c", str(ROOT / "examples/configs/llama_7b.yaml"), "--global-batch-size", "16"]


def _long(seq: int):
    return _base(LLAMA_7B + ["--max-seq-len", str(seq), "--max-position-embeddings", str(seq)])


def test_context_parallel_candidates_are_valid_runs():
    """cp divides the devices, 2 x cp (x tp under sp) the sequence, each rank keeps at least MIN_CP_TOKENS of
    it; a2a only where tp x cp divides the heads, p2p and all_gather with attention dropout too; the
    flags of a layout (printed under the table) run it."""
    long = ["--max-seq-len", "8192", "--max-position-embeddings", "8192"]
    argv = SMALL + NO_ATTENTION_DROPOUT + long  # 4 heads
    hw = Hardware(devices=8, devices_per_node=8, device_memory_gb=1000)
    result = plan_layouts(_base(argv), hw, max_micro_batch=2, max_vpp=1)
    kinds = {(p.layout.cp, p.layout.cp_comm) for p in result.plans}
    assert kinds == {(1, "p2p"), (2, "p2p"), (2, "all_gather"), (2, "a2a"), (4, "p2p"), (4, "all_gather"),
                     (4, "a2a"), (8, "p2p"), (8, "all_gather")}
    for plan in result.plans:
        lay = plan.layout
        assert lay.tp * lay.cp * lay.pp * lay.dp * lay.sharding_degree == 8
        assert lay.cp == 1 or 8192 % (2 * lay.cp * (lay.tp if lay.sequence_parallel else 1)) == 0
        assert lay.cp_comm != "a2a" or 4 % (lay.tp * lay.cp) == 0
    for plan in result.plans[::7]:  # the flags printed for a layout run that layout
        config = parse_config(argv + ["--device", "gpu", *plan.layout.flags().split()])
        validate(config, world_size=8, cuda_available=True, training_data=False)
        assert configured_layout(config) == plan.layout
    with pytest.raises(ConfigError, match="--cp-comm-type a2a gives each context-parallel rank whole heads"):
        layout_config(_base(argv), Layout(2, 1, 1, 1, 1, 1, False, "off", 2, True, 0, 4, "a2a"), 8)
    dropout = plan_layouts(_base(SMALL + long), hw, max_micro_batch=1, max_vpp=1)  # attention dropout 0.1
    assert {p.layout.cp_comm for p in dropout.plans if p.layout.cp > 1} == {"p2p", "all_gather", "a2a"}
    short = plan_layouts(_base(SMALL + NO_ATTENTION_DROPOUT), hw, max_micro_batch=1, max_vpp=1)  # 32 tokens
    assert {p.layout.cp for p in short.plans} == {1}


def test_context_parallel_memory_is_the_estimators_for_s_over_cp_tokens():
    base = _base(SMALL + NO_ATTENTION_DROPOUT)
    config = layout_config(base, Layout(1, 1, 1, 1, 1, 1, False, "off", 8, False, 0, 2, "p2p"), 2)
    memory, e = layout_memory(config, float("inf")), estimate(config, 0)
    assert (memory.activations, memory.temporaries, memory.total) == (e.activations, e.temporaries, e.total)
    whole = layout_memory(layout_config(base, Layout(1, 1, 1, 1, 1, 1, False, "off", 8), 1), float("inf"))
    assert memory.activations <= 0.55 * whole.activations
    assert memory.model_states == whole.model_states  # the cp ranks hold the whole model, as replicas


def test_context_parallel_time_terms():
    """tp comm and compute per device follow s / cp; a2a's 8 all-to-alls and all_gather's gathers and
    reduce-scatter are counted whole, p2p's ring only where it exceeds the attention it overlaps; the cp
    ranks' gradient all-reduce is data-parallel traffic."""
    base = _base(SMALL + NO_ATTENTION_DROPOUT + ["--num-layers", "8", "--global-batch-size", "16"])
    hw = Hardware(devices=4, devices_per_node=4, device_memory_gb=1000)

    def time(tp, cp, comm="p2p"):
        return layout_time(layout_config(base, Layout(tp, 1, 1, 1, 1, 1, False, "off", 4, tp > 1, 0, cp, comm),
                                         tp * cp), hw)

    alone, split = time(2, 1), time(2, 2)
    assert split.tp_comm == pytest.approx(alone.tp_comm / 2) and split.compute == pytest.approx(alone.compute / 2)
    assert alone.cp_comm == 0 and alone.dp_comm == 0 and split.dp_comm > 0
    kv = 2 * 4 * 16 * (4 // 2) * 16 * 2  # 2 b (s / cp) (ng / tp) hd a
    q, bandwidth, steps = kv / 2, 150e9, 4 * 8  # 4 micro-batches of 8 layers
    assert time(2, 2, "a2a").cp_comm == pytest.approx(steps * 2 * (1 / 2) * (2 * q + kv) / bandwidth)
    assert time(2, 2, "all_gather").cp_comm == pytest.approx(steps * (kv + kv + 4 * kv / 2) / bandwidth)
    ring = split.cp_comm  # a tiny model: its attention hides only part of the ring's transfers
    assert 0 < ring < steps * (kv + kv + 2 * 4 * kv / 2) / bandwidth
    long = _long(32768)
    hidden = layout_time(layout_config(long, Layout(4, 1, 1, 1, 1, 1, False, "full", 1, True, 0, 2, "p2p"), 8),
                         Hardware(devices=8))
    assert hidden.cp_comm == 0  # 16384 tokens of attention per rank hide the ring


@pytest.mark.parametrize("seq", [32768, 131072])
def test_the_planner_proposes_context_parallelism_for_long_sequences(seq):
    """A Llama 7B at 32K / 128K tokens on 8 80 GB GPUs: the best layout splits the sequence (less tp traffic
    than tp alone for the same memory), faster than every layout without cp."""
    result = plan_layouts(_long(seq), Hardware(devices=8, device_memory_gb=80), max_micro_batch=1, max_vpp=1)
    best = result.plans[0]
    assert best.layout.cp > 1
    assert best.time.step < min(p.time.step for p in result.plans if p.layout.cp == 1)


def test_context_parallelism_fits_where_tensor_parallelism_alone_does_not():
    """512K tokens on 16 40 GB GPUs, 8 per node: tp stops at a node, and no layout without cp fits."""
    result = plan_layouts(_long(524288), Hardware(devices=16, devices_per_node=8, device_memory_gb=40),
                          max_micro_batch=1, max_vpp=1)
    assert result.plans and all(p.layout.cp > 1 for p in result.plans)


def test_cli_prints_cp_and_its_flags(capsys):
    argv = LLAMA_7B + ["--max-seq-len", "131072", "--max-position-embeddings", "131072", "--devices", "8",
                       "--max-micro-batch", "1", "--max-vpp", "1", "--top", "3"]
    assert plan_layout.main(argv) == 0
    out = capsys.readouterr().out
    assert "cp comm" in out
    rows = [line for line in out.splitlines() if line.strip()[:2] in ("1 ", "2 ", "3 ")]
    cp, comm = re.search(r" cp(\d+):(\w+) ", rows[0]).groups()  # the top layout splits the sequence
    flags = next(line for line in out.splitlines() if line.startswith("flags of #1: ")).removeprefix("flags of #1: ")
    assert f"--context-parallel-size {cp} --cp-comm-type {comm}" in flags
    config = parse_config(LLAMA_7B + ["--max-seq-len", "131072", "--max-position-embeddings", "131072",
                                      *flags.split()])
    validate(config, world_size=8, cuda_available=True, training_data=False)
    assert rows[0].split(None, 1)[1].startswith(configured_layout(config).describe() + " ")  # the flags run #1
    assert plan_layout.main(argv + ["--json"]) == 0
    first = json.loads(capsys.readouterr().out)["layouts"][0]["layout"]
    assert (first["cp"], first["cp_comm"], first["flags"]) == (int(cp), comm, flags)


def test_cli_places_a_context_parallel_configuration(capsys):
    assert plan_layout.main(SMALL + NO_ATTENTION_DROPOUT + ["--cp", "2", "--cp-comm-type", "all_gather", "--dp", "1",
                                                           "--devices", "2", "--device-memory-gb", "16"]) == 0
    assert "the configuration's own layout, tp1 cp2:all_gather pp1 dp1 mb8: " in capsys.readouterr().out


def test_the_flags_of_a_layout_turn_off_what_the_configuration_turns_on():
    """Given after a configuration that recomputes, shards 8-way with offload, pipelines with vpp and uses sequence
    parallelism, the flags of every proposed layout run that layout (before: a layout without recompute or
    sharding printed no flag for it, and the configuration's own setting stayed)."""
    argv = SMALL + ["--use-recompute", "--recompute-granularity", "full", "--sharding", "8", "--sharding-offload",
                    "--tp", "2", "--sequence-parallel", "--pp", "2", "--vpp", "2"]
    hw = Hardware(devices=8, devices_per_node=8, device_memory_gb=1000)
    result = plan_layouts(_base(argv), hw, max_micro_batch=2)
    assert "off" in {p.layout.recompute for p in result.plans}
    assert 1 in {p.layout.sharding_degree for p in result.plans}
    for plan in result.plans:
        config = parse_config(argv + ["--device", "gpu", *plan.layout.flags().split()])
        validate(config, world_size=8, cuda_available=True, training_data=False)
        assert configured_layout(config) == plan.layout, plan.layout.flags()
