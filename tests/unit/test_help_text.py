"""What the command line says to the user: pretrain_gpt.py --help (grouped by section, each flag once with its
aliases and default, Megatron-LM's other flags hidden), hints for unknown flags, and every script's own --help."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.config import ConfigError, megatron_flags, parse_config
from megatron.config.cli import LEAVES, MEGATRON_DEST, SECTIONS, build_parser, get
from megatron.config.help import COMMON_NAMES, NONE_DEFAULTS, closest_key, section_helps

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.relative_to(ROOT).as_posix() for p in [*(ROOT / "tools").glob("*.py"),
                                                           *(ROOT / "benchmarks").glob("*.py")]
                 if p.name != "__init__.py")
TAKE_THE_CONFIGURATION = {"tools/estimate_memory.py", "tools/evaluate.py", "tools/plan_layout.py"}


@pytest.fixture(scope="module")
def help_text() -> str:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLUMNS", "120")  # argparse wraps at the terminal's width
        return build_parser().format_help()


def groups(text: str) -> dict[str, str]:
    """Each help group's title -> its text (a title is an unindented line ending in ':')."""
    out: dict[str, str] = {}
    title = None
    for line in text.splitlines():
        if re.fullmatch(r"\S[^ ]*:", line):
            title = line[:-1]
            out[title] = ""
        elif title is not None:
            out[title] += line + "\n"
    return out


def invocations(text: str) -> list[str]:
    """The option strings of the help's flag lines (the first column, not the help texts)."""
    found = []
    for line in text.splitlines():
        m = re.match(r"  (-[^ ].*?)(?:  +\S|$)", line)
        if m:
            found += re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", m.group(1))
    return found


def test_usage_is_one_short_line_then_the_precedence_rule(help_text):
    lines = help_text.splitlines()
    assert lines[0] == "usage: pretrain_gpt.py [-h] [-c CONFIG] [-o Section.key=value ...] [--flag value ...]"
    assert lines[1] == ""
    head = help_text.split("\n\noptions:")[0]
    assert "Precedence" in head and head.index("-c") < head.index("-o Section.key=value") < head.index("flags.")


def test_the_help_is_grouped_by_section_in_schema_order(help_text):
    found = groups(help_text)
    sections = ["run"] + [".".join(path) for path in section_helps()]
    assert [t for t in found if t != "options"] == sections
    assert sections[:3] == ["run", "batch_size", "mix_precision"] and "Optimizer.lr" in sections
    assert "Distributed.sharding" in sections
    for path, text in section_helps().items():
        assert text in " ".join(found[".".join(path)].split())  # the schema's section help describes the group
    model = found["Model"]
    assert re.search(r"--hidden-size N +Width of the residual stream\. \(default: 1024\)", model)
    assert "--hidden-size" not in found["run"] and "--max-lr, --lr X" in found["Optimizer.lr"]
    for leaf in LEAVES.values():  # each flag in its section's group
        assert leaf.flag in invocations(found[".".join(leaf.path[:-1]) or "run"]), leaf.dotted


def test_no_option_string_appears_twice(help_text):
    listed = invocations(help_text)
    assert len(listed) == len(set(listed)), sorted({s for s in listed if listed.count(s) > 1})
    assert listed.count("--data-cache-path") == 1
    shown = {s for a in build_parser()._actions if a.help != "==SUPPRESS==" for s in a.option_strings}
    assert set(listed) == shown  # every visible flag, aliases and --no- forms included, and nothing else
    for action in build_parser()._actions:
        assert len(action.option_strings) == len(set(action.option_strings)), action.dest


def test_defaults_choices_and_aliases_are_shown(help_text):
    flat = " ".join(help_text.split())
    assert "--max-steps, --train-iters N Optimizer steps to train. (default: 500000)" in flat
    assert "--seed N Seed of the weights, dropout and data order. (default: 1024; Megatron-LM: 1234)" in flat
    assert "--swiglu / --no-swiglu" in flat and "--eod-mask-loss / --no-eod-mask-loss" in flat
    assert "--use-pure-fp16 / --no-use-pure-fp16, --fp16 / --no-fp16" in flat
    assert re.search(r"--eod-mask-loss / --no-eod-mask-loss .*?\(default: on; Megatron-LM: off\)", flat)
    assert "--sharding-stage {1,2,3}" in flat and "--normalization {LayerNorm,RMSNorm}" in flat
    assert "Choices: GPT2BPETokenizer, SentencePieceTokenizer" in flat  # long choice lists in the help text
    assert re.search(r"--ffn-hidden-size N Width of the MLP; default 4 x hidden_size\. \(default: derived\)", flat)
    assert re.search(r"--save-steps, --save-interval N .*?\(default: none\)", flat)
    assert "(default: local_batch_size)" in flat  # micro_batch_size: from the table of None defaults
    assert "--adam-epsilon, --adam-eps X AdamW epsilon. (default: 1e-08)" in flat
    assert "%" not in help_text.replace("%%", "")
    assert flat.count("(default: ") == len(LEAVES)
    defaults = parse_config([])
    for name in NONE_DEFAULTS:  # the table names leaves whose default is None
        assert get(defaults, name) is None, name


def test_megatron_only_flags_are_hidden_and_the_epilog_says_where_they_are(help_text):
    listed = set(invocations(help_text))
    for flag in [*megatron_flags.NO_EFFECT, *megatron_flags.ABSENT, *megatron_flags.DERIVED]:
        assert flag not in listed, flag
    assert "--tensor-model-parallel-size" in listed  # Megatron-LM's names that are ours are aliases
    assert "docs/megatron.md" in help_text.split("Distributed.sharding:")[1]


def test_the_namespace_holds_only_what_was_given():
    parser = build_parser()
    assert vars(parser.parse_args([])) == {"override": []}
    given = vars(parser.parse_args(["--tp", "2", "--no-swiglu", "--data-path", "1", "a", "--hidden-size=8"]))
    assert given == {"override": [], "mp_degree": "2", "swiglu": False, "input_dir": ["1", "a"], "hidden_size": "8"}
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--help"])
    assert exit_.value.code == 0


# ---------------------------------------------------------------------------------------- unknown names


def unknown(*argv: str) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config(list(argv))
    return str(err.value)


def test_other_frameworks_names_get_ours():
    text = unknown("--precision", "bf16")
    assert "'--bf16' or '--fp16'" in text and "adam" not in text
    assert "'--bf16' or '--fp16'" in unknown("--mixed_precision", "bf16") and "--bf16" in unknown("--dtype=bf16")
    assert "'--global-batch-size' or '--micro-batch-size'" in unknown("--batch-size", "8")
    assert "'--num-train-epochs'" in unknown("--epochs", "3")
    assert "'--max-steps'" in unknown("--max-iters", "3")
    assert "'--max-lr'" in unknown("--learning-rate", "1e-3")
    assert "did you mean '--output-dir'?" in unknown("--out-dir", "x")


def test_a_real_typo_still_gets_its_flag():
    assert unknown("--hiden-size", "8") == "unknown argument '--hiden-size'; did you mean '--hidden-size'?"
    assert "did you mean '--num-attention-heads'?" in unknown("--num-atention-heads", "8")
    assert "did you mean '--min-lr'?" in unknown("--lr-min", "0")  # words swapped
    assert "did you mean '--decay-steps'?" in unknown("--lr-decay-steps", "9")  # an alias and its flag: once
    assert "did you mean '--max-seq-len'?" in unknown("--max-seq-length", "9")  # an abbreviated word
    assert "did you mean '--hidden-size'?" in unknown("--hidden_size", "8")


@pytest.mark.parametrize("name", ["--precision", "--zzz-unheard-of", "--tensorboard-logs", "--beta", "--rope-scaling"])
def test_no_far_fetched_hint(name):
    text = unknown(name, "1")
    assert "--adam-epsilon" not in text and "--tensor-fusion" not in text and "--adam-beta2" not in text
    assert not any(f"'{flag}'" in text for flag in [*megatron_flags.NO_EFFECT, *megatron_flags.ABSENT])


def test_yaml_keys_get_word_hints_too():
    keys = list(LEAVES) + list(SECTIONS)
    assert closest_key("hiden_size", keys) == "; did you mean 'hidden_size'?"
    assert closest_key("precision", keys) in ("", "; did you mean 'mix_precision'?")
    assert "epsilon" not in closest_key("precision", keys)


def test_the_common_names_table_names_real_flags_only():
    options = {s for a in build_parser()._actions for s in a.option_strings if not a.dest.startswith(MEGATRON_DEST)}
    for name, answer in COMMON_NAMES.items():
        assert name not in options and name == name.lower() and "_" not in name, name
        for quoted in re.findall(r"'([^']+)'", answer):
            assert quoted.split()[0] in options, (name, quoted)


# ---------------------------------------------------------------------------------------- every script's help

DRIVER = """
import contextlib, io, json, os, runpy, sys
out = {}
for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    buffer = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    sys.path.pop(0)
    out[script] = [code, buffer.getvalue()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def script_helps() -> dict[str, list]:
    """Every script's ``--help``, run as ``python SCRIPT --help`` would (runpy, as __main__) in one fresh
    interpreter, so torch is imported once."""
    env = {**os.environ, "COLUMNS": "100"}
    done = subprocess.run([sys.executable, "-c", DRIVER, *SCRIPTS], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_has_its_own_help(script_helps, script):
    code, text = script_helps[script]
    name = Path(script).name
    assert code == 0, text[-1000:]
    assert text.startswith(f"usage: {name} "), text[:300]
    assert "pretrain_gpt.py [-h] [-c CONFIG]" not in text and "--hidden-size N" not in text  # not the config's
    description = text.split("\n\n")[1]
    assert description.strip() and not description.startswith(("options:", "positional arguments:"))
    if script in TAKE_THE_CONFIGURATION:
        flat = " ".join(text.split())
        assert "Plus every pretrain_gpt.py configuration flag" in flat and "see python pretrain_gpt.py --help" in flat
