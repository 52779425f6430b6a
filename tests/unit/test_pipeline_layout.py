"""Megatron-LM's pipeline layout strings (``--pipeline-model-parallel-layout``): our parser against Megatron Core
0.16.1's ``PipelineParallelLayerLayout`` on many strings, errors included; the layout through the command line,
validation and every reader of the layer cut (the model builder, the memory estimate, the planner)."""

from __future__ import annotations

import pytest

from megatron.config import ConfigError, parse_config, validate
from megatron.config import pipeline_layout as pl
from megatron.config.layer_split import rank_chunks, segment, stage_layers
from megatron.memory.activations import chunk_specs
from megatron.memory.model_states import parameter_split
from megatron.model.gpt import GPTModel
from megatron.parallelize_gpt import stage_chunks
from megatron.pipeline_parallel.partition import cut_stage
from megatron.planner.stages import stage_chunks as planner_chunks
from tests.unit.megatron_core_reference import CORE_WARNINGS, megatron_core

pytestmark = CORE_WARNINGS
SMALL = ["--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "128", "--max-seq-len", "16",
         "--max-position-embeddings", "16"]

# (layout, pp, num_layers, mtp_num_layers): Megatron builds them, and so do we
VALID = [
    ("EttttL", 1, 4, None),
    ("Et|tttL", 2, 4, None),
    ("E|ttttL", 2, 4, None),  # the embedding alone on the first stage
    ("Etttt|L", 2, 4, None),  # the norm and head alone on the last
    ("E|tttt|L", 3, 4, None),
    ("Et|t|t|tL", 2, 4, None),  # pp 2 x vpp 2, even
    ("Et|t|tt|L", 2, 4, None),  # pp 2 x vpp 2, uneven, the head alone
    ("E|tt|t|tL", 2, 4, None),
    ("Et*2|t*2L", 2, 4, None),
    ("Et,t|t,t,L", 2, 4, None),
    ("(Et|)*1,tttL", 2, 4, None),
    ("E(t|)*3,tL", 2, 4, None),
    ("E(t|)*3,tL", 4, 4, None),
    ("Ett|(t|)*2,L", 2, 4, None),
    ("Et*3|(tt|)*30,L", 16, 63, None),  # Megatron's help's shape: pp 16 x vpp 2
    ("Et*3|(tt|)*30,tmL", 16, 64, 1),
    ("Ett|ttmL", 2, 4, 1),
    ("Etttt|mL", 2, 4, 1),  # multi-token prediction with the head, no decoder layer there
    ("Ett|t|t|mmL", 2, 4, 2),
    ("Et*12|t*12mL", 2, 24, 1),
    ("Et*4|t*0L", 2, 4, None),  # t*0: no decoder layer on the last stage
    # the layouts of Megatron-LM's own functional-test configurations (tests/functional_tests/test_cases/)
    ("Et*3|(tt|)*6mL", 2, 15, 1),
    ("Et*3|(tt|)*6L", 2, 15, None),
    ("Et|(tt|)*6mL", 2, 13, 1),
    ("Et*3|(tt|)*6tmL", 2, 16, 1),
    ("Et*2|(tt|)*5t|tmL", 4, 14, 1),
    # empty stages: a chunk without any layer passes its input on
    ("Et||ttL", 3, 3, None),
    ("Et*10|t*0|t*2|L", 2, 12, None),  # t*0 alone
    ("Et|t||tL", 2, 3, None),
    ("Et||ttt|L", 2, 4, None),
]
# refused by both (Megatron asserts, raises)
REFUSED = [
    ("Etx|tL", 2, 2, None),  # not a layer letter
    ("E t|tL", 2, 2, None),
    ("(Et|tL", 2, 2, None),  # an unmatched parenthesis stays
    ("Et|tL)", 2, 2, None),
    ("((t)*2)*2", 1, 4, None),  # no nesting
    ("Et*2*3|tL", 2, 7, None),  # a repetition left over
    ("Et|t|tL", 2, 3, None),  # 3 stages over pp 2
    ("Et|tL", 4, 2, None),
    ("tE|ttL", 2, 3, None),  # the embedding first
    ("Et|tLt", 2, 3, None),  # the loss last
    ("EEt|tL", 2, 2, None),
    ("Et|LtL", 2, 2, None),
    ("Et|tL", 2, 3, None),  # the decoder layers counted
    ("Et|tmL", 2, 2, None),  # 'm' without multi-token prediction
    ("Et|tL", 2, 2, 1),  # multi-token prediction without 'm'
    ("Et|tmmL", 2, 2, 1),
    ("Etm|tL", 2, 2, 1),  # a decoder layer after an 'm'
    ("Ett|m|t|L", 2, 3, 1),
    ("Ett|tm|m|L", 2, 3, 2),  # 'm' in a chunk that is not its rank's last
    ("Ett|t|m|mL", 4, 3, 2),  # the 'm' spread over stages
    ("", 1, 1, None),
    ("|", 1, 1, None),
]
# Megatron builds them; this project refuses them (what it cannot place)
OURS_REFUSED = [
    ("Etttt|m|L", 3, 4, 1),  # Megatron's standalone multi-token prediction, on rank 1 of 3
    ("Ett|tt|m|L", 2, 4, 1),  # ... on rank 0's last chunk
    ("Et*3|(tt|)*29,m|L", 16, 61, 1),  # Megatron's help's example
    ("|EttttL", 2, 4, None),  # an empty first stage (Megatron builds the embedding there)
    ("EttttL|", 2, 4, None),  # an empty last stage (Megatron builds the head there)
]


def _ours(text: str, pp: int, num_layers: int, mtp: int | None) -> pl.PipelineLayout:
    layout = pl.parse(text, pp)
    pl.check(layout, num_layers, mtp)
    return layout


def _megatron(core, text: str, pp: int, num_layers: int, mtp: int | None, patches) -> tuple[object, bool]:
    """Megatron's layout of ``text`` and whether it is "standalone MTP"; its exception as it raises it."""
    layout = core.PipelineParallelLayerLayout(text, pp)
    patches.setattr(core.parallel_state, "get_virtual_pipeline_model_parallel_world_size",
                    lambda: layout.virtual_pipeline_model_parallel_size)
    return layout, layout.validate_layer_layout(num_layers, mtp)


@pytest.fixture(scope="module")
def core():
    """Megatron Core's layout class and parallel state (the process group its context sets up is unused)."""
    with megatron_core():
        from megatron.core import parallel_state
        from megatron.core.transformer import pipeline_parallel_layer_layout as layout_module
        from megatron.core.transformer.enums import LayerType

        yield type("Core", (), {"PipelineParallelLayerLayout": layout_module.PipelineParallelLayerLayout,
                                "LayerType": LayerType, "parallel_state": parallel_state})


@pytest.mark.parametrize("text,pp,num_layers,mtp", VALID)
def test_layouts_equal_megatron_cores(core, monkeypatch, text, pp, num_layers, mtp):
    ours = _ours(text, pp, num_layers, mtp)
    theirs, standalone = _megatron(core, text, pp, num_layers, mtp, monkeypatch)
    assert not standalone
    assert ours.vpp == theirs.virtual_pipeline_model_parallel_size
    expanded = core.PipelineParallelLayerLayout.parse_str_to_list(text)
    assert [len(stage) for stage in expanded] == [len(stage) for stage in ours.stages]
    for rank in range(pp):
        for chunk in range(ours.vpp):
            kinds = [t.name for t in theirs.layout[rank][chunk]]
            assert kinds == [{"E": "embedding", "t": "decoder", "m": "mtp", "L": "loss"}[c]
                             for c in ours.stage(rank, chunk)]
            decoder = theirs.get_layer_id_list(core.LayerType.decoder, vp_stage=chunk, pp_rank=rank)
            assert list(ours.decoder_layers(rank, chunk)) == decoder
            assert ours.stage(rank, chunk).count("m") == theirs.get_num_layers_to_build(
                core.LayerType.mtp, vp_stage=chunk, pp_rank=rank)


@pytest.mark.parametrize("text,pp,num_layers,mtp", REFUSED)
def test_refused_as_megatron_core_refuses(core, monkeypatch, text, pp, num_layers, mtp):
    with pytest.raises((AssertionError, IndexError, ValueError, KeyError)):
        _megatron(core, text, pp, num_layers, mtp, monkeypatch)
    with pytest.raises(ValueError) as err:
        _ours(text, pp, num_layers, mtp)
    message = str(err.value)
    assert message.endswith(".") and message.count(": ") <= 3 and "\n" not in message


@pytest.mark.parametrize("text,pp,num_layers,mtp", OURS_REFUSED)
def test_what_this_project_cannot_place_is_refused(core, monkeypatch, text, pp, num_layers, mtp):
    _megatron(core, text, pp, num_layers, mtp, monkeypatch)  # Megatron builds it
    with pytest.raises(ValueError, match="standalone MTP|the first stage without|the last stage without"):
        _ours(text, pp, num_layers, mtp)


def test_unrolling_follows_megatrons_two_passes():
    assert pl.expand("(t*2|)*2") == "tt|tt|"  # groups first, then single characters
    assert pl.expand("E|(t|)*3,m|m||L") == "E|t|t|t|m|m||L"
    assert pl.expand("t|*2") == "t||"  # x*n repeats any character, '|' included
    assert pl.expand("Et*2*3") == "Ett*3"  # the left-over repetition is then refused as a character
    with pytest.raises(ValueError, match="more than"):
        pl.expand("(t*999999)*999999")


def test_looks_like_layout_tells_methods_and_counts_apart():
    assert pl.looks_like_layout("E|ttttL") and pl.looks_like_layout("tttt")
    for method in ("layer:TransformerDecoderLayer", "uniform", "2,3,3", " 2, 3,3 ", ""):
        assert not pl.looks_like_layout(method)


def test_rank_chunks_and_segment_cut_by_the_layout():
    assert rank_chunks(4, 2, 1, "E|ttttL", 0) == [(range(0, 0), True, False)]
    assert rank_chunks(4, 2, 1, "E|ttttL", 1) == [(range(0, 4), False, True)]
    assert rank_chunks(4, 2, 2, "Et|t|tt|L", 0) == [(range(0, 1), True, False), (range(2, 4), False, False)]
    assert rank_chunks(4, 2, 2, "Et|t|tt|L", 1) == [(range(1, 2), False, False), (range(4, 4), False, True)]
    assert segment(4, 2, "E|ttttL") == [0, 1, 7]  # the FleetX log's items: the embedding alone, then the rest
    assert [stage_layers(segment(4, 3, "E|tttt|L"), s) for s in range(3)] == [range(0), range(4), range(4, 4)]
    with pytest.raises(ValueError, match="chunks per rank"):
        rank_chunks(4, 2, 1, "Et|t|tt|L", 0)
    with pytest.raises(ValueError, match="interleaved"):
        segment(4, 2, "Et|t|tt|L")


def _config(*flags: str, world: int = 2):
    config = parse_config(["--mock-data", *SMALL, "--num-layers", "4", "--global-batch-size", "8",
                           "--micro-batch-size", "1", "--pp", "2", *flags])
    validate(config, world_size=world)
    return config


def test_megatron_flag_sets_the_partition_and_the_virtual_stages():
    config = _config("--pipeline-model-parallel-layout", "Et|t|tt|L")
    d = config.distributed
    assert (d.pipeline_partition, d.virtual_pp_degree) == ("Et|t|tt|L", 2)
    chunks = [stage_chunks(config, rank, 2) for rank in range(2)]
    assert chunks == [rank_chunks(4, 2, 2, "Et|t|tt|L", rank) for rank in range(2)]
    assert [chunk_specs(config, rank) for rank in range(2)] == chunks  # the activation memory's cut
    assert [planner_chunks(config, rank) for rank in range(2)] == [(1, 2), (1, 0)]
    same = _config("--pipeline-partition", "Et|t|tt|L", "--vpp", "2")  # our own flag, the same run
    assert same.distributed.virtual_pp_degree == 2



@pytest.mark.parametrize("layout", ["E|ttttL", "Etttt|L", "Et|t|tt|L", "E|tt|t|tL", "Et||ttt|L"])
def test_the_cut_model_holds_what_the_estimate_counts(layout):
    """Each rank's chunks as the model builder cuts them: the embedding alone, the head alone; the memory
    estimate's parameter count of the rank equals the cut model's."""
    config = _config("--pipeline-model-parallel-layout", layout)
    m = config.model
    for rank in range(2):
        chunks = [cut_stage(GPTModel(m, config.padded_vocab_size), layers, first, last)
                  for layers, first, last in stage_chunks(config, rank, 2)]
        held = sum(p.numel() for chunk in chunks for p in chunk.parameters())
        assert parameter_split(config, 1, 2, rank) == (held, 0)
        if layout.startswith("E|") and rank == 0:
            assert not list(chunks[0].layers) and hasattr(chunks[0], "embedding")  # the embedding alone
        if layout.endswith("|L") and rank == 1:
            assert not list(chunks[-1].layers) and hasattr(chunks[-1], "final_layernorm")  # the norm and head alone


@pytest.mark.parametrize("flags,message", [
    (["--pipeline-model-parallel-layout", "Et|t|tt|L", "--vpp", "3"], "virtual_pp_degree is 3"),
    (["--pipeline-model-parallel-layout", "Et|t|tt|L", "--num-layers-per-virtual-pipeline-stage", "1"],
     "cannot be given with --num-layers-per-virtual-pipeline-stage"),
    (["--pipeline-model-parallel-layout", "Et|tttL", "--decoder-first-pipeline-num-layers", "1"],
     "cannot be given with --decoder-first-pipeline-num-layers"),
    (["--pipeline-model-parallel-layout", "Et|tttL", "--account-for-loss-in-pipeline-split"],
     "cannot be given with --account-for-loss-in-pipeline-split"),
    (["--pipeline-model-parallel-layout", "Et|t|tL"], "3 stages, not a multiple of the pipeline size"),
    (["--pipeline-model-parallel-layout", "Et|ttL"], "holds 3 transformer layers 't' but num_layers is 4"),
    (["--pipeline-model-parallel-layout", "Et|tt L"], "' ' (in stage 'tt L') is not a layer letter"),
    (["--pipeline-model-parallel-layout", "Ettt|tmL"], "mtp_num_layers is None"),
    (["--pipeline-model-parallel-layout", "Ett|tt|m|L", "--mtp-num-layers", "1", "--position-embedding-type",
      "rope"], "standalone MTP"),
    (["--pipeline-partition", "Ett|ttL", "--pp", "1"], "needs pp_degree > 1"),
])
def test_refusals_are_one_sentence_at_validation(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _config(*flags, world=1 if "--pp" in flags else 2)
