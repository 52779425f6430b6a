"""The configuration: schema, generated flags, YAML loading/dumping, precedence and validation."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest

from megatron.checkpoint import resumed_config
from megatron.config import Config, ConfigError, megatron_flags, parse_config, save_yaml, to_dict, to_yaml, validate
from megatron.config.cli import LEAVES, MEGATRON_DEST, build_parser, iter_leaves
from tests.functional.launch import run_here
from tests.functional.processes import error_lines

REPO = Path(__file__).resolve().parents[2]

# The seeds' (FleetX) structure: Model / Optimizer (with lr:) / Distributed (with sharding:)
# sections, plus top-level keys and the batch_size / mix_precision / dataset / save_load sections.
SEED_BODY = """\
device: cpu
max_steps: 200
seed: 7
logging_freq: 5
batch_size:
  global_batch_size: 16
  micro_batch_size: 4
mix_precision:
  use_pure_fp16: false
  scale_loss: 1024.0
dataset:
  mock_data: true
  max_seq_len: 128
save_load:
  save_steps: 50
  output_dir: ./out_seed
Model:
  vocab_size: 1000
  hidden_size: 64
  num_layers: 2
  num_attention_heads: 4
  max_position_embeddings: 256
Optimizer:
  weight_decay: 0.05
  grad_clip: 0.5
  lr:
    decay_steps: 180
    warmup_steps: 10
    max_lr: 3.0e-4
    min_lr: 3.0e-5
Distributed:
  dp_degree: 1
  sharding:
    sharding_degree: 1
    sharding_stage: 2
"""


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def valid_config(*argv: str) -> Config:
    """A config that passes validation on one CPU process (mock data), plus the given flags."""
    return parse_config(["--mock-data", "--device", "cpu", *argv])


def check(config: Config) -> list[str]:
    return validate(config, world_size=1, cuda_available=False)


# ---------------------------------------------------------------- YAML form


def test_yaml_round_trip(tmp_path):
    config = valid_config("--hidden-size", "256", "--num-attention-heads", "8", "--num-layers", "3",
                          "--lr", "6e-4", "--min-lr", "6e-5", "--train-iters", "1234",
                          "--global-batch-size", "32", "--micro-batch-size", "4", "--bf16",
                          "--use-recompute", "--no-recompute-layers", "0", "2", "--peak-tflops", "312.5",
                          "--save", str(tmp_path / "run"), "--no-eod-mask-loss", "--scale-loss", "65536")
    assert check(config) == []
    path = tmp_path / "saved" / "config.yaml"
    save_yaml(config, str(path))
    assert path.read_text() == to_yaml(config)
    loaded = parse_config(["-c", str(path)])
    assert to_dict(loaded) == to_dict(config)  # the derived values came back too
    assert check(loaded) == []
    assert to_dict(loaded) == to_dict(config)
    assert loaded == config
    assert loaded.model.ffn_hidden_size == 1024 and loaded.num_micro_batches == 8
    assert loaded.no_recompute_layers == [0, 2] and loaded.recompute_granularity == "full"


@pytest.mark.parametrize("wrapped", [True, False], ids=["PreTraining", "unwrapped"])
def test_seed_structure_loads(tmp_path, wrapped):
    body = SEED_BODY
    if wrapped:
        body = "PreTraining:\n" + textwrap.indent(SEED_BODY, "  ")
    config = parse_config(["-c", write(tmp_path, body)])
    assert check(config) == []
    assert config.device == "cpu" and config.max_steps == 200 and config.seed == 7 and config.logging_freq == 5
    assert (config.model.hidden_size, config.model.num_layers, config.model.num_attention_heads) == (64, 2, 4)
    assert config.model.ffn_hidden_size == 256
    assert config.optimizer.weight_decay == 0.05 and config.optimizer.grad_clip == 0.5
    lr = config.optimizer.lr
    assert (lr.decay_steps, lr.warmup_steps, lr.max_lr, lr.min_lr) == (180, 10, 3.0e-4, 3.0e-5)
    assert config.distributed.sharding.sharding_stage == 2 and config.distributed.dp_degree == 1
    b = config.batch_size
    assert (b.global_batch_size, b.local_batch_size, b.micro_batch_size) == (16, 16, 4)
    assert config.mix_precision.scale_loss == 1024.0 and config.dataset.max_seq_len == 128
    assert config.save_load.save_steps == 50 and config.save_load.output_dir == "./out_seed"


def test_both_forms_give_the_same_config(tmp_path):
    wrapped = parse_config(["-c", write(tmp_path, "PreTraining:\n" + textwrap.indent(SEED_BODY, "  "), "a.yaml")])
    plain = parse_config(["-c", write(tmp_path, SEED_BODY, "b.yaml")])
    assert to_dict(wrapped) == to_dict(plain)


# ---------------------------------------------------------------- schema <-> flags


def _sections(cls: type = Config) -> typing.Iterator[type]:
    yield cls
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            yield from _sections(hints[f.name])


def test_every_field_has_help():
    classes = list(_sections())
    assert len(classes) == 13  # Config + 12 sections
    for cls in classes:
        for f in dataclasses.fields(cls):
            text = f.metadata.get("help")
            assert isinstance(text, str) and text.strip(), f"{cls.__name__}.{f.name} has no help text"
    assert "--hidden-size" in build_parser().format_help()  # and every help formats (no stray '%')


def test_leaf_names_are_unique():
    names = [leaf.name for leaf in iter_leaves()]
    assert len(names) == len(set(names)) == len(LEAVES)


def test_flags_equal_schema_leaves():
    parser = build_parser()
    options = {s: a.dest for a in parser._actions for s in a.option_strings}
    for leaf in LEAVES.values():
        assert options.get(leaf.flag) == leaf.name, f"{leaf.dotted} has no {leaf.flag}"
    # argparse's own -h/--help and Megatron-LM's flags of megatron_flags' tables are the only other actions
    extra = {a.dest for a in parser._actions} - set(LEAVES) - {"config", "override", "help"}
    assert extra == {MEGATRON_DEST + flag for flag in [*megatron_flags.NO_EFFECT, *megatron_flags.ABSENT,
                                                        *megatron_flags.DERIVED]}
    assert {a.dest for a in parser._actions} >= {"config", "override"}


def test_to_dict_covers_every_leaf():
    def count(tree):
        return sum(count(v) if isinstance(v, dict) else 1 for v in tree.values())
    assert count(to_dict(Config())) == len(LEAVES)


# ---------------------------------------------------------------- precedence and flags


def test_precedence_default_yaml_override_flag(tmp_path):
    path = write(tmp_path, """\
        Model:
          hidden_size: 256
          num_layers: 4
          vocab_size: 2000
        Optimizer:
          lr:
            max_lr: 1.0e-3
    """)
    config = parse_config(["-c", path, "-o", "Model.hidden_size=512", "-o", "num_layers=6",
                           "-o", "Optimizer.lr.max_lr=2.0e-3", "--hidden-size", "768"])
    assert config.model.hidden_size == 768      # default < YAML < -o < flag
    assert config.model.num_layers == 6         # YAML < -o (shortened path)
    assert config.optimizer.lr.max_lr == 2.0e-3  # YAML < -o (full path)
    assert config.model.vocab_size == 2000      # YAML only
    assert config.model.num_attention_heads == Config().model.num_attention_heads  # default
    # flag order relative to -c / -o on the command line does not matter
    again = parse_config(["--hidden-size", "768", "-o", "Model.hidden_size=512", "-c", path])
    assert again.model.hidden_size == 768


def test_override_with_wrong_section_path_is_refused():
    with pytest.raises(ConfigError, match="Model.hidden_size"):
        parse_config(["-o", "Optimizer.hidden_size=5"])


@pytest.mark.parametrize("argv, attrs, expected", [
    (["--tp", "2"], ("distributed", "mp_degree"), 2),
    (["--pp", "3"], ("distributed", "pp_degree"), 3),
    (["--dp", "4"], ("distributed", "dp_degree"), 4),
    (["--vpp", "2"], ("distributed", "virtual_pp_degree"), 2),
    (["--lr", "6e-4"], ("optimizer", "lr", "max_lr"), 6e-4),
    (["--train-iters", "77"], ("max_steps",), 77),
    (["--seq-length", "512"], ("dataset", "max_seq_len"), 512),
    (["--fp16"], ("mix_precision", "use_pure_fp16"), True),
    (["--clip-grad", "0.3"], ("optimizer", "grad_clip"), 0.3),
    (["--data-path", "0.3", "/d/a_text", "0.7", "/d/b_text"], ("dataset", "input_dir"),
     "0.3 /d/a_text 0.7 /d/b_text"),
    (["--data-path", "/d/only_text"], ("dataset", "input_dir"), "/d/only_text"),
    (["--save", "/tmp/run1"], ("save_load", "output_dir"), "/tmp/run1"),
    (["--load", "/tmp/ckpt"], ("save_load", "ckpt_dir"), "/tmp/ckpt"),
])
def test_aliases(argv, attrs, expected):
    obj = parse_config(argv)
    for attr in attrs:
        obj = getattr(obj, attr)
    assert obj == expected and type(obj) is type(expected)


def test_boolean_flags():
    assert parse_config([]).dataset.mock_data is False
    assert parse_config(["--mock-data"]).dataset.mock_data is True
    assert parse_config(["--use-recompute"]).use_recompute is True
    assert parse_config(["--no-eod-mask-loss"]).dataset.eod_mask_loss is False
    assert parse_config(["--no-dynamic-loss-scale"]).mix_precision.dynamic_loss_scale is False
    assert parse_config(["--no-fp16"]).mix_precision.use_pure_fp16 is False
    assert parse_config(["--fp16", "--no-fp16"]).mix_precision.use_pure_fp16 is False  # last wins


def test_boolean_flag_beats_yaml(tmp_path):
    path = write(tmp_path, "dataset:\n  eod_mask_loss: true\n  mock_data: false\n")
    config = parse_config(["-c", path, "--no-eod-mask-loss", "--mock-data"])
    assert config.dataset.eod_mask_loss is False and config.dataset.mock_data is True


# ---------------------------------------------------------------- user mistakes


def test_unknown_flag_suggests_closest():
    with pytest.raises(ConfigError, match="--hiden-size.*did you mean '--hidden-size'"):
        parse_config(["--hiden-size", "128"])
    with pytest.raises(ConfigError, match="did you mean '--num-layers'"):
        parse_config(["--num-layer=4"])


def test_every_unknown_flag_is_reported_at_once_with_its_closest_name():
    with pytest.raises(ConfigError) as err:
        parse_config(["--num-layers", "2", "--hiden-size", "128", "--zzz-unheard-of", "--num-atention-heads=4",
                      "--hiden-size", "64"])
    assert str(err.value) == ("3 unknown arguments: '--hiden-size' (did you mean '--hidden-size'?), "
                              "'--zzz-unheard-of', '--num-atention-heads' (did you mean '--num-attention-heads'?); "
                              "see --help for the flags.")


def test_unknown_yaml_key_suggests_closest(tmp_path):
    path = write(tmp_path, "Model:\n  hiden_size: 128\n")
    with pytest.raises(ConfigError, match="hiden_size.*did you mean 'hidden_size'"):
        parse_config(["-c", path])


def test_key_under_wrong_section(tmp_path):
    path = write(tmp_path, "Optimizer:\n  hidden_size: 128\n")
    with pytest.raises(ConfigError, match="'hidden_size' belongs under Model, found under Optimizer"):
        parse_config(["-c", path])
    path = write(tmp_path, "Optimizer:\n  max_lr: 1.0e-3\n", "b.yaml")  # belongs under Optimizer.lr
    with pytest.raises(ConfigError, match="Optimizer.lr"):
        parse_config(["-c", path])
    path = write(tmp_path, "max_steps: 3\nModel:\n  max_steps: 3\n", "c.yaml")
    with pytest.raises(ConfigError, match="the top level"):
        parse_config(["-c", path])


@pytest.mark.parametrize("text, key, line, first", [
    ("Model:\n  hidden_size: 64\n  num_layers: 2\n  hidden_size: 128\n", "hidden_size", 4, 2),
    ("Model:\n  hidden_size: 64\nOptimizer:\n  grad_clip: 0.5\nModel:\n  num_layers: 2\n", "Model", 5, 1),
    ("PreTraining:\n  seed: 1\n  Optimizer:\n    lr:\n      max_lr: 1.0e-3\n      max_lr: 2.0e-3\n", "max_lr", 6, 5),
    ("max_steps: 3\nmax_steps: 4\n", "max_steps", 2, 1),
])
def test_repeated_yaml_key_or_section_refused(tmp_path, text, key, line, first):
    """A key or a whole section given twice is one line naming the key, the file and both lines: PyYAML's
    last-wins would drop the first silently (a second ``Model:`` erased the first one's values)."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        parse_config(["-c", path])
    assert str(err.value).startswith(f"{path} line {line}: key '{key}' is repeated (first at line {first})")


def test_yaml_merge_keys_are_not_repeats(tmp_path):
    """A merge key (``<<:``) keeps YAML's meaning: the mapping's own key overrides the merged one."""
    text = "Model:\n  <<: {hidden_size: 64, num_layers: 2}\n  hidden_size: 128\n"
    config = parse_config(["-c", write(tmp_path, text)])
    assert (config.model.hidden_size, config.model.num_layers) == (128, 2)


def test_wrong_types(tmp_path):
    with pytest.raises(ConfigError, match="Model.hidden_size must be an integer, got 'abc'"):
        parse_config(["-c", write(tmp_path, "Model:\n  hidden_size: abc\n")])
    with pytest.raises(ConfigError, match="Model.hidden_size must be an integer"):
        parse_config(["--hidden-size", "abc"])
    with pytest.raises(ConfigError, match="max_lr must be a number"):
        parse_config(["--lr", "fast"])
    with pytest.raises(ConfigError, match="mock_data must be true or false"):
        parse_config(["-c", write(tmp_path, "dataset:\n  mock_data: maybe\n", "b.yaml")])
    with pytest.raises(ConfigError, match="device"):
        parse_config(["--device", "tpu"])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        parse_config(["-c", str(tmp_path / "nope.yaml")])


# ---------------------------------------------------------------- the entry point


@pytest.mark.parametrize("argv, needle", [
    (["--hiden-size", "128"], "--hidden-size"),
    (["--mock-data", "--device", "cpu", "--hidden-size", "abc"], "hidden_size must be an integer"),
    (["--mock-data", "--device", "cpu", "--global-batch-size", "16", "--local-batch-size", "8"],
     "global_batch_size"),
    (["--mock-data", "--device", "cpu", "--hidden-size", "100", "--num-attention-heads", "16"],
     "must divide"),
    (["-c", "/nonexistent/dir/config.yaml"], "does not exist"),
], ids=["flag", "type", "batch", "heads", "missing-file"])
def test_pretrain_gpt_reports_one_line(argv, needle):
    proc = run_here(*argv)  # in this process: the interpreter and torch are not started again
    assert proc.returncode != 0
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0] and "Traceback" not in proc.stderr


@pytest.mark.parametrize("env, needle", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK and LOCAL_RANK and MASTER_ADDR and MASTER_PORT are not"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, "MASTER_ADDR and MASTER_PORT are not"),
    ({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"},
     "RANK=2 is not a rank of WORLD_SIZE=2 (0..1)"),
    ({"WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE='two' is not an integer"),
    ({"WORLD_SIZE": "1", "RANK": "-1"}, "RANK=-1 is not a rank of WORLD_SIZE=1"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"},
     "LOCAL_RANK=2 is not a rank of this node"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"},
     "MASTER_PORT='http' is not a port number"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "free"},
     "rank 0 of WORLD_SIZE=2 could not meet the other processes at 127.0.0.1:"),
], ids=["world-only", "no-master", "rank-too-big", "not-int", "negative-rank", "local-rank", "port", "alone"])
def test_launch_environment_set_by_hand_is_one_line_at_once(monkeypatch, tmp_path, env, needle):
    """torchrun's variables set by hand (without torchrun) or inconsistent: one line, exit 2, before any
    rendezvous (on main: a ValueError traceback from init_process_group, or a wait for ranks that never
    come ending in a DistStoreError traceback) and, when refused from the variables alone, before the output
    folder is made. All set but one process started: the rendezvous waits its timeout, then one line."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        if value == "free":  # all set, one process started: it waits distributed_timeout_minutes (1.2 s) alone
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                value = str(sock.getsockname()[1])
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    proc = run_here("--mock-data", "--device", "cpu", "--num-layers", "1", "--hidden-size", "32",
                    "--num-attention-heads", "2", "--max-seq-len", "16", "--vocab-size", "64", "--max-steps", "1",
                    "--distributed-timeout-minutes", "0.02", "--output-dir", str(out))
    assert proc.returncode == 2
    errors = [*error_lines(proc.stderr), *[line for line in proc.stderr.splitlines() if "Traceback" in line]]
    assert len(errors) == 1 and needle in errors[0] and "torchrun" in errors[0], proc.stderr
    if not needle.startswith("rank 0 of"):  # refused from the variables alone: not even the start-up lines
        assert len(proc.stderr.splitlines()) == 1 and not out.exists(), proc.stderr


def test_an_explicit_base_is_under_the_yaml_and_the_flags_and_left_unchanged(tmp_path):
    base = parse_config(["--hidden-size", "96", "--num-attention-heads", "4", "--max-steps", "50", "--lr", "1e-3"])
    before = to_dict(base)
    path = write(tmp_path, "max_steps: 70\nOptimizer:\n  lr:\n    min_lr: 1.0e-6\n")
    config = parse_config(["-c", path, "--max-steps", "80", "-o", "num_layers=3"], base)
    assert config.model.hidden_size == 96 and config.optimizer.lr.max_lr == 1e-3  # from the base
    assert config.optimizer.lr.min_lr == 1e-6 and config.model.num_layers == 3  # from the YAML file and -o
    assert config.max_steps == 80  # flags over the YAML file over the base
    assert to_dict(base) == before and config is not base  # the base is not modified
    assert to_dict(parse_config([], base)) == before  # nothing given: the base itself
    assert parse_config([], None).model.hidden_size == Config().model.hidden_size  # no base: the defaults
    with pytest.raises(TypeError, match="base must be a Config"):  # warnings are keyword-only
        parse_config([], [])


def test_importing_the_config_imports_nothing_above_it():
    """The configuration is the bottom layer: importing it, and validating a mock-data config, loads no
    checkpoint, data, tokenizer or torch.distributed module (a subprocess: a clean sys.modules)."""
    code = ("import sys; import megatron.config as c; config = c.parse_config(['--mock-data', '--device', 'cpu']); "
            "c.validate(config); print(' '.join(sorted(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=True)
    loaded = proc.stdout.split()
    above = [m for m in loaded if m.startswith(("megatron.", "torch")) and not m.startswith("megatron.config")]
    assert above == [], above
    assert "megatron.config.validate" in loaded


def _saved_run(tmp_path, *flags: str) -> Path:
    """A run folder whose ``latest`` names step_5, holding the config.yaml of a run started with ``flags``."""
    step = tmp_path / "run" / "step_5"
    step.mkdir(parents=True)
    (step / "metadata.json").write_text("{}")
    (tmp_path / "run" / "latest").write_text("step_5")
    (step / "config.yaml").write_text(to_yaml(parse_config(list(flags))))
    return tmp_path / "run"


def test_a_resumed_run_starts_from_the_saved_configuration(tmp_path):
    """Flags given now win; the layout (Distributed) is the launch's; everything else is the saved run's."""
    run = _saved_run(tmp_path, "--hidden-size", "96", "--num-attention-heads", "4", "--max-steps", "50", "--tp", "2",
                     "--lr", "1e-3")
    warnings: list[str] = []
    config = resumed_config(["--load", str(run), "--max-steps", "80"], warnings)
    assert config.model.hidden_size == 96 and config.optimizer.lr.max_lr == 1e-3  # from the saved run
    assert config.max_steps == 80  # given now
    assert config.distributed.mp_degree == 1  # the layout is not carried over
    assert config.save_load.ckpt_dir == str(run)
    assert warnings == []  # the saved config is not a resolved one (no decay_steps): no schedule is kept
    assert parse_config(["--load", str(run)]).model.hidden_size == Config().model.hidden_size  # no implicit base


def test_a_resumed_run_is_told_when_it_keeps_the_saved_schedule(tmp_path):
    run = _saved_run(tmp_path, "--max-steps", "50", "--lr-decay-iters", "50")
    warnings: list[str] = []
    config = resumed_config(["--load", str(run), "--max-steps", "80"], warnings)
    assert config.optimizer.lr.decay_steps == 50 and len(warnings) == 1
    assert "resuming with max_steps 80 while the saved run's learning rate decays over 50 steps" in warnings[0]
    warnings.clear()
    resumed_config(["--load", str(run), "--max-steps", "80", "--lr-decay-iters", "80"], warnings)
    assert warnings == []  # the schedule was changed too


def test_a_resumed_megatron_command_line_with_another_schedule_stops_unless_told_which_wins(tmp_path):
    """Megatron-LM's OptimizerParamScheduler: a schedule value given now that differs from the checkpoint's stops the
    run, unless --override-opt_param-scheduler (the values given now) or --use-checkpoint-opt_param-scheduler (the
    saved ones) says which wins; another command line's flags win, as ever."""
    run = _saved_run(tmp_path, "--train-iters", "10", "--lr", "3e-3", "--min-lr", "1e-5")
    load = ["--load", str(run), "--train-iters", "10"]
    with pytest.raises(ConfigError, match=r"resuming .* with max_lr 0.001, but the saved run's schedule has 0.003 "
                                          r"\(Megatron-LM stops here too\); pass --override-opt_param-scheduler"):
        resumed_config([*load, "--lr", "1e-3", "--min-lr", "1e-5"])
    assert resumed_config([*load, "--lr", "3e-3", "--min-lr", "1e-5"]).optimizer.lr.max_lr == 3e-3  # the same: runs
    for override in ("--override-opt_param-scheduler", "--override-opt-param-scheduler"):
        assert resumed_config([*load, "--lr", "1e-3", override]).optimizer.lr.max_lr == 1e-3
    for keep in ("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"):
        kept = resumed_config([*load, "--lr", "1e-3", "--min-lr", "0", keep]).optimizer.lr
        assert (kept.max_lr, kept.min_lr) == (3e-3, 1e-5)
    fleetx = _saved_run(tmp_path / "fleetx", "--max-steps", "10", "--lr", "3e-3")
    assert resumed_config(["--load", str(fleetx), "--lr", "1e-3"]).optimizer.lr.max_lr == 1e-3


def test_how_to_load_is_not_inherited_and_finetune_takes_no_base(tmp_path):
    step = _saved_run(tmp_path, "--hidden-size", "96", "--num-attention-heads", "4", "--finetune",
                      "--no-load-optim") / "step_5"
    resumed = resumed_config(["--load", str(step)])
    assert not resumed.save_load.finetune and resumed.save_load.load_optim
    assert resumed.model.hidden_size == 96
    tuned = resumed_config(["--load", str(step), "--finetune"])
    assert tuned.model.hidden_size == Config().model.hidden_size  # only what is given now


@pytest.mark.parametrize("argv, message", [
    (["--cp-comm-type", "p2p", "a2a"],
     "unexpected value 'a2a' after --cp-comm-type p2p: --cp-comm-type takes one value"),
    (["--num-layers", "2", "3", "4"], "unexpected values '3', '4' after --num-layers 2"),
    (["--save", "/tmp/x", "foo"], "unexpected value 'foo' after --save /tmp/x"),
])
def test_extra_words_after_a_flag_are_refused_not_dropped(argv, message):
    """A word after a flag's value (Megatron-LM's per-layer --cp-comm-type list, a typo) was silently dropped and the
    run trained with the first value only."""
    with pytest.raises(ConfigError) as err:
        parse_config(["--mock-data", *argv])
    assert message in str(err.value)


def test_a_refused_flags_values_are_not_called_extra_words():
    with pytest.raises(ConfigError) as err:
        parse_config(["--mock-data", "--mrope-section", "16", "24", "24", "--export-te-mcore-model"])
    assert "not available here" in str(err.value) and "unexpected value" not in str(err.value)


def test_other_frameworks_names_for_context_parallelism_get_a_hint(tmp_path):
    """FleetX users write *_degree keys (sep_degree is Paddle's): the hint names context_parallel_size."""
    path = tmp_path / "cp.yaml"
    path.write_text("Distributed:\n  cp_degree: 2\n")
    with pytest.raises(ConfigError, match="unknown key 'cp_degree'; did you mean '--context-parallel-size'"):
        parse_config(["-c", str(path)])
    with pytest.raises(ConfigError, match="did you mean '--context-parallel-size'"):
        parse_config(["--sep-degree", "2"])
