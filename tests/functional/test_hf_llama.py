"""Hugging Face Llama (``LlamaForCausalLM``) export and import: HF -> ours -> HF is bitwise (grouped-query
attention, tied and untied head, with and without biases, any tp), an export of our model gives
transformers the same logits, and what has no Llama (or GPT-2) equivalent is refused in one line."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch

from megatron import parallel_state
from megatron.checkpoint import CheckpointReader, resolve_checkpoint
from megatron.checkpoint.convert import open_checkpoint, tensor_layout, write_params
from megatron.checkpoint.hf import llama as L
from megatron.checkpoint.hf.common import ConversionError
from megatron.config import Config, parse_config, validate
from megatron.parallelize_gpt import build_model
from megatron.tensor_parallel import tensor_parallel_seed
from tests.functional.launch import ROOT, TINY, run_here

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 250, 32  # vocab 250 pads to 256 (tp 1 and 2): the padding rows are exercised
# 4 query heads in 2 key/value groups, head width 16, SwiGLU width 96 (tp 2 divides every split)
LLAMA = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--ffn-hidden-size", "96", "--position-embedding-type", "rope",
         "--normalization", "RMSNorm", "--swiglu", "--rotary-base", "500000", "--layernorm-epsilon", "1e-6",
         "--vocab-size", str(VOCAB), "--max-seq-len", str(SEQ), "--max-position-embeddings", str(SEQ),
         "--hidden-dropout", "0", "--attention-dropout", "0")
WTE = "embedding.word_embeddings.weight"
VARIANTS = [pytest.param(tie, bias, id=f"{'tied' if tie else 'untied'}-{'bias' if bias else 'nobias'}")
            for tie in (True, False) for bias in (True, False)]


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


convert = _tool("convert_checkpoint")


def llama_flags(tie: bool = True, bias: bool = False) -> list[str]:
    return [*LLAMA, *([] if tie else ["--untie-embeddings-and-output-weights"]),
            *([] if bias else ["--disable-bias-linear"])]


def make_config(*argv: str) -> Config:
    config = parse_config(["--mock-data", "--device", "cpu", *argv])
    validate(config, world_size=1, cuda_available=False)
    return config


def hf_model(tie: bool, bias: bool, head_dim: int = 16, seed: int = 0):
    """A tiny random ``LlamaForCausalLM`` (every weight perturbed, so norms are not 1 and biases not 0)."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=head_dim, vocab_size=VOCAB, max_position_embeddings=SEQ, rms_norm_eps=1e-6, rope_theta=500000.0,
        tie_word_embeddings=tie, attention_bias=bias, mlp_bias=bias, bos_token_id=None, eos_token_id=None)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # a tied head is the same Parameter: perturbed once
            p.add_(torch.randn_like(p) * 0.1)
    return model


def hf_state(model) -> dict[str, torch.Tensor]:
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def tokens(batch: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def write_perturbed_checkpoint(config: Config, folder) -> None:
    """A checkpoint at ``folder`` of our model built from ``config``, every weight perturbed by N(0, 0.1) (norms,
    biases and gates then matter), the padding rows of the vocabulary zero."""
    from tests.unit.test_checkpoint_tools import write_params

    generator = torch.Generator().manual_seed(0)
    params = {}
    for name, p in build_model(config).named_parameters():
        t = p.detach() + torch.randn(p.shape, generator=generator) * 0.1
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            t[VOCAB:] = 0.0
        params[name] = t
    write_params(str(folder), config, params)


def our_logits(config: Config, ckpt, ids: torch.Tensor) -> torch.Tensor:
    """Our model built from ``config``, its weights those of the checkpoint at ``ckpt``: logits [b, s, Vp]."""
    parallel_state.initialize()
    tensor_parallel_seed(config.seed, 0, torch.device("cpu"))
    model = build_model(config).eval()
    reader = CheckpointReader(resolve_checkpoint(str(ckpt)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(reader.full("param", name))
        return model(ids)


def hf_logits(hf_dir, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir)).eval()
    with torch.no_grad():
        return model(ids).logits


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("convert_checkpoint.py: error: ") and "\n" not in err, err
    return err


# ---------------------------------------------------------------- the mapping (no model needed)


@pytest.mark.parametrize("tie, bias", VARIANTS)
def test_hf_to_ours_to_hf_state_dict_is_bitwise(tie, bias):
    hf = hf_model(tie, bias)
    model_cfg = parse_config(L.model_flags(hf.config.to_dict())).model
    assert (model_cfg.untie_embeddings_and_output_weights, model_cfg.disable_bias_linear) == (not tie, not bias)
    ours = L.from_hf_state_dict(hf.state_dict(), model_cfg, 256)
    assert set(ours) == set(L.name_map(model_cfg))
    assert ours[WTE].shape == (256, 64) and torch.count_nonzero(ours[WTE][VOCAB:]) == 0
    assert ("output_layer.weight" in ours) == (not tie)
    back = L.to_hf_state_dict(ours, model_cfg)
    want = hf_state(hf)
    assert back.keys() == want.keys()
    for key in want:
        assert torch.equal(back[key], want[key]), key


def test_qkv_rows_by_group_and_interleaved_gate_up():
    hf = hf_model(tie=True, bias=True)
    model_cfg = parse_config(L.model_flags(hf.config.to_dict())).model
    ours = L.from_hf_state_dict(hf.state_dict(), model_cfg, 256)
    attn, mlp = hf.model.layers[1].self_attn, hf.model.layers[1].mlp
    qkv, hd = ours["layers.1.self_attention.query_key_value.weight"], 16
    for group in range(2):  # rows [group, (query, query, key, value), hd]; query head j is in group j // 2
        block = qkv[group * 4 * hd:(group + 1) * 4 * hd]
        for j in range(2):
            head = 2 * group + j
            assert torch.equal(block[j * hd:(j + 1) * hd], attn.q_proj.weight[head * hd:(head + 1) * hd])
        assert torch.equal(block[2 * hd:3 * hd], attn.k_proj.weight[group * hd:(group + 1) * hd])
        assert torch.equal(block[3 * hd:], attn.v_proj.weight[group * hd:(group + 1) * hd])
    h_to_4h = ours["layers.1.mlp.dense_h_to_4h.bias"]
    assert torch.equal(h_to_4h[0::2], mlp.gate_proj.bias) and torch.equal(h_to_4h[1::2], mlp.up_proj.bias)


def test_a_head_width_other_than_hidden_over_heads_is_kv_channels():
    hf = hf_model(tie=False, bias=False, head_dim=32)
    model_cfg = parse_config(L.model_flags(hf.config.to_dict())).model
    assert model_cfg.kv_channels == 32
    assert model_cfg.group_query_attention and model_cfg.num_query_groups == 2
    ours = L.from_hf_state_dict(hf.state_dict(), model_cfg, 256)
    assert ours["layers.0.self_attention.query_key_value.weight"].shape == ((4 + 2 * 2) * 32, 64)
    assert ours["layers.0.self_attention.dense.weight"].shape == (64, 4 * 32)
    back = L.to_hf_state_dict(ours, model_cfg)
    assert all(torch.equal(back[k], v) for k, v in hf_state(hf).items())


@pytest.mark.parametrize("tie, bias", VARIANTS)
def test_hf_config_maps_back_to_the_same_model(tie, bias):
    model_cfg = make_config(*llama_flags(tie, bias)).model
    cfg = L.hf_config(model_cfg)
    loaded = transformers.LlamaConfig.from_dict(cfg)
    assert (loaded.num_key_value_heads, loaded.head_dim, loaded.intermediate_size, loaded.rms_norm_eps) == (
        2, 16, 96, 1e-6)
    assert (loaded.tie_word_embeddings, loaded.attention_bias, loaded.mlp_bias) == (tie, bias, bias)
    assert cfg["rope_theta"] == 500000.0 and cfg["hidden_act"] == "silu" and cfg["vocab_size"] == VOCAB
    back = parse_config(L.model_flags(cfg)).model
    for field in ("hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                  "max_position_embeddings", "position_embedding_type", "normalization", "swiglu", "rotary_base",
                  "rotary_percent", "layernorm_epsilon", "group_query_attention", "num_query_groups",
                  "untie_embeddings_and_output_weights", "disable_bias_linear"):
        assert getattr(back, field) == getattr(model_cfg, field), field
    # transformers 5's rope_parameters form reads the same
    modern = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling")}
    modern["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    assert L.model_flags(modern) == L.model_flags(cfg)


# ---------------------------------------------------------------- refusals


ROPE, RMS, SWIGLU = {"position_embedding_type": "rope"}, {"normalization": "RMSNorm"}, {"swiglu": True}


@pytest.mark.parametrize("fields, setting", [
    ({**ROPE, **SWIGLU}, "normalization LayerNorm has no Hugging Face Llama"),
    ({**RMS, **SWIGLU}, "position_embedding_type learned_absolute has no Hugging Face Llama"),
    ({**ROPE, **RMS}, "a GELU MLP (swiglu off) has no Hugging Face Llama"),
    ({**ROPE, **RMS, **SWIGLU, "rotary_percent": 0.5}, "rotary_percent 0.5 has no Hugging Face Llama"),
    ({"untie_embeddings_and_output_weights": True}, "untie_embeddings_and_output_weights has no Hugging Face GPT-2"),
    ({"disable_bias_linear": True}, "disable_bias_linear has no Hugging Face GPT-2"),
    ({"group_query_attention": True, "num_query_groups": 2}, "num_query_groups 2 (grouped-query attention) has no"),
    ({"kv_channels": 32}, "kv_channels 32 has no Hugging Face GPT-2"),
    ({"position_embedding_type": "none"}, "position_embedding_type none has no Hugging Face GPT-2"),
])
def test_a_model_without_a_hugging_face_equivalent_is_refused_naming_the_setting(fields, setting):
    model_cfg = dataclasses.replace(make_config("--num-attention-heads", "4", "--vocab-size", str(VOCAB)).model,
                                    **fields)
    with pytest.raises(ConversionError) as err:
        convert.converter_for_model(model_cfg)
    message = str(err.value)
    assert setting in message and "\n" not in message and ". " not in message  # one sentence


def test_llama_mapping_refuses_a_gpt2_shaped_model():
    model_cfg = parse_config(["--vocab-size", str(VOCAB)]).model
    assert convert.converter_for_model(model_cfg).__name__.endswith("hf.gpt2")
    with pytest.raises(ConversionError, match="position_embedding_type learned_absolute has no Hugging Face Llama"):
        L.to_hf_state_dict({}, model_cfg)
    with pytest.raises(ConversionError, match="has no Hugging Face Llama"):
        L.hf_config(model_cfg)


@pytest.fixture
def hf_dir(tmp_path):
    """A tiny random Llama (GQA, untied head, biases) saved with save_pretrained."""
    path = tmp_path / "hf_in"
    hf_model(tie=False, bias=True).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope scaling"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rope scaling"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not this GPT's SwiGLU"),
    ({"mlp_bias": False}, "attention_bias=True but mlp_bias=False"),
    ({"rope_theta": 10000.5, "rope_parameters": None}, "rope_theta 10000.5 is not an integer"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "'mistral' model (MistralForCausalLM)"),
    ({"num_key_value_heads": 3}, "num_key_value_heads (3) does not divide"),
    ({"num_hidden_layers": 3}, "missing 16 (first 'model.layers.2.input_layernorm"),
])
def test_unsupported_hf_configs_are_refused_in_one_line(tmp_path, hf_dir, capsys, change, message):
    cfg = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**cfg, **change}))
    assert convert.main(["from-hf", str(hf_dir), str(tmp_path / "out")]) == 2
    assert message in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def test_a_tied_config_with_a_different_lm_head_is_refused(tmp_path, hf_dir, capsys):
    cfg = json.loads((hf_dir / "config.json").read_text())  # the weights hold an untied lm_head
    (hf_dir / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    assert convert.main(["from-hf", str(hf_dir), str(tmp_path / "out")]) == 2
    assert "lm_head.weight differs from model.embed_tokens.weight" in one_line_error(capsys)


# ---------------------------------------------------------------- through our model and checkpoints


@pytest.mark.parametrize("tie, bias", VARIANTS)
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_to_our_checkpoint_to_hf_is_bitwise(tmp_path, tie, bias, tp):
    from safetensors.torch import load_file

    src = tmp_path / "hf_in"
    hf_model(tie, bias).save_pretrained(str(src))
    assert convert.main(["from-hf", str(src), str(tmp_path / "ours"), "--tp", str(tp)]) == 0
    reader, common, config = open_checkpoint(str(tmp_path / "ours"))
    assert common["step"] == 0 and config.distributed.mp_degree == tp
    assert len({p["rank"] for p in reader.metadata["pieces"]}) == tp  # one rank file per tp rank
    m = config.model
    assert (m.position_embedding_type, m.normalization, m.swiglu, m.num_query_groups, m.rotary_base) == (
        "rope", "RMSNorm", True, 2, 500000)
    assert reader.global_shape(WTE) == (256, 64)  # 250 padded to a multiple of 128 x tp
    assert convert.main(["to-hf", str(tmp_path / "ours"), str(tmp_path / "hf_out")]) == 0
    before = load_file(str(src / "model.safetensors"))
    after = load_file(str(tmp_path / "hf_out" / "model.safetensors"))
    if tie:
        before.pop("lm_head.weight", None)  # tied: written or not depending on the transformers version
    assert before.keys() == after.keys()
    for key in before:
        assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key
    a = transformers.LlamaForCausalLM.from_pretrained(str(src)).state_dict()
    b = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf_out")).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_import_gives_our_model_the_hf_logits(tmp_path, hf_dir):
    assert convert.main(["from-hf", str(hf_dir), str(tmp_path / "ours")]) == 0
    config = make_config(*llama_flags(tie=False, bias=True))
    ids = tokens(seed=2)
    ours = our_logits(config, tmp_path / "ours", ids)
    torch.testing.assert_close(ours[..., :VOCAB], hf_logits(hf_dir, ids), rtol=0, atol=1e-4)
    assert ours[..., VOCAB:].abs().max() == 0  # zero padding rows: zero logits


@pytest.mark.parametrize("tie, bias", VARIANTS)
def test_export_of_our_initialised_model_gives_hf_the_same_logits(tmp_path, tie, bias):
    config = make_config(*llama_flags(tie, bias))
    parallel_state.initialize()
    tensor_parallel_seed(config.seed, 0, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    params = {}  # our initialisation, every tensor perturbed (norm weights off 1, biases off 0)
    for name, p in build_model(config).named_parameters():
        t = p.detach() + torch.randn(p.shape, generator=g) * 0.05
        if name in (WTE, "output_layer.weight"):
            t[VOCAB:] = 0.0
        params[name] = t
    assert set(params) == set(tensor_layout(config)) == set(L.name_map(config.model))
    write_params(str(tmp_path / "ckpt"), config, params)
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_key_value_heads"] == 2
    ids = tokens()
    ours = our_logits(config, tmp_path / "ckpt", ids)
    theirs = hf_logits(tmp_path / "hf", ids)
    assert ours.shape == (3, SEQ, 256) and theirs.shape == (3, SEQ, VOCAB)
    assert ours.abs().max() > 1.0  # not a near-zero comparison
    torch.testing.assert_close(ours[..., :VOCAB], theirs, rtol=0, atol=1e-4)


def test_an_export_leaves_out_multi_token_prediction_with_a_notice(tmp_path, capsys):
    """LlamaForCausalLM has no place for MTP modules (only DeepSeek-V3's checkpoints store them): the export drops
    them, says so, and the logits (which never use them) are the same."""
    config = make_config(*llama_flags(tie=False, bias=False), "--mtp-num-layers", "1")
    params = {name: p.detach() + 0.05 for name, p in build_model(config).named_parameters()}
    for name in (WTE, "output_layer.weight"):
        params[name][VOCAB:] = 0.0
    assert any(name.startswith("mtp.layers.0.") for name in params)
    write_params(str(tmp_path / "ckpt"), config, params)
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    assert "the 1 multi-token prediction module(s) are not exported: LlamaForCausalLM" in capsys.readouterr().out
    ids = tokens()
    ours, theirs = our_logits(config, tmp_path / "ckpt", ids), hf_logits(tmp_path / "hf", ids)
    torch.testing.assert_close(ours[..., :VOCAB], theirs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("flags, setting", [
    (("--position-embedding-type", "rope", "--swiglu", "--ffn-hidden-size", "96"), "normalization LayerNorm"),
    ((*LLAMA, "--rotary-percent", "0.5"), "rotary_percent 0.5"),
])
def test_export_of_a_checkpoint_with_no_llama_equivalent_is_one_line(tmp_path, capsys, flags, setting):
    config = make_config("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                         "--vocab-size", str(VOCAB), "--max-seq-len", str(SEQ), "--max-position-embeddings", str(SEQ),
                         *flags)
    write_params(str(tmp_path / "ckpt"), config,
                 {name: torch.zeros(shape) for name, (shape, _) in tensor_layout(config).items()})
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 2
    assert f"{setting} has no Hugging Face Llama equivalent" in one_line_error(capsys)
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_a_trained_llama_run_exports_with_the_same_logits(tmp_path):
    result = run_here(*TINY, *llama_flags(tie=False, bias=False), "--max-steps", "2", "--save-interval", "2",
                      "--save", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert convert.main(["to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    _, common, config = open_checkpoint(str(tmp_path / "run"))
    assert common["step"] == 2
    ids = tokens(seed=1)
    ours = our_logits(config, tmp_path / "run", ids)
    torch.testing.assert_close(ours[..., :VOCAB], hf_logits(tmp_path / "hf", ids), rtol=0, atol=1e-4)
