"""Megatron-LM checkpoints as MoE runs write them: grouped-GEMM experts and expert parallelism > 1
(``megatron/checkpoint/megatron_lm/experts.py``; docs/checkpoints.md, section 7).

- Megatron Core's legacy grouped GEMM (``GroupedMLP``: ``weight1`` / ``weight2``, the local spec with
  ``moe_grouped_gemm``) is built and run on the CPU here. Two things of the package it needs are not there and are
  patched: its constructor's check for the ``grouped_gemm`` package (CUDA only) and that package's ``ops.gmm``,
  replaced by what a grouped GEMM computes (each expert's rows of the input times its matrix, a loop); its forward's
  "bf16 only" assertion is lifted on its own copy of the config and its jit-compiled activation run eagerly (the
  same function). Its weights are put in place by Megatron Core's own ``dist_checkpointing.load`` from a
  ``SequentialMLP`` model's torch_dist checkpoint (its ``sharded_state_dict``'s merge: the interchange it
  documents), and equal bitwise what ``to-megatron --moe-grouped-gemm --transformer-impl local`` writes. Its state
  dict saved as Megatron-LM's legacy save writes it, and its own ``dist_checkpointing.save``, convert with
  ``from-megatron`` to the SequentialMLP model's logits within 1e-5; Megatron Core's GroupedMLP gives them too.
- ``TEGroupedMLP`` needs Transformer Engine (absent on the CPU): its legacy files are written here in its layout, as
  its code and Transformer Engine's ``GroupedLinear`` name them (``linear_fc1.weight{e}``, one ``_extra_state`` per
  module; the spec's fused norms ``linear_qkv.layer_norm_weight``, a dense layer's ``linear_fc1.layer_norm_weight``),
  from the SequentialMLP model's tensors, and convert to its logits.
- Expert parallelism 2: Megatron Core on two gloo ranks (``tests/distributed/harness.py``; slow: the ranks import it)
  saves its legacy rank files ``mp_rank_00_00{e}`` (its state dicts, as Megatron-LM's save; each rank's experts
  drawn from its own seed), which convert with the logits of its ep 2 forward (the allgather dispatcher over both
  ranks), and ``to-megatron --expert-model-parallel-size 2`` of the result writes its files tensor for tensor.
  Our exports at ep 2 with tp 2 x pp 2, and with grouped names, read back bitwise.
- What cannot be read or written is one line.
"""

from __future__ import annotations

import argparse
import copy
import io
import re
import types
import warnings

import pytest
import torch

from megatron.checkpoint.convert import open_checkpoint, read_tensors, tensor_layout, write_checkpoint, write_params
from megatron.checkpoint.megatron_lm.core_names import interleaved_to_halves
from megatron.checkpoint.megatron_lm.legacy import FILE, TRACKER, safe_load
from megatron.config import parse_config, validate
from megatron.model.gpt import GPTModel
from tests.unit.megatron_core_reference import (
    CORE_WARNINGS,
    LLAMA,
    MOE,
    TINY,
    assert_close_to_scale,
    build_pair,
    core_forward,
    core_model_from_args,
    megatron_core,
    tokens_and_labels,
)
from tests.unit.test_megatron_checkpoints import SHAPES, convert, megatron_args, our_checkpoint

pytestmark = CORE_WARNINGS


def moe_args(config, **change) -> argparse.Namespace:
    """The ``args`` of a Llama-shaped MoE run (tests/unit/megatron_core_reference.py's MOE) as Megatron-LM saves
    them."""
    args = megatron_args(config)
    args.num_experts, args.moe_router_topk, args.moe_layer_freq, args.moe_ffn_hidden_size = 4, 2, [1, 0], 24
    args.moe_router_load_balancing_type, args.moe_aux_loss_coeff = "aux_loss", 0.1
    args.moe_token_dispatcher_type, args.transformer_impl = "allgather", "local"
    for name, value in change.items():
        setattr(args, name, value)
    return args


def _gmm(a, b, batch_sizes, trans_b=False):
    """What ``grouped_gemm.ops.gmm`` computes: the rows of ``a`` in groups of ``batch_sizes``, group e times
    ``b[e]`` (transposed with ``trans_b``)."""
    out, start = [], 0
    for e, n in enumerate(batch_sizes.tolist()):
        out.append(a[start:start + n] @ (b[e].t() if trans_b else b[e]))
        start += n
    return torch.cat(out)


def _eager(fn):
    return getattr(fn, "_torchdynamo_orig_callable", fn)


def grouped_model(mcore, args, patches):
    """Megatron Core's GPTModel of ``args`` with GroupedMLP experts, runnable on the CPU (see the docstring)."""
    from megatron.core.transformer.moe import grouped_gemm_util

    patches.setattr(grouped_gemm_util, "grouped_gemm", types.SimpleNamespace())  # the package's presence
    patches.setattr(grouped_gemm_util, "ops", types.SimpleNamespace(gmm=_gmm))
    model = core_model_from_args(mcore, args)
    for layer in model.decoder.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            assert type(experts).__name__ == "GroupedMLP"
            experts.config = copy.copy(experts.config)
            experts.config.bf16 = True  # its forward's assertion only: the weights and inputs stay fp32
            experts.activation_func = _eager(experts.activation_func)
            experts.activation_func_with_probs = _eager(experts.activation_func_with_probs)
    return model


def dist_save(state: dict, folder) -> None:
    """Megatron Core's ``dist_checkpointing.save`` on the CPU (its writer's two CUDA-only calls patched, as in
    test_megatron_checkpoints.py)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    with pytest.MonkeyPatch.context() as patches:
        patches.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
        patches.setattr(filesystem_async, "_process_memory", lambda: 0)
        folder.mkdir(parents=True, exist_ok=True)  # (every rank of a distributed save)
        dist_checkpointing.save(state, str(folder))
    (folder.parent / TRACKER).write_text(folder.name.split("_")[1].lstrip("0") or "0")


def legacy_save(folder, rank: str, model_state: dict, args) -> None:
    """A rank file as Megatron-LM's legacy save writes it."""
    (folder / rank).mkdir(parents=True)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 4, "model": model_state},
               folder / rank / FILE)
    (folder.parent / TRACKER).write_text("4")


def _te_extra_state() -> io.BytesIO:
    """Transformer Engine's ``get_extra_state`` without FP8 (older versions): ``torch.save(None)`` in a BytesIO."""
    buffer = io.BytesIO()
    torch.save(None, buffer)
    return io.BytesIO(buffer.getvalue())


def te_grouped_layout(state: dict) -> dict:
    """A SequentialMLP model's state dict named as Transformer Engine's spec with TEGroupedMLP names it (its
    GroupedLinear's ``weight{e}`` and one ``_extra_state`` per module, empty without FP8; the fused norms)."""
    out = {}
    moe = {m[1] for m in (re.match(r"(decoder\.layers\.\d+)\.mlp\.router\.weight$", n) for n in state) if m}
    for name, t in state.items():
        expert = re.match(r"^(.+\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.(.+)$", name)
        if expert and expert[4] == "_extra_state":
            out[f"{expert[1]}{expert[3]}._extra_state"] = torch.empty(0, dtype=torch.uint8)
        elif expert:
            out[f"{expert[1]}{expert[3]}.{expert[4]}{expert[2]}"] = t
        elif name.endswith("._extra_state"):
            out[name] = _te_extra_state()
        else:
            layer = re.match(r"^(decoder\.layers\.\d+)\.", name)
            name = name.replace(".input_layernorm.", ".self_attention.linear_qkv.layer_norm_")
            if layer and layer[1] not in moe:
                name = name.replace(".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_")
            out[name] = t
    return out


def our_logits(folder, tokens):
    reader, _, config = open_checkpoint(str(folder))
    model = GPTModel(config.model, config.padded_vocab_size).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(reader.full("param", name))
        return model(tokens), config


def grouped_pair(mcore, tmp_path, patches, tokens):
    """(our config, Megatron Core's SequentialMLP model, its logits, its GroupedMLP model, that model's args): the
    GroupedMLP model's weights put in place by Megatron Core's own ``dist_checkpointing.load`` of our grouped
    torch_dist export (its merge into ``weight1`` / ``weight2``); our legacy export for a local-spec grouped run at
    ``tmp_path / "legacy"``."""
    from megatron.core import dist_checkpointing

    config, ours, theirs = build_pair(mcore, *LLAMA, *MOE)
    with torch.no_grad():
        logits = core_forward(theirs.eval(), tokens)
    write_params(str(tmp_path / "run"), config, {n: p.detach() for n, p in ours.named_parameters()}, step=4)
    for fmt, flags in (("torch_dist", []), ("legacy", ["--transformer-impl", "local"])):
        assert convert.main(["to-megatron", str(tmp_path / "run"), str(tmp_path / fmt), "--format", fmt,
                             "--moe-grouped-gemm", *flags]) == 0
    grouped_args = moe_args(config, iteration=4, moe_grouped_gemm=True)
    grouped = grouped_model(mcore, grouped_args, patches)
    with torch.no_grad():
        for p in grouped.parameters():
            p.zero_()
    with torch.serialization.safe_globals([argparse.Namespace]):
        loaded = dist_checkpointing.load({"model": grouped.sharded_state_dict()},
                                         str(tmp_path / "torch_dist" / "iter_0000004"))
    grouped.load_state_dict(loaded["model"], strict=True)
    return config, theirs, logits, grouped, grouped_args


def convert_and_compare(tmp_path, sources, tokens, logits) -> None:
    for source in sources:
        assert convert.main(["from-megatron", str(tmp_path / source), str(tmp_path / f"ours_{source}")]) == 0
        got, back = our_logits(tmp_path / f"ours_{source}", tokens)
        assert back.model.moe_grouped_gemm and back.model.num_experts == 4
        assert_close_to_scale(got, logits, f"{source} logits")


def test_megatron_cores_grouped_gemm_checkpoints_give_its_logits_here(tmp_path, one_process):
    """Megatron Core's GroupedMLP loads our grouped torch_dist export (its own ``dist_checkpointing.load``), gives
    the SequentialMLP model's logits and holds bitwise our legacy export's ``weight1`` / ``weight2``; its state dict
    saved as Megatron-LM's legacy save writes it, and TEGroupedMLP's legacy layout, convert to those logits."""
    tokens, _ = tokens_and_labels()
    with megatron_core() as mcore, pytest.MonkeyPatch.context() as patches:
        config, theirs, logits, grouped, grouped_args = grouped_pair(mcore, tmp_path, patches, tokens)
        with torch.no_grad():
            assert_close_to_scale(core_forward(grouped.eval(), tokens), logits, "GroupedMLP's logits")
        state = grouped.state_dict()
        assert list(state["decoder.layers.0.mlp.experts.weight1"].shape) == [16, 4 * 48]  # [h, E * 2 ffn]
        exported = safe_load(str(tmp_path / "legacy" / "iter_0000004" / "mp_rank_00" / FILE))
        assert exported["args"].moe_grouped_gemm and exported["args"].transformer_impl == "local"
        for name in ("weight1", "weight2"):
            assert torch.equal(exported["model"][f"decoder.layers.0.mlp.experts.{name}"],
                               state[f"decoder.layers.0.mlp.experts.{name}"]), name
        grouped.load_state_dict(exported["model"], strict=True)
        legacy_save(tmp_path / "grouped" / "iter_0000004", "mp_rank_00", state, grouped_args)
        te_args = moe_args(config, iteration=4, moe_grouped_gemm=True, transformer_impl="transformer_engine")
        legacy_save(tmp_path / "te" / "iter_0000004", "mp_rank_00", te_grouped_layout(theirs.state_dict()), te_args)
    convert_and_compare(tmp_path, ("grouped", "te"), tokens, logits)


@pytest.mark.slow
def test_megatron_cores_own_grouped_gemm_torch_dist_checkpoint_gives_its_logits_here(tmp_path, one_process):
    """GroupedMLP's ``sharded_state_dict`` saved by Megatron Core's own ``dist_checkpointing.save`` (slow: its
    writer forks processes) converts to the SequentialMLP model's logits."""
    tokens, _ = tokens_and_labels()
    with megatron_core() as mcore, pytest.MonkeyPatch.context() as patches:
        _, _, logits, grouped, grouped_args = grouped_pair(mcore, tmp_path, patches, tokens)
        dist_save({"model": grouped.sharded_state_dict(), "args": grouped_args, "iteration": 4,
                   "checkpoint_version": 3.0}, tmp_path / "grouped_dist" / "iter_0000004")
    convert_and_compare(tmp_path, ("grouped_dist",), tokens, logits)


def test_grouped_and_expert_parallel_exports_read_back_bitwise(tmp_path, one_process):
    """ours -> Megatron legacy at ep 2 (tp 2 x pp 2), with TEGroupedMLP names (tp 1 x pp 2 x ep 2) and GroupedMLP's
    (tp 2 x ep 2, the local spec) -> ours is bitwise; the rank files hold Megatron's names and cuts."""
    config, params = our_checkpoint(tmp_path / "run", SHAPES["llama_moe"])
    fc1 = {e: interleaved_to_halves(params[f"layers.0.mlp.experts.{e}.dense_h_to_4h.weight"]) for e in range(4)}
    fc2 = {e: params[f"layers.0.mlp.experts.{e}.dense_4h_to_h.weight"] for e in range(4)}

    def halves(t, r, tp):  # tp rank r's [gate_r; up_r]
        gate, up = t.chunk(2)
        return torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])

    for name, flags, (tp, pp) in (
            ("sequential", [], (2, 2)), ("te", ["--moe-grouped-gemm"], (1, 2)),
            ("grouped", ["--moe-grouped-gemm", "--transformer-impl", "local"], (2, 1))):
        meg = tmp_path / name
        assert convert.main(["to-megatron", str(tmp_path / "run"), str(meg), "--tp", str(tp), "--pp", str(pp),
                             "--expert-model-parallel-size", "2", *flags]) == 0
        folder = meg / "iter_0000012"
        files = {tuple(int(x) for x in f.parent.name.split("_")[2:]): f for f in folder.glob(f"mp_rank_*/{FILE}")}
        assert len(files) == tp * pp * 2 and all(len(key) == (3 if pp > 1 else 2) for key in files)
        first = safe_load(str(files[(0, 0, 1) if pp > 1 else (0, 1)]))["model"]  # ep rank 1: experts 2 and 3
        last = (tp - 1, 0, 1) if pp > 1 else (tp - 1, 1)
        if name == "sequential":
            mine = safe_load(str(files[last]))["model"]
            assert torch.equal(mine["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"],
                               halves(fc1[3], 1, 2))
            assert torch.equal(mine["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"],
                               fc2[3].chunk(2, dim=1)[1])
            assert not any(".local_experts.2." in n for n in mine)
        elif name == "te":
            assert torch.equal(first["decoder.layers.0.mlp.experts.linear_fc1.weight1"], fc1[3])
            assert torch.equal(first["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"],
                               params["layers.0.input_layernorm.weight"])
            assert torch.equal(first["decoder.layers.0.pre_mlp_layernorm.weight"],  # a MoE layer keeps its norm
                               params["layers.0.post_attention_layernorm.weight"])
            assert "decoder.layers.0.mlp.experts.linear_fc1._extra_state" in first
            stage1 = safe_load(str(files[(0, 1, 0)]))["model"]  # the dense layer: its norm fused into linear_fc1
            assert torch.equal(stage1["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"],
                               params["layers.1.post_attention_layernorm.weight"])
        else:
            mine = safe_load(str(files[last]))["model"]
            weight1 = mine["decoder.layers.0.mlp.experts.weight1"]  # [h, E_local * F]: GroupedMLP's view per expert
            assert list(weight1.shape) == [16, 2 * 24]
            assert torch.equal(weight1.view(2, 16, -1)[1].t(), halves(fc1[3], 1, 2))
            weight2 = mine["decoder.layers.0.mlp.experts.weight2"]
            assert torch.equal(weight2.view(2, -1, 16)[0].t(), fc2[2].chunk(2, dim=1)[1])
        args = safe_load(str(files[last]))["args"]
        assert (args.expert_model_parallel_size, args.expert_tensor_parallel_size) == (2, tp)
        assert convert.main(["from-megatron", str(meg), str(tmp_path / f"back_{name}")]) == 0
        reader, _, back_config = open_checkpoint(str(tmp_path / f"back_{name}"))
        assert bool(back_config.model.moe_grouped_gemm) == bool(flags)  # unset (None): grouped where it runs
        back = read_tensors(reader)
        assert back.keys() == params.keys()
        for key, t in params.items():
            assert torch.equal(back[key], t), (name, key)


def _ep2_rank(rank: int, world_size: int, folder: str):
    """One of two gloo ranks: Megatron Core with expert parallelism 2 builds the Llama-shaped MoE (its experts 2
    per rank, each rank's drawn from its own seed: experts put under other global numbers would route and weigh the
    tokens otherwise), saves its legacy rank file and returns its logits (its forward through the allgather
    dispatcher over both ranks)."""
    import importlib.metadata
    from pathlib import Path

    import megatron

    core_folder = str(Path(importlib.metadata.distribution("megatron-core").locate_file("megatron")))
    megatron.__path__.append(core_folder)
    patches = pytest.MonkeyPatch()
    caught = warnings.catch_warnings()
    caught.__enter__()
    warnings.simplefilter("ignore")  # Megatron Core's notices (Apex absent, deprecations): not ours to act on
    try:
        from megatron.core import parallel_state as core_state
        from megatron.core.models.gpt import GPTModel as CoreGPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        from megatron.core.tensor_parallel import random as core_random
        from megatron.core.transformer.moe import moe_utils
        from megatron.core.transformer.transformer_config import TransformerConfig

        patches.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
        patches.setattr(core_random.CudaRNGStatesTracker, "fork", lambda self, name=None: __import__(
            "contextlib").nullcontext())
        patches.setattr(moe_utils, "te_general_gemm", None, raising=False)
        core_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
        mcore = {"GPTModel": CoreGPTModel, "block_spec": get_gpt_decoder_block_spec, "config": TransformerConfig}
        config = parse_config([*TINY, *LLAMA, *MOE])
        validate(config)
        args = moe_args(config, iteration=4, expert_model_parallel_size=2)
        model = core_model_from_args(mcore, args)
        with torch.no_grad():
            for seed, experts in ((7, False), (100 + rank, True)):
                generator = torch.Generator().manual_seed(seed)
                for name, p in model.named_parameters():
                    if (".local_experts." in name) == experts:
                        p.copy_(torch.randn(p.shape, generator=generator) * 0.3 + (1.0 if "norm" in name else 0.0))
        root = Path(folder)
        legacy_save(root / "legacy" / "iter_0000004", f"mp_rank_00_{rank:03d}", model.state_dict(), args)
        tokens, _ = tokens_and_labels()
        with torch.no_grad():
            logits = core_forward(model.eval(), tokens)
        core_state.destroy_model_parallel()
        return logits
    finally:
        caught.__exit__(None, None, None)
        patches.undo()
        megatron.__path__.remove(core_folder)


@pytest.mark.slow
def test_megatron_cores_own_expert_parallel_checkpoint_converts(tmp_path, one_process):
    from tests.distributed.harness import run_distributed

    logits = run_distributed(_ep2_rank, 2, str(tmp_path))
    assert torch.equal(logits[0], logits[1])
    tokens, _ = tokens_and_labels()
    assert convert.main(["from-megatron", str(tmp_path / "legacy"), str(tmp_path / "ours_legacy")]) == 0
    got, config = our_logits(tmp_path / "ours_legacy", tokens)
    assert config.model.num_experts == 4
    assert_close_to_scale(got, logits[0], "logits")
    # and back: our export at ep 2 is Megatron Core's own rank files, tensor for tensor
    assert convert.main(["to-megatron", str(tmp_path / "ours_legacy"), str(tmp_path / "back"),
                         "--expert-model-parallel-size", "2"]) == 0
    for e in range(2):
        theirs = safe_load(str(tmp_path / "legacy" / "iter_0000004" / f"mp_rank_00_{e:03d}" / FILE))["model"]
        mine = safe_load(str(tmp_path / "back" / "iter_0000004" / f"mp_rank_00_{e:03d}" / FILE))["model"]
        tensors = {n for n, t in theirs.items() if isinstance(t, torch.Tensor)
                   and not n.endswith("local_tokens_per_expert")}
        assert set(mine) == tensors
        for name in tensors:
            assert torch.equal(mine[name], theirs[name]), name


def _legacy(meg, args: dict, model: dict | None = None, ranks=("mp_rank_00",), **extra) -> None:
    for rank in ranks:
        (meg / "iter_0000002" / rank).mkdir(parents=True)
        torch.save({"args": argparse.Namespace(**args), "model": model or {}, "iteration": 2, **extra},
                   meg / "iter_0000002" / rank / FILE)
    (meg / TRACKER).write_text("2")


@pytest.mark.parametrize("change, ranks, message", [
    ({"expert_model_parallel_size": 2}, ("mp_rank_00_000",), "mp_rank_00_001/model_optim_rng.pt is missing"),
    ({"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1}, ("mp_rank_00",),
     "expert tensor parallelism 1 under tensor parallelism 2"),
    ({"expert_model_parallel_size": 3}, ("mp_rank_00_000",), "expert parallelism 3 but 4 experts"),
    ({"moe_single_grouped_weight": True}, ("mp_rank_00",), "one weight for all of a layer's experts"),
])
def test_what_cannot_be_read_is_one_line(tmp_path, one_process, capsys, change, ranks, message):
    config = parse_config([*TINY, *LLAMA, *MOE])
    validate(config)
    _legacy(tmp_path / "meg", vars(moe_args(config)) | change, ranks=ranks)
    assert convert.main(["from-megatron", str(tmp_path / "meg"), str(tmp_path / "ours")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "ours").exists()


def test_the_optimizer_of_expert_parallel_files_is_one_line(tmp_path, one_process, capsys):
    our_checkpoint(tmp_path / "run", SHAPES["llama_moe"])
    assert convert.main(["to-megatron", str(tmp_path / "run"), str(tmp_path / "meg"), "--tp", "2",
                         "--expert-model-parallel-size", "2"]) == 0
    for file in (tmp_path / "meg" / "iter_0000012").glob(f"mp_rank_*/{FILE}"):
        torch.save({**safe_load(str(file)), "optimizer": {"state": {}, "param_groups": []}}, file)
    capsys.readouterr()
    assert convert.main(["from-megatron", str(tmp_path / "meg"), str(tmp_path / "ours")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "expert parallelism > 1" in err and "--no-optim" in err, err
    assert convert.main(["from-megatron", str(tmp_path / "meg"), str(tmp_path / "ours"), "--no-optim"]) == 0


def test_experts_cut_otherwise_than_the_args_say_are_one_line(tmp_path, one_process, capsys):
    """Rank files whose experts are whole (expert tensor parallelism 1) under args that say tp 2 and no expert
    tensor-parallel size."""
    _, params = our_checkpoint(tmp_path / "run", SHAPES["llama_moe"])
    assert convert.main(["to-megatron", str(tmp_path / "run"), str(tmp_path / "meg"), "--tp", "2"]) == 0
    for file in (tmp_path / "meg" / "iter_0000012").glob(f"mp_rank_*/{FILE}"):
        saved = safe_load(str(file))
        del saved["args"].expert_tensor_parallel_size
        for e in range(4):
            whole = interleaved_to_halves(params[f"layers.0.mlp.experts.{e}.dense_h_to_4h.weight"])
            saved["model"][f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight"] = whole
        torch.save(saved, file)
    capsys.readouterr()
    assert convert.main(["from-megatron", str(tmp_path / "meg"), str(tmp_path / "ours")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has 48 rows, not the 24 of 48 cut over tensor parallelism 2" in err, err


@pytest.mark.parametrize("shape, flags, message", [
    ("llama_moe", ["--expert-model-parallel-size", "3"], "--expert-model-parallel-size 3 does not divide the 4"),
    ("llama", ["--moe-grouped-gemm"], "need a mixture of experts"),
    ("gpt2_moe", ["--moe-grouped-gemm", "--transformer-impl", "local"], "legacy GroupedMLP"),
    ("llama_moe_adam", ["--expert-model-parallel-size", "2"], "written only for expert parallelism 1"),
])
def test_an_export_megatron_cannot_load_is_one_line(tmp_path, one_process, capsys, shape, flags, message):
    if shape == "gpt2_moe":
        our_checkpoint(tmp_path / "run", [*MOE, "--vocab-size", "250"])
    elif shape == "llama_moe_adam":
        config = parse_config([*TINY, *SHAPES["llama_moe"]])
        validate(config)
        layout = tensor_layout(config)
        entries = [(kind, name) for kind in ("param", "exp_avg", "exp_avg_sq") for name in layout]
        write_checkpoint(str(tmp_path / "run"), config, entries, lambda kind, name: torch.ones(layout[name][0]),
                         step=3, adam_step=3.0)
    else:
        our_checkpoint(tmp_path / "run", SHAPES[shape])
    assert convert.main(["to-megatron", str(tmp_path / "run"), str(tmp_path / "meg"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not list(tmp_path.glob("meg/iter_*"))
