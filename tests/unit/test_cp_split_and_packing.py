"""Context parallelism and packed documents in one process: the load-balanced split, Megatron-LM's
packed-document semantics, per-document attention against each document run alone, the settings' checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.attention.plan import plan_blocks
from megatron.config import ConfigError, parse_config, validate
from megatron.context_parallel.attention import AttentionPlan, attend
from megatron.context_parallel.layout import chunk_ids, local_positions, merge_chunks, scatter_chunks, split_batch
from megatron.data.loader import build_batch
from megatron.data.packing import document_ids, reset_positions
from megatron.parallelize_gpt import build_model

EOD = 9


# ---------------------------------------------------------------- the split


def test_each_rank_keeps_chunk_r_and_its_mirror():
    assert [chunk_ids(r, 2) for r in range(2)] == [(0, 3), (1, 2)]
    assert [chunk_ids(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert local_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    every = torch.cat([local_positions(32, r, 4) for r in range(4)])
    assert sorted(every.tolist()) == list(range(32))  # a partition of the sequence


def test_causal_work_is_the_same_on_every_rank():
    """The number of (query, key) pairs under the causal mask is equal across the ranks: the reason for the split."""
    for cp in (2, 4, 8):
        work = {sum(int(p) + 1 for p in local_positions(64, r, cp)) for r in range(cp)}
        assert len(work) == 1, (cp, work)


def test_merge_and_scatter_invert_each_other():
    whole = torch.arange(2 * 24).view(2, 24)
    for cp in (1, 2, 3):
        parts = scatter_chunks(whole, cp, dim=1)
        assert [p.tolist() for p in parts] == [whole[:, local_positions(24, r, cp)].tolist() for r in range(cp)]
        assert torch.equal(merge_chunks(parts, dim=1), whole)


def test_split_batch_cuts_the_per_token_fields_and_keeps_documents_whole():
    samples = [np.arange(17) % 7, (np.arange(17) * 3) % 11]
    batch = build_batch(samples, eod_id=EOD, reset_attention_mask=True)
    mine = split_batch(batch, 1, 2)
    index = local_positions(16, 1, 2)
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(mine[key], batch[key][:, index]), key
    assert torch.equal(mine["document_ids"], batch["document_ids"])
    assert torch.equal(build_batch(samples, EOD, cp_rank=1, cp_size=2, reset_attention_mask=True)["tokens"],
                       mine["tokens"])


# ---------------------------------------------------------------- Megatron-LM's packed-document semantics


def megatron_masks_and_positions(tokens: torch.Tensor, eod: int, reset_positions_: bool, reset_mask: bool,
                                 eod_mask_loss: bool):
    """Megatron-LM's ``_get_ltor_masks_and_position_ids`` written out as its loop (the reference)."""
    b, s = tokens.shape
    mask = torch.tril(torch.ones(b, 1, s, s))
    loss_mask = torch.ones(b, s)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    positions = torch.arange(s).unsqueeze(0).repeat(b, 1)
    for i in range(b):
        eods = (tokens[i] == eod).nonzero().flatten().tolist()
        prev = 0
        for j in eods:
            if reset_mask:
                mask[i, 0, j + 1:, :j + 1] = 0
            if reset_positions_:
                positions[i, j + 1:] -= j + 1 - prev
                prev = j + 1
    return mask < 0.5, loss_mask, positions


def test_packing_follows_megatron_semantics():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 10, (3, 40), generator=g)  # id 9 (EOD) about one in ten, also first and last
    tokens[0, 0], tokens[1, -1] = EOD, EOD
    masked_out, loss_mask, positions = megatron_masks_and_positions(tokens, EOD, True, True, True)
    docs = document_ids(tokens, EOD)
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    allowed = causal & (docs[:, :, None] == docs[:, None, :])
    assert torch.equal(allowed, ~masked_out[:, 0])  # attention never crosses a document boundary, eod in its own
    assert torch.equal(reset_positions(tokens, EOD), positions)
    samples = [np.concatenate([t.numpy(), [1]]) for t in tokens]
    batch = build_batch(samples, EOD, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    assert torch.equal(batch["loss_mask"], loss_mask) and torch.equal(batch["position_ids"], positions)
    assert torch.equal(batch["document_ids"], docs)


def test_planned_blocks_skip_pairs_without_a_shared_document_or_outside_the_window():
    ends = [[2, 4, 8]]  # documents [0, 2), [2, 4), [4, 8) of one sample of 8 tokens
    # cp 2, rank 0 (chunks 0 and 3 of 2 tokens) against rank 1's keys (chunks 1 and 2): chunk 3 sees chunk 2 only
    # (chunk 1 holds document 1, which chunk 3 lacks)
    blocks = plan_blocks(0, 1, 2, 4, None, ends)
    assert [(b.q, b.k, b.offset, b.sample) for b in blocks] == [(slice(2, 4), slice(2, 4), 2, 0)]
    # one process: the lower triangle cut into its documents
    blocks = plan_blocks(0, 0, 1, 8, None, ends)
    assert [(b.q, b.k, b.kind) for b in blocks] == [(slice(0, 2), slice(0, 2), "causal"),
                                                   (slice(2, 4), slice(2, 4), "causal"),
                                                   (slice(4, 8), slice(4, 8), "causal")]
    # a window of 1 key over 8 tokens in tiles of 2 query rows (TILE's minimum is the window + 1): each tile against
    # the keys it can reach, itself and the one key before it (the first tile: itself, the lower triangle)
    from megatron.attention import plan

    rows, plan.TILE["rows"] = plan.TILE["rows"], 2
    try:
        blocks = plan_blocks(0, 0, 1, 8, 1, None)
    finally:
        plan.TILE["rows"] = rows
    assert [(b.q, b.k, b.kind) for b in blocks] == [(slice(0, 2), slice(0, 2), "causal"),
                                                   (slice(2, 4), slice(1, 4), "masked"),
                                                   (slice(4, 6), slice(3, 6), "masked"),
                                                   (slice(6, 8), slice(5, 8), "masked")]
    visible = blocks[1].visible(torch.device("cpu"))  # rows 2, 3 against keys 1, 2, 3: itself and the one before
    assert visible.tolist() == [[True, True, False], [False, True, True]]


# ---------------------------------------------------------------- per-document attention vs each document alone

GPT2 = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "64",
        "--max-seq-len", "48", "--max-position-embeddings", "64", "--hidden-dropout", "0", "--attention-dropout", "0"]
LLAMA = [*GPT2, "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear"]


@pytest.mark.parametrize("shape", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_a_packed_sample_scores_as_its_documents_alone(shape):
    """With the same weights, the packed sample's loss is the token-weighted mean of each of its documents run
    as a sequence of its own (positions from 0, nothing before it): the reference shares no code with the
    document blocks."""
    config = parse_config(["--mock-data", "--device", "cpu", *shape])
    validate(config)
    model = build_model(config).eval()
    eod = config.model.vocab_size - 1
    g = torch.Generator().manual_seed(1)
    sample = torch.randint(0, eod, (49,), generator=g)
    sample[[5, 6, 19, 40]] = eod  # documents of 6, 1, 13, 21 and 8 tokens (the last one cut by the sample)
    batch = build_batch([sample.numpy()], eod, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    with torch.no_grad():
        packed = model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                       document_ids=batch["document_ids"])[0]
        total = count = 0.0
        starts = [0, 6, 7, 20, 41]
        for start, end in zip(starts, [*starts[1:], 48]):
            tokens, labels = batch["tokens"][:, start:end], batch["labels"][:, start:end]
            alone = model(tokens, None, labels=labels)[0]  # default positions 0..len-1, a whole sequence
            assert torch.allclose(packed[start:end], alone, rtol=1e-5, atol=1e-6), (start, end)
            mask = batch["loss_mask"][0, start:end]
            total, count = total + float((alone * mask).sum()), count + float(mask.sum())
        packed_loss = float((packed * batch["loss_mask"][0]).sum() / batch["loss_mask"][0].sum())
        assert packed_loss == pytest.approx(total / count, rel=1e-6)
        crossing = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])[0]
        assert not torch.allclose(crossing[7:], packed[7:], atol=1e-3)  # without the documents, attention crosses


def test_one_process_attention_with_documents_equals_the_masked_one():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 24, 8, generator=g) for _ in range(3))
    docs = document_ids(torch.tensor([[1, 9, 2, 2, 9, 3] * 4, [2] * 23 + [9]]), EOD)
    out = attend(q, k, v, AttentionPlan(document_ids=docs))
    mask = torch.ones(24, 24, dtype=torch.bool).tril() & (docs[:, None, :, None] == docs[:, None, None, :])
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask)
    assert torch.allclose(out, want, atol=1e-6)


# ---------------------------------------------------------------- settings


def _validate(*argv: str, world_size: int = 2) -> None:
    config = parse_config(["--mock-data", "--device", "cpu", "--hidden-size", "64", "--num-attention-heads", "4",
                           "--vocab-size", "64", "--max-seq-len", "32", "--attention-dropout", "0", *argv])
    validate(config, world_size=world_size)


HCP = ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes"]


@pytest.mark.parametrize(("argv", "world", "message"), [
    (["--cp", "2", "--max-seq-len", "30"], 2, "max_seq_len (30) must be divisible by 2 x context_parallel_size = 4"),
    (["--cp", "2", "--tp", "2", "--sequence-parallel", "--max-seq-len", "36"], 4,
     "must be divisible by 2 x context_parallel_size x mp_degree = 8"),
    (["--cp", "2", "--cp-comm-type", "a2a", "--num-attention-heads", "2", "--tp", "2"], 4,
     "the attention heads per tensor-parallel rank (2 / mp_degree 2) must be divisible by --context-parallel-size 2"),
    (["--cp", "2"], 3, "world size 3 is not divisible by mp_degree x pp_degree x sharding_degree x "
                       "context_parallel_size = 2"),
    (["--cp", "0"], 1, "Distributed.context_parallel_size must be at least 1"),
    # hierarchical cp (a2a+p2p): Megatron-LM's checks, and whole heads and query groups on each rank of its a2a
    (["--hierarchical-context-parallel-sizes", "2", "2"], 4,
     "--hierarchical-context-parallel-sizes 2 2 must be positive and multiply to --context-parallel-size 1"),
    (["--cp", "4", "--cp-comm-type", "a2a+p2p"], 4, "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-"
                                                    "sizes INNER OUTER"),
    (["--cp", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "1", "2"], 4,
     "--hierarchical-context-parallel-sizes 2 1 2 gives 3 levels: a2a+p2p has two"),
    (["--cp", "4", *HCP, "4", "1", "--group-query-attention", "--num-query-groups", "2"], 4,
     "the query groups per tensor-parallel rank (2 / mp_degree 1) must be divisible by the inner size 4 of "
     "--hierarchical-context-parallel-sizes"),
    (["--cp", "2", "--tp", "2", *HCP, "2", "1", "--num-attention-heads", "2"], 4,
     "the attention heads per tensor-parallel rank (2 / mp_degree 2) must be divisible by the inner size 2"),
])
def test_bad_settings_are_one_line(argv, world, message):
    with pytest.raises(ConfigError) as err:
        _validate(*argv, world_size=world)
    assert message in str(err.value)


def test_good_settings_give_the_grid():
    config = parse_config(["--mock-data", "--device", "cpu", "--hidden-size", "64", "--num-attention-heads", "4",
                           "--vocab-size", "64", "--max-seq-len", "32", "--attention-dropout", "0",
                           "--context-parallel-size", "2", "--cp-comm-type", "a2a", "--tp", "2",
                           "--sequence-parallel"])
    validate(config, world_size=8)
    assert (config.distributed.dp_degree, config.data_parallel_size) == (2, 2)  # cp ranks share their samples


def test_hierarchical_cp_takes_grouped_queries_its_inner_level_divides():
    """a2a+p2p splits the heads over its inner level only: 2 query groups allow an inner size of 2 at cp 4 (where
    a2a over the four would refuse them); other comm types accept the sizes and build no levels (Megatron-LM's)."""
    gqa = ["--cp", "4", "--group-query-attention", "--num-query-groups", "2"]
    _validate(*gqa, *HCP, "2", "2", world_size=4)
    _validate(*gqa, "--cp-comm-type", "p2p", "--hierarchical-context-parallel-sizes", "2", "2", world_size=4)
    with pytest.raises(ConfigError, match="--cp-comm-type a2a gives each context-parallel rank whole heads"):
        _validate(*gqa, "--cp-comm-type", "a2a", world_size=4)


def test_context_parallel_ranks_draw_different_dropout_masks():
    """Each cp rank holds other tokens (and with a2a other heads): its default and tensor-parallel streams
    differ from every other cp rank's, while tensor-parallel ranks of one cp rank share the default one."""
    from megatron.tensor_parallel import get_rng_tracker, tensor_parallel_seed

    draws = {}
    for cp_rank in (0, 1):
        for tp_rank in (0, 1):
            tensor_parallel_seed(1234, tp_rank, "cpu", cp_rank)
            default = torch.rand(4)
            with get_rng_tracker().fork():
                draws[cp_rank, tp_rank] = (default, torch.rand(4))
    assert torch.equal(draws[0, 0][0], draws[0, 1][0]) and torch.equal(draws[1, 0][0], draws[1, 1][0])
    assert not torch.equal(draws[0, 0][0], draws[1, 0][0])
    tracked = [d[1] for d in draws.values()]
    assert all(not torch.equal(a, b) for i, a in enumerate(tracked) for b in tracked[i + 1:])
    tensor_parallel_seed(1234, 0, "cpu")
