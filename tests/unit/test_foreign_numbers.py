"""One rule for the numbers of a checkpoint made elsewhere (``megatron/checkpoint/foreign_numbers.py``): every weight,
fp32 master and Adam state read by ``convert_checkpoint.py from-megatron`` (legacy, torch_dist, the distributed
optimizer's files) or ``from-hf``, and every weight ``tools/generate.py`` / ``tools/serve.py`` load, is a finite
floating-point tensor (Adam's second moment never negative), else one line naming the tensor and what is wrong,
exit status 2, nothing written, nothing generated or served.

Before: a NaN fp32 master passed the "master equals weight" comparison and replaced a finite weight; NaN, infinite
or negative Adam moments, NaN weights and an int32 Hugging Face weight converted with exit 0; a distributed
optimizer's state of the right size in two dimensions was a traceback; a model with a NaN weight generated token 0
forever with exit 0 (and the server served it).

The checkpoints are tiny and built here (``our_checkpoint`` / ``trained_checkpoint`` and ``to-megatron`` /
``to-hf``), then one number is changed as a crafted or damaged file would hold it.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from megatron.checkpoint.convert import open_checkpoint, read_tensors, write_params
from megatron.checkpoint.megatron_lm.dist import read_torch_dist, write_torch_dist
from megatron.checkpoint.megatron_lm.distrib_optim import rank_layout
from megatron.checkpoint.megatron_lm.legacy import FILE, safe_load
from megatron.checkpoint.megatron_lm.optim import core_order, decays, parameters
from tests.functional.launch import program_module
from tests.unit.megatron_core_reference import CORE_WARNINGS
from tests.unit.test_megatron_checkpoints import SHAPES, convert, our_checkpoint
from tests.unit.test_megatron_optimizer_states import trained_checkpoint

pytestmark = CORE_WARNINGS

NAN, INF = float("nan"), float("inf")
FC2 = "decoder.layers.1.mlp.linear_fc2.weight"  # Megatron Core's name of a weight (dense layer 1 of 2)


def refused(argv: list[str], out: pathlib.Path, capsys) -> str:
    """The one line ``convert_checkpoint.py`` prints for ``argv``, which writes nothing into ``out``."""
    capsys.readouterr()
    assert convert.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("convert_checkpoint.py: error: ") and len(err.splitlines()) == 1, err
    assert not out.exists()
    return err


def to_megatron(tmp_path, fmt: str, *flags: str, trained: bool = True) -> pathlib.Path:
    """The iteration folder of a Llama-shaped checkpoint of ours (with AdamW states unless not ``trained``) exported
    by ``to-megatron`` in ``fmt``."""
    (trained_checkpoint if trained else our_checkpoint)(tmp_path / "run", SHAPES["llama"])
    assert convert.main(["to-megatron", str(tmp_path / "run"), str(tmp_path / "meg"), "--format", fmt, *flags]) == 0
    return tmp_path / "meg" / "iter_0000012"


def rewrite_rank_file(folder: pathlib.Path, change) -> None:
    """``change(saved)`` on the legacy rank file of ``folder`` (tp 1, pp 1), saved back."""
    path = folder / "mp_rank_00" / FILE
    saved = safe_load(str(path))
    change(saved)
    torch.save(saved, path)


def rewrite_torch_dist(folder: pathlib.Path, out: pathlib.Path, change) -> pathlib.Path:
    """A torch_dist save folder ``out`` of ``folder``'s tensors after ``change(whole, {kind: states})``."""
    args, head, whole, by_kind = read_torch_dist(str(folder))
    change(whole, by_kind)
    write_torch_dist(str(out), 12, whole, args, args.num_layers, by_kind, head)
    return out


# ---- from-megatron ----

@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_a_megatron_weight_that_is_not_finite_is_one_line(tmp_path, one_process, capsys, fmt):
    folder = to_megatron(tmp_path, fmt, "--no-optim", trained=False)

    def poison(whole, *_):
        whole[FC2][0, :3] = NAN
        whole[FC2][1, 0] = -INF

    if fmt == "legacy":
        rewrite_rank_file(folder, lambda saved: poison(saved["model"]))
        meg = folder.parent
    else:
        meg = rewrite_torch_dist(folder, tmp_path / "bad", poison)
    err = refused(["from-megatron", str(meg), str(tmp_path / "ours")], tmp_path / "ours", capsys)
    assert f"the weight {FC2} holds 3 NaN values and 1 infinite value; " in err, err
    assert "convert an earlier checkpoint" in err, err


def _master_slot(folder: pathlib.Path, name: str) -> slice:
    """Where ``name``'s states lie in the legacy ``distrib_optim.pt`` of ``folder``'s rank (Megatron Core's buckets)."""
    saved = safe_load(str(folder / "mp_rank_00" / FILE))
    at, numel = rank_layout(saved["model"], saved["args"], 0).slots[name]
    return slice(at, at + numel)


def _rewrite_distrib_optim(folder: pathlib.Path, change) -> None:
    path = folder / "mp_rank_00" / "distrib_optim.pt"
    saved = torch.load(path, weights_only=True)
    change(next(iter(saved[0].values())))  # the one buffer: {"param", "exp_avg", "exp_avg_sq", "numel_unpadded"}
    torch.save(saved, path)


@pytest.mark.parametrize("where", ["distrib_optim.pt", "torch_dist"])
def test_a_nan_master_never_replaces_a_finite_weight(tmp_path, one_process, capsys, where):
    """Every comparison with NaN is False, so a NaN fp32 master passed the check that each master rounds to its
    weight, and became the converted weight (exit 0). Now refused; --no-optim converts the finite weights."""
    if where == "torch_dist":  # the fp32 optimizer's states by name: optimizer.state.fp32_param.<key>
        meg = rewrite_torch_dist(to_megatron(tmp_path, "torch_dist"), tmp_path / "bad",
                                 lambda whole, states: states["fp32_param"][FC2].view(-1)[5:7].fill_(NAN))
    else:
        folder = to_megatron(tmp_path, "legacy", "--use-distributed-optimizer")
        slot = _master_slot(folder, FC2)
        _rewrite_distrib_optim(folder, lambda buffer: buffer["param"][slot][5:7].fill_(NAN))
        meg = folder.parent
    err = refused(["from-megatron", str(meg), str(tmp_path / "ours")], tmp_path / "ours", capsys)
    assert f"the fp32 master of {FC2} holds 2 NaN values; the optimizer states are damaged" in err, err
    assert "--no-optim" in err, err
    assert convert.main(["from-megatron", str(meg), str(tmp_path / "ours"), "--no-optim"]) == 0
    assert all(bool(torch.isfinite(t).all()) for t in read_tensors(open_checkpoint(str(tmp_path / "ours"))[0]).values())


def _legacy_state(saved: dict, name: str) -> dict:
    """Adam's state of ``name`` in a legacy rank file's fp32 optimizer (Megatron Core's parameter order)."""
    names = core_order(parameters(saved["model"]))
    order = [n for decayed in (True, False) for n in names if decays(n, saved["model"][n].shape) == decayed]
    return saved["optimizer"]["state"][order.index(name)]


@pytest.mark.parametrize("fmt, kind, values, said", [
    ("legacy", "exp_avg_sq", [-1.0, -2.0], "Adam's exp_avg_sq of {} holds 2 negative values (Adam's second moment "
                                           "is a mean of squares, never negative)"),
    ("legacy", "exp_avg", [NAN, INF], "Adam's exp_avg of {} holds 1 NaN value and 1 infinite value"),
    ("torch_dist", "exp_avg_sq", [NAN, 1.0], "Adam's exp_avg_sq of {} holds 1 NaN value"),
    ("distrib_optim.pt", "exp_avg_sq", [-0.5, 1.0], "Adam's exp_avg_sq of {} holds 1 negative value"),
])
def test_adam_moments_that_are_not_finite_or_negative_are_one_line(tmp_path, one_process, capsys, fmt, kind, values,
                                                                   said):
    def poison(t):
        t.view(-1)[:len(values)] = torch.tensor(values)

    if fmt == "legacy":
        folder = to_megatron(tmp_path, "legacy")
        rewrite_rank_file(folder, lambda saved: poison(_legacy_state(saved, FC2)[kind]))
        meg = folder.parent
    elif fmt == "torch_dist":
        meg = rewrite_torch_dist(to_megatron(tmp_path, "torch_dist"), tmp_path / "bad",
                                 lambda whole, states: poison(states[kind][FC2]))
    else:
        folder = to_megatron(tmp_path, "legacy", "--use-distributed-optimizer")
        slot = _master_slot(folder, FC2)
        _rewrite_distrib_optim(folder, lambda buffer: poison(buffer[kind][slot]))
        meg = folder.parent
    err = refused(["from-megatron", str(meg), str(tmp_path / "ours")], tmp_path / "ours", capsys)
    assert said.format(FC2) in err and "the optimizer states are damaged" in err and "--no-optim" in err, err


@pytest.mark.parametrize("fmt, step, said", [
    ("legacy", NAN, "is nan"), ("legacy", -3.0, "is -3.0"), ("legacy", 2.5, "is 2.5"), ("torch_dist", INF, "is inf"),
    ("torch_dist", -7.0, "is -7.0"),
])
def test_an_adam_step_that_is_not_a_whole_number_from_0_is_one_line(tmp_path, one_process, capsys, fmt, step, said):
    """Before: NaN was a JSON traceback at the write (legacy: a line listing every NaN as "not one common step"), a
    negative or fractional step converted with exit 0 into a checkpoint that our own loaders refuse; checkpoint_info.py
    --verify said "converts" for each."""
    folder = to_megatron(tmp_path, fmt)
    if fmt == "legacy":
        rewrite_rank_file(folder, lambda saved: [state.update(step=torch.tensor(step)) for state in
                                                 saved["optimizer"]["state"].values() if isinstance(state, dict)])
    else:
        common = torch.load(folder / "common.pt", weights_only=False)  # our own export
        common["optimizer"]["state"]["common_step"] = torch.tensor(step)
        torch.save(common, folder / "common.pt")
    err = refused(["from-megatron", str(folder.parent), str(tmp_path / "ours")], tmp_path / "ours", capsys)
    assert f"the optimizer's Adam step {said}, not a whole number from 0 to 2^40" in err and "--no-optim" in err, err
    assert program_module("tools/checkpoint_info.py").main([str(folder.parent), "--verify"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("converts: the weights only (from-megatron --no-optim)")


def test_a_distributed_optimizer_state_of_another_shape_is_one_line(tmp_path, one_process, capsys):
    """Megatron saves each state as one flat tensor of the buckets' size; the right size in two dimensions was a
    traceback (``shape '[16]' is invalid for input of size ...``)."""
    folder = to_megatron(tmp_path, "legacy", "--use-distributed-optimizer")
    _rewrite_distrib_optim(folder, lambda buffer: buffer.update(exp_avg=buffer["exp_avg"].view(1, -1)))
    err = refused(["from-megatron", str(folder.parent), str(tmp_path / "ours")], tmp_path / "ours", capsys)
    assert "the distributed optimizer's exp_avg is shaped [1, " in err and "in one dimension" in err, err


# ---- from-hf ----

def to_hf(tmp_path, flags: list[str], our=our_checkpoint) -> pathlib.Path:
    our(tmp_path / "run", flags)
    assert convert.main(["to-hf", str(tmp_path / "run"), str(tmp_path / "hf"), "--no-tokenizer"]) == 0
    return tmp_path / "hf"


def rewrite_safetensors(hf: pathlib.Path, change) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(hf / "model.safetensors"))
    change(state)
    save_file(state, str(hf / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("change, said", [
    (lambda s: s["model.layers.0.mlp.down_proj.weight"].view(-1)[:4].fill_(NAN),
     "the weight model.layers.0.mlp.down_proj.weight holds 4 NaN values"),
    (lambda s: s["lm_head.weight"].view(-1)[7:9].fill_(-INF), "the weight lm_head.weight holds 2 infinite values"),
    (lambda s: s.update({"model.norm.weight": s["model.norm.weight"].to(torch.int32)}),
     "the weight model.norm.weight is torch.int32, not a floating-point type"),
])
def test_a_hugging_face_weight_that_is_not_a_finite_float_is_one_line(tmp_path, one_process, capsys, change, said):
    pytest.importorskip("safetensors")
    hf = to_hf(tmp_path, SHAPES["llama"])
    rewrite_safetensors(hf, change)
    err = refused(["from-hf", str(hf), str(tmp_path / "ours")], tmp_path / "ours", capsys)
    assert said in err and "the folder's weights are damaged" in err, err


def test_an_infinite_deepseek_expert_bias_is_one_line(tmp_path, one_process, capsys):
    pytest.importorskip("safetensors")
    from tests.unit.test_megatron_deepseek import SHAPES as DEEPSEEK
    from tests.unit.test_megatron_deepseek import our_checkpoint as deepseek_checkpoint

    hf = to_hf(tmp_path, DEEPSEEK["q_proj"], deepseek_checkpoint)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    rewrite_safetensors(hf, lambda state: state[bias].__setitem__(2, INF))
    err = refused(["from-hf", str(hf), str(tmp_path / "ours")], tmp_path / "ours", capsys)
    assert f"the weight {bias} holds 1 infinite value" in err, err


# ---- generate.py and serve.py ----

def nan_model(tmp_path, value: float = NAN) -> str:
    """A run folder whose checkpoint (GPT-2's shape) holds ``value`` in one weight, written as a conversion before
    this rule could have written it."""
    config, params = our_checkpoint(tmp_path / "good", SHAPES["gpt2"])
    params["layers.1.mlp.dense_4h_to_h.weight"][2, 3] = value
    write_params(str(tmp_path / "run"), config, params, step=12)
    return str(tmp_path / "run")


GENERATE = ["--tokenizer-type", "NullTokenizer", "--prompt", "1 2 3", "--max-new-tokens", "4"]


def test_generate_refuses_a_model_whose_weights_are_not_finite(tmp_path, capsys):
    run = nan_model(tmp_path)
    capsys.readouterr()
    assert program_module("tools/generate.py").main(["--load", run, *GENERATE]) == 2
    out, err = capsys.readouterr()
    assert not out and len(err.strip().splitlines()) == 1, (out, err)
    assert err.startswith("generate.py: error: ") and "the weight layers.1.mlp.dense_4h_to_h.weight holds 1 NaN " \
        "value; a model whose weights are not finite cannot generate" in err, err


@pytest.mark.parametrize("command", [["to-hf"], ["to-megatron"], ["to-megatron", "--format", "torch_dist"],
                                     ["reshard", "--tp", "2"]])
def test_an_export_of_a_checkpoint_with_a_nan_weight_is_one_line(tmp_path, one_process, capsys, command):
    """Training never saves a non-finite weight, so such a checkpoint is damaged (or crafted, its checksums redone):
    before, to-hf and to-megatron exported it with exit 0 (and from-hf then refused the export)."""
    run = nan_model(tmp_path)
    err = refused([command[0], run, str(tmp_path / "out"), *command[1:]], tmp_path / "out", capsys)
    assert "the fp32 master of layers.1.mlp.dense_4h_to_h.weight holds 1 NaN value; training never saves such " \
        "numbers: the checkpoint is damaged" in err, err


def test_generate_refuses_a_weight_beyond_fp16_in_fp16(tmp_path, capsys):
    run = nan_model(tmp_path, 1e5)
    generate = program_module("tools/generate.py")
    capsys.readouterr()
    assert generate.main(["--load", run, *GENERATE, "--dtype", "fp16"]) == 2
    err = capsys.readouterr().err.strip()
    assert "layers.1.mlp.dense_4h_to_h.weight holds 1 infinite value once cast to fp16" in err, err
    assert "load it with --dtype fp32 or bf16" in err and len(err.splitlines()) == 1, err
    assert generate.main(["--load", run, *GENERATE, "--dtype", "bf16"]) == 0


def test_serve_refuses_a_model_whose_weights_are_not_finite_before_serving(tmp_path, capsys, monkeypatch):
    pytest.importorskip("fastapi")
    from megatron.inference import server

    served = []
    monkeypatch.setattr(server, "serve", lambda *args, **kwargs: served.append(args) or 0)
    run = nan_model(tmp_path, -INF)
    capsys.readouterr()
    assert program_module("tools/serve.py").main(["--load", run, "--tokenizer-type", "NullTokenizer"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("serve.py: error: ") and len(err.splitlines()) == 1, err
    assert "the weight layers.1.mlp.dense_4h_to_h.weight holds 1 infinite value" in err and not served, err


# ---- the rule ----

def test_the_rule_and_its_words(monkeypatch):
    from megatron.checkpoint import foreign_numbers as rule

    monkeypatch.setattr(rule, "_CHUNK", 3)  # every tensor below crosses chunks: counts are summed over them
    t = torch.arange(10.0)
    assert rule.what_is_wrong(t) is None and rule.what_is_wrong(t, second_moment=True) is None
    t[[1, 5, 9]] = NAN
    t[4] = INF
    assert rule.what_is_wrong(t) == "holds 3 NaN values and 1 infinite value"
    assert rule.what_is_wrong(-torch.arange(10.0), second_moment=True).startswith("holds 9 negative values")
    assert rule.what_is_wrong(-torch.arange(10.0)) is None  # a first moment or a weight may be negative
    assert rule.what_is_wrong(torch.ones(4, dtype=torch.int64)) == "is torch.int64, not a floating-point type"
    assert rule.what_is_wrong(torch.full((4,), 70000.0).half()) == "holds 4 infinite values"
    assert rule.what_is_wrong(torch.full((4,), 3e38)) is None  # finite values whose sum overflows
    assert rule.what_is_wrong(torch.zeros(4, 4).t()) is None  # strided: checked whole
    assert rule.what_is_wrong(torch.zeros(3).to(torch.float8_e4m3fn)) is None  # no isfinite kernel: widened
    assert rule.what_is_wrong([1.0]) == "is a list, not a tensor"
    with pytest.raises(rule.CheckpointError, match=r"^F: Adam's exp_avg of w has shape \[2\], not its parameter's "
                                                   r"\[3\]; do this\.$"):
        rule.check_state("exp_avg", "w", torch.zeros(2), "F", "do this", shape=(3,))
