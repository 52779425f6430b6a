"""Render the configuration reference (docs/configuration.md) from the schema.

    python -m megatron.config.docs > docs/configuration.md
    python -m megatron.config.docs --megatron > docs/megatron.md   (from megatron_flags' tables)
"""

from __future__ import annotations

from megatron.config import megatron_flags as flags
from megatron.config.cli import ALIASES, LEAVES, _strip_optional, get
from megatron.config.schema import Config

HEADER = """# Configuration reference

Generated from `megatron/config/schema.py` by `python -m megatron.config.docs`; a test keeps
it in step. Every key is a YAML leaf (at the path shown) and a flag. Precedence: built-in
default < `-c` YAML < `-o Section.key=value` < flags. A default of `None` is derived during
validation unless set. Where Megatron-LM's default differs it is shown too: it applies to a command line
that gives `--train-iters` or `--train-samples` (a Megatron-LM script; see docs/megatron.md).

What is refused, each in one line before anything starts (`pretrain_gpt.py: error: ...`, exit 2):

- **A key or a section given twice** in one mapping of a YAML file (`-c`, a checkpoint's `config.yaml`):
  `cfg.yaml line 4: key 'hidden_size' is repeated (first at line 2); ...`. YAML's usual last-wins would
  drop the first silently. Merge keys (`<<: *anchor`) keep their meaning.
- **A number out of its range**, however it is spelled: `--lr -1`, `--lr=-1e-3`, `--clip-grad -inf`,
  `--seed -5`, `nan`, `inf` (on the command line, in YAML as `-1`, `.nan`, `-.inf`, or in `-o`) all reach
  validation, which names the key and its range (`max_lr and min_lr must be >= 0, got -0.001 ...`,
  `Optimizer.grad_clip must be a finite number, got '-inf'.`). No numeric key takes a negative value or a
  non-finite one; keys unused by the run (`rotary_base` without rope, `wsd_decay_steps` without WSD) are
  checked too.
- **torchrun's environment set by hand or inconsistent**: `WORLD_SIZE`, `RANK`, `LOCAL_RANK`,
  `LOCAL_WORLD_SIZE` that are not integers, `RANK` or `LOCAL_RANK` out of range, `WORLD_SIZE > 1` without
  `RANK`, `LOCAL_RANK`, `MASTER_ADDR` or `MASTER_PORT`, a `MASTER_PORT` that is not a port: e.g.
  `WORLD_SIZE=2 is set but RANK and LOCAL_RANK and MASTER_ADDR and MASTER_PORT are not: the processes could
  not find each other; launch with torchrun ...`, at once, instead of a rendezvous that waits and ends in a
  traceback (`megatron/initialize.launch_env`, the one reader). All of them set but the other processes never
  started: the rendezvous waits `distributed_timeout_minutes`, then one line (`rank 0 of WORLD_SIZE=2 could not
  meet the other processes at host:port within distributed_timeout_minutes (10): ...`).
- **A data path with spaces** works: one argument of `--data-path` (`--data-path 0.5 "/my data/a" 0.5 /data/b`:
  in the weighted form the words between two weights are one prefix), unquoted in YAML (without weights, the runs
  of words that name existing data are joined), or quoted (`input_dir: "0.5 '/my data/a' 0.5 /data/b"`). A blend
  given as one argument (`--data-path "0.5 a 0.5 b"`) is still a blend. `--data-cache-path`, `--save` and
  `--load` take any path.
"""


def _type_name(tp) -> str:
    inner, optional = _strip_optional(tp)
    name = getattr(inner, "__name__", str(inner)).replace("typing.", "")
    if name == "list":
        name = "list[int]"
    return name + (" or None" if optional else "")


def render_markdown() -> str:
    defaults = Config()
    aliases: dict[str, list[str]] = {}
    for alias, name in ALIASES.items():
        aliases.setdefault(name, []).append(f"`{alias}`")
    lines = [HEADER]
    section = None
    for leaf in LEAVES.values():
        where = ".".join(leaf.path[:-1]) or "(top level)"
        if where != section:
            section = where
            lines += ["", f"## {where}", "", "| key | flag | type | default | meaning |",
                      "| --- | --- | --- | --- | --- |"]
        value = defaults
        for attr in leaf.attrs:
            value = getattr(value, attr)
        flag = ", ".join([f"`{leaf.flag}`"] + aliases.get(leaf.name, []))
        default = f"`{value}`"
        if leaf.name in flags.MEGATRON_DEFAULTS:
            default += f" (Megatron-LM: `{flags.MEGATRON_DEFAULTS[leaf.name]}`)"
        lines.append(f"| `{leaf.name}` | {flag} | {_type_name(leaf.type)} | {default} | {leaf.help} |")
    return "\n".join(lines) + "\n"


# --- docs/megatron.md -------------------------------------------------------------------------------------
MEGATRON_HEADER = """# Megatron-LM's flags here

Generated from `megatron/config/megatron_flags.py` by `python -m megatron.config.docs --megatron`; a test keeps it
in step with the tables the command line uses. A Megatron-LM `pretrain_gpt.py` script runs here unchanged:

- **implemented** flags mean what they mean in Megatron-LM;
- **accepted, no effect here** flags concern only Megatron's implementation; they are parsed and listed once
  at start ("accepted, no effect here: ...");
- **absent** flags name a feature this framework lacks; the run is refused with one line naming each (those
  of one feature together), except with the value that changes nothing (shown).

Every option of Megatron-LM core_v0.16.1's `pretrain_gpt.py` parser (680, read from the parser itself: a test
builds a command line of all of them and finds none unknown) is one of these, by name: {counts}. Every unknown
flag of a command line (a later Megatron-LM's, a typo) is reported in one message, each with its closest flag.

The `MODEL_ARGS` of a set of Megatron-LM's functional tests (`tests/unit/megatron_flag_sets.py`) parse and
validate here, or are refused by the absent flags alone; `tests/functional/test_megatron_script.py` trains three
of them, scaled down, unchanged otherwise: a Llama-shaped GPT, and the two DeepSeek-like ones (multi-latent
attention, DeepSeek-V3's router, multi-token prediction at tp 2 x pp 2 x vpp 4; Megatron FSDP, here ZeRO-3),
without their FP8 flags, which need a GPU.

## Defaults

A command line that gives `--train-iters` or `--train-samples` (every Megatron-LM script does; FleetX's is
`max_steps`) gets Megatron-LM's defaults where they differ from FleetX's; a YAML file, `-o` or a flag still
sets each of them. The run's log says so at start, and the resolved configuration it prints shows the values.

| key | FleetX default | Megatron-LM default |
| --- | --- | --- |
"""


def _fleetx_default(name: str) -> object:
    return get(Config(), name)


def _counts() -> str:
    """How many Megatron-LM flags each table holds, for the page's header."""
    implemented = len({*flags.IMPLEMENTED, *flags.REWRITES, *flags.DERIVED})
    return (f"{implemented} implemented, {len(flags.NO_EFFECT)} accepted without effect and {len(flags.ABSENT)} "
            f"absent (with the aliases of each)")


def render_megatron_markdown() -> str:
    """docs/megatron.md from the tables of ``megatron_flags``."""
    by_flag = {leaf.flag: leaf for leaf in LEAVES.values()}
    by_flag.update({"--no-" + leaf.flag[2:]: leaf for leaf in LEAVES.values()})
    by_flag.update({alias: LEAVES[name] for alias, name in ALIASES.items()})
    lines = [MEGATRON_HEADER.rstrip("\n").replace("{counts}", _counts())]
    for name, value in flags.MEGATRON_DEFAULTS.items():
        lines.append(f"| `{LEAVES[name].dotted}` | `{_fleetx_default(name)}` | `{value}` |")
    lines += ["", "## Implemented", "", "| Megatron-LM flag | here | meaning |", "| --- | --- | --- |"]
    for flag in flags.IMPLEMENTED:
        if flag in flags.DERIVED:
            lines.append(f"| `{flag}` | derived | {flags.DERIVED[flag]} |")
            continue
        leaf = by_flag[flag]
        lines.append(f"| `{flag}` | `{leaf.dotted}` | {leaf.help} |")
    for flag, (ours, meaning) in flags.REWRITES.items():
        lines.append(f"| `{flag}` | `{' '.join(ours).replace('{}', 'VALUE')}` | {meaning} |")
    lines += ["", "## Accepted, no effect here", "", "| Megatron-LM flag | why |", "| --- | --- |"]
    lines += [f"| `{flag}` | {why} |" for flag, why in flags.NO_EFFECT.items()]
    lines += ["", "## Absent", "", "| Megatron-LM flag | missing feature | accepted as a no-op with |",
              "| --- | --- | --- |"]
    for flag, absent in flags.ABSENT.items():
        noop = ", ".join(f"`{v}`" for v in absent.noop) or "-"
        lines.append(f"| `{flag}` | {absent.feature} | {noop} |")
    for prefix, feature in flags._ABSENT_PREFIXES.items():
        lines.append(f"| `{prefix}*` | {feature} | - |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    print(render_megatron_markdown() if sys.argv[1:] == ["--megatron"] else render_markdown(), end="")
