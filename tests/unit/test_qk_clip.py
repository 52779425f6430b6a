"""QK-clip (MuonClip: megatron/attention/max_logits.py, megatron/optimizer/qk_clip.py) against plain references and
Megatron Core's own ``clip_qk``: each head's largest logit equals the maximum of the materialised scaled scores over
the visible pairs (causal, windows, documents; sinks and masked pairs never count; grouped, multi-head and
multi-latent shapes), in one process and split over context-parallel ranks (every communication type); the layers
track it in training only, without changing their output; one optimizer step with QK-clip leaves the weights of
Megatron Core 0.16.1's ``SelfAttention.clip_qk`` / ``MLASelfAttention.clip_qk`` applied to the same step's weights,
bitwise (multi-head, grouped-query, multi-latent with and without the query LoRA), only the heads past the
threshold scaled; sharded masters cut mid-row; bf16 parameters published from the clipped masters; the settings'
checks and Megatron-LM's flags."""

from __future__ import annotations

import functools
import types

import pytest
import torch

from megatron import parallel_state
from megatron.attention import blocks as blocks_module
from megatron.attention.local import AttentionPlan, attend
from megatron.attention.tiling import MATH_TILE_BYTES
from megatron.config import ConfigError, parse_config, validate
from megatron.distributed.parallelize import ShardingPlan, parallelize
from megatron.model.mla import MultiLatentAttention
from megatron.model.transformer import SelfAttention
from megatron.optimizer import build_optimizer
from megatron.optimizer.qk_clip import QKClip, _scale_span, clip_rows, decoder_attention
from megatron.parallelize_gpt import build_model
from tests.unit.megatron_core_reference import CORE_WARNINGS, megatron_core

pytestmark = CORE_WARNINGS
B, S = 2, 24
RTOL, ATOL = 1e-5, 1e-6
TINY = ("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "128",
        "--max-seq-len", "16", "--max-position-embeddings", "16", "--hidden-dropout", "0", "--attention-dropout", "0")
GQA = ("--group-query-attention", "--num-query-groups", "2")
MLA = ("--multi-latent-attention", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
       "--disable-bias-linear", "--kv-lora-rank", "8", "--qk-head-dim", "6", "--qk-pos-emb-head-dim", "4",
       "--v-head-dim", "5", "--qk-layernorm", "--rotary-scaling-factor", "4", "--mscale", "0.9", "--mscale-all-dim",
       "0.7", "--original-max-position-embeddings", "8")
MODELS = {"mha": (), "gqa": GQA, "mla": MLA, "mla-q-lora": (*MLA, "--q-lora-rank", "10")}
GATED = {"gqa-gated": (*GQA, "--attention-output-gate")}  # Megatron Core's clip does not take the gate's rows
# name: (key/value heads, query/key width, value width, softmax scale: None for 1 / sqrt(width))
SHAPES = {"mha": (4, 8, 8, None), "gqa": (2, 8, 8, None), "mla": (4, 12, 6, 0.3)}


def make_config(*argv: str):
    config = parse_config(["--mock-data", "--device", "cpu", *argv])
    validate(config, world_size=1, cuda_available=False)
    return config


def documents(length: int = S) -> torch.Tensor:
    """Sample 0: documents ending at 3, 10 and the end; sample 1: one document."""
    ids = torch.zeros(B, length, dtype=torch.long)
    ids[0, 3:10], ids[0, 10:] = 1, 2
    return ids


def naive_max(q, k, scale=None, window=None, docs=None) -> torch.Tensor:
    """[heads]: the largest of the materialised ``q k^T x scale`` (float64) over the causal pairs within the window
    and the documents."""
    length, heads = q.shape[2], q.shape[1]
    keys = k.repeat_interleave(heads // k.shape[1], dim=1)
    scores = q.double() @ keys.double().transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    distance = torch.arange(length).view(-1, 1) - torch.arange(length)
    mask = ((distance >= 0) & (distance <= (length if window is None else window))).expand(q.shape[0], 1, -1, -1)
    if docs is not None:
        mask = mask & (docs[:, None, :, None] == docs[:, None, None, :])
    return scores.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3)).float()


# ------------------------------------------------------------------------------------------------ the maxima

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("docs, window, sinks", [(False, None, False), (True, None, False), (False, 3, True),
                                                 (True, 5, False)])
@pytest.mark.parametrize("fused", [True, False])
def test_max_logits_equal_the_materialised_scores(shape, docs, window, sinks, fused, monkeypatch):
    """attend(max_logits=) raises each head's running maximum to the naive one; the attention itself is unchanged;
    tiles of a few query rows (offsets inside the blocks) change nothing."""
    groups, dk, dv, scale = SHAPES[shape]
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, n, S, dk, generator=generator) * 2 for n in (4, groups))
    v = torch.randn(B, groups, S, dv, generator=generator)
    plan = AttentionPlan(document_ids=documents() if docs else None)
    head_sinks = torch.randn(4, generator=generator) + 5 if sinks else None  # larger than any logit: not counted
    monkeypatch.setitem(blocks_module.FUSED_ON_CPU, "enabled", fused)
    monkeypatch.setitem(MATH_TILE_BYTES, "limit", B * 4 * S * 4 * 5)
    running = torch.full((4,), float("-inf"))
    out = attend(q, k, v, plan, scale=scale, window=window, sinks=head_sinks, max_logits=running)
    want = naive_max(q, k, scale, window, plan.document_ids)
    torch.testing.assert_close(running, want, rtol=RTOL, atol=ATOL)
    assert torch.equal(out, attend(q, k, v, AttentionPlan(document_ids=plan.document_ids), scale=scale,
                                   window=window, sinks=head_sinks))
    attend(q * 0.5, k, v, plan, scale=scale, window=window, sinks=head_sinks, max_logits=running)  # smaller logits
    torch.testing.assert_close(running, want, rtol=RTOL, atol=ATOL)  # a running maximum: kept


def _attention(name: str):
    config = make_config(*TINY, *{**MODELS, **GATED}[name])
    torch.manual_seed(0)
    module = (MultiLatentAttention if config.model.multi_latent_attention else SelfAttention)(config.model, 0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.5) if p.dim() == 2 else p.fill_(1.0)
    return module


@pytest.mark.parametrize("name", MODELS)
def test_layers_track_their_heads_in_training_only(name):
    """A tracking layer's max_logits is the naive maximum of the queries and keys it attends with (its own softmax
    scale), over two forwards; its output is the untracked layer's, bitwise; evaluation leaves it alone."""
    module = _attention(name)
    x = torch.randn(S, B, 32, generator=torch.Generator().manual_seed(1))
    plain = module(x)
    seen, attend_planned = [], module.planned_attention
    module.planned_attention = lambda q, k, v, plan: seen.append((q, k)) or attend_planned(q, k, v, plan)
    module.tracks_max_logits = True
    assert torch.equal(module(x), plain)
    module(x * 0.5)
    scale = module.scale if isinstance(module, MultiLatentAttention) else module.softmax_scale
    want = torch.maximum(*(naive_max(q.detach(), k.detach(), scale) for q, k in seen))
    torch.testing.assert_close(module.max_logits, want, rtol=RTOL, atol=ATOL)
    module.eval()
    module.max_logits = None
    module(x)
    assert module.max_logits is None


# ------------------------------------------------------------------------------------------------ the clip

def _core_clip(module, maxima: torch.Tensor, threshold: float, alpha: float) -> None:
    """Megatron Core 0.16.1's ``clip_qk`` of the attention class ``module`` stands for, on ``module``'s weights (in
    place), through a stand-in holding what it reads."""
    with megatron_core():
        from megatron.core.transformer.attention import SelfAttention as CoreSelfAttention
        from megatron.core.transformer.multi_latent_attention import MLASelfAttention as CoreMLA

        config = types.SimpleNamespace(qk_clip=True, qk_clip_threshold=threshold, qk_clip_alpha=alpha)
        core = types.SimpleNamespace(config=config, num_attention_heads_per_partition=module.num_heads,
                                     core_attention=types.SimpleNamespace(current_max_attn_logits=maxima.clone()))
        if isinstance(module, MultiLatentAttention):
            config.q_lora_rank = 10 if module.q_lora else None
            config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim = module.dn, module.dr, module.dv
            core.cache_mla_latents = False
            core.linear_q_up_proj = core.linear_q_proj = module.linear_q_up_proj if module.q_lora else \
                module.linear_q_proj
            core.linear_kv_up_proj = module.linear_kv_up_proj
            for method in ("_clip_q_proj_weight", "_clip_kv_proj_weight"):
                setattr(core, method, types.MethodType(getattr(CoreMLA, method), core))
            with torch.no_grad():
                CoreMLA.clip_qk(core)
        else:
            core.num_query_groups_per_partition = module.num_kv_heads
            core.query_projection_size = module.num_heads * module.head_dim
            core.kv_projection_size = module.num_kv_heads * module.head_dim
            core.linear_qkv = module.query_key_value
            core._clip_linear_qkv = types.MethodType(CoreSelfAttention._clip_linear_qkv, core)
            with torch.no_grad():
                CoreSelfAttention.clip_qk(core)
        assert core.core_attention.current_max_attn_logits is None  # it reset them, as ours does


@pytest.mark.parametrize("name", MODELS)
def test_clip_rows_are_megatron_cores_clip(name):
    """Heads 1 and 3 past the threshold (grouped: both groups clip, group 0 through head 1 only); multiplied row by
    row, the weights equal Megatron Core's clip_qk's, bitwise; heads under it keep their rows."""
    ours, theirs = _attention(name), _attention(name)
    maxima, threshold, alpha = torch.tensor([40.0, 130.0, 90.0, 400.0]), 100.0, 0.3
    with torch.no_grad():
        for weight, factor in clip_rows(ours, maxima, threshold, alpha):
            weight.mul_(factor[:, None])
    _core_clip(theirs, maxima, threshold, alpha)
    for (n, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), n
    if name == "mha":  # head 0 and 2 unchanged, 1 and 3 scaled: q by eta^alpha, k by eta^(1 - alpha), v never
        before, after = _attention(name).query_key_value.weight.view(4, 3, 8, -1), ours.query_key_value.weight
        after = after.view(4, 3, 8, -1)
        assert torch.equal(after[[0, 2]], before[[0, 2]]) and torch.equal(after[:, 2], before[:, 2])
        eta = torch.tensor(100.0) / 400.0
        torch.testing.assert_close(after[3, 0], before[3, 0] * eta ** alpha)  # (pow's last bit: see qk_clip.py)
        torch.testing.assert_close(after[3, 1], before[3, 1] * eta ** (1 - alpha))


def _trained(name: str, qk_clip: QKClip, *flags: str):
    """One step of a built two-layer GPT (lr 0.01) on a fixed batch, then ``qk_clip.after_step``: (model, the
    maxima it recorded per layer, the optimizer, the logged value)."""
    config = make_config(*TINY, *MODELS[name], "--qk-clip", *flags)
    torch.manual_seed(0)
    model = build_model(config)
    plan = ShardingPlan()
    buffer = parallelize(model, plan).buffer
    optimizer = build_optimizer(buffer, plan, config)
    tokens = torch.randint(0, 128, (B, 16), generator=torch.Generator().manual_seed(3))
    model.train()
    model(tokens, labels=tokens.roll(-1, 1)).mean().backward()
    assert optimizer.step(0.01, 0.0).applied
    maxima = [a.max_logits.clone() for a in decoder_attention(model)]
    logged = qk_clip.after_step(model, optimizer)
    assert all(a.max_logits is None for a in decoder_attention(model))  # reset for the next step
    return model, maxima, optimizer, logged


@pytest.mark.parametrize("name", MODELS)
def test_a_step_clips_as_megatron_core(name):
    """The step with QK-clip (threshold: the median head's maximum, so that some heads clip and some do not) equals
    the step without it followed by Megatron Core's clip_qk on every layer, bitwise; the logged value is the
    largest maximum."""
    _, maxima, _, logged = _trained(name, QKClip(False, 0.5, 1.0))
    threshold = torch.cat(maxima).median().item()
    assert logged == torch.cat(maxima).max().item()
    clipped, seen, _, _ = _trained(name, QKClip(True, 0.4, threshold))
    reference, _, _, _ = _trained(name, QKClip(False, 0.4, threshold))
    for layer, layer_max in zip(decoder_attention(reference), seen):
        _core_clip(layer, layer_max, threshold, 0.4)
    unclipped = dict(_trained(name, QKClip(False, 0.4, threshold))[0].named_parameters())
    changed = set()
    for (n, a), b in zip(clipped.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), n
        if not torch.equal(a, unclipped[n]):
            changed.add(n.split(".")[-2])
    assert changed and changed <= {"query_key_value", "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj"}


@pytest.mark.parametrize("name", [*MODELS, *GATED])
def test_clipped_heads_peak_at_the_threshold(name):
    """The clip's purpose: on the same input, a clipped head's logits are scaled by eta = threshold / max (the
    queries by eta^alpha, the keys by eta^(1 - alpha); multi-latent attention's rope queries by eta), so every head
    (grouped: the largest head of every group) then peaks at the threshold; the others keep their maxima. With
    Qwen3-Next's output gate the gate rows (between each group's queries and its key) are left alone."""
    module = _attention(name)
    gates_before = module.query_key_value.weight.view(2, 6, 8, -1)[:, 2:4].clone() if name == "gqa-gated" else None
    if not isinstance(module, MultiLatentAttention):
        module.query_key_value.bias = None  # Megatron's clip leaves the bias alone: without one, exactly eta
    x = torch.randn(S, B, 32, generator=torch.Generator().manual_seed(1))
    module.tracks_max_logits = True
    module(x)
    before, module.max_logits = module.max_logits, None
    threshold = before.sort().values[1].item()  # the two smallest heads under it (or at it)
    with torch.no_grad():
        for weight, factor in clip_rows(module, before, threshold, 0.3):
            weight.mul_(factor[:, None])
    module(x)
    after = module.max_logits
    if gates_before is not None:
        assert torch.equal(module.query_key_value.weight.view(2, 6, 8, -1)[:, 2:4], gates_before)
    if name.startswith("gqa"):
        before, after = before.view(2, 2), after.view(2, 2)
        over = before.amax(1) > threshold
        torch.testing.assert_close(after.amax(1)[over], torch.full((int(over.sum()),), threshold), rtol=RTOL,
                                   atol=ATOL)
        assert torch.equal(after[~over], before[~over])
        return
    over = before > threshold
    assert over.sum() == 2
    torch.testing.assert_close(after[over], torch.full((2,), threshold), rtol=RTOL, atol=ATOL)
    assert torch.equal(after[~over], before[~over])


def test_bf16_parameters_are_the_clipped_masters():
    """bf16 training: the clip scales the fp32 masters, and the parameters are their cast (published)."""
    model, _, optimizer, _ = _trained("gqa", QKClip(True, 0.5, 1e-3), "--bf16")
    buffer = optimizer.buffer
    for bucket, lo, hi, master in optimizer.pieces():
        assert torch.equal(buffer.shard_param(bucket, lo, hi), master.detach().to(torch.bfloat16))
    assert decoder_attention(model)[0].query_key_value.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("first, n", [(0, 40), (3, 40), (5, 3), (8, 16), (13, 27), (7, 1)])
def test_sharded_masters_cut_mid_row(first, n):
    """A ZeRO slice of a matrix may begin and end inside rows: each element takes its row's factor."""
    width, rows = 8, 8
    matrix = torch.randn(rows, width)
    factor = torch.rand(rows)
    span = matrix.reshape(-1)[first:first + n].clone()
    _scale_span(span, first, factor, width)
    assert torch.equal(span, (matrix * factor[:, None]).reshape(-1)[first:first + n])


# ------------------------------------------------------------------------------------------------ settings

@pytest.mark.parametrize("flags, message", [
    (("--qk-clip-alpha", "0"), "qk_clip_alpha must be between 0 and 1 (exclusive), got 0.0"),
    (("--qk-clip-alpha", "1"), "qk_clip_alpha must be between 0 and 1 (exclusive), got 1.0"),
    (("--qk-clip-threshold", "0"), "qk_clip_threshold must be a positive number, got 0.0"),
    (("--qk-clip-threshold", "-5"), "qk_clip_threshold must be a positive number, got -5.0"),
])
@pytest.mark.parametrize("on", [("--qk-clip",), ()])
def test_bad_settings_are_refused(flags, message, on):
    """Megatron-LM checks them under --qk-clip only; here always (no numeric key takes a meaningless value)."""
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_config(*TINY, *on, *flags)


def test_megatron_flags():
    config = make_config(*TINY, "--qk-clip", "--qk-clip-alpha", "0.25", "--qk-clip-threshold", "50",
                         "--log-max-attention-logit")
    assert QKClip.of(config) == QKClip(True, 0.25, 50.0)
    assert QKClip.of(make_config(*TINY, "--log-max-attention-logit")) == QKClip(False, 0.5, 100.0)
    assert QKClip.of(make_config(*TINY)) is None
    assert not any(a.tracks_max_logits for a in decoder_attention(build_model(make_config(*TINY))))
    assert all(a.tracks_max_logits for a in decoder_attention(build_model(config)))


# ------------------------------------------------------------------------------------------------ context parallel

def _cp_maxima(rank: int, world: int) -> list[str]:
    """Every rank's maxima over its queries (or, after an all-to-all, its heads), the maximum over the cp ranks:
    the whole sequence's naive maximum, for every communication type (a2a+p2p at cp 4 as 2 x 2)."""
    from megatron.context_parallel.attention import CpLevels, exchange
    from megatron.context_parallel.layout import local_positions

    bad = []
    for cp, comms in ((2, ("p2p", "all_gather", "a2a")), (4, ("a2a+p2p",))):
        parallel_state.destroy()
        ps = parallel_state.initialize(cp=cp, cp_inner=2 if cp == 4 else None)
        for comm in comms:
            for shape, (groups, dk, dv, scale) in SHAPES.items():
                for docs, window in ((None, None), (documents(), None), (None, 5)):
                    generator = torch.Generator().manual_seed(0)
                    q, k = (torch.randn(B, n, S, dk, generator=generator) * 2 for n in (4, groups))
                    v = torch.randn(B, groups, S, dv, generator=generator)
                    meet = functools.partial(exchange, levels=CpLevels.of(ps)) if comm == "a2a+p2p" else exchange
                    plan = AttentionPlan(cp, ps.cp_rank, ps.group("cp"), comm, docs, exchange=meet)
                    mine = local_positions(S, ps.cp_rank, cp)
                    running = torch.full((4,), float("-inf"))
                    attend(q[:, :, mine], k[:, :, mine], v[:, :, mine], plan, scale=scale, window=window,
                           max_logits=running)
                    torch.distributed.all_reduce(running, op=torch.distributed.ReduceOp.MAX, group=ps.group("cp"))
                    want = naive_max(q, k, scale, window, docs)
                    if not torch.allclose(running, want, rtol=RTOL, atol=ATOL):
                        bad.append(f"cp{cp} {comm} {shape} docs={docs is not None} window={window}: "
                                   f"{running.tolist()} != {want.tolist()}")
    return bad


def test_context_parallel_maxima_are_the_whole_sequences():
    from tests.distributed.harness import run_distributed

    assert run_distributed(_cp_maxima, 4) == [[]] * 4
