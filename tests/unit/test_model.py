"""The GPT model: causality, the fused cross entropy, recompute, initialisation and the FLOPs formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import megatron.ops.cross_entropy as ce
from megatron.config import Config, parse_config, validate
from megatron.metrics import model_flops_per_token
from megatron.model.init import init_value
from megatron.parallelize_gpt import build_model
from megatron.tensor_parallel import token_cross_entropy
from tests.grads import assert_grads_close

# Tiny shapes: 2 CPU cores, every test must stay fast.
TINY = ("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "200",
        "--max-seq-len", "16", "--max-position-embeddings", "32")
NO_DROPOUT = ("--hidden-dropout", "0", "--attention-dropout", "0")


def make_config(*argv: str) -> Config:
    config = parse_config(["--mock-data", "--device", "cpu", *argv])
    validate(config, world_size=1, cuda_available=False)
    return config


def random_tokens(config: Config, batch: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.model.vocab_size, (batch, config.dataset.max_seq_len), generator=g)


# ---------------------------------------------------------------- causality


def test_causal_logits_do_not_see_the_future():
    config = make_config(*TINY, *NO_DROPOUT)
    model = build_model(config).eval()
    tokens = random_tokens(config)
    s = tokens.shape[1]
    with torch.no_grad():
        base = model(tokens)
        assert base.shape == (2, s, config.padded_vocab_size) and base.dtype == torch.float32
        g = torch.Generator().manual_seed(1)
        for t in (1, 5, s // 2, s - 1):
            changed = tokens.clone()
            changed[:, t:] = torch.randint(0, config.model.vocab_size, (2, s - t), generator=g)
            assert (changed[:, t:] != tokens[:, t:]).any()
            out = model(changed)
            # Masked keys contribute exp(-inf) = 0 exactly, and every other op is per position, so the
            # past is bit-for-bit unchanged.
            torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=0, msg=f"t={t}")
            # ... while the changed positions do see the change (the test is not vacuous).
            assert not torch.allclose(out[:, t:], base[:, t:])


def test_loss_path_matches_logits_path():
    """``model(tokens, labels=...)`` is the cross entropy of ``model(tokens)`` over the real vocabulary."""
    config = make_config(*TINY, *NO_DROPOUT)
    model = build_model(config).eval()
    tokens, labels = random_tokens(config, seed=2), random_tokens(config, seed=3)
    with torch.no_grad():
        logits = model(tokens)
        losses = model(tokens, labels=labels)
    v = config.model.vocab_size
    assert config.padded_vocab_size > v  # 200 -> 256: padding is exercised
    ref = F.cross_entropy(logits[..., :v].reshape(-1, v), labels.reshape(-1), reduction="none").view_as(labels)
    assert losses.shape == labels.shape and losses.dtype == torch.float32
    # same fp32 logits, different reduction order in logsumexp: a few ulps of ~5.3
    torch.testing.assert_close(losses, ref, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- fused cross entropy


def _ce_case(n: int, vocab: int, padded: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (3.0 * torch.randn(n, padded, generator=g)).to(dtype)
    if padded > vocab:
        # large padded logits: they would dominate the softmax if they were not excluded
        logits[:, vocab:] = 20.0
    labels = torch.randint(0, vocab, (n,), generator=g)
    upstream = torch.rand(n, generator=g) + 0.5  # a non-uniform incoming gradient
    return logits, labels, upstream


def _fused_and_reference(logits, labels, upstream, vocab):
    x = logits.clone().requires_grad_(True)
    loss = token_cross_entropy(x, labels, vocab)
    (loss * upstream).sum().backward()
    y = logits.detach().float()[:, :vocab].clone().requires_grad_(True)
    ref = F.cross_entropy(y, labels, reduction="none")
    (ref * upstream).sum().backward()
    return loss, x.grad, ref, y.grad


@pytest.mark.parametrize("vocab,padded", [(96, 96), (200, 256)])
def test_fused_cross_entropy_fp32(vocab, padded):
    logits, labels, upstream = _ce_case(37, vocab, padded, torch.float32)
    loss, grad, ref, ref_grad = _fused_and_reference(logits, labels, upstream, vocab)
    assert loss.dtype == torch.float32 and grad.dtype == torch.float32 and grad.shape == (37, padded)
    # fp32, same inputs, only summation order differs: losses ~10, a few ulps
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad[:, :vocab], ref_grad, rtol=1e-6, atol=1e-7)
    assert torch.equal(grad[:, vocab:], torch.zeros_like(grad[:, vocab:]))  # padded columns: exactly 0


def test_fused_cross_entropy_bf16():
    vocab, padded = 200, 256
    logits, labels, upstream = _ce_case(29, vocab, padded, torch.bfloat16, seed=1)
    loss, grad, ref, ref_grad = _fused_and_reference(logits, labels, upstream, vocab)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    # The loss is computed in fp32 from the same bf16 values as the reference: fp32 round-off only.
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    # The gradient is stored in bf16: one rounding of each value (unit roundoff 2**-8 = 3.9e-3),
    # plus the in-place scaling by the upstream gradient, a second bf16 rounding.
    torch.testing.assert_close(grad[:, :vocab].float(), ref_grad, rtol=2 * 2.0**-8, atol=1e-5)
    assert not grad[:, vocab:].any()


@pytest.mark.parametrize("chunk_rows", [1, 3, 8])
def test_fused_cross_entropy_chunked(monkeypatch, chunk_rows):
    vocab, padded, n = 200, 256, 21  # 21 rows: several chunks and, for 8 rows, a short last one
    monkeypatch.setattr(ce, "_CHUNK_ELEMENTS", chunk_rows * padded)
    calls = []
    real_logsumexp = torch.logsumexp

    def counting_logsumexp(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real_logsumexp(*args, **kwargs)

    monkeypatch.setattr(torch, "logsumexp", counting_logsumexp)
    logits, labels, upstream = _ce_case(n, vocab, padded, torch.float32, seed=2)
    loss, grad, ref, ref_grad = _fused_and_reference(logits, labels, upstream, vocab)
    monkeypatch.setattr(torch, "logsumexp", real_logsumexp)
    assert calls == [min(chunk_rows, n - i) for i in range(0, n, chunk_rows)]  # one logsumexp per chunk
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)  # fp32 round-off, as above
    torch.testing.assert_close(grad[:, :vocab], ref_grad, rtol=1e-6, atol=1e-7)
    assert not grad[:, vocab:].any()


def test_fused_cross_entropy_chunk_smaller_than_a_row(monkeypatch):
    monkeypatch.setattr(ce, "_CHUNK_ELEMENTS", 10)  # fewer elements than one row: one row per chunk
    logits, labels, upstream = _ce_case(5, 200, 256, torch.float32, seed=3)
    loss, grad, ref, ref_grad = _fused_and_reference(logits, labels, upstream, 200)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)  # fp32 round-off
    torch.testing.assert_close(grad[:, :200], ref_grad, rtol=1e-6, atol=1e-7)


def test_fused_cross_entropy_keeps_label_shape():
    logits = torch.randn(4, 3, 128)
    labels = torch.randint(0, 100, (4, 3))
    loss = token_cross_entropy(logits, labels, 100)
    ref = F.cross_entropy(logits[..., :100].reshape(-1, 100), labels.reshape(-1), reduction="none").view(4, 3)
    assert loss.shape == (4, 3)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)  # fp32 round-off


# ---------------------------------------------------------------- activation recompute


def _loss_and_grads(config: Config, tokens: torch.Tensor, labels: torch.Tensor, dropout_seed: int = 1234):
    model = build_model(config)
    model.train()
    calls = {"sdpa": [0] * config.model.num_layers, "mlp": [0] * config.model.num_layers}
    for i, layer in enumerate(model.layers.values()):
        attn = layer.self_attention
        core = attn.core_attention

        def counted(q, k, v, _i=i, _core=core):
            calls["sdpa"][_i] += 1
            return _core(q, k, v)

        attn.core_attention = counted  # instance attribute: what forward (and checkpoint) call
        layer.mlp.register_forward_hook(lambda *_, _i=i: calls["mlp"].__setitem__(_i, calls["mlp"][_i] + 1))
    torch.manual_seed(dropout_seed)
    loss = model(tokens, labels=labels).mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.detach(), grads, calls


RECOMPUTE_CASES = [
    # flags, layers recomputed, whether the MLP is recomputed
    (("--recompute-granularity", "full"), {0, 1}, True),
    (("--recompute-granularity", "only_attn"), {0, 1}, False),
    (("--recompute-granularity", "full_attn"), {0, 1}, False),
    (("--recompute-granularity", "core_attn"), {0, 1}, False),
    (("--recompute-granularity", "full", "--no-recompute-layers", "0"), {1}, True),
]


@pytest.mark.parametrize("flags,recomputed,mlp_recomputed", RECOMPUTE_CASES,
                         ids=["full", "only_attn", "full_attn", "core_attn", "full-skip-layer0"])
def test_recompute_matches_no_recompute_with_dropout(flags, recomputed, mlp_recomputed):
    dropout = ("--hidden-dropout", "0.1", "--attention-dropout", "0.1")
    base = make_config(*TINY, *dropout)
    config = make_config(*TINY, *dropout, "--use-recompute", *flags)
    assert config.use_recompute and not base.use_recompute
    tokens, labels = random_tokens(base, seed=4), random_tokens(base, seed=5)
    ref_loss, ref_grads, ref_calls = _loss_and_grads(base, tokens, labels)
    loss, grads, calls = _loss_and_grads(config, tokens, labels)
    assert ref_calls == {"sdpa": [1, 1], "mlp": [1, 1]}
    # the granularity is what was asked: recomputed pieces run twice (forward + backward)
    assert calls["sdpa"] == [2 if i in recomputed else 1 for i in range(2)]
    assert calls["mlp"] == [2 if i in recomputed and mlp_recomputed else 1 for i in range(2)]
    # dropout is really on: another seed gives another loss
    other_loss, _, _ = _loss_and_grads(base, tokens, labels, dropout_seed=99)
    assert other_loss != ref_loss
    # Recompute replays the same ops on the same inputs with the same RNG state (same dropout
    # masks), so the results are identical; allow only fp32 round-off from a different
    # order of gradient accumulation.
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for name in ref_grads:
        assert ref_grads[name].abs().sum() > 0, name  # every parameter takes part
    assert_grads_close(grads, ref_grads)


# ---------------------------------------------------------------- initialisation


def test_init_is_deterministic_in_the_seed():
    a = build_model(make_config(*TINY, "--seed", "11"))
    b = build_model(make_config(*TINY, "--seed", "11"))
    c = build_model(make_config(*TINY, "--seed", "12"))
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), name
        if p.std() > 0:  # random tensors; constant ones (LayerNorm, biases) do not depend on the seed
            assert not torch.equal(p, r), name
        else:
            assert torch.equal(p, r), name


def test_init_value_does_not_depend_on_other_parameters():
    two = build_model(make_config(*TINY, "--seed", "5"))
    four = build_model(make_config(*TINY, "--seed", "5", "--num-layers", "4"))
    p2, p4 = dict(two.named_parameters()), dict(four.named_parameters())
    assert len(p4) > len(p2)
    for name in ("layers.1.mlp.dense_h_to_4h.weight", "layers.0.self_attention.query_key_value.weight",
                 "embedding.word_embeddings.weight", "embedding.position_embeddings.weight"):
        assert torch.equal(p2[name], p4[name]), name
    # scaled output projections: the same draw, std divided by sqrt(2 x num_layers)
    name = "layers.1.mlp.dense_4h_to_h.weight"
    torch.testing.assert_close(p2[name] / math.sqrt(2.0), p4[name], rtol=1e-6, atol=0)  # fp32 round-off
    # and init_value is a pure function of (name, shape, seed, config)
    cfg = make_config(*TINY).model
    shape = torch.Size([4 * 32, 32])
    v = init_value("layers.1.mlp.dense_h_to_4h.weight", shape, 5, cfg)
    assert torch.equal(v, p2["layers.1.mlp.dense_h_to_4h.weight"])
    assert not torch.equal(v, init_value("layers.0.mlp.dense_h_to_4h.weight", shape, 5, cfg))


def test_init_rules():
    config = make_config(*TINY)
    model = build_model(config)
    v, padded = config.model.vocab_size, config.padded_vocab_size
    params = dict(model.named_parameters())
    word = params["embedding.word_embeddings.weight"]
    assert word.shape == (padded, 32) and padded > v
    assert not word[v:].any()  # padded vocab rows: zero
    assert (word[:v].abs().sum(dim=1) > 0).all()  # every real row is drawn
    for name, p in params.items():
        if "layernorm.weight" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith(".bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
    assert sum("layernorm" in n for n in params) == 2 * (2 * 2 + 1)  # 2 per layer + final, weight and bias


def test_init_std():
    std = 0.02
    cfg = make_config("--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "4",
                      "--vocab-size", "128", "--max-seq-len", "16").model
    # 262144 samples: the sample std has relative standard error 1/sqrt(2n) = 0.14%, so a 1%
    # tolerance is a > 7 sigma margin (and the seed is fixed, so the check is deterministic)
    shape = torch.Size([256, 1024])
    scaled = init_value("layers.3.mlp.dense_4h_to_h.weight", shape, 7, cfg)
    dense = init_value("layers.3.self_attention.dense.weight", torch.Size([512, 512]), 7, cfg)
    plain = init_value("layers.3.mlp.dense_h_to_4h.weight", shape, 7, cfg)
    want_scaled = std / math.sqrt(2 * 8)
    assert float(scaled.std()) == pytest.approx(want_scaled, rel=0.01)
    assert float(dense.std()) == pytest.approx(want_scaled, rel=0.01)
    assert float(plain.std()) == pytest.approx(std, rel=0.01)
    # means: standard error std/sqrt(n) ~ 0.002 std; 0.01 std is a 5 sigma margin
    assert abs(float(scaled.mean())) < 0.01 * want_scaled and abs(float(plain.mean())) < 0.01 * std
    # the same rule inside a built model: 4 layers, dense_4h_to_h [64, 256] = 16384 samples,
    # relative standard error 0.55%, so a 4% tolerance is a > 7 sigma margin
    model = build_model(make_config("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                                    "--vocab-size", "128", "--max-seq-len", "16"))
    params = {n: p.detach() for n, p in model.named_parameters()}
    for i in range(4):
        w = params[f"layers.{i}.mlp.dense_4h_to_h.weight"]
        assert float(w.std()) == pytest.approx(std / math.sqrt(8), rel=0.04)
        w = params[f"layers.{i}.mlp.dense_h_to_4h.weight"]
        assert float(w.std()) == pytest.approx(std, rel=0.04)


def test_build_model_dtype():
    assert all(p.dtype == torch.bfloat16 for p in build_model(make_config(*TINY, "--bf16")).parameters())
    assert all(p.dtype == torch.float16 for p in build_model(make_config(*TINY, "--fp16")).parameters())
    # low-precision parameters are the fp32 init rounded once
    fp32 = build_model(make_config(*TINY))
    bf16 = build_model(make_config(*TINY, "--bf16"))
    for p, q in zip(fp32.parameters(), bf16.parameters()):
        assert torch.equal(p.to(torch.bfloat16), q)


# ---------------------------------------------------------------- FLOPs formula


@pytest.mark.parametrize("argv", [
    ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "128",
     "--max-seq-len", "16"),
    ("--num-layers", "3", "--hidden-size", "48", "--num-attention-heads", "4", "--vocab-size", "200",
     "--ffn-hidden-size", "80", "--max-seq-len", "24"),
], ids=["4h-no-padding", "ffn80-padded-vocab"])
def test_flops_formula_matches_flop_counter(argv):
    config = make_config(*argv, *NO_DROPOUT)
    model = build_model(config)
    batch = 3
    tokens = random_tokens(config, batch=batch, seed=6)
    # The default CPU attention kernel (_scaled_dot_product_flash_attention_for_cpu) is not
    # registered with torch's FlopCounterMode, so it would count 0 FLOPs; the math backend
    # computes the same attention with bmm's, which the counter does count.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens, labels=tokens).sum().backward()
    counted = counter.get_total_flops()
    expected = model_flops_per_token(config) * batch * config.dataset.max_seq_len
    assert counted > 0
    assert expected == pytest.approx(counted, rel=1e-9)


@pytest.mark.parametrize("divisible_by, rows", [(128, 256), (64, 256), (3, 201), (1, 200)])
def test_make_vocab_size_divisible_by_pads_the_embedding_and_changes_no_result(divisible_by, rows):
    """Megatron's --make-vocab-size-divisible-by: the word embedding's rows; the real rows' values, the
    logits of the real vocabulary and the loss are the same whatever the padding."""
    reference = make_config(*TINY, *NO_DROPOUT)
    config = make_config(*TINY, *NO_DROPOUT, "--make-vocab-size-divisible-by", str(divisible_by))
    assert config.padded_vocab_size == rows
    ref_model, model = build_model(reference).eval(), build_model(config).eval()
    assert model.embedding.word_embeddings.weight.shape[0] == rows
    tokens = random_tokens(config)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[..., :200], ref_model(tokens)[..., :200], rtol=0, atol=1e-6)
        labels = random_tokens(config, seed=1)
        torch.testing.assert_close(model(tokens, labels=labels), ref_model(tokens, labels=labels), rtol=0, atol=1e-6)
