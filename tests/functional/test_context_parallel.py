"""Context parallelism reproduces the single-process losses under every layout it composes with, each
communication type (p2p ring, all_gather, a2a, hierarchical a2a+p2p), on ordinary samples and on packed short documents
(``--reset-attention-mask --reset-position-ids --eod-mask-loss``, whose reference is the one-process run
with the same flags), and with attention dropout (the ring's positional masks, those of one process under
``--attention-dropout-masks positional``). The layouts train 5 steps (a validation at the 5th), against 5-step
references: the parity is as strict, at half the cost of the launches."""

from __future__ import annotations

import pytest

from tests.functional.launch import FIVE, TINY, parity_layouts, reference_runs, whole_share
from tests.functional.test_llama_layouts import LLAMA

pytestmark = pytest.mark.slow

# documents of ~6 tokens: every 32-token sample holds several, cut across the chunks of every cp rank
PACKED = [*FIVE, "--mock-document-length", "6", "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
LLAMA5 = [*LLAMA, "--max-steps", "5"]
reference_runs({"tiny-packed": PACKED, "llama-5": LLAMA5})

CP2 = ["--cp", "2"]
# (processes, flags, communication type on plain samples, on packed documents): every type meets several axes
# one micro-batch a step where nothing accumulates micro-batches but the reference (``whole_share``)
LAYOUTS = {
    "cp2-p2p": (2, [*CP2, *whole_share()], "p2p", "p2p"),
    "cp2-all_gather": (2, [*CP2, *whole_share()], "all_gather", "all_gather"),
    "cp2-a2a": (2, [*CP2, *whole_share()], "a2a", "a2a"),
    # hierarchical: a2a within the cp rank pairs {0, 1} {2, 3}, a ring of 2 steps over the pairs (the ring at cp 4 is
    # cp4-saved's, whose resumed runs below equal one process; all_gather at cp 4 is tests/distributed's)
    "cp4-a2a+p2p": (4, ["--cp", "4", "--hierarchical-context-parallel-sizes", "2", "2", *whole_share()], "a2a+p2p",
                    "a2a+p2p"),
    "cp2-tp2-sp": (4, [*CP2, *whole_share(), "--tp", "2", "--sequence-parallel"], "p2p", "a2a"),
    "cp2-pp2": (4, [*CP2, "--pp", "2"], "all_gather", "p2p"),
    "cp2-zero3": (4, [*CP2, "--sharding", "2", "--sharding-stage", "3"], "p2p", "all_gather"),
    "cp2-recompute": (2, [*CP2, *whole_share(), "--use-recompute", "--recompute-granularity", "full"], "a2a", "p2p"),
    # data parallelism beside cp (the loss averaged over dp x cp); cp with tp is cp2-tp2-sp's (an 8-rank cp2 x dp2 x tp2
    # cost 39 s on 2 cores for nothing the two do not check)
    "cp2-dp2": (4, [*CP2, *whole_share(2), "--dp", "2"], "p2p", "p2p"),
}
PLAIN = parity_layouts({name: (n, [*FIVE, *flags, "--cp-comm-type", plain])
                        for name, (n, flags, plain, _) in LAYOUTS.items()})
PLAIN += parity_layouts({  # the other sharded optimizers: their shards span the cp ranks (dp x cp, as Megatron-LM)
    "cp2-zero2-offload": (4, [*FIVE, *CP2, "--sharding", "2", "--sharding-stage", "2", "--sharding-offload",
                              "--cp-comm-type", "a2a"]),
    "cp2-distributed-optimizer-dp1": (2, [*FIVE, *CP2, "--use-distributed-optimizer"]),  # sharded over cp alone
})
PACKED_LAYOUTS = parity_layouts({f"packed-{name}": (n, [*PACKED, *flags, "--cp-comm-type", packed])
                                 for name, (n, flags, _, packed) in LAYOUTS.items()})


@pytest.mark.parametrize("layout", PLAIN)
def test_cp_losses_equal_single_process(parity, references, layout):
    parity.assert_matches(layout, references["tiny-5"])


@pytest.mark.parametrize("layout", PACKED_LAYOUTS)
def test_cp_on_packed_documents_equals_single_process(parity, references, layout):
    parity.assert_matches(layout, references["tiny-packed"])


# saved by 4 ranks, resumed by 2 and 1: the launches run by world size, largest first, with no launch of a size
# waiting for one of a smaller size (a 4-rank run resuming a 2-rank save took a third launch of 2 ranks, ~15 s)
@pytest.mark.parametrize("layout", parity_layouts({
    "cp4-saved": (4, [*TINY, "--cp", "4", "--use-distributed-optimizer", "--save-interval", "5", "--exit-interval",
                      "5"]),
    "cp2-resumed-from-cp4": (2, [*TINY, *CP2, "--cp-comm-type", "a2a", "--load", "{runs}/cp4-saved/step_5"],
                             ("cp4-saved",)),
    "cp1-resumed-from-cp4": (1, [*TINY, "--load", "{runs}/cp4-saved/step_5"], ("cp4-saved",))})[1:])
def test_a_cp_checkpoint_resumes_under_another_cp(parity, reference, layout):
    """Saved at cp 4 with the optimizer sharded over the four cp ranks, resumed at cp 2 (unsharded) or in one
    process: the single-process run's steps 6-10 (a checkpoint holds every shard once, by global name)."""
    assert parity.curves(layout)[0] == pytest.approx(reference[0][5:], rel=1e-5)


# Attention dropout 0.1 (GPT-2's and Megatron-LM's default), no hidden dropout: the ring's masks are functions of
# global positions (megatron/context_parallel/dropout.py), the same as one process draws under
# --attention-dropout-masks positional, so the losses are equal (with hidden dropout each rank draws its own
# tokens' masks: equal only in distribution).
ATTENTION_DROPOUT = [*FIVE, "--attention-probs-dropout-prob", "0.1"]
DROPOUT_RUNS = parity_layouts({
    "attn-dropout-positional": (1, [*ATTENTION_DROPOUT, "--attention-dropout-masks", "positional"]),
    "attn-dropout-cp2-p2p": (2, [*ATTENTION_DROPOUT, *CP2]),
})


@pytest.mark.shared_runs(*DROPOUT_RUNS)
def test_attention_dropout_at_cp2_draws_the_one_process_masks(parity, references):
    single = parity.curves("attn-dropout-positional")
    parity.assert_matches("attn-dropout-cp2-p2p", single)
    # the dropout is drawn: the losses move by up to 9e-4 from the run without (the parity holds within 1e-5)
    assert max(abs(a - b) for a, b in zip(single[0], references["tiny-5"][0])) > 5e-4


LLAMA_LAYOUTS = parity_layouts({
    # rope at each chunk's positions, grouped queries split over the a2a ranks, interleaved pipeline
    "llama-cp2-a2a-pp2-vpp2": (4, [*LLAMA5, *CP2, "--cp-comm-type", "a2a", "--pp", "2", "--vpp", "2"]),
    # compiled norms and MLP around the eager ring
    "llama-cp2-p2p-compile": (2, [*LLAMA5, *CP2, *whole_share(), "--compile"]),
    # selective recompute: the gathered attention replayed in the backward
    "llama-cp2-all_gather-core-attn": (2, [*LLAMA5, *CP2, *whole_share(), "--cp-comm-type", "all_gather",
                                           "--use-recompute", "--recompute-granularity", "core_attn"]),
})


@pytest.mark.parametrize("layout", LLAMA_LAYOUTS)
def test_llama_shaped_cp_losses_equal_single_process(parity, references, layout):
    parity.assert_matches(layout, references["llama-5"])
    assert "--compile:" not in parity.outcome(layout).log  # no fallback to eager


reference_runs({"tiny-bf16": [*TINY, "--bf16"], "tiny-fp16": [*TINY, "--fp16"]})  # test_sharding.py's too
LOW_PRECISION = parity_layouts({f"{p}-cp2-{t}": (2, [*TINY, f"--{p}", *CP2, "--cp-comm-type", t])
                                for p, t in (("bf16", "p2p"), ("fp16", "all_gather"))})


@pytest.mark.parametrize("layout", LOW_PRECISION)
def test_low_precision_cp_tracks_one_process(parity, references, layout):
    """bf16 / fp16: the blocks' results merge in fp32 and round once, where one process rounds its fused
    kernel's output; the loss curves stay within 1e-3."""
    single = references[f"tiny-{layout.split('-')[0]}"][0]
    assert parity.curves(layout)[0] == pytest.approx(single, rel=1e-3)


@pytest.mark.parametrize(("layout", "message"), [
    (parity_layouts({"bad-cp2-seq": (2, [*TINY, *CP2, "--max-seq-len", "30"])})[0],
     "--context-parallel-size 2 cuts each sample into 4 chunks: max_seq_len (30) must be divisible by 2 x "
     "context_parallel_size = 4"),
    (parity_layouts({"bad-cp2-a2a-heads": (2, [*TINY, *CP2, "--cp-comm-type", "a2a",
                                               "--num-attention-heads", "1"])})[0],
     "--cp-comm-type a2a gives each context-parallel rank whole heads"),
])
def test_bad_cp_settings_fail_on_every_rank(parity, layout, message):
    parity.assert_fails_on_every_rank(layout, message)


def _doc_example() -> list[str]:
    """docs/context_parallel.md's CPU example, its pretrain_gpt.py arguments as written."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "context_parallel.md").read_text()
    command = re.search(r"(torchrun --standalone --nproc-per-node 2 pretrain_gpt\.py .*?)\n(?!    )", text, re.S)
    argv = shlex.split(command.group(1).replace("\\\n", " "))
    return argv[argv.index("pretrain_gpt.py") + 1:]


@pytest.mark.parametrize("layout", parity_layouts({"cp2-docs-example": (2, _doc_example())}))
def test_the_cpu_example_of_the_docs_runs_as_written_with_gpt2_dropout_and_learns(parity, layout):
    """The example a reader tries first: GPT-2's dropout (0.1 on the attention probabilities too) under the default
    p2p ring, which once refused it; its validation loss ends at least a nat below ln(1024), an untrained model's."""
    import math

    from tests.functional.launch import losses

    out = parity.outcome(layout).check()
    valid = losses(out, "valid")
    assert len(valid) == 2 and valid[-1] < valid[0] < math.log(1024) and valid[-1] < math.log(1024) - 1.0, valid
