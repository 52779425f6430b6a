"""Hugging Face Qwen-MoE (``Qwen2MoeForCausalLM``) export and import of our mixture of experts with a shared expert:
transformers computes the export's logits as our model does (both softmax routers, dense layers among the MoE
ones; the shared expert's gate trained, or absent: written as zeros with the down projection doubled), HF -> ours
-> HF is bitwise with trained gates (either form of the experts), and what Qwen-MoE or our GPT has not (a trained
gate into a model without one, query/key/value-only biases, a sliding window, the sigmoid router) is refused in one
line."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megatron import parallel_state
from megatron.checkpoint import CheckpointReader
from megatron.checkpoint.convert import open_checkpoint, write_params
from megatron.checkpoint.hf import mixtral as hf_mixtral
from megatron.checkpoint.hf import qwen2_moe as hf_qwen_moe
from megatron.checkpoint.hf.common import ConversionError
from megatron.config import parse_config, validate
from megatron.parallelize_gpt import build_model
from megatron.tensor_parallel import tensor_parallel_seed
from tests.functional.launch import program_module, run_tool_here

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402  (installed with transformers)

convert = program_module("tools/convert_checkpoint.py")
VOCAB, SEQ, E = 250, 32, 4
# 3 layers, 4 query heads in 2 groups, 4 experts of width 48 (top-2), a shared expert of width 40, dense MLP 96
QWEN = ["--mock-data", "--device", "cpu", "--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--position-embedding-type", "rope", "--normalization",
        "RMSNorm", "--swiglu", "--disable-bias-linear", "--vocab-size", str(VOCAB), "--max-seq-len", str(SEQ),
        "--max-position-embeddings", str(SEQ), "--ffn-hidden-size", "96", "--num-experts", str(E), "--moe-router-topk",
        "2", "--moe-ffn-hidden-size", "48", "--moe-shared-expert-intermediate-size", "40"]


def tool(*args: str):
    return run_tool_here("tools/convert_checkpoint.py", *args)


def one_line_error(text: str) -> str:
    err = text.strip()
    assert err.startswith("convert_checkpoint.py: error: ") and "\n" not in err, err
    return err


def make_config(*flags: str):
    config = parse_config([*QWEN, *flags])
    validate(config, world_size=1, cuda_available=False)
    return config


@pytest.mark.parametrize("flags, dense, normalised", [
    ([], [], True),
    (["--moe-router-pre-softmax", "--moe-layer-freq", "[1,0,1]", "--untie-embeddings-and-output-weights"], [1], False),
    (["--moe-shared-expert-gate", "--moe-layer-freq", "[1,0,1]"], [1], True),  # its gates perturbed as every weight
], ids=["all-moe-tied", "pre-softmax-dense-layer-untied", "shared-expert-gate"])
def test_export_of_our_model_gives_transformers_the_same_logits(tmp_path, flags, dense, normalised):
    config = make_config(*flags)
    parallel_state.initialize()
    tensor_parallel_seed(config.seed, 0, torch.device("cpu"))
    model = build_model(config).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every weight perturbed (norms off 1); the padding rows stay zero
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                p[VOCAB:] = 0.0
    write_params(str(tmp_path / "ckpt"), config, {n: p.detach() for n, p in model.named_parameters()})
    done = tool("to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["architectures"], cfg["mlp_only_layers"], cfg["norm_topk_prob"], cfg["qkv_bias"]) == (
        ["Qwen2MoeForCausalLM"], dense, normalised, False)
    hf, info = transformers.Qwen2MoeForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    with torch.no_grad():
        ours, theirs = model(ids), hf.eval()(ids).logits
    assert ours.abs().max() > 1.0  # not a near-zero comparison
    torch.testing.assert_close(ours[..., :VOCAB], theirs, rtol=0, atol=1e-4)


def hf_model(gate_zero: bool = False, seed: int = 0):
    """A tiny random ``Qwen2MoeForCausalLM``: layer 1 dense, the experts' top k renormalised; its shared experts'
    gates random, or zero with ``gate_zero`` (what a model of ours without the gate exports)."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen2MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=40,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
        max_position_embeddings=SEQ, rms_norm_eps=1e-6, rope_theta=500000.0, num_experts=E, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], qkv_bias=False, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None)
    model = transformers.Qwen2MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.1)
            if gate_zero and name.endswith("shared_expert_gate.weight"):
                p.zero_()
    return model


def test_hf_to_our_checkpoint_to_hf_is_bitwise(tmp_path):
    src = tmp_path / "hf_in"
    model = hf_model()
    model.save_pretrained(str(src))
    assert tool("from-hf", str(src), str(tmp_path / "ours"), "--tp", "2").returncode == 0
    reader, _, config = open_checkpoint(str(tmp_path / "ours"))
    m = config.model
    assert (m.num_experts, m.moe_ffn_hidden_size, m.moe_shared_expert_intermediate_size, m.ffn_hidden_size,
            m.moe_layer_freq, m.moe_router_pre_softmax) == (E, 48, 40, 96, "[1,0,1]", False)
    assert m.moe_shared_expert_gate  # Qwen's shared expert and its gate, as they are
    saved = CheckpointReader(reader.step_dir)
    hf_mlp = model.model.layers[2].mlp
    assert torch.equal(saved.full("param", "layers.2.mlp.shared_expert.dense_4h_to_h.weight"),
                       hf_mlp.shared_expert.down_proj.weight)
    gate = saved.full("param", "layers.2.mlp.shared_expert_gate.weight")
    assert torch.equal(gate, hf_mlp.shared_expert_gate.weight) and gate.abs().min() > 0
    # the in-memory (fused) form of transformers 5 reads as the saved one
    model_cfg = parse_config(hf_qwen_moe.model_flags(model.config.to_dict())).model
    fused = hf_qwen_moe.from_hf_state_dict(model.state_dict(), model_cfg, 256)
    hub = hf_qwen_moe.from_hf_state_dict(load_file(str(src / "model.safetensors")), model_cfg, 256)
    assert fused.keys() == hub.keys() and all(torch.equal(fused[k], hub[k]) for k in hub)
    assert tool("to-hf", str(tmp_path / "ours"), str(tmp_path / "hf_out")).returncode == 0
    before = load_file(str(src / "model.safetensors"))
    after = load_file(str(tmp_path / "hf_out" / "model.safetensors"))
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    a, b = (transformers.Qwen2MoeConfig.from_pretrained(str(d)).to_dict() for d in (src, tmp_path / "hf_out"))
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                "num_hidden_layers", "num_key_value_heads", "num_experts", "num_experts_per_tok", "norm_topk_prob",
                "mlp_only_layers", "layer_types", "rope_parameters", "rms_norm_eps", "tie_word_embeddings",
                "router_aux_loss_coef", "qkv_bias"):
        assert a[key] == b[key], key


def test_to_hf_chooses_qwen_moe_for_a_shared_expert_and_refuses_what_it_has_not():
    config = make_config()
    assert convert.converter_for_model(config.model) is hf_qwen_moe
    without = dataclasses.replace(config.model, moe_shared_expert_intermediate_size=None)
    assert convert.converter_for_model(without) is hf_mixtral
    with pytest.raises(ConversionError) as err:
        convert.converter_for_model(dataclasses.replace(config.model, moe_router_score_function="sigmoid"))
    assert str(err.value) == ("moe_router_score_function sigmoid has no Hugging Face Qwen-MoE (Qwen2MoeForCausalLM) "
                              "equivalent (Qwen-MoE's router is a softmax), so this checkpoint cannot be exported.")


def test_a_trained_gate_is_refused_by_a_model_without_one_and_zeros_are_taken_halving_down_proj():
    hf = hf_model()
    flags = hf_qwen_moe.model_flags(hf.config.to_dict())
    ungated = parse_config([f for f in flags if f != "--moe-shared-expert-gate"]).model
    with pytest.raises(ConversionError, match="shared_expert_gate.weight is not zero: the model's shared expert has"):
        hf_qwen_moe.from_hf_state_dict(hf.state_dict(), ungated, 256)
    zero = hf_model(gate_zero=True)
    ours = hf_qwen_moe.from_hf_state_dict(zero.state_dict(), ungated, 256)
    assert "layers.0.mlp.shared_expert_gate.weight" not in ours
    assert torch.equal(ours["layers.0.mlp.shared_expert.dense_4h_to_h.weight"] * 2,
                       zero.model.layers[0].mlp.shared_expert.down_proj.weight)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """A saved Qwen2-MoE folder ("zero": its gates zero)."""
    root = tmp_path_factory.mktemp("qwen-in")
    hf_model(gate_zero=True).save_pretrained(str(root / "zero"))
    return root


@pytest.mark.parametrize("folder, change, message", [
    ("zero", {"qkv_bias": True}, "config.json sets qkv_bias (biases on the query/key/value projections only)"),
    ("zero", {"use_sliding_window": True}, "config.json sets use_sliding_window"),
    ("zero", {"shared_expert_intermediate_size": 0}, "config.json lacks num_experts, num_experts_per_tok"),
])
def test_what_our_gpt_cannot_represent_is_refused_in_one_line(tmp_path, hf_dirs, folder, change, message):
    src = tmp_path / "hf"
    src.mkdir()
    cfg = json.loads((hf_dirs / folder / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **change}))
    (src / "model.safetensors").symlink_to(hf_dirs / folder / "model.safetensors")
    done = tool("from-hf", str(src), str(tmp_path / "out"))
    assert done.returncode == 2 and message in one_line_error(done.stderr)
    assert not (tmp_path / "out").exists()
