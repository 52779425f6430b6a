"""Render the configuration reference (docs/configuration.md) from the schema.

    python -m megatron.config.docs > docs/configuration.md
    python -m megatron.config.docs --megatron > docs/megatron.md   (megatron_flags.render_markdown)
"""

from __future__ import annotations

from megatron.config.cli import ALIASES, LEAVES, _strip_optional
from megatron.config.megatron_flags import MEGATRON_DEFAULTS
from megatron.config.schema import Config

HEADER = """# Configuration reference

Generated from `megatron/config/schema.py` by `python -m megatron.config.docs`; a test keeps
it in step. Every key is a YAML leaf (at the path shown) and a flag. Precedence: built-in
default < `-c` YAML < `-o Section.key=value` < flags. A default of `None` is derived during
validation unless set. Where Megatron-LM's default differs it is shown too: it applies to a command line
that gives `--train-iters` or `--train-samples` (a Megatron-LM script; see docs/megatron.md).
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
        if leaf.name in MEGATRON_DEFAULTS:
            default += f" (Megatron-LM: `{MEGATRON_DEFAULTS[leaf.name]}`)"
        lines.append(f"| `{leaf.name}` | {flag} | {_type_name(leaf.type)} | {default} | {leaf.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    from megatron.config import megatron_flags

    print(megatron_flags.render_markdown() if sys.argv[1:] == ["--megatron"] else render_markdown(), end="")
