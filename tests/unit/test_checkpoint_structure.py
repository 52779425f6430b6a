"""The layout of megatron/checkpoint/ (docs/checkpoints.md, "The code"): our own format at the top (at most 15 files),
Hugging Face's families in hf/, each a declarative table the engine (hf/mapping.py) expands (no family builds names in
a loop over the layers or experts), and tools/convert_checkpoint.py naming no family: what differs between families
is a flag or hook of the family's value."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = ROOT / "megatron" / "checkpoint"
FAMILIES = ("gpt2", "llama", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")


def _loops_over_range(tree: ast.AST) -> list[int]:
    """The lines of every ``for`` statement or comprehension whose iterable is a call of ``range``."""
    lines = []
    for node in ast.walk(tree):
        iters = [node.iter] if isinstance(node, (ast.For, ast.AsyncFor)) else [
            g.iter for g in node.generators] if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp,
                                                                  ast.GeneratorExp)) else []
        lines += [node.lineno for it in iters
                  if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"]
    return lines


def test_the_checkpoint_package_keeps_at_most_15_top_level_files():
    top = sorted(p.name for p in CHECKPOINT.glob("*.py"))
    assert "__init__.py" in top and len(top) <= 15, top
    assert (CHECKPOINT / "hf" / "__init__.py").is_file() and (CHECKPOINT / "megatron_lm" / "__init__.py").is_file()


def test_every_family_has_its_file_and_its_value():
    import importlib

    from megatron.checkpoint.hf.mapping import Family

    for name in FAMILIES:
        module = importlib.import_module(f"megatron.checkpoint.hf.{name}")
        assert isinstance(module.FAMILY, Family) and module.FAMILY.name == name


def test_every_family_maps_config_json_by_a_key_table():
    """Each family's config.json both ways is its ``Key`` table (``mapping.config_out`` / ``config_in``): every key
    written under one name, each of our fields read by one key, every key written or read."""
    import importlib

    from megatron.checkpoint.hf.mapping import Key

    for name in FAMILIES:
        keys = importlib.import_module(f"megatron.checkpoint.hf.{name}").FAMILY.keys
        assert keys and all(isinstance(k, Key) for k in keys), name
        theirs, ours = [k.theirs for k in keys], [k.ours for k in keys if k.ours is not None]
        assert len(set(theirs)) == len(theirs) and len(set(ours)) == len(ours), name
        assert all(k.ours is not None or k.export is not None for k in keys), name
        assert {"architectures", "model_type", "vocab_size"} <= set(theirs), name


def test_the_check_sees_a_loop_over_range():
    assert _loops_over_range(ast.parse("for i in range(3):\n    pass\nx = [i for i in range(2)]\n")) == [1, 3]
    assert _loops_over_range(ast.parse("for a, b in pairs(m):\n    pass\n")) == []


def test_no_family_builds_names_in_a_loop_over_range():
    found = {name: lines for name in FAMILIES
             if (lines := _loops_over_range(ast.parse((CHECKPOINT / "hf" / f"{name}.py").read_text())))}
    assert found == {}, f"loops over range (the engine in hf/mapping.py expands the placeholders): {found}"


def test_the_conversion_tool_names_no_family():
    tree = ast.parse((ROOT / "tools" / "convert_checkpoint.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
    families = {m for m in imported for name in FAMILIES if m.endswith(f"checkpoint.hf.{name}")}
    assert families == set(), f"tools/convert_checkpoint.py imports {sorted(families)}"
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    aliases = {f"hf_{name}" for name in (*FAMILIES, "qwen_moe", "deepseek")}
    assert names & aliases == set(), f"tools/convert_checkpoint.py names {sorted(names & aliases)}"
