"""Hugging Face gpt-oss (``GptOssForCausalLM``) both ways (megatron/checkpoint/hf/gpt_oss.py): our gpt-oss-shaped
model (sliding windows narrower than the sequence in alternate layers, sinks, the clamped quick GeGLU, biases, 4
experts top 2, unrounded YaRN) exports with our logits, a transformers-initialised one imports with transformers'
logits and exports back bitwise, our engine generates transformers' greedy tokens past the window (its rolling KV
cache), our config round-trips through GptOssConfig, and what does not map is refused in one line. In process: tiny
models, no runs."""

from __future__ import annotations

import json

import pytest
import torch

from megatron.checkpoint.convert import open_checkpoint
from megatron.checkpoint.hf import gpt_oss as hf_gpt_oss
from megatron.checkpoint.hf.common import ConversionError
from megatron.checkpoint.hf.models import converter_for_hf, converter_for_model
from megatron.config import parse_config
from megatron.inference import InferenceEngine, Request, SamplingParams, initialize, load_model
from megatron.parallelize_gpt import build_model
from tests.functional.test_hf_llama import (
    VOCAB,
    convert,
    make_config,
    one_line_error,
    our_logits,
    tokens,
    write_perturbed_checkpoint,
)
from tests.unit.test_checkpoint_tools import write_params

transformers = pytest.importorskip("transformers")

WINDOW = 8  # Hugging Face's sliding_window: a query and the 7 keys before it (SEQ is 32)
# 4 query heads in 2 groups of width 24, 4 experts of width 32 top 2, sinks, biases, a clamp of 1 (it bites)
BASE = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
        "--num-query-groups", "2", "--kv-channels", "24", "--ffn-hidden-size", "32", "--normalization", "RMSNorm",
        "--layernorm-epsilon", "1e-6", "--quick-geglu", "--glu-linear-offset", "1.0",
        "--activation-func-clamp-value", "1.0", "--softmax-type", "learnable", "--num-experts", "4",
        "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--rotary-base", "10000", "--vocab-size", str(VOCAB),
        "--max-seq-len", "32", "--max-position-embeddings", "128", "--hidden-dropout", "0", "--attention-dropout", "0")
# the window in layer 1 (of 1, 2: skip freq 2); YaRN x4 over 32 positions with beta_fast 4 (the unrounded ramp has
# fractional ends)
WINDOWS = ("--window-size", f"{WINDOW - 1},0", "--window-attn-skip-freq", "2")
YARN = ("--position-embedding-type", "yarn", "--rotary-scaling-factor", "4", "--original-max-position-embeddings",
        "32", "--yarn-beta-fast", "4", "--no-yarn-correction-range-round-to-int")
OURS = (*BASE, *WINDOWS, *YARN, "--untie-embeddings-and-output-weights")
# what a round trip through GptOssConfig keeps
FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "moe_ffn_hidden_size",
          "normalization", "layernorm_epsilon", "quick_geglu", "glu_linear_offset", "activation_func_clamp_value",
          "window_size", "window_attn_skip_freq", "softmax_type", "num_experts", "moe_router_topk", "moe_layer_freq",
          "position_embedding_type", "rotary_base", "rotary_scaling_factor", "original_max_position_embeddings",
          "yarn_beta_fast", "yarn_beta_slow", "yarn_correction_range_round_to_int", "mscale", "mscale_all_dim",
          "vocab_size", "max_position_embeddings", "untie_embeddings_and_output_weights", "disable_bias_linear",
          "moe_router_pre_softmax", "moe_aux_loss_coeff")


def hf_config(**changes):
    """A tiny ``GptOssConfig``: 3 layers, full attention in the first (a pattern, not a skip frequency)."""
    settings = dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, vocab_size=VOCAB, max_position_embeddings=128, rms_norm_eps=1e-6, sliding_window=WINDOW,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"], num_local_experts=4,
        num_experts_per_tok=2, swiglu_limit=1.0, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                            "original_max_position_embeddings": 32})
    return transformers.GptOssConfig(**{**settings, **changes})


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(a random ``GptOssForCausalLM``, every weight perturbed: sinks and biases not zero; its folder; our import)."""
    folder = tmp_path_factory.mktemp("gpt_oss")
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(hf_config()).eval()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(folder / "hf_in"))
    assert convert.main(["from-hf", str(folder / "hf_in"), str(folder / "ours")]) == 0
    return model, folder / "hf_in", folder / "ours"


def test_an_import_gives_transformers_logits(imported):
    model, _, ours_dir = imported
    _, _, config = open_checkpoint(str(ours_dir))
    m = config.model
    assert (m.window_size, m.window_attn_skip_freq, m.softmax_type, m.quick_geglu, m.glu_linear_offset,
            m.activation_func_clamp_value, m.disable_bias_linear) == ("7,0", "[0,1,1]", "learnable", True, 1.0, 1.0,
                                                                      False)
    assert (m.position_embedding_type, m.rotary_base, m.rotary_scaling_factor, m.original_max_position_embeddings,
            m.yarn_correction_range_round_to_int) == ("yarn", 150000, 4.0, 32, False)
    ids = tokens()  # 32 positions: four windows
    ours, theirs = our_logits(config, ours_dir, ids), hf_logits(model, ids)
    assert ours.abs().max() > 1.0  # not a near-zero comparison
    torch.testing.assert_close(ours[..., :VOCAB], theirs, rtol=0, atol=1e-5)


def test_an_import_exports_back_bitwise(imported, tmp_path):
    from safetensors.torch import load_file

    _, src, ours_dir = imported
    assert convert.main(["to-hf", str(ours_dir), str(tmp_path / "hf_out")]) == 0
    before, after = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "hf_out" / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in before and "model.layers.0.self_attn.sinks" in before
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    config = json.loads((tmp_path / "hf_out" / "config.json").read_text())
    assert config["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    assert (config["sliding_window"], config["swiglu_limit"], config["rope_parameters"]["truncate"]) == (WINDOW, 1.0,
                                                                                                         False)


def test_our_engine_generates_transformers_greedy_tokens_past_the_window(imported):
    """Three prompts in one batch (left-padded to the longest, which is longer than the window: the short one's padding
    fills the rolling cache after the prompt), 24 new tokens each: up to 36 positions, the window 8."""
    model, _, ours_dir = imported
    prompts = [[5, 17, 99, 3, 249, 42, 7], [11, 200, 31, 64], [int(t) for t in tokens(1, seed=3)[0, :12]]]
    initialize()
    ours, config = load_model(str(ours_dir))
    engine = InferenceEngine(ours, config, None)
    completions = engine.generate([Request(p, SamplingParams(max_tokens=24, temperature=0)) for p in prompts])
    for prompt, completion in zip(prompts, completions):
        with torch.no_grad():
            theirs = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
        assert len(completion.tokens) == 24 and len(prompt) + 24 > 3 * WINDOW
        assert completion.tokens == theirs[0, len(prompt):].tolist()


def _our_model(tmp_path, *flags: str):
    config = make_config(*OURS, *flags)
    write_perturbed_checkpoint(config, tmp_path / "ckpt")
    return config


@pytest.mark.parametrize("flags", [(), ("--disable-bias-linear",)], ids=["biases", "megatron-recipe-no-biases"])
def test_an_export_of_our_model_gives_transformers_our_logits(tmp_path, flags):
    config = _our_model(tmp_path, *flags)
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["GptOssForCausalLM"] and cfg["sliding_window"] == WINDOW
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager")
    ids = tokens()
    ours, theirs = our_logits(config, tmp_path / "ckpt", ids)[..., :VOCAB], hf_logits(model.eval(), ids)
    assert ours.abs().max() > 1.0
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("flags", [
    OURS,
    (*OURS, "--num-layers", "3", "--window-attn-skip-freq", "[1,0,0]", "--moe-aux-loss-coeff", "0.01"),
    (*BASE, *YARN, "--window-size", "3,0"),  # every layer sliding
    (*BASE, "--position-embedding-type", "rope"),  # tied, plain rope, no window
], ids=["gpt-oss", "pattern", "all-sliding", "rope-tied-no-window"])
def test_our_config_round_trips_through_gpt_oss_config(flags):
    m = make_config(*flags).model
    hf = transformers.GptOssConfig(**hf_gpt_oss.hf_config(m)).to_dict()
    assert converter_for_hf(hf) is hf_gpt_oss
    back = parse_config(hf_gpt_oss.model_flags(hf)).model
    assert {f: getattr(back, f) for f in FIELDS} == {f: getattr(m, f) for f in FIELDS}


@pytest.mark.parametrize("change, message", [
    ({"swiglu_alpha": 1.5}, "config.json sets swiglu_alpha 1.5; this GPT's quick GeGLU has the sigmoid gain 1.702"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "gpt-oss's MXFP4 experts"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "attention_factor": 2.0,
                          "original_max_position_embeddings": 32}}, "YaRN scales cos and sin by 2.0"),
    ({"layer_types": ["sliding_attention"] * 3, "sliding_window": None}, "its sliding_window is None"),
], ids=["alpha", "mxfp4", "attention-factor", "no-window-width"])
def test_what_this_gpt_cannot_represent_is_refused_in_one_line(tmp_path, capsys, change, message):
    src = tmp_path / "hf_in"
    src.mkdir()  # the config is read first: no weights needed
    (src / "config.json").write_text(json.dumps({**hf_config().to_dict(), **change}))
    assert convert.main(["from-hf", str(src), str(tmp_path / "out")]) == 2
    assert message in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def test_a_window_or_sinks_never_export_to_an_architecture_that_drops_them(tmp_path, capsys):
    from tests.functional.test_hf_llama import LLAMA

    config = make_config(*LLAMA, "--window-size", "7,0")  # Llama-shaped, dense: not Llama without its window
    write_params(str(tmp_path / "ckpt"), config,
                 {name: p.detach() for name, p in build_model(config).named_parameters()})
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 2
    assert "a dense model (num_experts unset) has no Hugging Face gpt-oss" in one_line_error(capsys)
    for flags, message in (((*OURS, "--softmax-type", "vanilla"), "softmax_type vanilla has no"),
                           ((*OURS, "--mscale-all-dim", "1"), "YaRN's mscale 1.0 / mscale_all_dim 1.0 has no")):
        with pytest.raises(ConversionError, match="cannot be exported") as err:
            converter_for_model(make_config(*flags).model)
        assert message in str(err.value)


def test_off_by_one_sinks_export_as_zero_sinks_and_come_back():
    config = make_config(*OURS, "--softmax-type", "off-by-one")
    params = {name: p.detach() + 0.1 for name, p in build_model(config).named_parameters()}
    hf = converter_for_model(config.model).to_hf_state_dict(params, config.model)
    assert torch.equal(hf["model.layers.1.self_attn.sinks"], torch.zeros(4))
    back = hf_gpt_oss.from_hf_state_dict(hf, config.model, config.padded_vocab_size)
    assert back.keys() == params.keys() and all(torch.equal(back[k][:VOCAB], params[k][:VOCAB]) for k in params)


def test_without_biases_the_router_and_experts_export_zero_biases_and_come_back():
    """Megatron-LM's gpt-oss recipe (--disable-bias-linear): gpt-oss always has router and expert biases, written as
    zeros (attention_bias false drops the attention's); imported back, the same parameters; a nonzero one refused."""
    config = make_config(*OURS, "--disable-bias-linear")
    params = {name: p.detach() + 0.1 for name, p in build_model(config).named_parameters()}
    assert not any(name.endswith(".bias") for name in params)
    hf = converter_for_model(config.model).to_hf_state_dict(params, config.model)
    assert torch.equal(hf["model.layers.1.mlp.router.bias"], torch.zeros(4))
    assert torch.equal(hf["model.layers.0.mlp.experts.down_proj_bias"], torch.zeros(4, 64))
    assert not any("self_attn" in name and name.endswith("_bias") for name in hf)
    assert hf_gpt_oss.hf_config(config.model)["attention_bias"] is False
    back = hf_gpt_oss.from_hf_state_dict(hf, config.model, config.padded_vocab_size)
    assert back.keys() == params.keys() and all(torch.equal(back[k][:VOCAB], params[k][:VOCAB]) for k in params)
    hf["model.layers.0.mlp.experts.gate_up_proj_bias"][1, 3] = 0.5
    with pytest.raises(ConversionError, match="gate_up_proj_bias is not zero, but config.json sets attention_bias"):
        hf_gpt_oss.from_hf_state_dict(hf, config.model, config.padded_vocab_size)
