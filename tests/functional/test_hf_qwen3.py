"""Hugging Face Qwen3 (``Qwen3ForCausalLM``) and Qwen3-MoE (``Qwen3MoeForCausalLM``) both ways
(megatron/checkpoint/hf/qwen3.py, hf/qwen3_moe.py): a transformers-initialised model imports with transformers'
logits, our model exports with ours, the files round-trip bitwise, and what our GPT cannot represent (sliding
windows, an attention bias) is refused in one line. In process: tiny models, no runs."""

from __future__ import annotations

import json

import pytest
import torch

from megatron.checkpoint.convert import open_checkpoint
from megatron.parallelize_gpt import build_model
from tests.functional.test_hf_llama import (
    LLAMA,
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

QWEN3 = (*LLAMA, "--qk-layernorm", "--disable-bias-linear", "--kv-channels", "24")  # head width 24, not 64 / 4


# Qwen3-MoE: 4 experts of width 32, top 2 renormalised, the first layer dense (mlp_only_layers)
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
       "mlp_only_layers": [0], "decoder_sparse_step": 1}


def hf_model(tie: bool, seed: int = 0, moe: bool = False):
    """A tiny random ``Qwen3ForCausalLM`` or ``Qwen3MoeForCausalLM`` (every weight perturbed: the QK norms are
    not 1)."""
    torch.manual_seed(seed)
    kind, config = ("Qwen3Moe", MOE) if moe else ("Qwen3", {})
    cfg = getattr(transformers, f"{kind}Config")(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, vocab_size=VOCAB, max_position_embeddings=32, rms_norm_eps=1e-6, rope_theta=500000.0,
        tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None, **config)
    model = getattr(transformers, f"{kind}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def qwen3_logits(hf_dir, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("tie, moe", [(True, False), (False, False), (False, True)],
                         ids=["tied", "untied", "moe-untied"])
def test_an_import_gives_transformers_logits_and_exports_back_bitwise(tmp_path, tie, moe):
    from safetensors.torch import load_file

    src = tmp_path / "hf_in"
    hf_model(tie, moe=moe).save_pretrained(str(src))
    assert convert.main(["from-hf", str(src), str(tmp_path / "ours")]) == 0
    _, _, config = open_checkpoint(str(tmp_path / "ours"))
    m = config.model
    assert (m.qk_layernorm, m.kv_channels, m.num_query_groups, m.disable_bias_linear) == (True, 24, 2, True)
    if moe:
        assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_layer_freq,
                m.moe_router_pre_softmax) == (4, 2, 32, "[0,1]", False)
    ids = tokens()
    ours, theirs = our_logits(config, tmp_path / "ours", ids), qwen3_logits(src, ids)
    assert ours.abs().max() > 1.0  # not a near-zero comparison
    torch.testing.assert_close(ours[..., :VOCAB], theirs, rtol=0, atol=1e-5)
    assert convert.main(["to-hf", str(tmp_path / "ours"), str(tmp_path / "hf_out")]) == 0
    before, after = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "hf_out" / "model.safetensors"))
    if tie:
        before.pop("lm_head.weight", None)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("experts, architecture", [
    ((), "Qwen3ForCausalLM"),
    (("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "[0,1]"),
     "Qwen3MoeForCausalLM"),
], ids=["dense", "moe"])
def test_an_export_of_our_model_gives_transformers_our_logits(tmp_path, experts, architecture):
    config = make_config(*QWEN3, "--untie-embeddings-and-output-weights", *experts)
    write_perturbed_checkpoint(config, tmp_path / "ckpt")
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == [architecture] and cfg["head_dim"] == 24 and not cfg["use_sliding_window"]
    ids = tokens()
    torch.testing.assert_close(our_logits(config, tmp_path / "ckpt", ids)[..., :VOCAB],
                               qwen3_logits(tmp_path / "hf", ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("change, message", [
    ({"use_sliding_window": True, "sliding_window": 8}, "sliding-window layers on (use_sliding_window)"),
    ({"attention_bias": True}, "config.json sets attention_bias"),
])
def test_what_this_gpt_cannot_represent_is_refused_in_one_line(tmp_path, capsys, change, message):
    src = tmp_path / "hf_in"
    hf_model(tie=True).save_pretrained(str(src))
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **change}))
    capsys.readouterr()  # transformers' progress bars
    assert convert.main(["from-hf", str(src), str(tmp_path / "out")]) == 2
    assert message in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def test_linear_biases_are_refused_on_export(tmp_path, capsys):
    config = make_config(*LLAMA, "--qk-layernorm")
    write_params(str(tmp_path / "ckpt"), config,
                 {name: p.detach() for name, p in build_model(config).named_parameters()})
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 2
    assert "linear biases (disable_bias_linear off) have no Hugging Face Qwen3 equivalent" in one_line_error(capsys)
