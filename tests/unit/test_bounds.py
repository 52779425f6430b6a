"""Every size a configuration gives is bounded before anything proportional to it is built
(``megatron/config/bounds.py``): ``--num-layers 1000000000`` grew the process to the machine's memory (a per-layer
window pattern, a MemoryError traceback under a limit); now it is one line naming the field, exit 2, with memory
bounded. The converters' own readers apply the same maxima (tests/unit/test_megatron_hostile.py,
tests/unit/test_hf_config_checks.py)."""

from __future__ import annotations

import math

import pytest

from megatron.config import ConfigError, parse_config, validate
from megatron.config.bounds import MAXIMA, check_sizes, size_problem
from tests.functional.processes import ROOT, run_tools_in_bounded_memory
from tests.unit.test_config import valid_config


@pytest.mark.slow
def test_a_layer_count_of_a_billion_is_one_line_in_bounded_memory():
    """gpt_oss_tiny_cpu builds a window pattern per layer: 5 GB before its MemoryError at 10^9 layers. Within the
    bound, a run that needs more than the process's address-space limit (ulimit -v) leaves it is refused by the
    memory check (before: it counted the RAM alone, started, and died in an allocator traceback 43 s later)."""
    config = ROOT / "examples" / "configs" / "gpt_oss_tiny_cpu.yaml"
    billion, beyond = run_tools_in_bounded_memory([
        ["pretrain_gpt.py", "-c", config, "--num-layers", "1000000000"],
        ["pretrain_gpt.py", "-c", config, "--num-layers", "4096", "--max-steps", "1"]], cwd=ROOT)
    assert billion.returncode == 2, billion.stderr[-2000:]
    assert billion.stderr.strip() == ("pretrain_gpt.py: error: Model.num_layers is 1,000,000,000, above the largest "
                                      "this framework accepts (16,384, far beyond any published model); check the "
                                      "value.")
    assert beyond.returncode == 2 and beyond.stderr.count("\n") == 1, beyond.stderr[-2000:]
    assert "not enough memory" in beyond.stderr and "the address space left under this process's limit, ulimit -v" \
        in beyond.stderr, beyond.stderr


@pytest.mark.parametrize("name", sorted(MAXIMA))
def test_every_bounded_size_is_refused_above_its_maximum_naming_it(name):
    flag = "--" + name.replace("_", "-")
    argv = [flag, str(MAXIMA[name] + 1)]
    if name in ("num_query_groups",):
        argv.append("--group-query-attention")
    with pytest.raises(ConfigError) as err:
        validate(valid_config(*argv))
    section = "dataset" if name == "max_seq_len" else "Model"
    assert str(err.value).startswith(f"{section}.{name} is {MAXIMA[name] + 1:,}, above the largest"), str(err.value)


def test_the_maxima_admit_the_largest_published_shapes():
    """126 layers and hidden 16384 (Llama 3.1 405B), a 262,144-token vocabulary, 256 experts of top 8 (DeepSeek-V3),
    a 10M-token context: none is near a bound."""
    published = {"num_layers": 126, "hidden_size": 16384, "ffn_hidden_size": 53248, "num_attention_heads": 128,
                 "vocab_size": 262144, "num_experts": 256, "moe_router_topk": 8, "max_position_embeddings": 10485760,
                 "kv_lora_rank": 512, "q_lora_rank": 1536}
    for name, value in published.items():
        assert size_problem(name, value) is None and value * 8 <= MAXIMA[name], name


@pytest.mark.parametrize("value, problem", [
    ("64", "hidden_size is '64', not a whole number"),
    (True, "hidden_size is True, not a whole number"),
    (64.5, "hidden_size is 64.5, not a whole number"),
    (math.inf, "hidden_size is inf, not a whole number"),
    (math.nan, "hidden_size is nan, not a whole number"),
    (-1, "hidden_size is -1, below 0"),
    ([64], "hidden_size is [64], not a whole number"),
])
def test_a_size_that_is_not_a_whole_number_in_range_is_named(value, problem):
    assert size_problem("hidden_size", value) == problem
    assert size_problem("hidden_size", 64.0) is None and size_problem("hidden_size", None) is None


def test_a_foreign_field_is_bounded_as_ours_and_named_as_its_file_names_it():
    def fail(message):
        raise ValueError(message)

    with pytest.raises(ValueError, match=r"^config.json: num_hidden_layers is 1,000,000,000, above the largest"):
        check_sizes({"num_hidden_layers": 10**9}, "config.json", fail, {"num_hidden_layers": "num_layers"})
    check_sizes({"num_hidden_layers": 126, "other": 10**9}, "config.json", fail, {"num_hidden_layers": "num_layers"})


def test_a_flag_within_the_bounds_is_untouched():
    config = parse_config(["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                           "--max-seq-len", "64", "--max-position-embeddings", "64", "--vocab-size", "512"])
    validate(config)
    assert config.model.num_layers == 2


@pytest.mark.slow
def test_a_checkpoint_whose_config_claims_a_billion_layers_is_one_line_in_bounded_memory(tmp_path, one_process):
    """A checkpoint of ours handed over by someone else: its ``common.json`` config (checksummed anew, as a crafter
    would) is bounded before any tool builds the model it describes (before: a MemoryError traceback from
    checkpoint_info.py, to-hf and reshard; generate.py's 'MemoryError: ')."""
    import json
    import zlib

    from tests.unit.test_megatron_checkpoints import SHAPES, our_checkpoint

    our_checkpoint(tmp_path / "run", SHAPES["gpt2"])
    step = tmp_path / "run" / "step_12"
    common = json.loads((step / "common.json").read_text())
    assert "num_layers: 2," in common["config"]
    common["config"] = common["config"].replace("num_layers: 2,", "num_layers: 1000000000,")
    (step / "common.json").write_text(json.dumps(common))
    meta = json.loads((step / "metadata.json").read_text())
    meta["files"]["common.json"] = zlib.crc32((step / "common.json").read_bytes())
    (step / "metadata.json").write_text(json.dumps(meta))
    run = tmp_path / "run"
    for done in run_tools_in_bounded_memory([["tools/checkpoint_info.py", run],
                                             ["tools/convert_checkpoint.py", "to-hf", run, tmp_path / "hf"],
                                             ["tools/generate.py", "--load", run, "--prompt", "1", "--tokenizer-type",
                                              "NullTokenizer"]], cwd=tmp_path):
        assert done.returncode == 2, (done.args, done.stderr[-2000:])
        assert done.stderr.count("\n") == 1 and "Model.num_layers is 1,000,000,000, above the largest" in done.stderr
    assert not (tmp_path / "hf").exists()


def test_a_metadata_json_beyond_any_runs_is_one_line_before_it_is_read(tmp_path, one_process, capsys):
    """A sparse 1 GiB + 1 ``metadata.json``: its size is said, none of it parsed (before: read whole; 5 GB was a
    MemoryError traceback from every tool under a 3 GiB limit, 2 GB took 4.5 GB and 13 s)."""
    from megatron.checkpoint.format import MAX_METADATA_BYTES
    from tests.functional.launch import program_module
    from tests.unit.test_megatron_checkpoints import SHAPES, our_checkpoint

    our_checkpoint(tmp_path / "run", SHAPES["gpt2"])
    with open(tmp_path / "run" / "step_12" / "metadata.json", "r+b") as f:
        f.truncate(MAX_METADATA_BYTES + 1)
    capsys.readouterr()
    assert program_module("tools/checkpoint_info.py").main([str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"metadata.json (it is {MAX_METADATA_BYTES + 1:,} bytes, more than any run's " \
                                     f"metadata.json ({MAX_METADATA_BYTES:,}))" in err, err
