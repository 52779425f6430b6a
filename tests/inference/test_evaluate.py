"""tools/evaluate.py against transformers on the exported weights (perplexity with overlapping windows,
by transformers' own strided recipe; LAMBADA decisions by the same rule), and the same results under tp 2,
pp 2, dp 2 and ZeRO stage 3 as on one process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.inference import initialize, load_model, tokenizer_for
from tests.functional.launch import outcome, run_several
from tests.inference.conftest import ROOT

pytestmark = pytest.mark.slow  # launches tools/evaluate.py

SEQ = 64  # evaluation windows of 64 tokens (the model has 96 positions)
STRIDE = 32
TASKS = ("perplexity", "lambada")
LAYOUT_ARGS = ["--overlapping-eval", str(STRIDE), "--micro-batch-size", "2"]
LAYOUTS = {"tp2": ("lambada", ["--tp", "2"]), "pp2": ("perplexity", ["--pp", "2"]), "dp2": ("lambada", ["--dp", "2"]),
           "sharding2-stage3": ("perplexity", ["--sharding", "2", "--sharding-stage", "3"])}


def _document() -> str:
    """A text no one here wrote: Python's licence, shipped with the interpreter (else a stdlib module)."""
    licence = Path(os.__file__).parent / "LICENSE.txt"
    text = licence.read_text() if licence.exists() else Path(json.__file__).read_text()
    return text[:1500]


def _evaluations(root: Path, runs: dict[str, list[str]], nproc: int) -> dict[str, dict]:
    """Each named tools/evaluate.py command line run by one launch of ``nproc`` ranks (the launch is what
    costs): name -> its JSON result."""
    planned = [(root / name, [*args, "--max-seq-len", str(SEQ)]) for name, args in runs.items()]
    launch = run_several(planned, nproc, program="tools/evaluate.py")
    results = {}
    for out, _ in planned:
        done = outcome(out, nproc, launch)
        done.check()
        results[out.name] = json.loads(done.stdout.splitlines()[-1])
    return results


@pytest.fixture(scope="module")
def hf(checkpoint, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("hf")
    done = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "to-hf", checkpoint, str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()


@pytest.fixture(scope="module")
def files(checkpoint, tmp_path_factory):
    """(the document, a LAMBADA-format file): lines of the document (whose last word the random model does not
    guess), and passages of it completed by a word the model does guess (its argmax is one whole word with
    its leading space), so that some answers are right and some wrong."""
    folder = tmp_path_factory.mktemp("eval")
    document = folder / "licence.txt"
    document.write_text(_document())
    initialize()
    model, config = load_model(checkpoint)
    tokenizer = tokenizer_for(config)
    lines = [" ".join(line.split()) for line in _document().splitlines() if len(line.split()) >= 6]
    guessed = []
    with torch.no_grad():
        for words in (line.split() for line in lines):
            for n in range(3, len(words)):
                context = " ".join(words[:n])
                best = int(model(torch.tensor([tokenizer.tokenize(context)]))[0, -1, :config.model.vocab_size].argmax())
                word = tokenizer.detokenize([best])
                if word.startswith(" ") and word[1:].isalpha() and tokenizer.tokenize(word) == [best]:
                    guessed.append(context + word)
                    break
            if len(guessed) == 8:
                break
    lambada = folder / "lambada.jsonl"
    lambada.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines[:12] + guessed))
    return str(document), str(lambada), tokenizer


def _args(task: str, files, checkpoint: str) -> list[str]:
    document, lambada, _ = files
    return ["--task", task, "--input", lambada if task == "lambada" else document, "--load", checkpoint]


@pytest.fixture(scope="module")
def one_process(checkpoint, files, tmp_path_factory) -> dict[str, dict]:
    """The one-process results, by one launch: each task as given, and with micro-batches of 2 (and overlapping
    windows for both) as the layout tests run it."""
    runs = {"perplexity": [*_args("perplexity", files, checkpoint), "--overlapping-eval", str(STRIDE)],
            "lambada": _args("lambada", files, checkpoint)}
    runs.update({f"{task}-layouts": [*_args(task, files, checkpoint), *LAYOUT_ARGS] for task in TASKS})
    return _evaluations(tmp_path_factory.mktemp("evaluate-one"), runs, nproc=1)


def test_perplexity_equals_transformers_strided_recipe(one_process, hf, files):
    document, _, tokenizer = files
    result = one_process["perplexity"]
    ids = torch.tensor([tokenizer.tokenize(Path(document).read_text())])
    # transformers' documentation, "Perplexity of fixed-length models", with max_length = SEQ + 1
    max_length, seq_len = SEQ + 1, ids.size(1)
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    with torch.no_grad():
        for begin in range(0, seq_len, STRIDE):
            end = min(begin + max_length, seq_len)
            trg_len = end - prev_end
            input_ids = ids[:, begin:end]
            target_ids = input_ids.clone()
            target_ids[:, :-trg_len] = -100
            loss = hf(input_ids, labels=target_ids).loss
            # The recipe counts (target_ids != -100).sum() - 1, i.e. as if the label shift always dropped a
            # counted label; after the first window it drops a masked one. Counted here: the shifted labels.
            valid = int((target_ids[:, 1:] != -100).sum())
            nll_sum += float(loss) * valid
            n_tokens += valid
            prev_end = end
            if end == seq_len:
                break
    assert result["tokens"] == n_tokens == seq_len - 1
    assert result["loss"] == pytest.approx(nll_sum / n_tokens, rel=1e-4)
    assert result["perplexity"] == pytest.approx(math.exp(nll_sum / n_tokens), rel=1e-4)
    words = len(Path(document).read_text().split())
    assert result["words"] == words
    assert result["adjusted_perplexity"] == pytest.approx(
        math.exp(nll_sum / n_tokens * n_tokens / (words - 1)), rel=1e-4)


def _hf_cloze(hf, tokenizer, text: str, strict: bool) -> bool:
    """Megatron-LM's LAMBADA rule, written against transformers' model."""
    if strict:
        last = text.split()[-1]
        context, target = tokenizer.tokenize(text[:text.rfind(last)].strip()), tokenizer.tokenize(" " + last)
    else:
        ids = tokenizer.tokenize(text)
        context, target = ids[:-1], ids[-1:]
    tokens = (context + target)[-(SEQ + 1):]
    with torch.no_grad():
        logits = hf(torch.tensor([tokens[:-1]])).logits[0]
    predicted = logits[-len(target):].argmax(-1).tolist()
    return predicted == tokens[-len(target):]


def test_lambada_decisions_equal_a_transformers_reference_in_both_modes(one_process, hf, files):
    _, lambada, tokenizer = files
    result = one_process["lambada"]
    texts = [json.loads(line)["text"] for line in Path(lambada).read_text().splitlines()]
    assert result["examples"] == len(texts)
    for mode, strict in (("strict", True), ("non_strict", False)):
        right = sum(_hf_cloze(hf, tokenizer, t, strict) for t in texts)
        assert result[f"{mode}_correct"] == right
        assert result[f"{mode}_accuracy"] == pytest.approx(right / len(texts))
    assert 0 < result["strict_correct"] < len(texts)  # some right, some wrong: the comparison means something
    assert 0 < result["non_strict_correct"] < len(texts)


@pytest.fixture(scope="module")
def layouts(checkpoint, files, tmp_path_factory) -> dict[str, dict]:
    """Each layout's results, all by one two-rank launch."""
    runs = {name: [*_args(task, files, checkpoint), *LAYOUT_ARGS, *layout] for name, (task, layout) in LAYOUTS.items()}
    return _evaluations(tmp_path_factory.mktemp("evaluate-layouts"), runs, nproc=2)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_gives_the_one_process_results(one_process, layouts, layout):
    task = LAYOUTS[layout][0]
    expected, parallel = one_process[f"{task}-layouts"], layouts[layout]
    for key in ("strict_correct", "non_strict_correct", "tokens", "windows"):
        assert parallel.get(key) == expected.get(key)
    if task == "perplexity":
        assert parallel["loss"] == pytest.approx(expected["loss"], rel=1e-6)


def test_a_missing_checkpoint_or_input_is_one_line(checkpoint, tmp_path):
    for args, message in ((["--input", str(tmp_path / "none.txt"), "--load", checkpoint], "No such file"),
                          (["--input", str(ROOT / "README.md"), "--load", str(tmp_path / "none")], "no checkpoint at")):
        result = subprocess.run([sys.executable, "tools/evaluate.py", "--task", "perplexity", *args], cwd=ROOT,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert message in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("task, suffix, text", [("perplexity", ".txt", "\n\n\n   \n\t\n"), ("perplexity", ".txt", ""),
                                               ("lambada", ".jsonl", "\n \n")], ids=["blank-lines", "empty", "lambada"])
def test_an_input_without_words_is_one_line(checkpoint, tmp_path, task, suffix, text):
    """An empty file, or one of blank lines (or JSON lines whose texts are blank): exit 2 and one line saying the
    input holds no words, never a perplexity of whitespace tokens (adjusted by a word count of 0) or a traceback."""
    from tests.functional.launch import run_tool_here

    path = tmp_path / f"blank{suffix}"
    path.write_text(text if suffix == ".txt" else "".join(json.dumps({"text": t}) + "\n" for t in text.split("\n")))
    done = run_tool_here("tools/evaluate.py", "--task", task, "--input", str(path), "--load", checkpoint)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [f"evaluate.py: error: {path} holds no words (it is empty, or only "
                                                f"blank lines): nothing to evaluate."], done.stderr
    assert done.stdout == ""


def test_context_parallel_evaluation_is_refused_with_what_to_do(checkpoint):
    """Evaluation scores whole samples per rank: --context-parallel-size is one line saying to drop it."""
    from tests.functional.launch import run_tool_here

    done = run_tool_here("tools/evaluate.py", "--task", "perplexity", "--input", str(ROOT / "README.md"), "--load",
                         checkpoint, "--context-parallel-size", "2")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "tools/evaluate.py scores whole samples on each rank: drop --context-parallel-size" in done.stderr
