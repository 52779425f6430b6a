"""Flags generated from the schema, YAML loading, ``-o`` overrides, and the YAML dump.

Precedence: base configuration (built-in defaults, or the one the caller gives: a resumed run's saved
configuration, see ``megatron.checkpoint.resume``) < YAML file (``-c``) < ``-o Section.key=value`` < flags.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import math
import os
import re
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from megatron.config import help as config_help
from megatron.config import megatron_flags
from megatron.config.schema import Config
from megatron.config.syntax import RepeatedKey, read_yaml, string_list


class ConfigError(ValueError):
    """A user mistake in the configuration: the message says what and how to fix it."""


def fail(message: str) -> typing.NoReturn:
    raise ConfigError(message)


@dataclass(frozen=True)
class Leaf:
    """One configurable value: its YAML path (section keys then the leaf name) and type."""

    path: tuple[str, ...]  # YAML keys, e.g. ("Optimizer", "lr", "max_lr")
    attrs: tuple[str, ...]  # dataclass attributes, e.g. ("optimizer", "lr", "max_lr")
    type: Any
    help: str
    choices: tuple | None

    @property
    def name(self) -> str:
        return self.path[-1]

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def dotted(self) -> str:
        return ".".join(self.path)


# Short and Megatron-LM names -> leaf name.
ALIASES: dict[str, str] = {
    "--tp": "mp_degree",
    "--tensor-model-parallel-size": "mp_degree",
    "--pp": "pp_degree",
    "--pipeline-model-parallel-size": "pp_degree",
    "--cp": "context_parallel_size",
    "--dp": "dp_degree",
    "--data-parallel-size": "dp_degree",
    "--vpp": "virtual_pp_degree",
    "--virtual-pipeline-model-parallel-size": "virtual_pp_degree",
    "--lr": "max_lr",
    "--lr-decay-iters": "decay_steps",
    "--lr-warmup-fraction": "warmup_rate",
    "--lr-warmup-iters": "warmup_steps",
    "--lr-decay-style": "decay_style",
    "--train-iters": "max_steps",
    "--seq-length": "max_seq_len",
    "--data-path": "input_dir",
    "--save": "output_dir",
    "--load": "ckpt_dir",
    "--save-interval": "save_steps",
    "--log-interval": "logging_freq",
    "--eval-interval": "eval_freq",
    "--clip-grad": "grad_clip",
    "--fp16": "use_pure_fp16",
    "--adam-eps": "adam_epsilon",
    "--hidden-dropout": "hidden_dropout_prob",
    "--attention-dropout": "attention_probs_dropout_prob",
    "--init-method-std": "initializer_range",
    "--initial-loss-scale": "scale_loss",
    "--sharding": "sharding_degree",
    "--norm-epsilon": "layernorm_epsilon",
    "--lr-warmup-init": "warmup_init",
    "--lr-decay-samples": "decay_samples",
    "--lr-warmup-samples": "warmup_samples",
    "--lr-wsd-decay-iters": "wsd_decay_steps",
    "--lr-wsd-decay-samples": "wsd_decay_samples",
    "--lr-wsd-decay-style": "wsd_decay_style",
    "--num-virtual-stages-per-pipeline-rank": "virtual_pp_degree",
    "--yarn-original-max-position-embeddings": "original_max_position_embeddings",
    "--hybrid-layer-pattern": "hybrid_override_pattern",  # Megatron-LM's newer name of it
}
MEGATRON_DEST = "megatron:"  # argparse dest prefix of the flags of megatron_flags' tables


DATA_PATH_LEAVES = ("input_dir", "train_data_path", "valid_data_path", "test_data_path")


def iter_leaves(cls: type = Config, path: tuple = (), attrs: tuple = ()) -> Iterator[Leaf]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            yield from iter_leaves(hints[f.name], path + (f.metadata["section"],), attrs + (f.name,))
        else:
            yield Leaf(path + (f.name,), attrs + (f.name,), hints[f.name], f.metadata["help"],
                       f.metadata.get("choices"))


LEAVES: dict[str, Leaf] = {leaf.name: leaf for leaf in iter_leaves()}
SECTIONS: set[str] = {key for leaf in LEAVES.values() for key in leaf.path[:-1]}


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def coerce(leaf: Leaf, value: Any) -> Any:
    """Convert a YAML or command-line value to the leaf's type, or raise ConfigError."""
    tp, optional = _strip_optional(leaf.type)
    where = leaf.dotted
    if tp is str and leaf.choices and isinstance(value, str) and value in leaf.choices:
        return value  # a choice spelled like an empty value: position_embedding_type none
    if isinstance(value, (list, dict, tuple, set)) and tp in (bool, int, float, str):
        raise ConfigError(f"{where} must be a single {tp.__name__}, got a {type(value).__name__}.")
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
        if optional:
            return None
        raise ConfigError(f"{where} cannot be empty; give a {getattr(tp, '__name__', tp)}.")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{where} must be true or false, got {value!r}.")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, float) and value.is_integer():
            number = int(value)
        else:
            try:
                number = int(str(value))
            except ValueError:
                raise ConfigError(f"{where} must be an integer, got {value!r}.") from None
        if leaf.choices and number not in leaf.choices:
            raise ConfigError(f"{where} must be one of {', '.join(map(str, leaf.choices))}, got {number}.")
        return number
    if tp is float:
        try:
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            number = float(value) if numeric else float(str(value))
        except ValueError:
            raise ConfigError(f"{where} must be a number, got {value!r}.") from None
        if not math.isfinite(number):  # nan compares false with every bound a later check would test
            raise ConfigError(f"{where} must be a finite number, got {value!r}.")
        return number
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where} must be a string, got {value!r}.")
        text = str(value)
        if leaf.choices and text not in leaf.choices:
            raise ConfigError(f"{where} must be one of {', '.join(leaf.choices)}, got {text!r}.")
        return text
    if typing.get_origin(tp) is list:
        items = [w for v in (value if isinstance(value, list) else [value]) for w in re.split(r"[\s,]+", str(v)) if w]
        names = typing.get_args(tp) == (str,)
        try:
            return string_list(items, leaf.choices) if names else [typing.get_args(tp)[0](v) for v in items]
        except (TypeError, ValueError) as error:
            raise ConfigError(f"{where}: {error}" if names else f"{where} must be a list of numbers, got {value!r}.") \
                from None
    raise TypeError(f"unsupported config type {tp} for {where}")


def set_value(config: Config, leaf: Leaf, value: Any) -> None:
    """Set ``leaf`` of ``config`` to ``value`` coerced to the leaf's type (ConfigError naming the path)."""
    obj = config
    for attr in leaf.attrs[:-1]:
        obj = getattr(obj, attr)
    setattr(obj, leaf.attrs[-1], coerce(leaf, value))


def get(config: Config, name: str) -> Any:
    obj = config
    for attr in LEAVES[name].attrs:
        obj = getattr(obj, attr)
    return obj


def flatten_yaml(tree: dict, source: str) -> list[tuple[Leaf, Any]]:
    """The (leaf, value) pairs of a FleetX-style YAML tree (with or without the ``PreTraining:`` wrapper);
    a key in the wrong section, or unknown, is a ConfigError naming ``source`` and the closest valid key."""
    if set(tree) == {"PreTraining"}:
        tree = tree["PreTraining"] or {}
    return list(_flatten(tree, (), source))


def _flatten(tree: dict, path: tuple[str, ...], source: str) -> Iterator[tuple[Leaf, Any]]:
    for key, value in tree.items():
        key = str(key)
        if key in LEAVES:
            leaf = LEAVES[key]
            if leaf.path[:-1] != path:
                want = ".".join(leaf.path[:-1]) or "the top level"
                got = ".".join(path) or "the top level"
                raise ConfigError(f"{source}: '{key}' belongs under {want}, found under {got}.")
            yield leaf, value
        elif key in SECTIONS:
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: '{key}' is a section and needs nested keys, got {value!r}.")
            yield from _flatten(value, path + (key,), source)
        else:
            hint = config_help.closest_key(key, list(LEAVES) + list(SECTIONS))
            raise ConfigError(f"{source}: unknown key '{key}'{hint}")


def load_yaml(path: str) -> list[tuple[Leaf, Any]]:
    """Read a FleetX-style YAML file (with or without the PreTraining: wrapper)."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' does not exist; check the path given to -c.")
    with open(path) as f:
        try:
            tree = read_yaml(f) or {}
        except RepeatedKey as err:
            raise ConfigError(f"{path} line {err.line}: key '{err.key}' is repeated (first at line {err.first_line}); "
                              f"give each key once per section (a repeated one would silently replace the first)."
                              ) from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path} must hold a mapping of sections, got {type(tree).__name__}.")
    return flatten_yaml(tree, path)


def parse_override(text: str) -> tuple[Leaf, Any]:
    """``Section.key=value`` (the section path may be shortened to just the key)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like Section.key=value.")
    dotted, raw = text.split("=", 1)
    keys = [k for k in dotted.strip().split(".") if k]
    if keys and keys[0] == "PreTraining":
        keys = keys[1:]
    name = keys[-1] if keys else ""
    if name not in LEAVES:
        raise ConfigError(f"override '{text}': unknown key '{name}'{config_help.closest_key(name, list(LEAVES))}")
    leaf = LEAVES[name]
    if len(keys) > 1 and tuple(keys) != leaf.path:
        raise ConfigError(f"override '{text}': the key is {leaf.dotted}.")
    try:
        return leaf, read_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override '{text}': the value is not valid YAML: {str(err).splitlines()[0]}") from None


# Every spelling of a negative or non-finite number (-1, -1e-3, -.5, -inf, -nan, -Infinity): argparse takes
# only -1 and -0.5 for a value, and reads the others as an unknown option ("--lr: expected one argument"). With it,
# the value reaches coerce() and validation, which refuse it naming the key and its range; so does --window-size -1,0.
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$|^-\d+(,\s*-?\d+)+$",
                              re.IGNORECASE)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_NUMBER  # argparse's one test of "a value, not an option"

    def error(self, message: str) -> typing.NoReturn:  # one line, no usage dump
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    """The command line of pretrain_gpt.py: -c, -o, one flag per schema leaf (grouped by section in --help, with
    its aliases and default) and Megatron-LM's flags of megatron_flags' tables (hidden). Nothing has a default
    in the namespace (``argument_default=SUPPRESS``): it holds exactly what was given."""
    parser = _Parser(prog="pretrain_gpt.py", allow_abbrev=False, argument_default=argparse.SUPPRESS,
                     usage=config_help.USAGE, description=config_help.DESCRIPTION, epilog=config_help.EPILOG,
                     formatter_class=config_help.Formatter)
    parser.add_argument("-c", "--config", metavar="CONFIG", help="YAML config file (FleetX structure).")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="Section.key=value",
                        help="Override one YAML value (Model.hidden_size=512, or just hidden_size=512); may repeat.")
    for flag in [*megatron_flags.NO_EFFECT, *megatron_flags.ABSENT, *megatron_flags.DERIVED]:
        parser.add_argument(flag, dest=MEGATRON_DEST + flag, nargs="*", help=argparse.SUPPRESS)
    aliases: dict[str, list[str]] = {}
    for alias, name in ALIASES.items():
        aliases.setdefault(name, []).append(alias)
    defaults, groups = Config(), {}
    for leaf in LEAVES.values():
        group = config_help.group_of(parser, groups, leaf.path[:-1])
        names = [leaf.flag] + aliases.get(leaf.name, [])
        tp, _ = _strip_optional(leaf.type)
        default = config_help.default_text(leaf.name, leaf.help, get(defaults, leaf.name),
                                           megatron_flags.MEGATRON_DEFAULTS.get(leaf.name))
        help_text = config_help.flag_help(leaf.help, leaf.choices, default)
        if tp is bool:
            group.add_argument(*names, dest=leaf.name, action=argparse.BooleanOptionalAction, help=help_text)
            continue
        metavar = config_help.metavar(leaf.name, tp, leaf.choices)
        if typing.get_origin(tp) is list:
            group.add_argument(*names, dest=leaf.name, nargs="*", metavar=metavar, help=help_text)
        elif leaf.name in DATA_PATH_LEAVES:  # Megatron's --data-path takes 'w1 p1 w2 p2'
            group.add_argument(*names, dest=leaf.name, nargs="+", metavar="PREFIX", help=help_text)
        else:  # values are coerced (and their choices checked) by coerce(), so argparse takes strings
            group.add_argument(*names, dest=leaf.name, metavar=metavar, help=help_text)
    return parser


@functools.cache
def _parser() -> argparse.ArgumentParser:
    """The parser, built once per process (parsing leaves it unchanged; building it takes 30 ms)."""
    return build_parser()


def parse_config(argv: Sequence[str] | None = None, base: Config | None = None, *,
                 warnings: list[str] | None = None) -> Config:
    """Build the (not yet validated) Config from a command line: ``base`` (default: the built-in defaults;
    left unchanged) under the YAML file, the ``-o`` overrides and the flags. What is suspicious but not
    wrong (an empty YAML file) is appended to ``warnings`` when a list is given."""
    if base is not None and not isinstance(base, Config):
        raise TypeError(f"parse_config: base must be a Config or None, got {type(base).__name__}.")
    import sys

    argv = megatron_flags.rewrite(list(sys.argv[1:] if argv is None else argv))
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    given = vars(args)
    megatron_given = {k[len(MEGATRON_DEST):]: given.pop(k) for k in list(given) if k.startswith(MEGATRON_DEST)}
    notices, refused = _megatron_flags(megatron_given, unknown, megatron_flags.accepted_leaves(given))
    if unknown and not any(u.startswith("-") for u in unknown):
        raise ConfigError(_stray_words(argv, unknown))
    if unknown or refused:
        them = "them" if sum(map(len, refused.values())) > 1 else "it"
        named = ", ".join(f"{', '.join(flags)} ({why})" for why, flags in refused.items())
        absent = (f"{'Not' if unknown else 'not'} available here: {named}; remove {them} "
                  f"(docs/megatron.md lists Megatron-LM's flags)." if refused else "")
        ours = {s: a.dest for a in parser._actions for s in a.option_strings if not a.dest.startswith(MEGATRON_DEST)}
        unknown_text = config_help.unknown_message(unknown, ours)  # hidden Megatron-LM flags are never suggested
        raise ConfigError(" ".join(part for part in (unknown_text, absent) if part))
    if megatron_flags.fp8_recipe_refusal(given.get("fp8_recipe")):  # given here: refused with FP8 off too
        raise ConfigError(megatron_flags.fp8_recipe_refusal(given["fp8_recipe"]))
    if "config" in given and not load_yaml(given["config"]) and warnings is not None:
        warnings.append(f"config file '{given['config']}' sets nothing: every value is a default or a flag.")
    if base is None and megatron_flags.is_megatron_command_line(argv):
        base = megatron_defaults()
        applied = {k: v for k, v in megatron_flags.MEGATRON_DEFAULTS.items() if given.get(k) is None}
        if applied:  # those the command line sets itself are not defaults
            notices.append("Megatron-LM command line (it gives --train-iters or --train-samples): Megatron-LM's "
                           "defaults apply where FleetX's differ: "
                           + ", ".join(f"{k} {_shown(v)}" for k, v in applied.items()) + " (docs/megatron.md).")
    config = _layered(Config() if base is None else copy.deepcopy(base), given)
    notices += _derive_megatron(config, megatron_given)
    if warnings is not None:
        warnings += notices
    return config


def _stray_words(argv: list[str], words: list[str]) -> str:
    """The error for words that follow a flag's value (``--cp-comm-type p2p a2a``, ``--num-layers 2 3``): argparse
    would leave them unused, and the run would quietly train with the first value only."""
    where, flag = "", "each flag"
    if words[0] in argv:
        i = argv.index(words[0])
        j = next((j for j in range(i - 1, -1, -1) if argv[j].startswith("-")), None)
        if j is not None:
            where, flag = f" after {' '.join(argv[j:i])}", argv[j].split("=")[0]
    shown = ", ".join(f"'{w}'" for w in words)
    return (f"unexpected value{'s' if len(words) > 1 else ''} {shown}{where}: {flag} takes one value here (only "
            f"the data paths and --rampup-batch-size take several); remove the extra words.")


def _shown(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def megatron_defaults() -> Config:
    """The built-in defaults with Megatron-LM's values where FleetX's differ (``MEGATRON_DEFAULTS``)."""
    config = Config()
    for name, value in megatron_flags.MEGATRON_DEFAULTS.items():
        set_value(config, LEAVES[name], value)
    return config


def _megatron_flags(given: dict[str, list[str]], unknown: list[str],
                    leaves: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """(notices, refused) for the Megatron flags of ``megatron_flags``' tables on the command line: the
    accepted-without-effect ones listed in one notice, the absent ones (unless at their no-op value) refused
    by name, those of one feature together. Unknown flags that name an absent Megatron feature (``--moe-*``) are
    moved from ``unknown``. ``leaves``: our own flags given that do nothing here (listed last)."""
    accepted, said, refused = [], [], {}  # refused: why -> the flags (with their values) refused for it
    for flag, values in given.items():
        shown = " ".join([flag, *values])
        instead = megatron_flags.said_instead(flag, values)
        if instead:
            said.append(instead)
        elif flag in megatron_flags.NO_EFFECT:
            accepted.append(shown)
        elif flag in megatron_flags.ABSENT:
            entry = megatron_flags.ABSENT[flag]
            if " ".join(values) in entry.noop:
                accepted.append(shown)
            else:
                noop = f"; accepted only as {flag} {' or '.join(entry.noop)}" if entry.noop else ""
                refused.setdefault(entry.feature + noop, []).append(shown)
    kept, after_refused, accepted = [], False, accepted + leaves
    for arg in unknown:
        feature = megatron_flags.absent_feature(arg.split("=")[0]) if arg.startswith("--") else None
        if feature:
            refused.setdefault(feature, []).append(arg.split("=")[0])
        elif not (after_refused and not arg.startswith("-")):  # a refused flag's values go with it
            kept.append(arg)
        after_refused = bool(feature) or (after_refused and not arg.startswith("-"))
    unknown[:] = kept
    notices = [f"accepted, no effect here: {', '.join(accepted)} (docs/megatron.md says why)."] if accepted else []
    return [*notices, *said], refused


def _derive_megatron(config: Config, given: dict[str, list[str]]) -> list[str]:
    """Megatron flags that set values from others (``megatron_flags.DERIVED``); the notices to print."""
    try:
        values, notices = megatron_flags.derived(given, config.model.num_layers, config.distributed.pp_degree)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    for name, value in values.items():
        set_value(config, LEAVES[name], value)
    return notices


def _layered(config: Config, given: dict) -> Config:
    """``config`` with the YAML file (-c), then the -o overrides, then the flags applied."""
    given = dict(given)
    if "config" in given:
        for leaf, value in load_yaml(given.pop("config")):
            set_value(config, leaf, value)
    for text in given.pop("override", []):
        set_value(config, *parse_override(text))
    for name, value in given.items():
        if name in DATA_PATH_LEAVES and isinstance(value, list):  # 'w1 p1 w2 p2', one argument or several
            value = " ".join(value)
        set_value(config, LEAVES[name], value)
    return config


def to_dict(config: Config) -> dict:
    """The nested YAML structure of a config (the inverse of load_yaml)."""
    tree: dict = {}
    for leaf in LEAVES.values():
        node = tree
        for key in leaf.path[:-1]:
            node = node.setdefault(key, {})
        node[leaf.name] = get(config, leaf.name)
    return tree


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False, default_flow_style=None)


def save_yaml(config: Config, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(to_yaml(config))
    os.replace(tmp, path)
