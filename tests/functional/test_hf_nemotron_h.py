"""Hugging Face Nemotron-H (``NemotronHForCausalLM``) both ways (megatron/checkpoint/hf/nemotron_h.py): a
transformers-initialised hybrid (Mamba-2, attention and squared-ReLU MLP layers) imports with transformers' logits
and exports back bitwise; our engine generates transformers' greedy tokens with the state cache; our hybrid exports
with our logits. transformers' steps unclamped (``time_step_min`` 0, as Megatron-LM's mixer). In process: tiny
models, no runs."""

from __future__ import annotations

import json

import pytest
import torch

from megatron.checkpoint.convert import open_checkpoint
from tests.functional.test_hf_deepseek import load_ours
from tests.functional.test_hf_llama import VOCAB, convert, make_config, our_logits, tokens, write_perturbed_checkpoint

transformers = pytest.importorskip("transformers")

PATTERN = ["mamba", "mlp", "mamba", "attention", "mlp", "mamba"]
SHAPE = {"hidden_size": 64, "intermediate_size": 96, "layers_block_type": PATTERN, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB, "max_position_embeddings": 32,
         "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None,
         "pad_token_id": None, "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 8,
         "time_step_min": 1e-4, "chunk_size": 16}  # (transformers' initialisation takes log(time_step_min))


def hf_model(seed: int = 0):
    """A tiny random ``NemotronHForCausalLM``, every weight perturbed, its steps unclamped (``time_step_min`` 0 once
    initialised, in its config and its mixers)."""
    torch.manual_seed(seed)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**SHAPE)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.config.time_step_min = 0.0
    for module in model.modules():
        if hasattr(module, "time_step_limit"):
            module.time_step_limit = (0.0, float("inf"))
    return model


def hf_logits(hf_dir, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    with torch.no_grad():
        return model(ids).logits


def test_an_import_gives_transformers_logits_exports_back_bitwise_and_generates_its_tokens(tmp_path):
    from safetensors.torch import load_file

    from megatron.inference import InferenceEngine, Request, SamplingParams, initialize, load_model

    src = tmp_path / "hf_in"
    model = hf_model()
    model.save_pretrained(str(src))
    assert convert.main(["from-hf", str(src), str(tmp_path / "ours")]) == 0
    _, _, config = open_checkpoint(str(tmp_path / "ours"))
    assert config.model.hybrid_override_pattern == "M-M*-M"
    ids = tokens()
    ours, theirs = our_logits(config, tmp_path / "ours", ids), hf_logits(src, ids)
    assert ours.abs().max() > 1.0
    torch.testing.assert_close(ours[..., :VOCAB], theirs, rtol=0, atol=1e-5)
    assert convert.main(["to-hf", str(tmp_path / "ours"), str(tmp_path / "hf_out")]) == 0
    before, after = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "hf_out" / "model.safetensors"))
    assert before.keys() == after.keys() and [k for k in before if not torch.equal(before[k], after[k])] == []
    prompts = [[5, 17, 99, 3, 249, 42, 7], [11, 200, 31, 64]]
    initialize()
    loaded, loaded_config = load_model(str(tmp_path / "ours"))
    completions = InferenceEngine(loaded, loaded_config, None).generate(
        [Request(p, SamplingParams(max_tokens=16, temperature=0)) for p in prompts])
    for prompt, completion in zip(prompts, completions):
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
        assert completion.tokens == want[0, len(prompt):].tolist()


def test_an_export_of_our_hybrid_gives_transformers_our_logits(tmp_path):
    config = make_config("--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4",
                         "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "96",
                         "--normalization", "RMSNorm", "--squared-relu", "--disable-bias-linear",
                         "--position-embedding-type", "none", "--untie-embeddings-and-output-weights",
                         "--vocab-size", str(VOCAB), "--max-seq-len", "32", "--max-position-embeddings", "32",
                         "--hidden-dropout", "0", "--attention-dropout", "0", "--is-hybrid-model",
                         "--hybrid-override-pattern", "M-M*-M", "--mamba-head-dim", "16", "--mamba-num-groups", "2",
                         "--mamba-state-dim", "8")
    write_perturbed_checkpoint(config, tmp_path / "ckpt")
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["NemotronHForCausalLM"] and cfg["layers_block_type"] == PATTERN
    ids = tokens()
    torch.testing.assert_close(our_logits(config, tmp_path / "ckpt", ids)[..., :VOCAB], hf_logits(tmp_path / "hf", ids),
                               rtol=0, atol=1e-5)


MOE = {"layers_block_type": ["mamba", "moe", "attention", "moe"], "n_routed_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48, "routed_scaling_factor": 2.5}


def test_nemotron_3_moe_layers_import_with_transformers_logits_and_export_back_bitwise(tmp_path):
    """Nemotron 3's MoE layers: a sigmoid router with its e_score_correction_bias (perturbed: our expert bias, the
    checkpoint's train state), squared-ReLU experts and a shared expert."""
    from safetensors.torch import load_file

    torch.manual_seed(1)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**{**SHAPE, **MOE})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    model.config.time_step_min = 0.0
    src = tmp_path / "hf_in"
    model.save_pretrained(str(src))
    assert convert.main(["from-hf", str(src), str(tmp_path / "ours")]) == 0
    _, common, config = open_checkpoint(str(tmp_path / "ours"))
    m = config.model
    assert (m.hybrid_override_pattern, m.num_experts, m.moe_router_score_function, m.moe_router_enable_expert_bias,
            m.moe_router_topk_scaling_factor) == ("ME*E", 4, "sigmoid", True, 2.5)
    assert sorted(common["train_state"]["moe_expert_bias"]) == ["1", "3"]
    ids = tokens()
    model_ours = load_ours(tmp_path / "ours")  # its expert biases set from the train state
    with torch.no_grad():
        ours = model_ours(ids)
    theirs = hf_logits(src, ids)
    assert ours.abs().max() > 1.0
    torch.testing.assert_close(ours[..., :VOCAB], theirs, rtol=0, atol=1e-5)
    assert convert.main(["to-hf", str(tmp_path / "ours"), str(tmp_path / "hf_out")]) == 0
    before, after = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "hf_out" / "model.safetensors"))
    assert before.keys() == after.keys() and [k for k in before if not torch.equal(before[k], after[k])] == []
