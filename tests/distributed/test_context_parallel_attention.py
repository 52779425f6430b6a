"""Context-parallel attention over gloo against one process's attention with an explicit mask, and the
multi-latent attention layer under context parallelism against the same layer in one process.

Every rank builds the same full queries, keys and values (same seed) and documents whose boundaries fall
inside chunks, on chunk edges and across several chunks; the reference is ``F.scaled_dot_product_attention``
over the whole sequence with a materialised causal-and-same-document mask. Each rank attends with its two
chunks (``split``) and its output and the gradients of its queries, keys and values must equal the matching
rows of the reference's. One spawn of 4 ranks checks cp 2 (two rings side by side) and cp 4, every
communication type (a2a+p2p at cp 4: 2 x 2, and its size-1 levels 1 x 4 and 4 x 1), with and without documents,
both block kernels (the plain one, which GPUs run, in tiles of a few query rows), and two shapes of heads
(``SHAPES``): grouped queries of one width, and multi-latent attention's (a key per head, values narrower than the
queries and keys, its own softmax scale).

The layer (``MultiLatentAttention`` with the query LoRA, the latent norms and YaRN) is checked at cp 2 with
p2p, all_gather and a2a, with and without packed documents (positions restarting per document, as
``--reset-position-ids`` gives them), and at cp 2 x tp 2 with sequence parallelism: its output and input
gradient on this rank's tokens, and every weight's gradient summed over the cp ranks (as the data-parallel
reduction over dp x cp sums them), equal the one-process layer's on the whole sequence.
"""

from __future__ import annotations

import functools

import pytest
import torch

from megatron import parallel_state
from megatron.attention import blocks as blocks_module
from megatron.attention.tiling import MATH_TILE_BYTES
from megatron.context_parallel.attention import AttentionPlan, CpLevels, attend, exchange
from megatron.context_parallel.layout import local_positions
from tests.distributed.harness import run_distributed

B, NQ, NG, S, HD = 2, 4, 2, 48, 8
RTOL, ATOL = 1e-5, 1e-5
MAX_DIFF: dict[str, float] = {}  # the largest difference seen, without and with dropout (the report prints it)
# name: (key/value heads, query/key width, value width, softmax scale: None for 1 / sqrt(width))
SHAPES = {"gqa": (NG, HD, HD, None), "mla": (NQ, 12, 6, 0.3)}


def documents() -> torch.Tensor:
    """Sample 0: short documents, edges inside and on chunk boundaries; sample 1: one long document then
    two short ones."""
    ends = [[3, 6, 7, 12, 20, 33, 48], [40, 41, 48]]
    ids = torch.zeros(B, S, dtype=torch.long)
    for i, row in enumerate(ends):
        start = 0
        for d, end in enumerate(row):
            ids[i, start:end] = d
            start = end
    return ids


def reference(q, k, v, docs, weight, scale=None, window=None, sinks=None, dropout=None):
    """The materialised softmax: causal, within ``window`` keys before each query, within each document, with each
    head's sink logit as one more column (dropped after the softmax); ``dropout`` (``BlockDropout``): its mask of
    the whole sequence [B, heads, S, S] applied to the normalised probabilities."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    distance = torch.arange(S).view(-1, 1) - torch.arange(S)
    mask = ((distance >= 0) & (distance <= (S if window is None else window))).expand(B, 1, S, S)
    if docs is not None:
        mask = mask & (docs[:, None, :, None] == docs[:, None, None, :])
    heads = q.shape[1]
    keys, values = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    scores = (q @ keys.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)).masked_fill(
        ~mask, float("-inf"))
    if sinks is not None:
        sinks = sinks.detach().clone().requires_grad_()
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(B, heads, S, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :S]
    if dropout is not None:
        probs = probs * dropout.scaled(range(B), heads, torch.arange(S), torch.arange(S))
    out = probs @ values
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad, None if sinks is None else sinks.grad


def _check(rank, cp, comm, docs, fused, shape, window=None, with_sinks=False, dropout=0.0) -> list[str]:
    ps = parallel_state.get()
    groups, dk, dv, scale = SHAPES[shape]
    torch.manual_seed(0)
    q, k, v = torch.randn(B, NQ, S, dk), torch.randn(B, groups, S, dk), torch.randn(B, groups, S, dv)
    weight = torch.randn(B, NQ, S, dv)
    sinks = torch.randn(NQ) if with_sinks else None
    meet = functools.partial(exchange, levels=CpLevels.of(ps)) if comm == "a2a+p2p" else exchange
    plan = AttentionPlan(cp, ps.cp_rank, ps.group("cp"), comm, docs, positional_dropout=True, seed=2024,
                         exchange=meet)
    drop = plan.dropout(dropout, 7, NQ, 0) if dropout else None
    want = reference(q, k, v, docs, weight, scale, window, sinks, drop)
    mine = local_positions(S, ps.cp_rank, cp)
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    local_sinks = None if sinks is None else sinks.clone().requires_grad_()
    blocks_module.FUSED_ON_CPU["enabled"] = fused
    limit = MATH_TILE_BYTES["limit"]
    MATH_TILE_BYTES["limit"] = B * NQ * S * 4 * 5  # tiles of a few query rows, offsets inside blocks
    try:
        out = attend(*local, plan, dropout, scale=scale, window=window, sinks=local_sinks, layer=7)
        (out * weight[:, :, mine]).sum().backward()
    finally:
        blocks_module.FUSED_ON_CPU["enabled"] = True
        MATH_TILE_BYTES["limit"] = limit
    got = [out.detach(), *(t.grad for t in local)]
    wanted = [w[:, :, mine] for w in want[:4]]
    if sinks is not None:  # each rank's sinks' gradient is its tokens' share: summed over cp, the whole gradient
        torch.distributed.all_reduce(local_sinks.grad, group=ps.group("cp"))
        got.append(local_sinks.grad)
        wanted.append(want[4])
    bad = []
    levels = f" {ps.cp_inner_size} x {cp // ps.cp_inner_size}" if comm == "a2a+p2p" else ""
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, wanted):
        if not torch.allclose(g, w, rtol=RTOL, atol=ATOL):
            bad.append(f"cp{cp} {comm}{levels} {shape} docs={docs is not None} fused={fused} window={window} "
                       f"sinks={with_sinks} dropout={dropout} {name}: max diff {(g - w).abs().max().item():.2e}")
    MAX_DIFF[f"dropout={dropout > 0}"] = max(MAX_DIFF.get(f"dropout={dropout > 0}", 0.0),
                                            *((g - w).abs().max().item() for g, w in zip(got, wanted)))
    return bad


def _ring_without_overlap(rank, cp, docs) -> list[str]:
    """The ring with its overlap off (each transfer waited for before the block: the benchmark's switch) ends
    and gives bitwise the overlapped ring's output and gradients, with attention dropout too (its masks depend on
    positions, not on when a block runs)."""
    from megatron.context_parallel.attention import RING_OVERLAP

    ps = parallel_state.get()
    torch.manual_seed(1)
    mine = local_positions(S, ps.cp_rank, cp)
    q, k, v = (torch.randn(B, n, S, HD)[:, :, mine] for n in (NQ, NG, NG))
    plan = AttentionPlan(cp, ps.cp_rank, ps.group("cp"), "p2p", docs, seed=99, exchange=exchange)
    runs = []
    for overlap in (True, False):
        RING_OVERLAP["enabled"] = overlap
        try:
            local = [t.clone().requires_grad_() for t in (q, k, v)]
            out = attend(*local, plan, 0.2)
            out.square().sum().backward()
        finally:
            RING_OVERLAP["enabled"] = True
        runs.append([out.detach(), *(t.grad for t in local)])
    same = all(torch.equal(a, b) for a, b in zip(*runs))
    return [] if same else [f"cp{cp} docs={docs is not None}: the ring without overlap differs"]


def _all_cases(rank: int, world: int) -> list[str]:
    bad = []
    for cp in (2, 4):
        parallel_state.destroy()
        parallel_state.initialize(cp=cp, cp_inner=2 if cp == 4 else None)
        for comm in ("p2p", "all_gather", "a2a") + (("a2a+p2p",) if cp == 4 else ()):
            for shape, (groups, *_) in SHAPES.items():
                if groups % (2 if comm == "a2a+p2p" else cp if comm == "a2a" else 1):
                    continue  # a2a gives each rank whole query groups (validation refuses it)
                for docs in (None, documents()):
                    for fused in (True, False):
                        bad += _check(rank, cp, comm, docs, fused, shape)
                    # attention dropout 0.3 by position (a2a: as --attention-dropout-masks positional draws it)
                    bad += _check(rank, cp, comm, docs, True, shape, dropout=0.3)
                    if shape == "gqa":
                        bad += _check(rank, cp, comm, docs, True, shape, window=3, with_sinks=True, dropout=0.3)
                        if shape == "gqa":  # gpt-oss's attention: windows shorter and longer than a chunk, sinks
                            bad += _check(rank, cp, comm, docs, fused, shape, window=3, with_sinks=True)
                            bad += _check(rank, cp, comm, docs, fused, shape, window=17)
            if comm == "p2p":
                for docs in (None, documents()):
                    bad += _ring_without_overlap(rank, cp, docs)
    for inner in (1, 4):  # a2a+p2p's levels of size 1: the plain ring (1 x 4), Ulysses over the four (4 x 1)
        parallel_state.initialize(cp=4, cp_inner=inner)
        bad += _check(rank, 4, "a2a+p2p", documents(), True, "mla", window=3, with_sinks=True, dropout=0.3)
    references = {name: _mla_reference(docs) for name, docs in (("plain", None), ("documents", documents()))}
    parallel_state.initialize(cp=2)
    for comm in ("p2p", "all_gather", "a2a"):
        for docs in references.values():
            bad += _mla_layer(1, 2, comm, *docs)
    parallel_state.initialize(tp=2, cp=2)  # sequence parallelism: the chunks split over tp again
    bad += _mla_layer(2, 2, "p2p", *references["documents"])
    bad += _mla_layer(2, 2, "a2a", *references["plain"])
    if rank == 0:
        print(f"largest difference from the reference: {MAX_DIFF}")
    return bad


# ------------------------------------------------------------------------------------------------ the MLA layer

MLA = ["--multi-latent-attention", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
       "--disable-bias-linear", "--hidden-size", "16", "--num-attention-heads", "4", "--q-lora-rank", "10",
       "--kv-lora-rank", "8", "--qk-head-dim", "6", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "5",
       "--qk-layernorm", "--rope-type", "yarn", "--rotary-scaling-factor", "4", "--mscale", "0.9",
       "--mscale-all-dim", "0.7", "--original-max-position-embeddings", "8", "--max-position-embeddings", "64",
       "--attention-dropout", "0"]


def _positions(docs: torch.Tensor | None) -> torch.Tensor:
    """[B, S]: 0..S-1, or restarting at every document (``--reset-position-ids``)."""
    if docs is None:
        return torch.arange(S).expand(B, S)
    starts = torch.cat([torch.ones(B, 1, dtype=torch.bool), docs[:, 1:] != docs[:, :-1]], 1)
    index = torch.arange(S).expand(B, S)
    return index - torch.cummax(torch.where(starts, index, 0), 1).values


def _mla_config():
    from megatron.config import parse_config

    return parse_config(MLA).model


def _mla_reference(docs: torch.Tensor | None):
    """(documents, the one-process layer after a backward on the whole sequence, its input, output, the output's
    weight, rotary embedding, positions), built on a rank whose grid has tp 1."""
    from megatron.model.mla import MultiLatentAttention, yarn_settings
    from megatron.model.rotary import RotaryEmbedding

    cfg = _mla_config()
    rope = RotaryEmbedding(cfg.qk_pos_emb_head_dim, 1.0, cfg.rotary_base, 64, interleaved=True,
                           yarn=yarn_settings(cfg))
    positions = _positions(docs)
    generator = torch.Generator().manual_seed(3)
    x, weight = torch.randn(S, B, 16, generator=generator), torch.randn(S, B, 16, generator=generator)
    full = MultiLatentAttention(cfg).train()
    with torch.no_grad():
        for name, p in full.named_parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.4 + (1.0 if "layernorm" in name else 0.0))
    x = x.requires_grad_()
    out = full(x, None, rope(positions, x.dtype), None if docs is None else AttentionPlan(document_ids=docs))
    (out * weight).sum().backward()
    return docs, full, x, out.detach(), weight, rope, positions


def _mla_layer(tp, cp, comm, docs, full, x, out_full, weight, rope, positions) -> list[str]:
    """The layer on this rank's grid (tp, cp; sequence parallel with tp 2) against the one-process layer: the
    output and input gradient of this rank's tokens, every weight's gradient (summed over cp) within 1e-5 of the
    tensor's largest magnitude (fp32 sums in another order: the weights' gradients reach ~40)."""
    from megatron.model.mla import MultiLatentAttention
    from megatron.tensor_parallel import shard_full_tensor
    from megatron.tensor_parallel.parallelize import apply_tensor_parallel

    ps = parallel_state.get()
    layer = MultiLatentAttention(_mla_config()).train()
    # split over the tp ranks as in the model (PLAN's names are the decoder layer's: self_attention.*)
    apply_tensor_parallel(torch.nn.ModuleDict({"self_attention": layer}), ps.group("tp") if tp > 1 else None, tp > 1)
    reference = dict(full.named_parameters())
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(shard_full_tensor(reference[name].detach(), p))
    mine = local_positions(S, ps.cp_rank, cp)
    rows = mine.chunk(tp)[ps.tp_rank] if tp > 1 else mine  # sequence parallel: this tp rank's share of the chunks
    x_local = x.detach()[rows].clone().requires_grad_()
    plan = AttentionPlan(cp, ps.cp_rank, ps.group("cp"), comm, docs, exchange=exchange)
    out = layer(x_local, None, rope(positions[:, mine], x.dtype), plan)
    (out * weight[rows]).sum().backward()
    got, want = {"out": out.detach(), "dx": x_local.grad}, {"out": out_full[rows], "dx": x.grad[rows]}
    for name, p in layer.named_parameters():
        torch.distributed.all_reduce(p.grad, group=ps.group("cp"))
        got[name], want[name] = p.grad, shard_full_tensor(reference[name].grad, p)
    return [f"MLA layer tp{tp} cp{cp} {comm} docs={docs is not None} {name}: max diff "
            f"{(got[name] - want[name]).abs().max().item():.2e} (largest {want[name].abs().max().item():.2e})"
            for name in got if (got[name] - want[name]).abs().max() > RTOL * want[name].abs().max() + ATOL]


def test_positional_masks_keep_one_minus_p_and_differ_by_every_field():
    """The hash's masks (no launch): the kept fraction is 1 - p within a few standard deviations over 2^22 entries,
    a block's mask is the matching part of the whole sequence's, and another seed, layer, head or sample draws
    another mask (about p (1 - p) x 2 of the entries differ)."""
    from megatron.attention.dropout import BlockDropout

    drop, positions = BlockDropout(0.1, 1234, 3), torch.arange(1024)
    whole = drop.keep(range(4), 1, positions, positions)  # [4, 1, 1024, 1024]
    assert abs(whole.float().mean().item() - 0.9) < 5 * (0.09 / whole.numel()) ** 0.5
    part = drop.keep(range(1, 3), 1, positions[100:164], positions[500:532])
    assert torch.equal(part, whole[1:3, :, 100:164, 500:532])
    for other in (BlockDropout(0.1, 1235, 3).keep(range(4), 1, positions, positions),
                  BlockDropout(0.1, 1234, 4).keep(range(4), 1, positions, positions),
                  BlockDropout(0.1, 1234, 3, first_head=1).keep(range(4), 1, positions, positions),
                  whole.roll(1, 0)):
        assert abs((other != whole).float().mean().item() - 0.18) < 0.005


@pytest.fixture(scope="module")
def failures():
    return run_distributed(_all_cases, 4, timeout=120)


def test_every_rank_matches_the_masked_reference(failures):
    assert failures == [[], [], [], []]
