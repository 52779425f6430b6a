"""tools/generate.py: tp 2 under torchrun generates what one process generates (greedy, and seeded
samples with top-k and with top-p, the path that gathers the whole vocabulary), checkpoints of any
tensor-parallel cut load, prompts come from flags, files and stdin, and bad input is one line."""

from __future__ import annotations

import io
import json
import sys

import pytest

from megatron.checkpoint.convert import reshard
from megatron.inference import InferenceEngine, Request, SamplingParams, initialize, load_model, tokenizer_for
from tests.functional.launch import RunOutcome, outcome, run_several
from tests.inference.conftest import PROMPTS, ROOT, _tool

GENERATE = _tool("generate")


def _generate_here(capsys, monkeypatch, *args: str, stdin: str | None = None) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of tools/generate.py's main in this process (one rank: no process group);
    torchrun's runs go through ``run_several`` (``tp2_generations``)."""
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    capsys.readouterr()
    status = GENERATE.main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def _engine(path: str) -> InferenceEngine:
    initialize()
    model, config = load_model(path)
    return InferenceEngine(model, config, tokenizer_for(config))


ROWS = [{"temperature": 0}, {"temperature": 0.9, "top_k": 20, "seed": 11},  # greedy; seeded top-k
        {"temperature": 0.9, "top_p": 0.9, "seed": 5}, {"temperature": 0.7, "seed": 3}]  # top-p and plain: all ids


TP2_MODELS = ["checkpoint", "moe_checkpoint", "mla_checkpoint"]


@pytest.fixture(scope="module")
def tp2_generations(request, tmp_path_factory) -> dict[str, RunOutcome]:
    """tools/generate.py at tp 2 on each model of TP2_MODELS, in one torchrun launch (``run_several``)."""
    folder = tmp_path_factory.mktemp("generate-tp2")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, **row}) + "\n" for p, row in zip(PROMPTS, ROWS, strict=True)))
    runs = [(folder / model, ["--load", request.getfixturevalue(model), "--tp", "2", "--prompts-file", str(prompts),
                              "--max-new-tokens", "24", "--ignore-eos", "--output-format", "jsonl", "--logprobs", "0"])
            for model in TP2_MODELS]
    launch = run_several(runs, 2, program="tools/generate.py")
    return {model: outcome(out, 2, launch) for model, (out, _) in zip(TP2_MODELS, runs, strict=True)}


@pytest.mark.slow
@pytest.mark.parametrize("model", TP2_MODELS)
def test_tp2_under_torchrun_generates_what_one_process_generates(model, request, tp2_generations):
    """One batch, each prompt with its own sampling fields (a JSON line of --prompts-file): greedy, seeded
    top-k (the merged top-k over ranks), seeded top-p and plain temperature (the whole vocabulary gathered).
    The MoE model's experts are cut over the 2 ranks, each routing its share of the tokens (a one-token step
    padded to 2); the multi-latent-attention model's heads (and their KV cache) are cut over the 2 ranks."""
    checkpoint = request.getfixturevalue(model)
    result = tp2_generations[model]
    result.check()
    records = [json.loads(line) for line in result.stdout.splitlines()]
    engine = _engine(checkpoint)
    expected = engine.generate([Request(engine.tokenizer.tokenize(p), SamplingParams(
        max_tokens=24, ignore_eos=True, logprobs=0, **row)) for p, row in zip(PROMPTS, ROWS, strict=True)])
    assert [r["prompt"] for r in records] == PROMPTS
    for record, completion in zip(records, expected, strict=True):
        assert record["tokens"] == completion.tokens and record["text"] == completion.text
        assert record["finish_reason"] == "length"
        assert record["logprobs"] == pytest.approx(completion.logprobs, abs=1e-5)
    sampled = [c.tokens for c in expected[1:]]
    assert sampled != [c.tokens for c in engine.generate([Request(engine.tokenizer.tokenize(p), SamplingParams(
        max_tokens=24, ignore_eos=True, **{**row, "seed": row["seed"] + 1})) for p, row in zip(PROMPTS[1:], ROWS[1:],
                                                                                                strict=True)])]


def test_a_checkpoint_of_another_tensor_parallel_cut_generates_the_same(checkpoint, tmp_path):
    resharded = reshard(checkpoint, str(tmp_path / "tp2"), tp=2)
    requests = [Request(_engine(checkpoint).tokenizer.tokenize(p), SamplingParams(max_tokens=16, temperature=0))
                for p in PROMPTS]
    assert [c.tokens for c in _engine(resharded).generate(requests)] == \
        [c.tokens for c in _engine(checkpoint).generate(requests)]


def test_prompts_from_flags_and_stdin_print_their_continuations(checkpoint, capsys, monkeypatch):
    engine = _engine(checkpoint)
    expected = engine.generate([Request(engine.tokenizer.tokenize(p), SamplingParams(max_tokens=8, temperature=0))
                                for p in PROMPTS[:2]])
    status, out, err = _generate_here(capsys, monkeypatch, "--load", checkpoint, "--prompt", PROMPTS[0], "--prompt",
                                      PROMPTS[1], "--max-new-tokens", "8", "--temperature", "0")
    assert status == 0, err
    assert f"{PROMPTS[0]}{expected[0].text}\n" in out and f"{PROMPTS[1]}{expected[1].text}\n" in out
    status, out, err = _generate_here(capsys, monkeypatch, "--load", checkpoint, "--max-new-tokens", "8",
                                      "--temperature", "0", stdin=f"{PROMPTS[0]}\n\n{PROMPTS[1]}\n")
    assert status == 0, err
    assert out == f"{expected[0].text}\n{expected[1].text}\n"


@pytest.mark.parametrize("args, message", [
    (["--prompt", "the model " * 60], "positions"),
    (["--prompt", "x", "--temperature", "-1"], "temperature"),
    (["--prompts-file", "/nonexistent/prompts.txt"], "No such file"),
    (["--prompts-file", str(ROOT / "tests" / "inference" / "bad_prompts.jsonl")], "unknown field 'temprature'"),
    (["--prompt", "x", "--seed", str(2**64)], "seed must be an integer from -9223372036854775808 to"),  # today: an
    (["--prompt", "x", "--seed", str(-2**63 - 1)], "seed must be an integer from"),  # overflow inside the batch
])
def test_bad_input_is_one_line_and_exit_status_2(checkpoint, args, message, capsys, monkeypatch):
    status, _, err = _generate_here(capsys, monkeypatch, "--load", checkpoint, *args)
    assert status == 2
    assert message in err and "Traceback" not in err


def test_a_missing_checkpoint_is_one_line(tmp_path, capsys, monkeypatch):
    status, _, err = _generate_here(capsys, monkeypatch, "--load", str(tmp_path / "nothing"), "--prompt", "x")
    assert status == 2 and "Traceback" not in err
    assert "nothing" in err.splitlines()[-1]
