"""The seam between the model and its parallel layouts (docs/architecture.md, "The plain GPT and its recipe"),
checked on the source: the model is single-device code built from its configuration, the parallel axes are
applied to it by one recipe (``megatron/parallelize_gpt.py``), and the packages below the model import nothing
of it."""

from __future__ import annotations

import ast

from tests.unit.test_structure import MODULES, ROOT, import_circles, imports_of

MODEL = sorted(m for m in MODULES if m == "megatron.model" or m.startswith("megatron.model."))
# what the model may never import: the parallel packages' layers and collectives, the training loop, the CLI
FORBIDDEN = ("megatron.tensor_parallel", "megatron.distributed", "megatron.pipeline_parallel", "megatron.training",
             "megatron.context_parallel", "megatron.parallel_state", "megatron.data", "megatron.config.cli",
             "megatron.config.layer_split", "megatron.parallelize_gpt", "megatron.checkpoint")
# what else the model may import: its attention engine (blocks, plans, the paths on this rank's tokens)


ALLOWED = ("megatron.config.schema", "megatron.config.schema_model", "megatron.config.validate_attention",
           "megatron.config.validate_moe", "megatron.config.validate_mup",
           "megatron.config.validate_hybrid")  # the configuration, and the rules that read it (which layers, ...)
# the model's parts that import nothing of it: its ops, attention engine, mixture of experts, linear recurrences
PARTS = ("megatron.ops", "megatron.moe", "megatron.attention", "megatron.hybrid")


def _outside(module: str) -> set[str]:
    return {m for m in imports_of(module) if not m.startswith(("megatron.model", *PARTS)) and m not in ALLOWED}


def test_the_model_imports_no_parallel_layer_training_or_cli():
    for module in MODEL:
        bad = sorted(m for m in imports_of(module) if m.startswith(FORBIDDEN))
        assert not bad, f"{module} imports {bad}: the model is single-device code (parallelize_gpt applies layouts)"


def test_the_model_imports_only_its_configuration_ops_attention_and_moe():
    found = {module: _outside(module) for module in MODEL if _outside(module)}
    assert found == {}


def test_moe_distributed_and_the_parallel_packages_import_nothing_of_the_model():
    for package in ("megatron.moe", "megatron.distributed", "megatron.context_parallel", "megatron.ops",
                    "megatron.tensor_parallel", "megatron.pipeline_parallel", "megatron.attention", "megatron.hybrid"):
        for module in (m for m in MODULES if m == package or m.startswith(package + ".")):
            model = sorted(m for m in imports_of(module) if m.startswith("megatron.model"))
            assert not model, f"{module} imports {model}"


def _calls_of(name: str) -> list[str]:
    """The files (repository-relative) that call ``name`` (a function, by its last dotted part)."""
    files = [*ROOT.glob("megatron/**/*.py"), *ROOT.glob("benchmarks/*.py"), *ROOT.glob("tools/*.py"),
             ROOT / "pretrain_gpt.py"]
    callers = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if called == name:
                    callers.append(str(path.relative_to(ROOT)))
                    break
    return sorted(callers)


def test_one_recipe_applies_the_parallel_layouts():
    assert _calls_of("apply_tensor_parallel") == ["megatron/parallelize_gpt.py"]
    assert _calls_of("parallelize") == ["megatron/parallelize_gpt.py"]  # data parallelism / ZeRO's buffer and hooks
    assert _calls_of("compile_model") == ["megatron/parallelize_gpt.py"]
    assert _calls_of("apply_fp8") == ["megatron/parallelize_gpt.py"]


def test_the_recipe_reads_in_short_functions():
    tree = ast.parse((ROOT / "megatron" / "parallelize_gpt.py").read_text())
    long = [(f.name, f.end_lineno - f.lineno + 1) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
            if f.end_lineno - f.lineno + 1 > 60]
    assert not long, long


def test_the_gpt_is_built_from_its_configuration_and_vocabulary():
    from megatron.config import parse_config, validate
    from megatron.model import GPTModel

    config = parse_config(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                           "--vocab-size", "100"])
    validate(config, training_data=False)
    model = GPTModel(config.model, config.padded_vocab_size)  # single-device: no rank grid needed
    assert type(model.layers["0"].self_attention.query_key_value).__name__ == "Linear"
    assert model(__import__("torch").zeros(1, 4, dtype=__import__("torch").long)).shape == (1, 4, 128)


def test_multi_token_prediction_reads_the_fields_the_data_writes():
    from megatron.data.future_tokens import MTP_KEYS
    from megatron.model.mtp import MTPInputs

    assert MTPInputs.keys() == MTP_KEYS


def test_the_model_and_the_parallel_packages_read_no_global_rank_grid():
    for package in ("megatron.model", "megatron.moe", "megatron.tensor_parallel", "megatron.context_parallel",
                    "megatron.attention"):
        for module in (m for m in MODULES if m == package or m.startswith(package + ".")):
            assert "megatron.parallel_state" not in imports_of(module), f"{module}: groups are handed in"


LAYOUT_WORDS = ("sequence_parallel", "recompute", "cp_", "pre_process", "post_process", "layers", "tp", "ep_",
                "pipeline", "context")


def test_model_constructors_take_no_layout_or_recompute_flag():
    import inspect

    import torch.nn as nn

    from megatron.model.gpt import GPTModel

    assert list(inspect.signature(GPTModel.__init__).parameters) == ["self", "cfg", "padded_vocab_size"]
    for module in MODEL:
        namespace = __import__(module, fromlist=["_"])
        for cls in vars(namespace).values():
            if inspect.isclass(cls) and issubclass(cls, nn.Module) and cls.__module__ == module:
                flags = [p for p in inspect.signature(cls.__init__).parameters if p.startswith(LAYOUT_WORDS)]
                assert not flags, f"{cls.__name__}({', '.join(flags)}): layouts are applied by parallelize_gpt"


def test_no_package_imports_another_that_imports_it_back():
    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for module in MODULES:
        graph.setdefault(package(module), set()).update(package(m) for m in imports_of(module)
                                                         if package(m) != package(module))
    assert import_circles(graph) == []


def test_no_model_file_calls_a_collective():
    """The model's step hooks sum over ranks with the collective the training step hands them (``sum_over``)."""
    for module in MODEL:
        tree = ast.parse(MODULES[module].read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any(name.startswith("torch.distributed") for name in names), module
