"""The example configs and scripts stay valid."""

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from megatron.config import parse_config, validate
from megatron.model import GPTModel, num_parameters

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))
SCRIPTS = sorted((ROOT / "examples").glob("*.sh"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_config_validates(path):
    """Configs that leave the data to their script (the quickstart) are checked with mock data."""
    config = parse_config(["-c", str(path), "--device", "cpu"])
    if not config.dataset.input_dir and not config.dataset.mock_data:
        config = parse_config(["-c", str(path), "--device", "cpu", "--mock-data"])
    d = config.distributed
    world_size = (d.dp_degree or 1) * d.mp_degree * d.pp_degree * d.sharding.sharding_degree  # as launched
    assert validate(config, world_size=world_size) == []  # no warnings either: the seeds' max_lr < min_lr bug is fixed


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_example_script_is_valid_bash_and_names_existing_configs(path):
    subprocess.run(["bash", "-n", str(path)], check=True)
    for config in re.findall(r"examples/configs/[\w.\-]+\.yaml", path.read_text()):
        assert (ROOT / config).is_file(), f"{path.name} refers to missing {config}"


@pytest.mark.parametrize("name, millions", [("gpt_345m_single_card.yaml", 354.87),
                                            ("gpt_1.3b_single_card.yaml", 1313.72),
                                            ("llama_1b.yaml", 1235.81), ("llama_7b.yaml", 6738.42)])
def test_seed_model_sizes(name, millions):
    """The example configs build the model sizes their names promise (GPT-2 medium: 354.9M with
    vocab 50304; the 1.3B: 24 layers of width 2048; Llama 3.2 1B's 1,235,814,400 and Llama 2 7B's
    6,738,415,616 parameters). Built on the meta device: no memory."""
    config = parse_config(["-c", str(ROOT / "examples" / "configs" / name), "--device", "cpu", "--tp", "1",
                           "--no-sequence-parallel"])  # the whole model on one rank
    validate(config)
    with torch.device("meta"):
        model = GPTModel(config.model, config.padded_vocab_size)
    assert num_parameters(model) / 1e6 == pytest.approx(millions, abs=0.01)


def test_estimate_memory_tool(capsys):
    import importlib.util

    from megatron.memory.activations import activation_bytes_per_microbatch

    spec = importlib.util.spec_from_file_location("estimate_memory", ROOT / "tools" / "estimate_memory.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    config_175b = str(ROOT / "examples" / "configs" / "gpt_175b_mp8_pp16.yaml")
    assert tool.main(["-c", config_175b, "--device", "cpu", "--device-memory-gb", "80"]) == 0
    states, activations = capsys.readouterr().out.split("\n\n")
    rows = [line.split() for line in states.splitlines()[2:]]
    assert [int(r[0]) for r in rows] == list(range(16))
    params = sum(float(r[1]) for r in rows) * 1e6 * 8  # x tp 8: the whole model
    assert params == pytest.approx(175e9, rel=0.01)  # GPT-3 175B (tied embedding counted on two stages)
    lines = activations.splitlines()
    assert lines[0].startswith("activations: micro-batch 1 x 2048 tokens, recompute full, sequence parallel, 1f1b")
    table = [line.split() for line in lines[2:18]]
    assert [int(r[0]) for r in table] == list(range(16))
    assert [int(r[2]) for r in table] == [16 - stage for stage in range(16)]  # 1F1B: pp - stage in flight
    for _, per_micro_batch, in_flight, acts, temps, states_gib, total in table:
        assert float(acts) == pytest.approx(float(per_micro_batch) * int(in_flight), abs=0.005 * (int(in_flight) + 1))
        assert float(total) == pytest.approx(float(acts) + float(temps) + float(states_gib), abs=0.02)
    assert re.fullmatch(r"fits in 80 GiB: stage \d+ needs [\d.]+ GiB, [\d.]+ GiB to spare", lines[-1])

    # without pipelining: the one-line figure, what the hooks measure for one micro-batch's forward
    argv = ["-c", str(ROOT / "examples" / "configs" / "gpt_345m_single_card.yaml"), "--device", "cpu"]
    assert tool.main(argv + ["--device-memory-gb", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    config = parse_config(argv)
    validate(config)
    expected = f"activations per micro-batch: {tool.format_bytes(activation_bytes_per_microbatch(config))}"
    assert expected in out
    assert re.fullmatch(r"activations per micro-batch: \d+\.\d\d (B|KiB|MiB|GiB|TiB)", expected)
    assert re.fullmatch(r"does not fit in 8 GiB: stage 0 needs [\d.]+ GiB, [\d.]+ GiB over", out[-1])


def _records(*records: tuple) -> str:
    return "".join(json.dumps({"split": split, "step": step, "loss": loss}) + "\n" for split, step, loss in records)


STOPPED = "run examples/quickstart.sh again to train the model to the end."


@pytest.mark.parametrize("metrics, status, last", [
    (None, 0, "quickstart: the training run wrote no {run}/metrics.jsonl: it stopped before its first logged step, so "
              f"there is nothing to compare; {STOPPED}"),
    ("", 0, "quickstart: the training run stopped before its first logged step ({run}/metrics.jsonl has no training "
            f"record), so there is nothing to compare; {STOPPED}"),
    (_records(("train", 10, 8.1), ("train", 20, 6.0)) + '{"split": "tra', 0,
     "quickstart: the training run stopped at step 20, before its first evaluation (every 100 steps): there is no "
     f"validation loss to compare; {STOPPED}"),
    (_records(("train", 10, 8.1), ("valid", 100, 7.0)), 1,
     "quickstart: the validation loss did not fall as expected (7.00 at step 100, not below 6.32)"),
    (_records(("train", 10, 8.1), ("valid", 100, 6.0), ("train", 400, 3.9), ("valid", 400, 4.4)), 0,
     "quickstart: the model learned.")],
    ids=["no-metrics", "no-train-record", "stopped-before-evaluating", "did-not-learn", "learned"])
def test_the_quickstart_summary_says_in_one_line_why_there_is_nothing_to_compare(tmp_path, metrics, status, last):
    """examples/quickstart.sh's summary (examples/quickstart_summary.py): a run stopped by SIGTERM (saved, exit 0)
    before its first evaluation, or its first logged step, is one line and exit 0 (stopping is not a failure),
    never an IndexError; a run that did not learn is one line on stderr and exit 1."""
    from tests.functional.launch import run_tool_here

    run = tmp_path / "train"
    run.mkdir()
    (run / "config.yaml").write_text("eval_freq: 100\n")
    if metrics is not None:
        (run / "metrics.jsonl").write_text(metrics)
    done = run_tool_here("examples/quickstart_summary.py", str(run))
    assert done.returncode == status and "Traceback" not in done.stderr, done.stderr
    assert (done.stdout + done.stderr).strip().splitlines()[-1] == last.format(run=run)
    assert (done.stderr.strip().splitlines() if status else [done.stderr]) == ([last.format(run=run)] if status
                                                                              else [""])
    if status == 0:  # learned, or stopped before there was anything to compare: said once, on stdout
        assert done.stdout.count(last.format(run=run)) == 1
