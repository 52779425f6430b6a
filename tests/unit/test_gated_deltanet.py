"""Qwen3-Next's layers (megatron/hybrid/gated_deltanet.py, docs/hybrid.md): the Gated DeltaNet layer equals
transformers' ``Qwen3NextGatedDeltaNet`` holding the same numbers (its projections and convolution reordered), output
and input gradient; within packed documents each document's output is the layer's on that document alone; the gated
attention's output is ``dense(attention(q, k, v) * sigmoid(gate))`` with each group's rows (queries, gates, key,
value); ``linear_attention_freq``'s layer choice and the settings refused in one sentence; a tiny Qwen3-Next trains."""

from __future__ import annotations

import re

import pytest
import torch

from megatron.attention.plan import AttentionPlan
from megatron.config import ConfigError, parse_config, validate
from megatron.config.validate_hybrid import is_linear_attention_layer, linear_attention_pattern
from megatron.hybrid.gated_deltanet import GatedDeltaNet
from megatron.model.blocks import make_norm
from megatron.model.transformer import SelfAttention, make_attention

NK, NV, DK, DV, K, H = 2, 4, 8, 6, 4, 16
LINEAR = ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "4",
          "--linear-num-key-heads", str(NK), "--linear-num-value-heads", str(NV), "--linear-key-head-dim", str(DK),
          "--linear-value-head-dim", str(DV)]


def _config(*flags: str, world: int = 1):
    config = parse_config(["--mock-data", "--num-layers", "4", "--hidden-size", str(H), "--num-attention-heads", "2",
                           "--vocab-size", "64", "--max-seq-len", "24", "--normalization", "RMSNorm",
                           "--layernorm-epsilon", "1e-6", *flags])
    validate(config, world_size=world)
    return config


def _layer(seed: int = 0) -> GatedDeltaNet:
    torch.manual_seed(seed)
    layer = GatedDeltaNet(_config(*LINEAR).model, make_norm, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
        layer.A_log.uniform_(0.0, 1.0)
    return layer


def _transformers_twin(layer: GatedDeltaNet):
    """transformers' layer with ``layer``'s numbers: in_proj cut into in_proj_qkvz and in_proj_ba (both ordered by
    key head), the convolution's channels put query-major."""
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(hidden_size=H, linear_num_key_heads=NK, linear_num_value_heads=NV,
                             linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=K,
                             rms_norm_eps=1e-6, num_hidden_layers=1, layer_types=["linear_attention"],
                             hidden_act="silu")
    twin, r = qwen3_next.Qwen3NextGatedDeltaNet(config, 0), NV // NK
    with torch.no_grad():
        rows = layer.in_proj.weight.view(NK, 2 * DK + 2 * r * DV + 2 * r, H)
        twin.in_proj_qkvz.weight.copy_(rows[:, :2 * DK + 2 * r * DV].reshape(-1, H))
        twin.in_proj_ba.weight.copy_(rows[:, 2 * DK + 2 * r * DV:].reshape(-1, H))
        conv = layer.conv1d_weight.view(NK, 2 * DK + r * DV, K)
        twin.conv1d.weight.copy_(torch.cat([conv[:, :DK].reshape(-1, K), conv[:, DK:2 * DK].reshape(-1, K),
                                            conv[:, 2 * DK:].reshape(-1, K)])[:, None])
        twin.dt_bias.copy_(layer.dt_bias)
        twin.A_log.copy_(layer.A_log)
        twin.norm.weight.copy_(layer.out_norm.weight)
        twin.out_proj.weight.copy_(layer.out_proj.weight)
    return twin


def test_the_layer_equals_transformers():
    layer = _layer()
    twin = _transformers_twin(layer)
    x = torch.randn(2, 24, H, generator=torch.Generator().manual_seed(1))
    ours_in, theirs_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours = layer(ours_in.transpose(0, 1)).transpose(0, 1)
    theirs = twin(theirs_in)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    weights = torch.linspace(-1, 1, ours.numel()).view_as(ours)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-5, atol=1e-5)


def test_packed_documents_do_not_see_each_other():
    """Documents of 7, 1 and 16 tokens in one sample: the convolution and the recurrence restart at each."""
    layer = _layer()
    x = torch.randn(24, 1, H, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[0] * 7 + [1] + [2] * 16])
    packed = layer(x, plan=AttentionPlan(document_ids=ids))
    for start, end in ((0, 7), (7, 8), (8, 24)):
        torch.testing.assert_close(packed[start:end], layer(x[start:end]), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(packed[8:], layer(x)[8:])  # the documents do change the output


def test_gated_attention_is_attention_times_the_sigmoid_of_its_gate():
    torch.manual_seed(0)
    gated = SelfAttention(_config("--attention-output-gate", "--group-query-attention", "--num-query-groups",
                                  "1", "--num-attention-heads", "2").model)
    plain = SelfAttention(_config("--group-query-attention", "--num-query-groups", "1",
                                  "--num-attention-heads", "2").model)
    hd = gated.head_dim
    with torch.no_grad():
        rows = gated.query_key_value.weight.view(1, 2 + 2 + 2, hd, H)  # one group: 2 queries, 2 gates, key, value
        plain.query_key_value.weight.copy_(torch.cat([rows[:, :2], rows[:, 4:]], dim=1).reshape(-1, H))
        plain.query_key_value.bias.copy_(gated.query_key_value.bias.view(1, 6, hd)[:, [0, 1, 4, 5]].reshape(-1))
        plain.dense.load_state_dict(gated.dense.state_dict())
        gate_w = rows[:, 2:4].reshape(-1, H)
        gate_b = gated.query_key_value.bias.view(1, 6, hd)[:, 2:4].reshape(-1)
    gated.eval(), plain.eval()  # no attention dropout
    x = torch.randn(10, 2, H)
    context = {}
    plain.dense.register_forward_hook(lambda m, args, out: context.update(ctx=args[0]))
    plain(x)
    want = torch.nn.functional.linear(context["ctx"] * torch.sigmoid(x @ gate_w.t() + gate_b), plain.dense.weight,
                                      plain.dense.bias)
    torch.testing.assert_close(gated(x), want, rtol=1e-5, atol=1e-6)


def test_the_layers_linear_attention_freq_chooses():
    assert linear_attention_pattern("4", 8) == [True, True, True, False] * 2  # Megatron-LM's (N-1):1
    assert linear_attention_pattern("([1]*3+[0]*1)*2", 8) == [True, True, True, False] * 2
    cfg = _config(*LINEAR).model
    assert [type(make_attention(cfg, i)).__name__ for i in range(4)] == ["GatedDeltaNet"] * 3 + ["SelfAttention"]
    assert not is_linear_attention_layer(cfg, 4)  # multi-token prediction's layer: softmax attention


@pytest.mark.parametrize("flags,message", [
    (["--linear-attention-freq", "4"], "give --experimental-attention-variant gated_delta_net too"),
    (["--experimental-attention-variant", "gated_delta_net"], "needs linear_attention_freq"),
    ([*LINEAR, "--linear-attention-freq", "[1,0]"], "needs num_layers (4) entries"),
    ([*LINEAR, "--linear-num-value-heads", "3"], "must be a multiple of linear_num_key_heads"),
    ([*LINEAR, "--tp", "2", "--linear-num-key-heads", "1", "--linear-num-value-heads", "2"],
     "must be divisible by the tensor-parallel size"),
    ([*LINEAR, "--cp", "2", "--max-seq-len", "8", "--linear-conv-kernel-dim", "4"], "chunks hold 2 tokens"),
])
def test_refused_in_one_sentence(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _config(*flags, world=2 if "--tp" in flags or "--cp" in flags else 1)


def test_deepseek_sparse_attention_is_refused_by_name():
    with pytest.raises(ConfigError, match="'dsa' is not built here"):
        _config("--experimental-attention-variant", "dsa", "--linear-attention-freq", "4")


def test_megatron_lm_export_is_refused_until_its_conversion_is_written():
    """(The Hugging Face export is Qwen3-Next's: tests/functional/test_hf_qwen3_next.py.)"""
    from megatron.checkpoint.hf.common import ConversionError
    from megatron.checkpoint.megatron_lm.args import to_args

    for flags in (LINEAR, ["--attention-output-gate"]):
        with pytest.raises(ConversionError, match="conversion to Megatron-LM is not written yet"):
            to_args(_config(*flags).model, tp=1, pp=1, seq_length=24, iteration=1, consumed_train_samples=0)


def test_a_tiny_qwen3_next_trains_and_generates_as_a_full_recompute(tmp_path):
    """Megatron-LM's flags, 12 steps on packed mock documents: the loss falls. The checkpoint generates greedily with
    the state cache (two prompts, left-padded) the tokens a full recompute of every prefix chooses."""
    from tests.functional.launch import run_here

    run = run_here("--mock-data", "--device", "cpu", "--num-layers", "4", "--hidden-size", "32",
                   "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
                   "--vocab-size", "128", "--seq-length", "32", "--max-position-embeddings", "32",
                   "--global-batch-size", "8", "--micro-batch-size", "4", "--train-iters", "12", "--lr", "3e-3",
                   "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "12", "--eval-iters", "1",
                   "--log-interval", "1", "--num-workers", "0", "--normalization", "RMSNorm", "--apply-layernorm-1p",
                   "--position-embedding-type", "rope", "--rotary-percent", "0.25", "--qk-layernorm",
                   "--attention-output-gate", "--mock-document-length", "10", "--reset-attention-mask",
                   "--reset-position-ids", *LINEAR, "--save", str(tmp_path / "run"))
    assert run.returncode == 0, run.stderr[-2000:]
    losses = [float(v) for v in re.findall(r" - global step \d+, .*?loss: ([\d.]+)", run.stderr)]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.3
    assert_generates_as_a_full_recompute(tmp_path / "run")


def test_the_estimates_count_the_linear_attention_layers():
    """The memory estimate's parameters equal the built model's (Gated DeltaNet, gated attention, MoE with a gated
    shared expert); the model FLOPs of a Gated DeltaNet layer are Megatron-LM's count for it."""
    from megatron.memory.model_states import parameter_split
    from megatron.metrics import model_flops_per_token
    from megatron.parallelize_gpt import build_model

    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--swiglu",
           "--moe-shared-expert-intermediate-size", "24", "--moe-shared-expert-gate", "--ffn-hidden-size", "32"]
    config = _config(*LINEAR, "--attention-output-gate", "--group-query-attention", "--num-query-groups", "1", *moe)
    assert sum(parameter_split(config)) == sum(p.numel() for p in build_model(config).parameters())
    plain = _config(*LINEAR[:2], "--linear-attention-freq", "[0,0,0,0]")  # the same model, attention everywhere
    linear, full = model_flops_per_token(_config(*LINEAR)), model_flops_per_token(plain)
    h, s = H, 24  # 2 heads of H / 2 channels: nq x hd = H
    attention = 2 * h * 3 * H + 2 * H * h + 2 * 2 * s * H  # QKV (no GQA), out, the scores and values
    gdn = 2 * (h * (2 * NK * DK + 2 * NV * DV + 2 * NV) + K * (2 * NK * DK + NV * DV) + 4 * NV * DK * DV + h * NV * DV)
    assert linear - full == 3 * 3 * (gdn - attention)  # 3 linear layers; forward and backward: x 3


def assert_generates_as_a_full_recompute(run_dir) -> None:
    """The checkpoint at ``run_dir`` generates greedily with the state cache (two prompts, left-padded) the tokens a
    full recompute of every prefix chooses."""
    from megatron.inference import InferenceEngine, Request, SamplingParams, initialize, load_model

    initialize()
    model, config = load_model(str(run_dir))
    prompts = [[3, 50, 7, 90, 11, 4], [60, 2, 33]]
    completions = InferenceEngine(model, config, None).generate(
        [Request(p, SamplingParams(max_tokens=8, temperature=0)) for p in prompts])
    for prompt, completion in zip(prompts, completions):
        sequence = list(prompt)
        with torch.no_grad():
            for _ in range(8):  # the whole prefix again, no cache
                logits = model.parallel_logits(model.hidden_states(torch.tensor([sequence]), None, None)[-1])
                sequence.append(int(logits[0, :config.model.vocab_size].argmax()))
        assert completion.tokens == sequence[len(prompt):]
