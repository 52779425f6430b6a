"""Megatron-LM's GPT variants (the Llama family): RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU, the untied output layer, no linear biases; their initialisation, validation, recompute methods,
FLOPs and parameter counts, and generation with the KV cache (fp32, one process; one spawned tp2 job)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megatron import parallel_state
from megatron.config import Config, ConfigError, parse_config, validate
from megatron.config.layer_split import recompute_plan, segment, stage_layers
from megatron.inference import InferenceEngine, Request, SamplingParams
from megatron.memory.model_states import parameters_per_rank
from megatron.metrics import model_flops_per_token
from megatron.model import num_parameters
from megatron.model.gpt import GPTModel
from megatron.model.rotary import RotaryEmbedding, apply_rotary
from megatron.model.transformer import MLP, SelfAttention
from megatron.parallelize_gpt import build_model
from megatron.pipeline_parallel.partition import cut_stage
from tests.distributed.harness import run_distributed
from tests.grads import assert_grads_close

TINY = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "200",
        "--max-seq-len", "16", "--max-position-embeddings", "64")
NO_DROPOUT = ("--hidden-dropout", "0", "--attention-dropout", "0")
LLAMA = ("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
         "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear")


def make_config(*argv: str, world_size: int = 1, positions: str | None = None) -> Config:
    config = parse_config(["--mock-data", "--device", "cpu", *argv])
    if positions is not None:  # "none" is not accepted on the command line yet (read as an empty value)
        config.model.position_embedding_type = positions
    validate(config, world_size=world_size, cuda_available=False)
    return config


def random_tokens(config: Config, batch: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.model.vocab_size, (batch, config.dataset.max_seq_len), generator=g)


# ---------------------------------------------------------------- the building blocks


def test_llama_shaped_model_has_the_agreed_names_and_shapes():
    config = make_config(*TINY, *LLAMA)
    shapes = {n: tuple(p.shape) for n, p in build_model(config).named_parameters()}
    h, hd, ffn, vp = 64, 16, config.model.ffn_hidden_size, config.padded_vocab_size
    assert ffn == int(4 * 64 * 2 / 3 / 64) * 64 == 128  # Megatron-LM's SwiGLU default
    want = {"embedding.word_embeddings.weight": (vp, h), "final_layernorm.weight": (h,), "output_layer.weight": (vp, h)}
    for i in range(2):
        want |= {f"layers.{i}.input_layernorm.weight": (h,), f"layers.{i}.post_attention_layernorm.weight": (h,),
                 f"layers.{i}.self_attention.query_key_value.weight": ((4 + 2 * 2) * hd, h),
                 f"layers.{i}.self_attention.dense.weight": (h, 4 * hd),
                 f"layers.{i}.mlp.dense_h_to_4h.weight": (2 * ffn, h), f"layers.{i}.mlp.dense_4h_to_h.weight": (h, ffn)}
    assert shapes == want


def test_rmsnorm_matches_the_formula():
    config = make_config(*TINY, *LLAMA, "--layernorm-epsilon", "1e-6")
    norm = build_model(config).layers["0"].input_layernorm
    assert [n for n, _ in norm.named_parameters()] == ["weight"] and torch.equal(norm.weight, torch.ones(64))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    x = 3.0 * torch.randn(5, 2, 64, generator=g)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), want, rtol=1e-6, atol=1e-6)  # fp32 round-off (another reduction order)


def _rope_reference(t: torch.Tensor, positions: torch.Tensor, base: float, rot: int,
                    interleaved: bool = False) -> torch.Tensor:
    """Channel pairs (i, i + rot/2), or (2i, 2i + 1) interleaved, rotated by the angle p / base^(2i/rot), in
    float64."""
    t, out, half = t.double(), t.double().clone(), rot // 2
    for i in range(half):
        angle = positions.double()[:, None, :] * base ** (-2.0 * i / rot)  # [b, 1, s]
        first, second = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        a, b = t[..., first], t[..., second]
        out[..., first] = a * torch.cos(angle) - b * torch.sin(angle)
        out[..., second] = b * torch.cos(angle) + a * torch.sin(angle)
    return out


@pytest.mark.parametrize("percent, base, interleaved", [(1.0, 10000, False), (0.5, 500000, False),
                                                        (1.0, 10000, True), (0.5, 500, True)])
def test_rope_matches_a_direct_reference_and_passes_the_tail_through(percent, base, interleaved):
    head_dim, g = 16, torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(head_dim, percent, base, max_positions=64, interleaved=interleaved)
    rot = int(head_dim * percent)
    assert rope.rot == rot
    positions = torch.stack([torch.arange(12), torch.arange(20, 32)])  # two rows at different positions
    t = torch.randn(2, 3, 12, head_dim, generator=g)  # [b, heads, s, hd]
    out = apply_rotary(t, *rope(positions), interleaved=interleaved)
    # The angles are fp32 (as Megatron-LM's and Hugging Face's): position x inv_freq rounded to 2^-24
    # relative, below 31 x 6e-8 = 2e-6 rad here, times |t| < 5: under 1e-5.
    want = _rope_reference(t, positions, base, rot, interleaved)
    torch.testing.assert_close(out[..., :rot].double(), want[..., :rot], rtol=0, atol=1e-5)
    assert torch.equal(out[..., rot:], t[..., rot:])  # the channels past rotary_percent: untouched


def test_rope_model_depends_only_on_relative_positions():
    """Shifting every position by a constant leaves a rope model's logits unchanged (q.k sees only the
    difference of the rotations); a learned absolute embedding changes them."""
    tokens = random_tokens(make_config(*TINY), seed=3)
    shifted = torch.arange(16).expand(2, 16) + 7
    for flags, invariant in ((LLAMA, True), ((*LLAMA, "--rotary-interleaved"), True), ((), False)):
        model = build_model(make_config(*TINY, *NO_DROPOUT, *flags)).eval()
        with torch.no_grad():
            base, moved = model(tokens), model(tokens, shifted)
        if invariant:
            torch.testing.assert_close(moved, base, rtol=0, atol=1e-5)  # fp32 round-off of the angles
        else:
            assert not torch.allclose(moved, base, atol=1e-3)


@pytest.mark.parametrize("rope", [False, True], ids=["no-rope", "rope"])
def test_grouped_query_attention_equals_mha_with_repeated_key_value_heads(rope):
    extra = ("--position-embedding-type", "rope") if rope else ()
    gqa_cfg = make_config(*TINY, *NO_DROPOUT, *extra, "--group-query-attention", "--num-query-groups", "2").model
    mha_cfg = make_config(*TINY, *NO_DROPOUT, *extra).model
    torch.manual_seed(0)
    gqa, mha = SelfAttention(gqa_cfg).eval(), SelfAttention(mha_cfg).eval()
    nq, ng, hd, r = 4, 2, 16, 2
    w, b = gqa.query_key_value.weight.detach(), gqa.query_key_value.bias.detach()  # rows [ng, (r q, k, v), hd]
    assert w.shape == ((nq + 2 * ng) * hd, 64) and gqa.num_kv_heads == ng

    def to_mha(t: torch.Tensor) -> torch.Tensor:  # -> rows [nq, (q, k, v), hd]: query head j reads group j // r
        grouped = t.reshape(ng, r + 2, hd, *t.shape[1:])
        return torch.stack([torch.stack([grouped[j // r, j % r], grouped[j // r, r], grouped[j // r, r + 1]])
                            for j in range(nq)]).reshape(3 * nq * hd, *t.shape[1:])

    with torch.no_grad():
        mha.query_key_value.weight.copy_(to_mha(w))
        mha.query_key_value.bias.copy_(to_mha(b))
        mha.dense.weight.copy_(gqa.dense.weight)
        mha.dense.bias.copy_(gqa.dense.bias)
        x = torch.randn(10, 3, 64, generator=torch.Generator().manual_seed(2))
        rotary = RotaryEmbedding(hd, 1.0, 10000, 64)(torch.arange(10).expand(3, 10)) if rope else None
        # the same products; only the kernel's blocking may differ: fp32 round-off
        torch.testing.assert_close(gqa(x, rotary=rotary), mha(x, rotary=rotary), rtol=1e-5, atol=1e-6)


def test_swiglu_mlp_equals_silu_gate_times_up_from_the_deinterleaved_weights():
    cfg = make_config(*TINY, "--swiglu", "--ffn-hidden-size", "96").model
    torch.manual_seed(0)
    mlp = MLP(cfg)
    w1, b1 = mlp.dense_h_to_4h.weight.detach(), mlp.dense_h_to_4h.bias.detach()
    assert w1.shape == (192, 64)
    gate_w, up_w, gate_b, up_b = w1[0::2], w1[1::2], b1[0::2], b1[1::2]  # row 2j: gate_j, row 2j+1: up_j
    x = torch.randn(7, 2, 64, generator=torch.Generator().manual_seed(1))
    hidden = F.silu(x @ gate_w.t() + gate_b) * (x @ up_w.t() + up_b)
    want = hidden @ mlp.dense_4h_to_h.weight.detach().t() + mlp.dense_4h_to_h.bias.detach()
    torch.testing.assert_close(mlp(x), want, rtol=1e-6, atol=1e-6)  # fp32 round-off


def test_disable_bias_linear_removes_every_linear_bias():
    with_bias = {n for n, _ in build_model(make_config(*TINY, "--swiglu")).named_parameters()}
    without = {n for n, _ in build_model(make_config(*TINY, "--swiglu", "--disable-bias-linear")).named_parameters()}
    removed = with_bias - without
    assert without < with_bias and all(n.endswith(".bias") and "layernorm" not in n for n in removed)
    assert len(removed) == 2 * 4  # qkv, dense, dense_h_to_4h, dense_4h_to_h in each of 2 layers


# ---------------------------------------------------------------- the untied head


def test_untied_output_layer_differs_from_the_tied_head():
    tied_cfg, untied_cfg = make_config(*TINY, *NO_DROPOUT), make_config(*TINY, *NO_DROPOUT,
                                                                         "--untie-embeddings-and-output-weights")
    tied, untied = build_model(tied_cfg).eval(), build_model(untied_cfg).eval()
    params = dict(untied.named_parameters())
    assert "output_layer.weight" not in dict(tied.named_parameters())
    head, word = params["output_layer.weight"], params["embedding.word_embeddings.weight"]
    assert head.shape == word.shape == (untied_cfg.padded_vocab_size, 64)
    # the word embedding is unchanged by untying; the head is drawn like it, from its own name
    assert torch.equal(word, dict(tied.named_parameters())["embedding.word_embeddings.weight"])
    v = untied_cfg.model.vocab_size
    assert not head[v:].any() and not torch.equal(head[:v], word[:v])
    assert float(head[:v].detach().std()) == pytest.approx(0.02, rel=0.05)  # 12800 samples: 0.6% standard error
    tokens = random_tokens(tied_cfg, seed=5)
    with torch.no_grad():
        tied_logits, untied_logits = tied(tokens), untied(tokens)
        torch.testing.assert_close(untied_logits, F.linear(untied.hidden_states(tokens), head).transpose(0, 1))
    assert not torch.allclose(tied_logits, untied_logits, atol=1e-3)
    # the word embedding's gradient comes from the lookup only: rows of tokens never seen stay 0
    untied.train()
    untied(tokens, labels=tokens).mean().backward()
    unseen = torch.ones(untied_cfg.padded_vocab_size, dtype=torch.bool)
    unseen[tokens.unique()] = False
    assert not word.grad[unseen].any() and head.grad[:v][unseen[:v]].abs().sum() > 0
    assert not getattr(word, "shared_embedding", False)  # no embedding-group sum under pipelining
    assert getattr(dict(tied.named_parameters())["embedding.word_embeddings.weight"], "shared_embedding", False)


# ---------------------------------------------------------------- generation


def test_kv_cache_generation_equals_the_full_forward_for_a_llama_shaped_model(monkeypatch):
    """Rope + GQA + left padding: every step's logits equal the full forward of that row's sequence alone,
    so the greedy continuation is the full forward's argmax; the cache holds the key/value heads only."""
    import megatron.inference.engine as engine_module

    config = make_config(*TINY, *NO_DROPOUT, *LLAMA, "--initializer-range", "0.2")
    model = build_model(config).eval()
    engine = InferenceEngine(model, config, tokenizer=None)
    assert engine.cache_shapes == {0: (2, 16, 16), 1: (2, 16, 16)}  # num_query_groups, not the 4 query heads
    seen = []
    real_choose = engine_module.choose

    def recording_choose(logits, rows, shard):
        seen.append((logits.clone(), [r.prompt + r.output for r in rows]))
        return real_choose(logits, rows, shard)

    monkeypatch.setattr(engine_module, "choose", recording_choose)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (9, 2, 5)]
    requests = [Request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                for p, n in zip(prompts, (6, 10, 3), strict=True)]
    completions = engine.generate(requests)
    assert [len(c.tokens) for c in completions] == [6, 10, 3]
    with torch.no_grad():
        for logits, sequences in seen:
            for row, sequence in enumerate(sequences):
                full = model(torch.tensor([sequence]))[0, -1, :200]
                torch.testing.assert_close(logits[row, :200], full, rtol=0, atol=1e-5)  # fp32 round-off
        for prompt, completion in zip(prompts, completions, strict=True):
            sequence = prompt + completion.tokens
            full = model(torch.tensor([sequence]))[0, len(prompt) - 1:-1, :200]
            assert full.argmax(-1).tolist() == completion.tokens


# ---------------------------------------------------------------- initialisation across layouts


def _tp2_rank(rank: int, world_size: int, argv: tuple[str, ...]) -> dict:
    torch.set_num_threads(1)
    parallel_state.initialize(tp=2)
    config = make_config(*argv, "--tp", "2", world_size=2)
    model = build_model(config).eval()
    tokens = random_tokens(config, seed=9)
    with torch.no_grad():
        losses = model(tokens, labels=tokens)
    meta = build_model(config, meta_init=True)  # ZeRO stage 3's deferred values: the same slices
    deferred = {n: p.deferred_init() for n, p in meta.named_parameters()}
    return {"params": {n: (p.detach().clone(), getattr(p, "partition_dim", -1)) for n, p in model.named_parameters()},
            "deferred": deferred, "losses": losses, "count": num_parameters(model),
            "predicted": parameters_per_rank(config, tp=2)}


def test_init_and_losses_are_layout_invariant_at_tp2():
    """tp2 ranks hold exactly the slices of the single-process tensors (grouped QKV rows, interleaved
    SwiGLU rows, the untied head's vocabulary rows), and compute its losses."""
    argv = (*TINY, *NO_DROPOUT, *LLAMA, "--vocab-size", "300")  # padded 384 at tp1, 512 at tp2
    full_config = make_config(*argv)
    full = dict(build_model(full_config).named_parameters())
    with torch.no_grad():
        want_losses = build_model(full_config).eval()(random_tokens(full_config, seed=9),
                                                      labels=random_tokens(full_config, seed=9))
    ranks = run_distributed(_tp2_rank, 2, argv)
    for rank, result in enumerate(ranks):
        assert result["count"] == result["predicted"]
        for name, (shard, dim) in result["params"].items():
            assert torch.equal(result["deferred"][name], shard), name
            value = full[name].detach()
            if dim < 0:
                assert torch.equal(shard, value), name
                continue
            if name.endswith(("word_embeddings.weight", "output_layer.weight")):  # padding depends on tp
                value = torch.cat([value, value.new_zeros(512 - value.shape[0], value.shape[1])])
            assert torch.equal(shard, value.chunk(2, dim=dim)[rank]), name
        torch.testing.assert_close(result["losses"], want_losses, rtol=1e-5, atol=1e-6)  # partial sums' order


def test_init_rules_hold_for_the_new_names():
    config = make_config(*TINY, *LLAMA, "--num-layers", "4")
    params = dict(build_model(config).named_parameters())
    for name, p in params.items():
        if "layernorm" in name:
            assert torch.equal(p, torch.ones_like(p)), name  # RMSNorm weights (no bias)
    std = {n: float(p.detach().std()) for n, p in params.items() if p.dim() == 2}
    for i in range(4):  # residual outputs scaled by 1/sqrt(2 x 4); 8192-row samples: ~1% standard error
        assert std[f"layers.{i}.mlp.dense_4h_to_h.weight"] == pytest.approx(0.02 / math.sqrt(8), rel=0.06)
        assert std[f"layers.{i}.self_attention.dense.weight"] == pytest.approx(0.02 / math.sqrt(8), rel=0.06)
        assert std[f"layers.{i}.mlp.dense_h_to_4h.weight"] == pytest.approx(0.02, rel=0.06)


# ---------------------------------------------------------------- recompute methods


def test_recompute_plan_follows_megatron():
    layers = range(4, 9)  # a chunk holding layers 4..8
    per_layer, units = recompute_plan(layers, "full", None, "uniform", 2)
    assert units == [[4, 5], [6, 7], [8]]  # the last, shorter unit: its one layer recomputes by itself
    assert per_layer == {4: None, 5: None, 6: None, 7: None, 8: "full"}
    assert recompute_plan(layers, "full", None, "uniform", 1) == ({i: "full" for i in layers}, [[i] for i in layers])
    per_layer, units = recompute_plan(layers, "full", None, "block", 2)
    assert per_layer == {4: "full", 5: "full", 6: None, 7: None, 8: None} and units == [[i] for i in layers]
    assert recompute_plan(layers, None, None, None, None)[0] == {i: None for i in layers}


@pytest.mark.parametrize("flags, recomputed", [
    (("--recompute-method", "uniform", "--recompute-num-layers", "2"), {0, 1, 2, 3}),
    (("--recompute-method", "uniform", "--recompute-num-layers", "3"), {0, 1, 2, 3}),
    (("--recompute-method", "block", "--recompute-num-layers", "1"), {0}),
    (("--recompute-method", "block", "--recompute-num-layers", "3"), {0, 1, 2}),
], ids=["uniform2", "uniform3", "block1", "block3"])
def test_recompute_methods_match_no_recompute_with_dropout(flags, recomputed):
    dropout = ("--hidden-dropout", "0.1", "--attention-dropout", "0.1")
    argv = (*TINY, *LLAMA, *dropout, "--num-layers", "4")
    tokens = random_tokens(make_config(*argv), seed=4)
    results = []
    for extra in ((), ("--use-recompute", "--recompute-granularity", "full", *flags)):
        model = build_model(make_config(*argv, *extra)).train()
        calls = [0] * 4
        for i, layer in enumerate(model.layers.values()):
            layer.mlp.register_forward_hook(lambda *_, _i=i, _calls=calls: _calls.__setitem__(_i, _calls[_i] + 1))
        torch.manual_seed(1234)
        loss = model(tokens, labels=tokens).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, calls))
    (ref_loss, ref_grads, ref_calls), (loss, grads, calls) = results
    assert ref_calls == [1] * 4 and calls == [2 if i in recomputed else 1 for i in range(4)]
    # the same ops replayed under the same RNG states: identical up to gradient accumulation order
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert_grads_close(grads, ref_grads)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("argv, world, message", [
    (("--group-query-attention", "--num-query-groups", "2", "--tp", "4"), 4,
     "Model.num_query_groups (2) must be divisible by the tensor-parallel size mp_degree (4): each tensor-parallel "
     "rank holds whole key/value groups."),
    (("--group-query-attention", "--num-query-groups", "3"), 1,
     "Model.num_query_groups (3) must divide Model.num_attention_heads (4)"),
    (("--group-query-attention",), 1, "group_query_attention needs num_query_groups"),
    (("--num-query-groups", "2"), 1, "num_query_groups (2) is set but group_query_attention is not"),
    (("--position-embedding-type", "rope", "--rotary-percent", "0.1"), 1,
     "rotary_percent (0.1) x the head width (16) must be an even number of channels"),
    (("--kv-channels", "0"), 1, "Model.kv_channels must be at least 1"),
    (("--recompute-method", "uniform"), 1, "recompute_method (uniform) chooses the layers of a full recompute, but "
                                           "recompute is off"),
    (("--use-recompute", "--recompute-granularity", "selective", "--recompute-method", "block"), 1,
     "but recompute is core_attn"),
    (("--use-recompute", "--recompute-method", "uniform", "--recompute-num-layers", "0"), 1,
     "recompute_num_layers must be at least 1, got 0."),
    (("--use-recompute", "--recompute-num-layers", "2"), 1, "recompute_num_layers (2) is set without recompute_method"),
    (("--use-recompute", "--recompute-method", "block", "--no-recompute-layers", "1"), 1,
     "no_recompute_layers and recompute_method both choose the layers to recompute"),
], ids=["groups-vs-tp", "groups-vs-heads", "gqa-without-groups", "groups-without-gqa", "odd-rotary", "kv-channels",
        "method-without-recompute", "method-with-selective", "num-layers-0", "num-layers-without-method",
        "method-and-skip"])
def test_bad_variant_settings_are_config_errors(argv, world, message):
    with pytest.raises(ConfigError) as err:
        make_config(*TINY, *argv, world_size=world)
    assert message in str(err.value)


def test_derived_variant_settings():
    assert make_config(*TINY, "--swiglu").model.ffn_hidden_size == 128  # int(4 x 64 x 2/3 / 64) x 64
    assert make_config(*TINY, "--swiglu", "--ffn-hidden-size", "96").model.ffn_hidden_size == 96  # as given
    assert make_config(*TINY).model.ffn_hidden_size == 256
    selective = make_config(*TINY, "--use-recompute", "--recompute-granularity", "selective")
    assert selective.recompute_granularity == "core_attn"
    uniform = make_config(*TINY, "--use-recompute", "--recompute-method", "uniform")
    assert (uniform.recompute_granularity, uniform.recompute_num_layers) == ("full", 1)


# ---------------------------------------------------------------- FLOPs and parameter counts

FLOPS_CASES = {
    "llama": (*LLAMA,),
    "gqa-kv-channels-bias": ("--group-query-attention", "--num-query-groups", "1", "--kv-channels", "8"),
}
# DeepSeek-V3's kind: multi-latent attention (with and without the query's LoRA), a multi-token prediction module
MLA = ("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
       "--multi-latent-attention", "--kv-lora-rank", "12", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
       "--v-head-dim", "6", "--qk-layernorm", "--mtp-num-layers", "1")
MLA_CASES = {"mla-q-lora-mtp-untied": (*MLA, "--q-lora-rank", "20", "--untie-embeddings-and-output-weights"),
             "mla-mtp-tied": MLA}


@pytest.mark.parametrize("case", list(FLOPS_CASES))
def test_flops_formula_matches_flop_counter(case):
    config = make_config(*TINY, *NO_DROPOUT, *FLOPS_CASES[case], positions="none" if "bias" in case else None)
    model = build_model(config)
    tokens = random_tokens(config, batch=3, seed=6)
    # the math backend's bmm's are counted (see tests/unit/test_model.py); grouped keys are expanded there
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens, labels=tokens).sum().backward()
    expected = model_flops_per_token(config) * 3 * config.dataset.max_seq_len
    assert expected == pytest.approx(counter.get_total_flops(), rel=1e-9)


@pytest.mark.parametrize("case", list(MLA_CASES))
def test_flops_formula_matches_flop_counter_with_multi_latent_attention_and_mtp(case):
    from megatron.data.loader import build_batch
    from megatron.model.mtp import MTPInputs

    config = make_config(*TINY, *NO_DROPOUT, *MLA_CASES[case])
    model = build_model(config)
    samples = random_tokens(config, 3, seed=1)[:, :config.dataset.max_seq_len].numpy()
    batch = build_batch([list(row) + [0] for row in samples], eod_id=-1, mtp_depth=1)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
              mtp=MTPInputs.from_batch(batch)).sum().backward()
    expected = model_flops_per_token(config) * 3 * config.dataset.max_seq_len
    assert expected == pytest.approx(counter.get_total_flops(), rel=1e-9)


PARAMETER_CASES = {"gpt2": (), "llama": LLAMA, "tied-pp": ("--swiglu",), "qk-norm": (*LLAMA, "--qk-layernorm"),
                   "gpt2-mtp": ("--mtp-num-layers", "2"), "qkv-bias": (*LLAMA, "--add-qkv-bias"), **MLA_CASES}


@pytest.mark.parametrize("case", list(PARAMETER_CASES))
def test_parameters_per_rank_counts_the_built_stages(case):
    flags = PARAMETER_CASES[case]
    heads = () if "mla" in case else ("--kv-channels", "8")
    config = make_config(*TINY, *flags, "--num-layers", "3", *heads, positions="none" if case == "tied-pp" else None)
    m, vp = config.model, config.padded_vocab_size
    assert parameters_per_rank(config) == num_parameters(GPTModel(m, vp))
    bounds = segment(3, 2, config.distributed.pipeline_partition)
    for stage in range(2):
        chunk = cut_stage(GPTModel(m, vp), stage_layers(bounds, stage), stage == 0, stage == 1)
        assert parameters_per_rank(config, pp=2, pp_rank=stage) == num_parameters(chunk), stage


def test_the_embeddings_take_their_own_init_std_as_megatron_s_flag_gives_it():
    """--embedding-init-method-std (Megatron-LM's): the word and position embeddings drawn N(0, that std) from their
    names' seeds; every other weight as without it; refused unless a positive number."""
    from megatron.model.init import init_value

    plain = dict(build_model(make_config(*TINY)).named_parameters())
    config = make_config(*TINY, "--embedding-init-method-std", "0.5")
    wide = dict(build_model(config).named_parameters())
    for name in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight"):
        want = init_value(name, wide[name].shape, config.seed, config.model)
        assert torch.equal(wide[name], want) and not torch.equal(wide[name], plain[name])
        assert 0.45 < float(wide[name][: config.model.vocab_size].std()) < 0.55
    assert all(torch.equal(wide[n], p) for n, p in plain.items() if "embeddings" not in n)
    for bad, message in (("0", "must be a positive number"), ("-1", "must be a positive number"),
                         ("nan", "must be a finite number"), ("inf", "must be a finite number")):
        with pytest.raises(ConfigError, match=f"embedding_init_method_std.* {message}"):
            make_config(*TINY, "--embedding-init-method-std", bad)


def test_a_bias_on_the_qkv_projection_alone_is_qwen2_s_and_refused_where_it_cannot_go():
    """--add-qkv-bias (Megatron-LM's) with --disable-bias-linear: the fused QKV projection alone has a bias; no
    Hugging Face family here has that attention (Llama's and gpt-oss's bias every projection or none), nor has
    multi-latent attention a QKV projection."""
    from megatron.checkpoint.hf.common import ConversionError
    from megatron.checkpoint.hf.models import converter_for_model

    config = make_config(*TINY, *LLAMA, "--add-qkv-bias")
    assert config.model.disable_bias_linear
    biases = [n for n, _ in build_model(config).named_parameters() if n.endswith(".bias")]
    assert biases == ["layers.0.self_attention.query_key_value.bias", "layers.1.self_attention.query_key_value.bias"]
    with pytest.raises(ConversionError, match="add_qkv_bias .* cannot be exported"):
        converter_for_model(config.model)
    with pytest.raises(ConfigError, match="multi-latent attention does not have"):
        make_config(*TINY, "--multi-latent-attention", "--add-qkv-bias", "--disable-bias-linear")
