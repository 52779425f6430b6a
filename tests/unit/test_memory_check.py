"""The memory check before a run (megatron/memory/check.py): a configuration whose predicted peak exceeds
what the device has stops in one line, before any model is built; --no-memory-check starts it anyway.

What the device has is monkeypatched (``check.host_available_bytes``, ``check.process_rss_bytes``,
``torch.cuda.mem_get_info``), so the verdicts do not depend on this machine's RAM."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import pretrain_gpt
from megatron.config import ConfigError, parse_config, validate
from megatron.memory import check, estimate
from tests.functional.processes import error_lines

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
TINY = ["--mock-data", "--device", "cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--vocab-size", "256", "--max-seq-len", "32", "--max-position-embeddings", "32", "--global-batch-size", "8",
        "--micro-batch-size", "4", "--max-steps", "2", "--eval-iters", "1", "--num-workers", "0"]
SUGGESTIONS = ("--micro-batch-size", "--use-recompute", "--sharding-degree", "--sharding-stage", "--tp", "--pp",
               "--max-seq-len", "smaller model", "--no-memory-check")


def _config(argv, world_size=1, cuda=False):
    config = parse_config(argv)
    validate(config, world_size=world_size, cuda_available=cuda)
    return config


@pytest.fixture
def ram(monkeypatch):
    """Set this machine's available RAM (bytes; the process holds nothing extra) for the check."""
    def set_ram(nbytes):
        monkeypatch.setattr(check, "host_available_bytes", lambda: nbytes)
        monkeypatch.setattr(check, "process_rss_bytes", lambda: 0)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return set_ram


@pytest.fixture
def no_training(monkeypatch):
    """Fail the test if the run gets as far as building anything."""
    def built(*args, **kwargs):
        raise AssertionError("the run went past the memory check")
    monkeypatch.setattr(pretrain_gpt, "pretrain", built)
    monkeypatch.setattr(pretrain_gpt, "model_provider", built)


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = error_lines(err)
    assert len(errors) == 1, err
    assert errors[0].startswith("pretrain_gpt.py: error: not enough memory: "), errors[0]
    return errors[0]


def test_the_345m_default_on_the_cpu_stops_before_any_model_is_built(ram, no_training, capsys):
    """The reported run: 345M parameters, sequence 1024, micro-batch 8, fp32, on a CPU with 20 GiB free
    (it was killed by the kernel at 21 GB). Predicted 59.8 GiB: refused in about a second."""
    ram(20 * GIB)
    start = time.perf_counter()
    assert pretrain_gpt.main(["--mock-data", "--device", "cpu"]) == 2
    assert time.perf_counter() - start < 30  # no model, no data: the estimate is arithmetic
    line = _error_line(capsys)
    assert "the run needs at least 59.8 GiB per rank (model states 5.3, activations 52.6, temporaries 1.5, " \
           "process 0.30), but 20.0 GiB is available" in line
    assert "lower --micro-batch-size (52.6 GiB of activations per micro-batch of 8)" in line
    for flag in SUGGESTIONS:
        assert flag in line, flag
    assert line.endswith("; or pass --no-memory-check to start anyway.")


def test_a_run_that_fits_logs_its_prediction_and_trains(ram, tmp_path, capsys):
    ram(16 * GIB)
    assert pretrain_gpt.main([*TINY, "--save", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "memory: " in line)
    assert "[    INFO] - memory: predicted peak 0.3" in line  # the process (0.30) and a tiny model
    assert line.endswith("of 16.0 GiB available (RAM available 16.0 GiB, + 0.00 GiB held by this process)")
    assert "global step 2," in err


def test_no_memory_check_starts_what_the_check_refuses(ram, tmp_path, capsys):
    ram(1 << 20)  # 1 MiB: the tiny run is refused...
    assert pretrain_gpt.main([*TINY, "--save", str(tmp_path / "refused")]) == 2
    assert "but 0.00 GiB is available" in _error_line(capsys)
    assert not (tmp_path / "refused").exists()
    # ...and trains with --no-memory-check
    assert pretrain_gpt.main([*TINY, "--save", str(tmp_path / "out"), "--no-memory-check"]) == 0
    err = capsys.readouterr().err
    assert "memory: not checked (--no-memory-check)" in err and "global step 2," in err
    assert not error_lines(err)


def test_the_need_on_the_cpu_adds_the_offloaded_states_and_the_process():
    config = _config([*TINY, "--sharding-degree", "2", "--sharding-stage", "2", "--sharding-offload"], world_size=2)
    e, need = estimate(config, 0), check.predicted_need(config)
    assert e.cpu > 0  # offloaded: on the CPU the same RAM
    assert need.model_states == e.model_states + e.cpu
    assert need.total == e.total + e.cpu + check.CPU_PROCESS_BYTES


def test_the_worst_pipeline_stage_is_checked():
    config = _config([*TINY, "--num-layers", "4", "--pp-degree", "2"], world_size=2)
    totals = [estimate(config, s).total for s in range(2)]
    need = check.predicted_need(config)
    assert need.stage == totals.index(max(totals)) and need.total == max(totals) + check.CPU_PROCESS_BYTES


def test_the_ranks_of_a_machine_share_its_ram(ram, monkeypatch):
    config = _config(TINY)
    need = check.predicted_need(config).total
    ram(3 * need)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's: half each, fits
    line = check.check_memory(config)
    assert f"of {check._gib(3 * need // 2)} GiB available (RAM available {check._gib(3 * need)} GiB over 2 ranks " \
           f"on this machine" in line
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # a quarter each: refused
    with pytest.raises(ConfigError, match=r"^not enough memory: .* over 4 ranks on this machine"):
        check.check_memory(config)
    assert check.check_memory(config, local_ranks=1)  # one rank: fits


def test_a_tight_fit_is_a_warning_and_only_rank_0_logs(ram, capsys):
    config = _config(TINY)
    need = check.predicted_need(config).total
    ram(int(need / 0.9))
    line = check.check_memory(config, rank=1)
    assert "little to spare" in line and "lower --micro-batch-size" in line
    assert capsys.readouterr().err == ""  # rank 1 says nothing
    check.check_memory(config, rank=0)
    assert "[ WARNING] - memory: predicted peak" in capsys.readouterr().err


def test_the_cuda_path_reads_the_free_memory_of_the_local_rank(monkeypatch):
    """On GPUs: torch.cuda.mem_get_info of LOCAL_RANK; the need is the estimate itself (no process term),
    the CUDA context being already out of the free memory; no division among the machine's ranks."""
    asked = []

    def mem_get_info(device):
        asked.append(device)
        return free, 80 * GIB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(check, "host_available_bytes", lambda: 1)  # the host's RAM plays no part here
    argv = ["--mock-data", "--device", "gpu"]
    config = _config(argv, cuda=True)
    need = check.predicted_need(config)
    assert need.process == 0 and need.total == estimate(config, 0).total
    free = 80 * GIB
    line = check.check_memory(config, rank=0, local_rank=3, local_ranks=8)
    assert asked == [3] and line.endswith("of 80.0 GiB free on GPU 3")
    assert "process" not in line
    free = need.total - 1
    with pytest.raises(ConfigError) as err:
        check.check_memory(config, rank=0, local_rank=3, local_ranks=8)
    message = str(err.value)
    assert "is free on GPU 3; lower --micro-batch-size" in message and "--sharding-offload" in message
    assert "\n" not in message


def test_a_gpu_run_that_offloads_needs_the_host_ram_for_its_states(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (80 * GIB, 80 * GIB))
    argv = ["--mock-data", "--device", "gpu", "--sharding-degree", "8", "--sharding-stage", "2", "--sharding-offload"]
    config = _config(argv, world_size=8, cuda=True)
    host_states = check.predicted_need(config).host_states
    assert host_states == estimate(config, 0).cpu > 0
    monkeypatch.setattr(check, "host_available_bytes", lambda: 8 * host_states - 8)  # 8 ranks on this machine
    with pytest.raises(ConfigError, match=r"^not enough host memory for the offloaded states: .*8 on this machine"):
        check.check_memory(config, rank=0, local_rank=0, local_ranks=8)
    monkeypatch.setattr(check, "host_available_bytes", lambda: 8 * host_states)
    assert "offloaded states" in check.check_memory(config, rank=0, local_rank=0, local_ranks=8)


def test_micro_batch_1_and_compile_are_said(ram):
    ram(1 << 20)
    config = _config([*TINY, "--micro-batch-size", "1", "--use-recompute", "--compile"])
    with pytest.raises(ConfigError) as err:
        check.check_memory(config)
    message = str(err.value)
    assert "GiB of activations per micro-batch of 1: use ZeRO sharding" in message  # recompute already on
    assert "lower --micro-batch-size" not in message and "--use-recompute" not in message
    assert "eager mode's activations: --compile may save less" in message


def test_the_available_ram(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684096 kB\nMemFree:  1000 kB\nMemAvailable:   20971520 kB\n")
    assert check._meminfo_available(str(meminfo)) == 20 * GIB
    assert check._meminfo_available(str(tmp_path / "none")) is None
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("max\n")
    (v2 / "memory.current").write_text(f"{GIB}\n")
    assert check.cgroup_available_bytes(str(v2)) is None  # no limit
    (v2 / "memory.max").write_text(f"{4 * GIB}\n")
    (v2 / "memory.stat").write_text(f"anon 1\ninactive_file {GIB // 2}\n")
    assert check.cgroup_available_bytes(str(v2)) == 3 * GIB + GIB // 2  # limit - usage + reclaimable cache
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (v1 / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    assert check.cgroup_available_bytes(str(tmp_path / "v1")) is None
    (v1 / "memory.limit_in_bytes").write_text(f"{2 * GIB}\n")
    assert check.cgroup_available_bytes(str(tmp_path / "v1")) == GIB
    # MemAvailable, at most what a cgroup limit leaves
    monkeypatch.setattr(check, "_meminfo_available", lambda: 20 * GIB)
    monkeypatch.setattr(check, "cgroup_available_bytes", lambda: 3 * GIB)
    assert check.host_available_bytes() == 3 * GIB
    monkeypatch.setattr(check, "cgroup_available_bytes", lambda: None)
    assert check.host_available_bytes() == 20 * GIB
    assert check.process_rss_bytes() >= 0


def test_a_machine_that_does_not_say_is_not_checked(monkeypatch, capsys):
    monkeypatch.setattr(check, "host_available_bytes", lambda: None)
    line = check.check_memory(_config(TINY), rank=0, local_rank=0, local_ranks=1)
    assert "not checked: this machine does not say its free RAM" in line
    assert "memory: predicted peak" in capsys.readouterr().err


def test_the_examples_that_fit_pass_with_a_large_margin():
    """The quickstart (with --mock-data instead of its data flags) and the tiny CPU example need well under
    2 GiB; the 345M default needs 59.8."""
    for argv, most in ((["-c", str(ROOT / "examples/configs/gpt_quickstart.yaml"), "--mock-data"], 2 * GIB),
                       (["-c", str(ROOT / "examples/configs/gpt_tiny_cpu.yaml")], GIB // 2)):
        assert check.predicted_need(_config(argv)).total < most
    assert check.predicted_need(_config(["--mock-data", "--device", "cpu"])).total > 59 * GIB


def test_estimate_memory_prints_the_check_on_this_machine(ram, capsys):
    """Without --device-memory-gb, tools/estimate_memory.py ends with the check's verdict here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("estimate_memory_tool", ROOT / "tools" / "estimate_memory.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    ram(20 * GIB)
    assert tool.main(["--mock-data", "--device", "cpu"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("on this machine: not enough memory: the run needs at least 59.8 GiB per rank")
    assert tool.main([*TINY, "--dp-degree", "2"]) == 0  # a CPU run's ranks share this machine
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("on this machine: predicted peak 0.3")
    assert last.endswith("of 10.0 GiB available (RAM available 20.0 GiB over 2 ranks on this machine, + 0.00 GiB "
                         "held by this process)")
    assert tool.main([*TINY, "--device-memory-gb", "1"]) == 0  # the given device's verdict only
    assert "on this machine" not in capsys.readouterr().out


def test_a_gpu_that_does_not_answer_is_not_checked(monkeypatch):
    def mem_get_info(device):
        raise RuntimeError("CUDA error: no CUDA-capable device is detected")

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    config = _config(["--mock-data", "--device", "gpu"], cuda=True)
    line = check.check_memory(config, rank=1, local_rank=0, local_ranks=1)
    assert line.endswith("not checked: this machine does not say its free GPU memory")


def test_the_check_counts_this_ranks_share_of_a_context_parallel_sequence(ram):
    """At cp 2 each rank holds half of every sample: the need's activations are the formula's for s / 2
    tokens (at most 0.55 of cp 1's), and a refusal says so and names --context-parallel-size."""
    from megatron.memory.activations import activation_bytes_per_microbatch

    flat = [*TINY, "--hidden-dropout-prob", "0", "--attention-probs-dropout-prob", "0"]
    whole, split = _config(flat), _config([*flat, "--cp", "2"], world_size=2)
    need = check.predicted_need(split)
    assert need.activations_per_microbatch == activation_bytes_per_microbatch(split)
    assert need.activations_per_microbatch <= 0.55 * check.predicted_need(whole).activations_per_microbatch
    ram(1 << 20)
    with pytest.raises(ConfigError, match="GiB of activations per micro-batch of 4 at context parallel 2.*"
                                          "--tp / --pp / --context-parallel-size"):
        check.check_memory(split)
