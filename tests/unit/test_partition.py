"""Pipeline segmentation (FleetX's SegmentLayers) and the interleaved model-chunk assignment."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron.config.layer_split import chunk_layers, segment, stage_layers
from megatron.config.schema import ModelConfig
from megatron.pipeline_parallel.partition import item_descriptions, segmentation_log

# The seed's (FleetX's) log, prefixes "2022-... [pp_layers.py:...:_segment_network] " stripped.
SEED_LINES = [
    "start segment network..",
    "segment result:0, 3, 7",
    "stage=0, global_rank=0 ,layer_number=3",
]
SEED_EMBEDDING = ("EmbeddingPipe(vocab_size=51200, hidden_size=1024, hidden_dropout_prob=0.1, "
                  "max_position_embeddings=1024, type_vocab_size=16, initializer_range=0.02)")


# Which stage holds which of the non-layer items (item 0, L + 1, L + 2 of the flat model).
def has_embedding(boundaries: list[int], stage: int) -> bool:
    return boundaries[stage] == 0


def has_final_norm(boundaries: list[int], num_layers: int, stage: int) -> bool:
    return boundaries[stage] <= num_layers + 1 < boundaries[stage + 1]


def has_head(boundaries: list[int], num_layers: int, stage: int) -> bool:
    return boundaries[stage] <= num_layers + 2 < boundaries[stage + 1]


def _check_invariants(boundaries: list[int], num_layers: int, num_stages: int, uniform: bool = False) -> None:
    assert len(boundaries) == num_stages + 1
    assert boundaries[0] == 0 and boundaries[-1] == num_layers + 3
    assert all(a < b for a, b in zip(boundaries, boundaries[1:])), boundaries  # every stage non-empty
    assert [has_embedding(boundaries, s) for s in range(num_stages)] == [True] + [False] * (num_stages - 1)
    assert [has_head(boundaries, num_layers, s) for s in range(num_stages)] == [False] * (num_stages - 1) + [True]
    layers = [i for s in range(num_stages) for i in stage_layers(boundaries, s)]
    assert layers == list(range(num_layers))  # every layer once, in order
    norm_stages = [s for s in range(num_stages) if has_final_norm(boundaries, num_layers, s)]
    assert len(norm_stages) == 1
    if not uniform:  # norm with the head, and a decoder layer on every stage
        assert norm_stages == [num_stages - 1]
        assert all(len(stage_layers(boundaries, s)) >= 1 for s in range(num_stages))
    else:
        assert norm_stages[0] >= num_stages - 2
        assert len(stage_layers(boundaries, 0)) >= 1  # the first stage never holds the embedding alone


# --- the seed ---------------------------------------------------------------------------------

def test_seed_segmentation_and_log():
    b = segment(4, 2)
    assert b == [0, 3, 7]
    cfg = ModelConfig(hidden_size=1024, num_layers=4, num_attention_heads=2, ffn_hidden_size=4096)
    desc = item_descriptions(cfg, 51200)
    lines = segmentation_log(b, desc, [0, 0])
    assert lines[:3] == SEED_LINES
    assert lines[3] == f"0: {SEED_EMBEDDING}"
    assert lines[4].startswith("1: TransformerDecoderLayer(d_model=1024, nhead=2, dim_feedforward=4096, "
                               "dropout=0.1, activation=gelu, attn_dropout=0.1, act_dropout=")
    assert lines[6] == "stage=1, global_rank=0 ,layer_number=4"
    assert [ln.split(":")[0] for ln in lines[7:11]] == ["3", "4", "5", "6"]
    assert lines[9] == "5: LayerNorm(normalized_shape=[1024], epsilon=1e-05)"
    assert lines[10] == "6: LMHeadPipe(tied to EmbeddingPipe.word_embeddings)"
    assert lines[-1] == "loss: GPTPretrainingCriterionPipe"
    assert len(lines) == 2 + 2 + 7 + 1


def test_log_uses_owner_ranks_and_checks_lengths():
    b = segment(4, 2)
    desc = [f"item{i}" for i in range(7)]
    lines = segmentation_log(b, desc, [0, 4])
    assert "stage=1, global_rank=4 ,layer_number=4" in lines
    with pytest.raises(ValueError, match="one description per item"):
        segmentation_log(b, desc[:-1], [0, 4])
    with pytest.raises(ValueError, match="one rank per stage"):
        segmentation_log(b, desc, [0])


def test_item_descriptions_default_ffn():
    desc = item_descriptions(ModelConfig(hidden_size=64, num_layers=3, num_attention_heads=4), 128)
    assert len(desc) == 6
    assert "dim_feedforward=256" in desc[1] and desc[1] == desc[3]
    assert desc[0].startswith("EmbeddingPipe(vocab_size=128, hidden_size=64,")


# --- methods ----------------------------------------------------------------------------------

def test_uneven_layer_counts_earlier_stages_get_more():
    assert segment(5, 2) == [0, 4, 8]  # 3 + 2 layers
    assert segment(5, 3) == [0, 3, 5, 8]  # 2 + 2 + 1 layers
    assert [len(stage_layers(segment(5, 3), s)) for s in range(3)] == [2, 2, 1]
    assert [list(stage_layers(segment(5, 2), s)) for s in range(2)] == [[0, 1, 2], [3, 4]]


def test_single_stage_holds_everything():
    b = segment(3, 1)
    assert b == [0, 6]
    assert has_embedding(b, 0) and has_head(b, 3, 0) and stage_layers(b, 0) == range(3)


def test_uniform():
    assert segment(4, 2, "uniform") == [0, 4, 7]  # 7 items: 4 + 3
    assert segment(5, 4, "uniform") == [0, 2, 4, 6, 8]
    b = segment(6, 3, "uniform")  # 9 items: 3 + 3 + 3
    assert b == [0, 3, 6, 9]
    assert [list(stage_layers(b, s)) for s in range(3)] == [[0, 1], [2, 3, 4], [5]]
    b = segment(5, 5, "uniform")  # 8 items: 2 + 2 + 2 + 1 + 1: the norm and the head on stages of their own
    assert b == [0, 2, 4, 6, 7, 8]
    assert has_final_norm(b, 5, 3) and not has_head(b, 5, 3) and has_head(b, 5, 4) and not has_final_norm(b, 5, 4)
    assert len(stage_layers(b, 3)) == 0 and len(stage_layers(b, 4)) == 0
    _check_invariants(b, 5, 5, uniform=True)


def test_explicit_counts():
    assert segment(4, 2, "1,3") == [0, 2, 7]
    assert segment(4, 2, [1, 3]) == [0, 2, 7]
    assert segment(8, 3, " 2, 3,3 ") == [0, 3, 6, 11]
    b = segment(4, 2, "1,3")
    assert stage_layers(b, 0) == range(0, 1) and stage_layers(b, 1) == range(1, 4)


@given(num_layers=st.integers(1, 64), data=st.data())
def test_invariants_default_and_uniform(num_layers, data):
    num_stages = data.draw(st.integers(1, num_layers))
    for method in ("layer:TransformerDecoderLayer", "uniform"):
        b = segment(num_layers, num_stages, method)
        _check_invariants(b, num_layers, num_stages, uniform=method == "uniform")
        sizes = [b[i + 1] - b[i] for i in range(num_stages)]
        if method == "uniform":
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    counts = [len(stage_layers(segment(num_layers, num_stages), s)) for s in range(num_stages)]
    assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)


@given(st.lists(st.integers(1, 6), min_size=1, max_size=8))
def test_invariants_explicit(counts):
    b = segment(sum(counts), len(counts), ",".join(map(str, counts)))
    _check_invariants(b, sum(counts), len(counts))
    assert [len(stage_layers(b, s)) for s in range(len(counts))] == counts


# --- interleaved model chunks -----------------------------------------------------------------

def test_chunk_layers_megatron_assignment():
    assert chunk_layers(8, 2, 2, 0, 0) == range(0, 2)
    assert chunk_layers(8, 2, 2, 1, 0) == range(2, 4)
    assert chunk_layers(8, 2, 2, 0, 1) == range(4, 6)
    assert chunk_layers(8, 2, 2, 1, 1) == range(6, 8)
    assert chunk_layers(6, 3, 1, 2, 0) == range(4, 6)  # vpp 1: plain contiguous stages


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
@pytest.mark.parametrize("vpp", [1, 2, 3])
@pytest.mark.parametrize("per_chunk", [1, 2])
def test_chunk_layers_cover_every_layer_once(pp, vpp, per_chunk):
    num_layers = pp * vpp * per_chunk
    seen = [i for r in range(pp) for c in range(vpp) for i in chunk_layers(num_layers, pp, vpp, r, c)]
    assert sorted(seen) == list(range(num_layers))
    # in execution order (chunk-major, then stage) the layers are consecutive
    order = [i for c in range(vpp) for r in range(pp) for i in chunk_layers(num_layers, pp, vpp, r, c)]
    assert order == list(range(num_layers))


# --- refusals ---------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["layer:TransformerDecoderLayer", "uniform", "1,1,1,1"])
def test_more_stages_than_layers(method):
    with pytest.raises(ValueError, match="at least one layer; lower pp_degree to at most 3"):
        segment(3, 4, method)


@pytest.mark.parametrize("counts, match", [
    ("2,3", "sum to 5, not to num_layers \\(4\\)"),
    ([1, 1], "sum to 2"),
    ("0,4", "below 1"),
    ("-1,5", "below 1"),
    ("4", "exactly one count per stage"),
    ("1,1,2", "exactly one count per stage"),
])
def test_bad_counts(counts, match):
    with pytest.raises(ValueError, match=match):
        segment(4, 2, counts)


@pytest.mark.parametrize("method", ["layer:LayerNorm", "parameters", "", "1;3"])
def test_unknown_method(method):
    with pytest.raises(ValueError, match="Unknown pipeline segmentation method.*'uniform'"):
        segment(4, 2, method)


def test_bad_sizes_and_stages():
    with pytest.raises(ValueError, match=">= 1"):
        segment(0, 1)
    with pytest.raises(ValueError, match=">= 1"):
        segment(4, 0)
    with pytest.raises(ValueError, match="out of range"):
        stage_layers([0, 3, 7], 2)
    with pytest.raises(ValueError, match="out of range"):
        stage_layers([0, 3, 7], -1)


@pytest.mark.parametrize("num_layers, pp, vpp", [(6, 2, 2), (8, 3, 1), (4, 2, 3)])
def test_chunk_layers_not_divisible(num_layers, pp, vpp):
    with pytest.raises(ValueError, match=f"divisible by pp x vpp \\({pp} x {vpp} = {pp * vpp}\\)"):
        chunk_layers(num_layers, pp, vpp, 0, 0)


def test_chunk_layers_out_of_range():
    with pytest.raises(ValueError, match="out of range"):
        chunk_layers(8, 2, 2, 2, 0)
    with pytest.raises(ValueError, match="out of range"):
        chunk_layers(8, 2, 2, 0, 2)
    with pytest.raises(ValueError, match=">= 1"):
        chunk_layers(8, 0, 2, 0, 0)
