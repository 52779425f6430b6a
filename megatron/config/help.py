"""The command line's words to the user: ``pretrain_gpt.py --help`` and the hint for an unknown name.

``--help`` has one argument group per configuration section (the schema's section help texts), each flag
with its aliases, help, choices and default; Megatron-LM's flags that are not ours stay hidden (docs/megatron.md
lists them). An unknown flag or YAML key gets a suggestion only when a known name is really close, compared
word by word (``--hiden-size`` -> ``--hidden-size``, never ``--precision`` -> ``--adam-epsilon``), and
``COMMON_NAMES`` maps other frameworks' names to ours (``--precision`` -> ``--bf16`` or ``--fp16``).

Imports only the schema: ``cli`` builds its parser with what is here.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import textwrap
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from megatron.config.schema import Config

USAGE = "%(prog)s [-h] [-c CONFIG] [-o Section.key=value ...] [--flag value ...]"
DESCRIPTION = """\
Pretrain a GPT. The configuration is FleetX-style YAML (-c); every key of it is
also a flag: Model.hidden_size is --hidden-size. Precedence, lowest first:
  built-in defaults (Megatron-LM's where they differ, for a command line
    with --train-iters or --train-samples)
  < the saved configuration of the run resumed from --load
  < the YAML file (-c)
  < -o Section.key=value overrides
  < flags."""
EPILOG = textwrap.fill(
    "Booleans are --x / --no-x. A default 'derived' is computed during validation from other values (the help "
    "says how); 'none' is unset (the feature off). 'Megatron-LM: X' is the default for a command line with "
    "--train-iters or --train-samples. Megatron-LM's flags that are ours are shown above as aliases; the others "
    "(accepted without effect, or refused as features absent here) are not listed: docs/megatron.md lists every "
    "one. docs/configuration.md is the same reference as a table.", 79, break_on_hyphens=False)
# The one line of a tool that also takes the whole training configuration (its epilog).
CONFIG_FLAGS_NOTE = ("Plus every pretrain_gpt.py configuration flag (and -c CONFIG, -o Section.key=value); see "
                     "python pretrain_gpt.py --help.")
TOP_LEVEL = "run"  # the group title of the unsectioned keys

# None defaults whose help text does not say how they are derived.
NONE_DEFAULTS = {
    "global_batch_size": "local_batch_size x data-parallel size",
    "local_batch_size": "global_batch_size / data-parallel size, else micro_batch_size, else 8",
    "micro_batch_size": "local_batch_size",
    "tokenizer_type": "GPT2BPETokenizer given --vocab-file and --merge-file, else none",
    "recompute_granularity": "full with --use-recompute",
}


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Each flag once with its aliases and one metavar (``--mp-degree, --tp N``), booleans as pairs
    (``--swiglu / --no-swiglu``); descriptions are kept as written."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34)

    def _split_lines(self, text: str, width: int) -> list[str]:  # never split a flag at its hyphens
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        strings = action.option_strings
        if isinstance(action, argparse.BooleanOptionalAction):
            return ", ".join(f"{a} / {b}" for a, b in zip(strings[::2], strings[1::2]))
        if action.nargs == 0:
            return ", ".join(strings)
        return ", ".join(strings) + " " + self._format_args(action, self._get_default_metavar_for_optional(action))


def section_helps(cls: type = Config, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], str]:
    """Each section's YAML path -> the schema's help text of it."""
    hints = typing.get_type_hints(cls)
    out: dict[tuple[str, ...], str] = {}
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            key = path + (f.metadata["section"],)
            out[key] = f.metadata["help"]
            out.update(section_helps(hints[f.name], key))
    return out


def group_of(parser: argparse.ArgumentParser, groups: dict, section: tuple[str, ...]) -> Any:
    """The argument group of a section, made on first use (in schema order)."""
    if section not in groups:
        if section:
            dotted = ".".join(section)
            text = f"{section_helps()[section]} YAML: {dotted}.<key>, or -o {dotted}.<key>=value."
            groups[section] = parser.add_argument_group(dotted, textwrap.fill(text, 77, break_on_hyphens=False))
        else:
            groups[section] = parser.add_argument_group(
                TOP_LEVEL, "The run itself: keys at the top level of the YAML (-o key=value).")
    return groups[section]


def shown(value: Any) -> str:
    """A value as the help prints it: integer floats without '.0', booleans on/off, lists space-separated."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, list):
        return " ".join(map(shown, value)) or "[]"
    return str(value)


def default_text(name: str, help_text: str, value: Any, megatron: Any = None) -> str:
    """``(default: X)``; None is 'derived' when the help text says how (or NONE_DEFAULTS does), else 'none';
    ``megatron``: Megatron-LM's default, when it differs."""
    if value is not None:
        text = shown(value)
    elif name in NONE_DEFAULTS:
        text = NONE_DEFAULTS[name]
    else:
        text = "derived" if re.search(r"\bdefault\b(?! None)", help_text, re.IGNORECASE) else "none"
    more = f"; Megatron-LM: {shown(megatron)}" if megatron is not None else ""
    return f"(default: {text}{more})"


def metavar(name: str, tp: Any, choices: tuple | None) -> str:
    if choices and len(",".join(map(str, choices))) <= 24:
        return "{" + ",".join(map(str, choices)) + "}"
    if choices:
        return "NAME"
    if tp is int or typing.get_origin(tp) is list:
        return "N"
    if tp is float:
        return "X"
    return "PATH" if name.endswith(("_dir", "_path", "_file", "_model")) else "TEXT"


def flag_help(help_text: str, choices: tuple | None, default: str) -> str:
    listed = f" Choices: {', '.join(map(str, choices))}." if choices and len(",".join(map(str, choices))) > 24 else ""
    return f"{help_text}{listed} {default}".replace("%", "%%")


# --- hints for unknown names --------------------------------------------------------------------------------
_PRECISION = "'--bf16' or '--fp16' (fp32 by default)"
_MAX_STEPS = "'--max-steps' (or '--train-iters')"
_SAVE = "'--save' (--output-dir) to save, '--load' (--ckpt-dir) to resume"
# Other frameworks' names (PyTorch scripts, Hugging Face, nanoGPT, DeepSpeed, Lightning) -> ours. Every quoted
# name in a value is one of our flags (a test checks).
COMMON_NAMES: dict[str, str] = {
    **dict.fromkeys(("--precision", "--mixed-precision", "--dtype", "--amp", "--half"), _PRECISION),
    "--fp32": "neither '--bf16' nor '--fp16' (fp32 is the default)",
    "--bfloat16": "'--bf16'", "--float16": "'--fp16'",
    "--batch-size": "'--global-batch-size' or '--micro-batch-size'",
    "--train-batch-size": "'--global-batch-size'",
    "--per-device-train-batch-size": "'--micro-batch-size'",
    **dict.fromkeys(("--gradient-accumulation-steps", "--grad-accum"),
                    "'--global-batch-size' with '--micro-batch-size' (accumulation steps = global / (micro x "
                    "data-parallel size))"),
    **dict.fromkeys(("--epochs", "--num-epochs", "--max-epochs"), "'--num-train-epochs'"),
    **dict.fromkeys(("--max-iters", "--iters", "--steps", "--num-steps", "--total-steps", "--train-steps",
                     "--training-steps", "--max-train-steps", "--num-train-steps"), _MAX_STEPS),
    **dict.fromkeys(("--block-size", "--context-length", "--ctx-len", "--n-ctx", "--n-positions"),
                    "'--max-seq-len' (or '--seq-length')"),
    **dict.fromkeys(("--learning-rate", "--peak-lr"), "'--max-lr' (or '--lr')"),
    "--min-learning-rate": "'--min-lr'",
    "--warmup": "'--warmup-steps' or '--warmup-rate'", "--warmup-ratio": "'--warmup-rate'",
    **dict.fromkeys(("--lr-scheduler", "--lr-schedule", "--scheduler", "--lr-scheduler-type"), "'--decay-style'"),
    **dict.fromkeys(("--max-grad-norm", "--gradient-clipping", "--grad-norm-clip"), "'--grad-clip' (or '--clip-grad')"),
    "--wd": "'--weight-decay'",
    **dict.fromkeys(("--cp-degree", "--context-parallel-degree", "--sep-degree", "--cp-size",
                     "--context-parallel", "--ulysses-degree"),
                    "'--context-parallel-size' (YAML Distributed.context_parallel_size)"),
    **dict.fromkeys(("--n-layer", "--n-layers", "--depth"), "'--num-layers'"),
    **dict.fromkeys(("--n-embd", "--d-model", "--dim", "--embed-dim", "--hidden-dim", "--width"), "'--hidden-size'"),
    **dict.fromkeys(("--n-head", "--n-heads", "--heads"), "'--num-attention-heads'"),
    **dict.fromkeys(("--intermediate-size", "--ffn-dim", "--mlp-dim"), "'--ffn-hidden-size'"),
    "--dropout": "'--hidden-dropout-prob' and '--attention-probs-dropout-prob'",
    **dict.fromkeys(("--checkpoint-dir", "--ckpt-dir-save", "--save-path"), _SAVE),
    **dict.fromkeys(("--resume", "--resume-from", "--resume-from-checkpoint", "--init-from"), "'--load' (--ckpt-dir)"),
    **dict.fromkeys(("--save-every", "--save-freq", "--checkpoint-interval", "--ckpt-interval"),
                    "'--save-steps' (or '--save-interval')"),
    **dict.fromkeys(("--log-every", "--logging-steps", "--log-steps"), "'--logging-freq' (or '--log-interval')"),
    **dict.fromkeys(("--eval-every", "--eval-steps"), "'--eval-freq' (or '--eval-interval')"),
    **dict.fromkeys(("--data-dir", "--dataset", "--data-prefix"), "'--data-path' (or '--input-dir')"),
    **dict.fromkeys(("--gradient-checkpointing", "--activation-checkpointing", "--recompute"), "'--use-recompute'"),
    **dict.fromkeys(("--zero-stage", "--zero"), "'--sharding-stage' with '--sharding-degree' (ZeRO)"),
    **dict.fromkeys(("--nproc-per-node", "--world-size", "--num-gpus", "--gpus", "--nnodes"),
                    "torchrun's --nproc-per-node and --nnodes: the launcher sets the world size"),
    "--cpu": "'--device cpu'", **dict.fromkeys(("--gpu", "--cuda"), "'--device gpu'"),
    "--save-dir": "'--save' (--output-dir)", "--log-dir": "'--tensorboard-dir' (metrics.jsonl is in '--output-dir')",
    "--data": "'--data-path' (or '--input-dir')", "--wandb": "'--wandb-project'",
    "--tokenizer": "'--tokenizer-type' with its files ('--vocab-file' and '--merge-file', or '--tokenizer-model')",
    "--rope": "'--position-embedding-type rope'", "--rms-norm": "'--normalization RMSNorm'",
    "--gqa": "'--group-query-attention' with '--num-query-groups'",
    **dict.fromkeys(("--num-kv-heads", "--n-kv-heads", "--kv-heads", "--num-key-value-heads"),
                    "'--num-query-groups' with '--group-query-attention'"),
    "--gbs": "'--global-batch-size'", "--mbs": "'--micro-batch-size'",
}


def common_name(name: str) -> str | None:
    """Our flags for another framework's ``name`` (any case, '_' or '-'); None when the table lacks it."""
    return COMMON_NAMES.get("--" + name.lstrip("-").lower().replace("_", "-"))


def _words(name: str) -> list[str]:
    return [w for w in re.split(r"[-_]+", name.lower()) if w]


def _same_word(a: str, b: str) -> int:
    """2: the same word, or a typo of it (hiden/hidden, layer/layers); 1: an abbreviation (len/length,
    seq/sequence), weaker, as a prefix may also be a word glued to another (tensorboard/tensor); 0: not."""
    if a == b:
        return 2
    if re.sub(r"\D", "", a) != re.sub(r"\D", "", b):  # beta1/beta2, fp16/fp32: never a typo
        return 0
    short, long = sorted((a, b), key=len)
    if len(short) >= 4 and difflib.SequenceMatcher(None, a, b).ratio() >= 0.8:
        return 2
    return int(len(short) >= 3 and long.startswith(short) and len(long) - len(short) <= 5)


def _word_distance(u: list[str], c: list[str]) -> tuple[int, int, int]:
    """(words inserted, deleted or replaced; words matched; of them, matched strongly) of the cheapest
    alignment of ``u`` to ``c``."""
    best = [[(0, 0, 0)] * (len(c) + 1) for _ in range(len(u) + 1)]
    for i in range(len(u) + 1):
        for j in range(len(c) + 1):
            if i == 0 or j == 0:
                best[i][j] = (i + j, 0, 0)
                continue
            cost, matched, strong = best[i - 1][j - 1]
            same = _same_word(u[i - 1], c[j - 1])
            options = [(cost + (not same), matched + bool(same), strong + (same == 2)),
                       (best[i - 1][j][0] + 1, *best[i - 1][j][1:]), (best[i][j - 1][0] + 1, *best[i][j - 1][1:])]
            best[i][j] = min(options, key=lambda o: (o[0], -o[1], -o[2]))
    return best[len(u)][len(c)]


def _closeness(name: str, candidate: str) -> float | None:
    """0: every word matches (in any order); 1: one word missing or extra (the others matching, one of them not
    by abbreviation only), or the first two or more words of a longer flag; 1.5: one word different, with two
    others matching; None: not close. Words glued or split differently (--numlayers) count as 0 when the
    letters match."""
    u, c = _words(name), _words(candidate)
    if not u or not c:
        return None
    distance, matched, strong = _word_distance(u, c)
    if distance == 0 or sorted(u) == sorted(c):  # --lr-min for --min-lr
        return 0
    if difflib.SequenceMatcher(None, "".join(u), "".join(c)).ratio() >= 0.9:
        return 0
    if distance == 1 and strong >= 1 and len(u) != len(c):
        return 1
    if len(u) >= 2 and len(c) > len(u) and all(_same_word(a, b) == 2 for a, b in zip(u, c)):
        return 1  # the first words of a long flag: --untie-embeddings
    if distance == 1 and strong >= 1 and matched >= 2:
        return 1.5
    return None


def close_names(name: str, candidates: Iterable[str] | Mapping[str, Any], most: int = 3) -> list[str]:
    """The known names really close to ``name``, best first: those at the smallest word distance, one per
    meaning (``candidates`` may map each name to what it sets, so an alias and its flag count once); none
    when more than ``most`` are equally close (a guess among many is no help)."""
    meaning = candidates if isinstance(candidates, Mapping) else {c: c for c in candidates}
    scored: dict[Any, tuple[float, float, str]] = {}
    for candidate, target in meaning.items():
        closeness = _closeness(name, candidate)
        if closeness is None:
            continue
        key = (closeness, -difflib.SequenceMatcher(None, name.lower(), candidate.lower()).ratio(), candidate)
        if target not in scored or key < scored[target]:
            scored[target] = key
    if not scored:
        return []
    best = min(k[0] for k in scored.values())
    names = [k[2] for k in sorted(k for k in scored.values() if k[0] == best)]
    return names if len(names) <= most else []


def hint(name: str, candidates: Iterable[str] | Mapping[str, Any], table: bool = True) -> str:
    """'did you mean ...?' without its punctuation around: the common-name table's answer (``table``), else the
    close names quoted ('--a' or '--b'); '' when there is none."""
    if table and name.startswith("--") and common_name(name):
        return f"did you mean {common_name(name)}?"
    names = close_names(name, candidates)
    quoted = " or ".join(f"'{n}'" for n in names)
    return f"did you mean {quoted}?" if names else ""


def closest_key(word: str, candidates: Sequence[str]) -> str:
    """'; did you mean ...' for an unknown YAML key: a close key, else another framework's name for one of ours."""
    found = hint(word, candidates, table=False)
    if not found and common_name(word):
        found = f"did you mean {common_name(word)}?"
    return f"; {found}" if found else ""


def unknown_message(unknown: list[str], flags: Sequence[str] | dict[str, str]) -> str:
    """Every unknown flag of the command line in one sentence, each with a hint when a known flag is really
    close or when it is another framework's name for one of ours (``help.hint``; a wrong hint is worse than
    none), so a script is fixed in one pass (the values that followed an unknown flag are not named again).
    ``flags``: the known flags, or each mapped to its dest (an alias and its flag are then suggested once)."""
    names = [u.split("=")[0] for u in unknown if u.startswith("-")] or unknown[:1]
    names = list(dict.fromkeys(names))
    if not names:
        return ""
    meaning = flags if isinstance(flags, dict) else {f: f for f in flags}
    meaning = {f: d for f, d in meaning.items() if f.startswith("--")}  # a long flag is never meant as a one-letter one
    hints = {name: hint(name, meaning) if name.startswith("--") else "" for name in names}
    if len(names) == 1:
        return f"unknown argument '{names[0]}'; {hints[names[0]] or 'see --help for the flags.'}"
    described = [f"'{name}'" + (f" ({hints[name]})" if hints[name] else "") for name in names]
    return f"{len(names)} unknown arguments: {', '.join(described)}; see --help for the flags."
