"""Hugging Face Qwen3-Next (``Qwen3NextForCausalLM``) both ways (megatron/checkpoint/hf/qwen3_next.py): a
transformers-initialised model (Gated DeltaNet and gated full-attention layers, partial rotary embeddings, zero-centred
norms; dense, or a MoE with a gated shared expert and a dense first layer) imports with transformers' logits and
exports back bitwise; our model exports with our logits. In process: tiny models, no runs."""

from __future__ import annotations

import json

import pytest
import torch

from megatron.checkpoint.convert import open_checkpoint
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

# 4 layers: linear, linear, linear, full attention (Qwen3-Next's 3:1); 2 key heads serving 4 value heads
SHAPE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 24, "vocab_size": VOCAB, "max_position_embeddings": 32,
         "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None,
         "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
         "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
         "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.25}}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
       "norm_topk_prob": True, "mlp_only_layers": [0], "decoder_sparse_step": 1}
DENSE = {"num_experts": 0, "mlp_only_layers": [0, 1, 2, 3]}


def hf_model(moe: bool, seed: int = 0):
    """A tiny random ``Qwen3NextForCausalLM``, every weight perturbed (the norms are not their initial values)."""
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**SHAPE, **(MOE if moe else DENSE))).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def hf_logits(hf_dir, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """transformers' fp32 logits, and their own fp32 round-off: the largest difference from its fp64 logits. The
    delta rule's triangular solves make a 4-layer model's fp32 logits differ from exact ones by ~3e-5 (where a Llama
    of this size differs by ~1e-6), so the comparison allows twice transformers' own round-off (and at least 1e-5)."""
    logits = {}
    for dtype in (torch.float32, torch.float64):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype,
                                                                  experts_implementation="eager").eval()
        with torch.no_grad():
            logits[dtype] = model(ids).logits
    round_off = (logits[torch.float32].double() - logits[torch.float64]).abs().max().item()
    return logits[torch.float32], max(1e-5, 2 * round_off)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_an_import_gives_transformers_logits_and_exports_back_bitwise(tmp_path, moe):
    from safetensors.torch import load_file

    src = tmp_path / "hf_in"
    hf_model(moe).save_pretrained(str(src))
    assert convert.main(["from-hf", str(src), str(tmp_path / "ours")]) == 0
    _, _, config = open_checkpoint(str(tmp_path / "ours"))
    m = config.model
    assert (m.experimental_attention_variant, m.linear_attention_freq, m.attention_output_gate, m.rotary_percent,
            m.apply_layernorm_1p) == ("gated_delta_net", "[1,1,1,0]", True, 0.25, True)
    ids = tokens()
    ours, (theirs, round_off) = our_logits(config, tmp_path / "ours", ids), hf_logits(src, ids)
    assert ours.abs().max() > 1.0 and round_off < 1e-4  # not a near-zero comparison; fp32's round-off
    torch.testing.assert_close(ours[..., :VOCAB], theirs, rtol=0, atol=round_off)
    assert convert.main(["to-hf", str(tmp_path / "ours"), str(tmp_path / "hf_out")]) == 0
    before, after = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "hf_out" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []


QWEN3_NEXT = ("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
              "--num-query-groups", "2", "--kv-channels", "24", "--ffn-hidden-size", "96", "--position-embedding-type",
              "rope", "--rotary-percent", "0.25", "--rotary-base", "500000", "--normalization", "RMSNorm",
              "--apply-layernorm-1p", "--swiglu", "--qk-layernorm", "--attention-output-gate", "--disable-bias-linear",
              "--untie-embeddings-and-output-weights", "--layernorm-epsilon", "1e-6", "--vocab-size", str(VOCAB),
              "--max-seq-len", "32", "--max-position-embeddings", "32", "--hidden-dropout", "0",
              "--attention-dropout", "0", "--experimental-attention-variant", "gated_delta_net",
              "--linear-attention-freq", "4", "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
              "--linear-key-head-dim", "16", "--linear-value-head-dim", "8")


MOE_FLAGS = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
             "--moe-shared-expert-intermediate-size", "48", "--moe-layer-freq", "[0,1,1,1]")


@pytest.mark.parametrize("experts", [(), MOE_FLAGS], ids=["dense", "moe-ungated-shared-expert"])
def test_an_export_of_our_model_gives_transformers_our_logits(tmp_path, experts):
    """The MoE model here has no shared-expert gate: exported as a zero gate and a doubled down projection."""
    config = make_config(*QWEN3_NEXT, *experts)
    write_perturbed_checkpoint(config, tmp_path / "ckpt")
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3NextForCausalLM"]
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    ids = tokens()
    theirs, round_off = hf_logits(tmp_path / "hf", ids)
    assert round_off < 1e-4
    torch.testing.assert_close(our_logits(config, tmp_path / "ckpt", ids)[..., :VOCAB], theirs, rtol=0, atol=round_off)


def test_a_model_qwen3_next_cannot_hold_is_refused_in_one_line(tmp_path, capsys):
    config = make_config(*(a for a in QWEN3_NEXT if a != "--apply-layernorm-1p"))
    write_params(str(tmp_path / "ckpt"), config,
                 {name: p.detach() for name, p in build_model(config).named_parameters()})
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 2
    assert "norms that scale by w (apply_layernorm_1p off) has no Hugging Face Qwen3-Next" in one_line_error(capsys)


def test_our_engine_generates_transformers_greedy_tokens(tmp_path):
    """Three prompts of 7, 4 and 12 tokens in one batch (left-padded: the linear-attention layers drop their state at
    each row's first real token), 20 new tokens each: the prompt through the chunked form, every new token through the
    recurrent one with the cached convolution rows and state; the tokens are transformers' greedy ones."""
    from megatron.inference import InferenceEngine, Request, SamplingParams, initialize, load_model

    model = hf_model(moe=True)
    model.save_pretrained(str(tmp_path / "hf_in"))
    assert convert.main(["from-hf", str(tmp_path / "hf_in"), str(tmp_path / "ours")]) == 0
    prompts = [[5, 17, 99, 3, 249, 42, 7], [11, 200, 31, 64], [int(t) for t in tokens(1, seed=3)[0, :12]]]
    initialize()
    ours, config = load_model(str(tmp_path / "ours"))
    engine = InferenceEngine(ours, config, None)
    completions = engine.generate([Request(p, SamplingParams(max_tokens=20, temperature=0)) for p in prompts])
    for prompt, completion in zip(prompts, completions):
        with torch.no_grad():
            theirs = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
        assert completion.tokens == theirs[0, len(prompt):].tolist()
