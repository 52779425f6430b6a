"""Megatron-LM's zero-centred norms (--apply-layernorm-1p) and squared-ReLU MLP (--squared-relu): what they compute,
their initialisation, and their Hugging Face export (transformers scores the export with our logits). Megatron
Core's squared-ReLU model is compared in test_megatron_checkpoints.py (it loads our Megatron export)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.checkpoint.hf import llama as hf_llama
from megatron.checkpoint.hf import qwen3 as hf_qwen3
from megatron.config import ConfigError, parse_config, validate
from megatron.config.schema_model import is_norm_weight
from megatron.model.gpt import GPTModel
from megatron.model.init import init_parameters

TINY = ("--mock-data", "--device", "cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--vocab-size", "96", "--max-seq-len", "16", "--max-position-embeddings", "16", "--hidden-dropout", "0",
        "--attention-dropout", "0")
LLAMA = ("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
         "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear")


def model_of(*flags: str) -> tuple[object, GPTModel]:
    config = parse_config([*TINY, *flags])
    validate(config)
    return config, GPTModel(config.model, config.padded_vocab_size).eval()


def random_weights(model: GPTModel, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # O(1) weights: every norm's scale matters
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
            if name.endswith(("word_embeddings.weight", "output_layer.weight")):
                p[96:] = 0  # the padding rows, as initialised (an import pads with zeros)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


TOKENS = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("flags", [(), LLAMA, (*LLAMA, "--qk-layernorm"), (*LLAMA, "--mtp-num-layers", "1")],
                         ids=["layernorm", "rmsnorm", "qk-norms", "mtp-norms"])
def test_zero_centred_norms_scale_by_one_plus_the_weight(flags):
    """A 1p model with weights w computes what the plain model computes with 1 + w in every norm (the layers', the
    query/key norms', the final one, multi-token prediction's): the rule holds for every norm the model has."""
    _, plain = model_of(*flags)
    _, one_p = model_of(*flags, "--apply-layernorm-1p")
    weights = random_weights(one_p)
    norms = [n for n in weights if is_norm_weight(n)]
    assert len(norms) >= 5, norms  # two per layer and the final one at least
    plain.load_state_dict({n: t + 1 if is_norm_weight(n) else t for n, t in weights.items()})
    with torch.no_grad():
        torch.testing.assert_close(one_p(TOKENS), plain(TOKENS), rtol=0, atol=1e-6)
        one_p.load_state_dict({**weights, norms[0]: weights[norms[0]] + 0.5})
        assert not torch.allclose(one_p(TOKENS), plain(TOKENS), atol=1e-3)  # the norm's weight is read


def test_zero_centred_norm_weights_start_at_zero():
    config, model = model_of(*LLAMA, "--qk-layernorm", "--apply-layernorm-1p")
    init_parameters(model, seed=3, cfg=config.model)
    norms = {n: p for n, p in model.named_parameters() if is_norm_weight(n)}
    assert norms and all(not p.any() for p in norms.values())
    assert model.layers["0"].self_attention.dense.weight.abs().sum() > 0  # the other weights are drawn


@pytest.mark.parametrize("flags,family", [(LLAMA, hf_llama), ((*LLAMA, "--qk-layernorm"), hf_qwen3)],
                         ids=["llama", "qwen3"])
def test_a_zero_centred_model_exports_to_hugging_face_with_our_logits(flags, family):
    """The export writes 1 + w (Hugging Face's norms scale by their weight); the import takes it back to w."""
    transformers = pytest.importorskip("transformers")
    config, ours = model_of(*flags, "--apply-layernorm-1p")
    weights = random_weights(ours)
    hf_state = family.to_hf_state_dict(weights, config.model)
    qk = family is hf_qwen3
    hf_cfg = hf_llama.hf_config(config.model, qk_norm=qk) if not qk else family.hf_config(config.model)
    kind = transformers.Qwen3Config if qk else transformers.LlamaConfig
    cls = transformers.Qwen3ForCausalLM if qk else transformers.LlamaForCausalLM
    theirs = cls(kind(**{k: v for k, v in hf_cfg.items() if k != "torch_dtype"})).eval()
    theirs.load_state_dict(hf_state, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(theirs(TOKENS).logits, ours(TOKENS)[..., :96], rtol=0, atol=2e-5)
    back = family.from_hf_state_dict(hf_state, config.model, config.padded_vocab_size)
    for name, t in weights.items():
        torch.testing.assert_close(back[name], t, rtol=0, atol=1e-6, msg=name)


def test_squared_relu_mlp_is_relu_squared_between_the_two_linears():
    config, model = model_of("--squared-relu")
    mlp = model.layers["0"].mlp
    assert mlp.dense_h_to_4h.weight.shape[0] == config.model.ffn_hidden_size  # not gated: one half
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(2))
    want = F.linear(F.relu(F.linear(x, mlp.dense_h_to_4h.weight, mlp.dense_h_to_4h.bias)) ** 2,
                    mlp.dense_4h_to_h.weight, mlp.dense_4h_to_h.bias)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), want)


@pytest.mark.parametrize("flags,message", [
    (("--squared-relu", "--swiglu"), "swiglu and squared_relu are different MLP activations"),
    (("--squared-relu", "--quick-geglu"), "quick_geglu and squared_relu are different MLP activations")])
def test_two_mlp_activations_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        model_of(*flags)


def test_hugging_face_gpt2_refuses_a_squared_relu_model():
    from megatron.checkpoint.hf.common import ConversionError
    from megatron.checkpoint.hf.models import converter_for_model

    config, _ = model_of("--squared-relu")
    with pytest.raises(ConversionError, match="squared_relu has no Hugging Face GPT-2 equivalent"):
        converter_for_model(config.model)
