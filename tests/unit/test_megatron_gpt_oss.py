"""Megatron-LM checkpoints of gpt-oss's shape (``tools/convert_checkpoint.py from-megatron`` / ``to-megatron``): a
sliding window in alternate layers (narrower than the sequence), learnable sinks, the clamped quick GeGLU with its
offset (a MoE layer's experts and a dense MLP), linear biases and the router's bias, YaRN on standard attention with
the unrounded ramp (fractional ends), grouped-query attention, an untied head.

- ours -> Megatron (legacy cut for tp 2 x pp 2, torch_dist) -> ours is bitwise: the weights, the AdamW states and
  the model's configuration (the window, its layers, the softmax, quick GeGLU, YaRN through the saved ``args``); the
  rank files hold Megatron Core's layout (the sinks cut with the heads, quick GeGLU's ``[gate_r; up_r]`` per rank,
  the router's bias whole) and torch_dist its sharded keys (``self_attention.core_attention.softmax_offset``);
- against NVIDIA's Megatron Core 0.16.1 (``megatron_core_reference``; skipped when absent), its ``GPTModel`` built
  with the local spec from the export's ``args`` by Megatron-LM's rule (``core_model_from_args``): it loads the
  legacy export (strict ``load_state_dict``) and torch_dist (its ``dist_checkpointing.load``) and gives our logits
  within 1e-5 of their scale in fp32; its own weights, saved as Megatron-LM saves them (legacy, and torch_dist by
  its ``dist_checkpointing.save``), convert with ``from-megatron`` and give its logits here; ``core_order`` (the
  legacy optimizer's parameter order) is its ``named_parameters`` order, the sinks included;
- Megatron-LM's own ``args`` (a window tuple, a skip list, YaRN's None defaults, ``--enable-gpt-oss``) give our
  model; what would change the network unseen (a window looking ahead, Llama 3's rope scaling, ...) is refused in
  one line, by ``model_flags`` and by the tool; a gpt-oss field given on the command line of ``from-megatron`` that
  differs from the checkpoint's is one line.

On the CPU, Megatron Core 0.16.1 needs two device choices patched (``mcore``; scoped to this module, the arithmetic
untouched): the sinks are allocated on ``torch.cuda.current_device()`` (``megatron_core()`` already makes that the
CPU), and ``get_sliding_window_causal_mask`` (megatron/core/transformer/utils.py, imported into
megatron/core/fusions/fused_softmax.py) builds the window's mask with ``device="cuda"``: it runs as written with
that one ``torch.ones(..., device=...)`` call on the CPU. Its ``quick_gelu`` runs eagerly
(``core_model_from_args``). Nothing of the comparison is left out on the CPU.
"""

from __future__ import annotations

import argparse
import types

import pytest
import torch

from megatron.checkpoint.convert import open_checkpoint, read_tensors, tensor_layout, write_checkpoint
from megatron.checkpoint.hf.common import ConversionError
from megatron.checkpoint.megatron_lm.args import model_flags, to_args
from megatron.checkpoint.megatron_lm.legacy import FILE, TRACKER, safe_load
from megatron.config import parse_config, validate
from megatron.model.gpt import GPTModel
from tests.unit.megatron_core_reference import (
    CORE_WARNINGS,
    TINY,
    assert_close_to_scale,
    core_forward,
    core_model_from_args,
    megatron_core,
    save_as_megatron,
    tokens_and_labels,
)
from tests.unit.test_megatron_checkpoints import convert

pytestmark = CORE_WARNINGS

KINDS = ("param", "exp_avg", "exp_avg_sq")
# 4 heads in 2 groups of width 8 (4 rotary frequencies); layer 0 MoE (4 experts top 2, the router's bias), layer 1
# dense; the window (a query and 3 keys before it, of 8) in layer 0 only (skip frequency 2); YaRN x4 over 64 original
# positions with beta_fast 4: the unrounded ramp's ends are 0.54 and 1.34 channels; a clamp of 0.5 (it bites)
GPT_OSS = ["--normalization", "RMSNorm", "--layernorm-epsilon", "1e-6", "--group-query-attention",
           "--num-query-groups", "2", "--kv-channels", "8", "--untie-embeddings-and-output-weights", "--quick-geglu",
           "--glu-linear-offset", "1", "--activation-func-clamp-value", "0.5", "--softmax-type", "learnable",
           "--window-size", "3,0", "--window-attn-skip-freq", "2", "--position-embedding-type", "yarn",
           "--rotary-base", "1000", "--rotary-scaling-factor", "4", "--original-max-position-embeddings", "64",
           "--yarn-beta-fast", "4", "--no-yarn-correction-range-round-to-int", "--num-experts", "4",
           "--moe-router-topk", "2", "--moe-layer-freq", "[1,0]", "--moe-token-dispatcher-type", "allgather"]
SINKS = "self_attention.core_attention.softmax_offset"


def our_checkpoint(run, flags=(), step=12, consumed=96, scale=1.0):
    """A checkpoint of ours: random weights and AdamW states. ``scale`` < 1: weights of that size, the norms' around
    1 (a well-conditioned network, for comparing computations)."""
    config = parse_config([*TINY, *GPT_OSS, *flags])
    validate(config)
    g = torch.Generator().manual_seed(3)
    tensors = {kind: {name: torch.randn(shape, generator=g).abs() if kind == "exp_avg_sq" else
                      torch.randn(shape, generator=g) for name, (shape, _) in tensor_layout(config).items()}
               for kind in KINDS}
    tensors["param"] = {name: t * scale + (1.0 if name.endswith("norm.weight") else 0.0)
                        for name, t in tensors["param"].items()}
    for by_name in tensors.values():
        for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            by_name[name][config.model.vocab_size:] = 0
    write_checkpoint(str(run), config, [(kind, name) for kind in KINDS for name in tensors["param"]],
                     lambda kind, name: tensors[kind][name], step=step, adam_step=5.0,
                     train_state={"consumed_samples": consumed, "skipped_steps": 0, "schedule_samples": consumed})
    return config, tensors


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_ours_to_megatron_and_back_is_bitwise(tmp_path, one_process, fmt):
    config, tensors = our_checkpoint(tmp_path / "run", ["--vocab-size", "250"])
    assert convert.main(["to-megatron", str(tmp_path / "run"), str(tmp_path / "meg"), "--format", fmt,
                         "--tp", "2", "--pp", "2"]) == 0
    folder = tmp_path / "meg" / "iter_0000012"
    if fmt == "legacy":
        ranks = {(t, p): safe_load(str(folder / f"mp_rank_{t:02d}_{p:03d}" / FILE)) for t in range(2) for p in range(2)}
        check_legacy_layout(ranks, tensors["param"])
    else:
        from megatron.checkpoint.megatron_lm.dcp_reader import SafeReader

        keys = SafeReader(str(folder)).read_metadata().state_dict_metadata.keys()
        assert {f"decoder.layers.0.{SINKS}", f"decoder.layers.1.{SINKS}", "decoder.layers.0.mlp.router.bias",
                "decoder.layers.0.mlp.experts.experts.linear_fc1.bias", "decoder.layers.1.mlp.linear_fc1.bias",
                f"optimizer.state.exp_avg.decoder.layers.1.{SINKS}"} <= keys
    assert convert.main(["from-megatron", str(tmp_path / "meg"), str(tmp_path / "back")]) == 0
    reader, common, back_config = open_checkpoint(str(tmp_path / "back"))
    assert back_config.model == config.model
    assert common["step"] == 12 and common["adam_step"] == 5.0
    for kind in KINDS:
        back = read_tensors(reader, kind)
        assert back.keys() == tensors[kind].keys()
        for name, t in tensors[kind].items():
            assert torch.equal(back[name], t), (kind, name)


def check_legacy_layout(ranks: dict, params: dict) -> None:
    """Megatron Core's layout on the tp 2 x pp 2 ranks ({(t, p): saved dict}): the sinks cut with the heads, quick
    GeGLU's ``linear_fc1`` ``[gate_r; up_r]`` on rank r (weight and bias, an expert's and the dense MLP's), the
    router's bias whole; the args carry the window, the softmax and YaRN as Megatron-LM names them."""
    args = ranks[(0, 0)]["args"]
    assert (args.window_size, args.window_attn_skip_freq, args.softmax_type, args.quick_geglu, args.glu_linear_offset,
            args.activation_func_clamp_value, args.position_embedding_type) == ((3, 0), 2, "learnable", True, 1.0,
                                                                                0.5, "yarn")
    assert (args.yarn_original_max_position_embeddings, args.yarn_beta_fast, args.yarn_beta_slow,
            args.yarn_correction_range_round_to_int, args.rotary_scaling_factor) == (64, 4.0, 1.0, False, 4.0)
    first, last = ranks[(1, 0)]["model"], ranks[(1, 1)]["model"]  # tp rank 1 of each stage
    assert torch.equal(first[f"decoder.layers.0.{SINKS}"], params["layers.0.self_attention.softmax_offset"][2:])
    assert torch.equal(last[f"decoder.layers.0.{SINKS}"], params["layers.1.self_attention.softmax_offset"][2:])
    assert torch.equal(first["decoder.layers.0.mlp.router.bias"], params["layers.0.mlp.router.bias"])
    for core, ours, model in (("mlp.experts.local_experts.3.linear_fc1", "layers.0.mlp.experts.3.dense_h_to_4h", first),
                              ("mlp.linear_fc1", "layers.1.mlp.dense_h_to_4h", last)):
        for param in ("weight", "bias"):
            fc1 = params[f"{ours}.{param}"]  # ours: rows gate_0, up_0, gate_1, up_1, ...
            assert torch.equal(model[f"decoder.layers.0.{core}.{param}"],
                               torch.cat([fc1[0::2].chunk(2)[1], fc1[1::2].chunk(2)[1]])), (core, param)
    names = list(first)  # Megatron Core's order: the attention's core before linear_proj
    proj = names.index("decoder.layers.0.self_attention.linear_proj.weight")
    assert names.index(f"decoder.layers.0.{SINKS}") + 1 == proj


def test_megatron_lms_own_gpt_oss_args_give_the_model():
    """The ``args`` a Megatron-LM gpt-oss run saves (its names and forms: the window a tuple, the skip frequency a
    list, YaRN's unset fields None) give our model; ``--enable-gpt-oss`` (its ModelOpt builder) sets gpt-oss's YaRN;
    a gated MLP's offset and clamp are carried for SwiGLU too and ignored (as Megatron Core does) without a gate."""
    args = argparse.Namespace(
        num_layers=4, hidden_size=16, ffn_hidden_size=24, num_attention_heads=4, kv_channels=8,
        group_query_attention=True, num_query_groups=2, max_position_embeddings=8, seq_length=8,
        position_embedding_type="yarn", rotary_base=1000, rotary_percent=1.0, rotary_interleaved=False,
        normalization="RMSNorm", norm_epsilon=1e-5, swiglu=False, quick_geglu=True, glu_linear_offset=1.0,
        activation_func_clamp_value=7.0, add_bias_linear=True, add_qkv_bias=True, bias_gelu_fusion=False,
        untie_embeddings_and_output_weights=True, vocab_size=None, padded_vocab_size=128, window_size=(5, 0),
        window_attn_skip_freq=[1, 0, 1, 0], softmax_type="off-by-one", rotary_scaling_factor=4.0, mscale=1.0,
        mscale_all_dim=0.0, yarn_original_max_position_embeddings=None, yarn_beta_fast=None, yarn_beta_slow=2.0,
        yarn_correction_range_round_to_int=None, use_rope_scaling=False, no_rope_freq=None, num_experts=4,
        moe_router_topk=2, moe_layer_freq=1, moe_grouped_gemm=False, moe_token_dispatcher_type="alltoall",
        hidden_dropout=0.0, attention_dropout=0.0)
    m = _model(args)
    assert (m.window_size, m.window_attn_skip_freq, m.softmax_type, m.quick_geglu, m.glu_linear_offset,
            m.activation_func_clamp_value, m.bias_gelu_fusion) == ("5,0", "[1,0,1,0]", "off-by-one", True, 1.0, 7.0,
                                                                   True)
    assert (m.position_embedding_type, m.rotary_scaling_factor, m.original_max_position_embeddings, m.yarn_beta_fast,
            m.yarn_beta_slow, m.yarn_correction_range_round_to_int, m.rotary_base) == ("yarn", 4.0, 4096, 32.0, 2.0,
                                                                                      True, 1000)
    m = _model(argparse.Namespace(**{**vars(args), "position_embedding_type": "rope", "enable_gpt_oss": True,
                                     "window_attn_skip_freq": 2}))
    assert (m.position_embedding_type, m.rotary_scaling_factor, m.original_max_position_embeddings, m.yarn_beta_fast,
            m.yarn_beta_slow, m.yarn_correction_range_round_to_int, m.window_attn_skip_freq) == (
        "yarn", 32.0, 131072, 32.0, 1.0, False, "2")
    m = _model(argparse.Namespace(**{**vars(args), "quick_geglu": False, "swiglu": True}))
    assert (m.swiglu, m.glu_linear_offset, m.activation_func_clamp_value) == (True, 1.0, 7.0)
    m = _model(argparse.Namespace(**{**vars(args), "quick_geglu": False, "window_size": (-1, 0)}))
    assert (m.glu_linear_offset, m.activation_func_clamp_value, m.window_size, m.window_attn_skip_freq) == (
        0.0, None, None, None)


def _model(args):
    config = parse_config(["--mock-data", *model_flags(args)])
    validate(config)
    return config.model


@pytest.mark.parametrize("change, message", [
    ({"window_size": (5, 2)}, "sliding window (5, 2) lets each token see 2 later token(s)"),
    ({"window_size": "wide"}, "window_size 'wide' is not two integers"),
    ({"use_rope_scaling": True}, "Llama 3's rope scaling (--use-rope-scaling)"),
    ({"no_rope_freq": 4}, "layers without rotary embeddings (--no-rope-freq)"),
    ({"rotary_seq_len_interpolation_factor": 2}, "interpolated rotary positions"),
    ({"position_embedding_type": "mrope"}, "position_embedding_type 'mrope' is not converted"),
])
def test_what_gpt_oss_args_cannot_give_is_one_line(change, message):
    args = to_args(parse_config([*TINY, *GPT_OSS]).model, tp=1, pp=1, seq_length=8, iteration=0,
                   consumed_train_samples=0)
    with pytest.raises(ConversionError) as refused:
        model_flags(argparse.Namespace(**{**vars(args), **change}))
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_megatron_checkpoint_with_an_unmapped_window_is_refused_in_one_line(tmp_path, one_process, capsys):
    config = parse_config([*TINY, *GPT_OSS])
    validate(config)
    args = to_args(config.model, tp=1, pp=1, seq_length=8, iteration=2, consumed_train_samples=0)
    args.window_size = (3, 1)
    meg = tmp_path / "meg"
    (meg / "iter_0000002" / "mp_rank_00").mkdir(parents=True)
    torch.save({"args": args, "model": {}, "iteration": 2}, meg / "iter_0000002" / "mp_rank_00" / FILE)
    (meg / TRACKER).write_text("2")
    assert convert.main(["from-megatron", str(meg), str(tmp_path / "ours")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "sliding window (3, 1)" in err and "RIGHT > 0" in err, err
    assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize("flags, field", [
    (["--window-size", "5,0"], "window_size"), (["--window-attn-skip-freq", "[1,1]"], "window_attn_skip_freq"),
    (["--softmax-type", "off-by-one"], "softmax_type"), (["--glu-linear-offset", "0"], "glu_linear_offset"),
    (["--activation-func-clamp-value", "7"], "activation_func_clamp_value"), (["--swiglu"], "swiglu"),
    (["--yarn-beta-fast", "32"], "yarn_beta_fast"), (["--yarn-beta-slow", "2"], "yarn_beta_slow"),
    (["--yarn-correction-range-round-to-int"], "yarn_correction_range_round_to_int"),
    (["--rotary-base", "10000"], "rotary_base"),
])
def test_the_checkpoints_shape_cannot_be_overridden(flags, field):
    """``from-megatron`` / ``from-hf`` take pretrain_gpt.py flags, never one that changes the network the weights
    belong to (``converted_config.SHAPE_FIELDS``)."""
    derived = model_flags(to_args(parse_config([*TINY, *GPT_OSS]).model, tp=1, pp=1, seq_length=8, iteration=0,
                                  consumed_train_samples=0))
    assert convert.shaped_config(derived, ["--max-seq-len", "8"], "the checkpoint's args").model.window_size == "3,0"
    with pytest.raises(convert.ToolError) as refused:
        convert.shaped_config(derived, flags, "the checkpoint's args")
    assert str(refused.value).startswith(f"{field} is ") and "cannot be changed" in str(refused.value)


def test_multi_latent_attentions_yarn_ramp_megatron_does_not_build_is_one_line():
    from tests.unit.test_mla import MLA, YARN

    config = parse_config([*TINY, *MLA, *YARN, "--yarn-beta-fast", "8"])
    validate(config)
    with pytest.raises(ConversionError) as refused:
        to_args(config.model, tp=1, pp=1, seq_length=8, iteration=0, consumed_train_samples=0)
    assert "Megatron Core builds (32, 1, True) there only" in str(refused.value)


# ----------------------------------------------------------------------------- against Megatron Core

@pytest.fixture(scope="module")
def mcore():
    """Megatron Core on the CPU (``megatron_core()``), its sliding-window mask made on the CPU: the function runs as
    written, its ``torch.ones(..., device="cuda")`` given the CPU."""
    with megatron_core() as env:
        from megatron.core.fusions import fused_softmax
        from megatron.core.transformer import utils as core_utils

        window_mask = fused_softmax.get_sliding_window_causal_mask
        cpu_torch = types.SimpleNamespace(**{n: getattr(torch, n) for n in dir(torch) if not n.startswith("__")})
        cpu_torch.ones = lambda *size, device=None, **kwargs: torch.ones(*size, **kwargs)

        def on_the_cpu(sq, skv, window_size):
            with pytest.MonkeyPatch.context() as inside:
                inside.setattr(core_utils, "torch", cpu_torch)
                return window_mask(sq, skv, window_size)

        patches = pytest.MonkeyPatch()
        patches.setattr(fused_softmax, "get_sliding_window_causal_mask", on_the_cpu)
        try:
            yield env
        finally:
            patches.undo()


def our_model(reader, config) -> GPTModel:
    model = GPTModel(config.model, config.padded_vocab_size)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(reader.full("param", name))
    return model.eval()


@pytest.mark.parametrize("fmt, softmax", [("legacy", "learnable"), ("torch_dist", "learnable"),
                                           ("legacy", "off-by-one")])
def test_megatron_core_loads_the_export_with_our_logits(tmp_path, mcore, fmt, softmax):
    from megatron.core import dist_checkpointing

    our_checkpoint(tmp_path / "run", ["--softmax-type", softmax], step=3, scale=0.3)
    reader, _, config = open_checkpoint(str(tmp_path / "run"))
    meg = tmp_path / "meg"
    assert convert.main(["to-megatron", str(tmp_path / "run"), str(meg), "--format", fmt, "--no-optim"]) == 0
    if fmt == "legacy":
        saved = safe_load(str(meg / "iter_0000003" / "mp_rank_00" / FILE))
        theirs = core_model_from_args(mcore, saved["args"])
        theirs.load_state_dict(saved["model"], strict=True)
    else:
        theirs = core_model_from_args(mcore, safe_load(str(meg / "iter_0000003" / "common.pt"))["args"])
        with torch.serialization.safe_globals([argparse.Namespace]):
            loaded = dist_checkpointing.load({"model": theirs.sharded_state_dict()}, str(meg / "iter_0000003"))
        theirs.load_state_dict(loaded["model"], strict=True)
    windows = [layer.self_attention.core_attention.scale_mask_softmax.window_size for layer in theirs.decoder.layers]
    assert windows == [(3, 0), None]  # layer 1 of 2 (1-based) has the window
    tokens, _ = tokens_and_labels()
    with torch.no_grad():
        got, want = our_model(reader, config)(tokens), core_forward(theirs.eval(), tokens)
    assert theirs.config.softmax_type == softmax
    print(f"{fmt}, {softmax}: max |logit difference| {float((got - want).abs().max()):.3g} of max |logit| "
          f"{float(want.abs().max()):.3g}")
    assert_close_to_scale(got, want, f"{fmt} logits, {softmax} softmax")


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_megatron_cores_own_checkpoint_gives_its_logits_here(tmp_path, mcore, fmt):
    """Megatron Core's own GPTModel of the gpt-oss shape (its initialisation, perturbed: the sinks and biases not
    zero), saved as Megatron-LM saves it (legacy: its state dict; torch_dist: its ``dist_checkpointing.save``),
    converts with ``from-megatron`` and gives its logits here."""

    config = parse_config([*TINY, *GPT_OSS])
    validate(config)
    args = to_args(config.model, tp=1, pp=1, seq_length=8, iteration=6, consumed_train_samples=24)
    theirs = core_model_from_args(mcore, args)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    save_as_megatron(theirs, args, tmp_path / "meg", 6, fmt)
    assert convert.main(["from-megatron", str(tmp_path / "meg"), str(tmp_path / "ours")]) == 0
    reader, _, back = open_checkpoint(str(tmp_path / "ours"))
    assert back.model == config.model
    tokens, _ = tokens_and_labels()
    with torch.no_grad():
        assert_close_to_scale(our_model(reader, back)(tokens), core_forward(theirs.eval(), tokens), f"{fmt} logits")


def test_core_order_is_megatron_cores_parameter_order(mcore):
    """What to-megatron numbers the legacy optimizer's states by (``megatron_optim.core_order``): Megatron Core's
    ``named_parameters`` order, the sinks (its attention's core) before ``linear_proj``, the router's bias."""
    from megatron.checkpoint.megatron_lm.optim import core_order

    config = parse_config([*TINY, *GPT_OSS])
    validate(config)
    theirs = core_model_from_args(mcore, to_args(config.model, tp=1, pp=1, seq_length=8, iteration=0,
                                                 consumed_train_samples=0))
    names = [n for n, _ in theirs.named_parameters()]
    assert f"decoder.layers.1.{SINKS}" in names and "decoder.layers.0.mlp.router.bias" in names
    assert core_order(list(reversed(names))) == names
