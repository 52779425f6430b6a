"""Pipeline parallelism (alone and with tp and dp) reproduces the single-process loss curve."""

from __future__ import annotations

import pytest

from tests.functional.launch import FIVE, TINY, parity_layouts

pytestmark = pytest.mark.slow

FOUR_LAYERS = [*FIVE, "--num-layers", "4"]  # enough layers for pp 4 and for pp 2 x vpp 2; 5 steps


LAYOUTS = parity_layouts({
    "pp2": (2, [*FOUR_LAYERS, "--pp", "2"]),
    "pp4": (4, [*FOUR_LAYERS, "--pp", "4"]),
    "pp2-gpipe": (2, [*FOUR_LAYERS, "--pp", "2", "--pipeline-schedule", "gpipe"]),
    "pp2-vpp2": (2, [*FOUR_LAYERS, "--pp", "2", "--vpp", "2"]),
    "pp2-recompute": (2, [*FOUR_LAYERS, "--pp", "2", "--use-recompute"]),
    # Megatron-LM's uneven stages: 1 layer on the first stage, 3 on the last (pipeline_partition 1,3)
    "pp2-uneven": (2, [*FOUR_LAYERS, "--pp", "2", "--decoder-first-pipeline-num-layers", "1"]),
    # Megatron-LM's layout strings: the embedding alone on the first stage
    "pp2-layout-E": (2, [*FOUR_LAYERS, "--pp", "2", "--pipeline-model-parallel-layout", "E|ttttL"]),
    # pp 2 x vpp 2 with chunks of 1 and 3 layers, and of none: rank 1's first chunk is empty, its second the head
    "pp2-vpp2-layout": (2, [*FOUR_LAYERS, "--pp", "2", "--pipeline-model-parallel-layout", "Et||ttt|L"]),
    "tp2-pp2-sp": (4, [*FOUR_LAYERS, "--pp", "2", "--tp", "2", "--sequence-parallel"]),
    "dp2-pp2": (4, [*FOUR_LAYERS, "--pp", "2", "--dp", "2"]),
    "dp2-tp2-pp2": (8, [*FOUR_LAYERS, "--pp", "2", "--dp", "2", "--tp", "2"]),
})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pp_losses_equal_single_process(parity, references, layout):
    parity.assert_matches(layout, references["tiny4-5"])

def test_segmentation_log_is_the_seeds(parity):
    result = parity.outcome("pp2")  # the pp2 parity run's start-up log
    result.check()
    rank0 = result.log.split("--- rank 1")[0]
    lines = [line.split(" - ", 1)[1] for line in rank0.splitlines() if " - " in line]
    start = lines.index("start segment network..")
    assert lines[start + 1] == "segment result:0, 3, 7"
    assert lines[start + 2] == "stage=0, global_rank=0 ,layer_number=3"
    assert lines[start + 3].startswith("0: EmbeddingPipe(vocab_size=256, hidden_size=64")
    assert "stage=1, global_rank=1 ,layer_number=4" in lines
    assert "loss: GPTPretrainingCriterionPipe" in lines


def test_segmentation_log_of_a_layout_string(parity):
    result = parity.outcome("pp2-layout-E")  # 'E|ttttL': the embedding alone on stage 0
    result.check()
    rank0 = result.log.split("--- rank 1")[0]
    lines = [line.split(" - ", 1)[1] for line in rank0.splitlines() if " - " in line]
    start = lines.index("start segment network..")
    assert lines[start + 1: start + 3] == ["segment result:0, 1, 7", "stage=0, global_rank=0 ,layer_number=1"]
    assert lines[start + 3].startswith("0: EmbeddingPipe(") and lines[start + 4].startswith("stage=1")


BAD = {  # name: (processes, flags, the message every rank prints)
    "bad-pp4-2-layers": (4, ["--pp", "4", "--num-layers", "2"], "Cannot cut 2 decoder layers into 4 pipeline stages"),
    "bad-vpp-2-layers": (2, ["--pp", "2", "--vpp", "2", "--num-layers", "2"],
                         "num_layers (2) divisible by pp x vpp (2 x 2 = 4)"),
    "bad-vpp-micro-batches": (2, ["--pp", "2", "--vpp", "2", "--num-layers", "4", "--global-batch-size", "6",
                                  "--micro-batch-size", "2"],
                              "micro_batch_size = 3) to be a multiple of pp_degree (2)"),
}
parity_layouts({name: (nproc, [*TINY, *extra]) for name, (nproc, extra, _) in BAD.items()})


@pytest.mark.parametrize("layout", list(BAD))
def test_bad_pipeline_settings_fail_on_every_rank(parity, layout):
    parity.assert_fails_on_every_rank(layout, BAD[layout][2])
