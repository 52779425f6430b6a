"""The structure docs/architecture.md promises, checked on the source: no import circle between megatron's
modules (imports inside functions count), config a leaf, one door to the device, the Trainer a short recipe."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron"


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its ``__init__``)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module ``name`` is, or is in (``megatron.config.Config`` -> ``megatron.config``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """The megatron modules ``module`` imports anywhere in its file (top level, functions, branches)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(_owner(alias.name) for alias in node.names if alias.name.startswith("megatron"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.startswith("megatron"):  # `from pkg import submodule` imports the submodule
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else _owner(base)
                             for a in node.names)
    found.discard(None)
    found.discard(module)
    return found  # type: ignore[return-value]


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}, "g": set()}
    assert sorted(import_circles(graph)) == [["a", "b", "c"], ["e", "f"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_function_level_imports_are_seen():
    assert "megatron.moe.layer" in imports_of("megatron.model.transformer")  # imported inside a function


def test_no_import_circle_between_megatron_modules():
    graph = {module: imports_of(module) for module in MODULES}
    assert import_circles(graph) == []


def test_config_imports_no_other_megatron_package():
    for module in MODULES:
        if module == "megatron.config" or module.startswith("megatron.config."):
            outside = {m for m in imports_of(module) if not m.startswith("megatron.config")}
            assert not outside, f"{module} imports {sorted(outside)}: config is the bottom layer"


def _uses_torch_cuda(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name)
                and node.value.id == "torch"):
            return True
        if isinstance(node, ast.Import) and any(a.name.startswith("torch.cuda") for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module and (
                node.module.startswith("torch.cuda") or node.module == "torch" and any(
                    a.name == "cuda" for a in node.names)):
            return True
    return False


def test_torch_cuda_only_in_the_device_module():
    assert _uses_torch_cuda(ast.parse(MODULES["megatron.device"].read_text()))  # the check sees a use
    users = sorted(module for module, path in MODULES.items()
                   if module != "megatron.device" and _uses_torch_cuda(ast.parse(path.read_text())))
    assert users == [], f"{users} call torch.cuda: go through megatron/device.py"


def test_the_trainer_is_a_short_recipe():
    from megatron.training import Trainer

    path = Path(__import__(Trainer.__module__, fromlist=["_"]).__file__)
    (cls,) = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "Trainer"]
    assert cls.end_lineno - cls.lineno + 1 <= 150


def test_modules_stay_under_500_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}
