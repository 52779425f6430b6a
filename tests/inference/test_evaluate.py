"""tools/evaluate.py against lm-eval (lm-evaluation-harness) and transformers on the exported weights: the
perplexity figures (word and byte perplexity, bits per byte) and LAMBADA's accuracy and target perplexity
equal lm-eval's, computed by lm-eval's own window, pair-encoding and metric functions around its ``hf``
backend's scoring rule; the strided figures equal transformers' strided recipe; LAMBADA's non-strict
decisions follow Megatron-LM's rule; and tp 2, pp 2, dp 2 and ZeRO stage 3 give the one-process results."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from megatron.inference import initialize, load_model, tokenizer_for
from tests.functional.launch import outcome, run_several, run_tool_here
from tests.inference.conftest import ROOT, last_word_guesses

pytestmark = pytest.mark.slow  # launches tools/evaluate.py

SEQ = 64  # evaluation windows of 64 tokens (the model has 96 positions)
STRIDE = 32
TASKS = ("perplexity", "lambada")
LAYOUT_ARGS = ["--overlapping-eval", str(STRIDE), "--micro-batch-size", "2"]
LAYOUTS = {"tp2": ("lambada", ["--tp", "2"]), "pp2": ("perplexity", ["--pp", "2"]), "dp2": ("lambada", ["--dp", "2"]),
           "pp2-lambada": ("lambada", ["--pp", "2"]), "sharding2-stage3": ("perplexity", ["--sharding", "2",
                                                                                           "--sharding-stage", "3"])}


def _document() -> str:
    """A text no one here wrote: Python's licence, shipped with the interpreter (else a stdlib module)."""
    licence = Path(os.__file__).parent / "LICENSE.txt"
    text = licence.read_text() if licence.exists() else Path(json.__file__).read_text()
    return text[:1500]


def _documents() -> list[str]:
    """The document's paragraphs, of several lengths (some over two windows of SEQ tokens, some under one), one
    with a trailing newline (lm-eval counts one more word for it)."""
    paragraphs = [p for p in _document().split("\n\n") if p.strip()]
    return [p + "\n" if i == 1 else p for i, p in enumerate(paragraphs)]


LOGS: dict[str, str] = {}  # each evaluation's stderr, every rank's (``--- rank r`` before each), by name


def _evaluations(root: Path, runs: dict[str, list[str]], nproc: int) -> dict[str, dict]:
    """Each named tools/evaluate.py command line run by one launch of ``nproc`` ranks (the launch is what
    costs): name -> its JSON result (and, under ``"examples"``, its ``{out}/examples.jsonl`` when it wrote one);
    its stderr in ``LOGS``."""
    planned = [(root / name, [a.replace("{out}", str(root / name)) for a in [*args, "--max-seq-len", str(SEQ)]])
               for name, args in runs.items()]
    launch = run_several(planned, nproc, program="tools/evaluate.py")
    results = {}
    for out, _ in planned:
        done = outcome(out, nproc, launch)
        done.check()
        LOGS[out.name] = done.log
        results[out.name] = json.loads(done.stdout.splitlines()[-1])
        if (out / "examples.jsonl").exists():
            results[out.name]["examples.jsonl"] = [json.loads(line) for line in
                                                   (out / "examples.jsonl").read_text().splitlines()]
    return results


@pytest.fixture(scope="module")
def hf_dir(checkpoint, tmp_path_factory) -> str:
    """The checkpoint exported by ``convert_checkpoint.py to-hf`` (weights and tokenizer)."""
    out = tmp_path_factory.mktemp("hf")
    done = run_tool_here("tools/convert_checkpoint.py", "to-hf", checkpoint, str(out))  # in this process
    assert done.returncode == 0, done.stderr
    return str(out)


@pytest.fixture(scope="module")
def hf(hf_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()


@pytest.fixture(scope="module")
def files(checkpoint, tmp_path_factory):
    """(the document, a LAMBADA-format file): lines of the document (whose last word the random model does not
    guess), and passages of it completed by a word the model does guess (its argmax is one whole word with
    its leading space), so that some answers are right and some wrong."""
    folder = tmp_path_factory.mktemp("eval")
    document = folder / "licence.jsonl"
    document.write_text("".join(json.dumps({"text": t}) + "\n" for t in _documents()))
    initialize()
    model, config = load_model(checkpoint)
    tokenizer = tokenizer_for(config)
    lines = [" ".join(line.split()) for line in _document().splitlines() if len(line.split()) >= 6]
    guessed = last_word_guesses(model, tokenizer, config.model.vocab_size, lines, 8)
    lambada = folder / "lambada.jsonl"
    lambada.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines[:12] + guessed))
    return str(document), str(lambada), tokenizer


def _args(task: str, files, checkpoint: str) -> list[str]:
    document, lambada, _ = files
    if task == "lambada":
        return ["--task", task, "--input", lambada, "--load", checkpoint, "--output-examples", "{out}/examples.jsonl"]
    return ["--task", task, "--input", document, "--load", checkpoint]


@pytest.fixture(scope="module")
def one_process(checkpoint, files, tmp_path_factory) -> dict[str, dict]:
    """The one-process results, by one launch: each task as given (with the strided figures, and the LAMBADA
    examples), and with micro-batches of 2 as the layout tests run it."""
    root = tmp_path_factory.mktemp("evaluate-one")
    runs = {"perplexity": [*_args("perplexity", files, checkpoint), "--overlapping-eval", str(STRIDE), "--output",
                           str(root / "new" / "folder" / "results.json")],  # its folders made before the scoring
            "lambada": _args("lambada", files, checkpoint)}
    runs.update({f"{task}-layouts": [*_args(task, files, checkpoint), *LAYOUT_ARGS] for task in TASKS})
    results = _evaluations(root, runs, nproc=1)
    assert json.loads((root / "new" / "folder" / "results.json").read_text()) == results["perplexity"]
    assert not [p.name for p in (root / "new" / "folder").iterdir() if p.name != "results.json"]  # no probe left
    return results


@pytest.fixture(scope="module")
def lm_eval_hf(hf_dir):
    """lm-eval's own ``hf`` backend (``HFLM``) on the export, its window the checkpoint's ``max_seq_len``."""
    pytest.importorskip("lm_eval", reason="lm-eval (the eval extra) is not installed")
    from tests.inference.lm_eval_tasks import hf_lm

    return hf_lm(hf_dir, SEQ, 1)


def _requests(kind: str, arguments: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(arguments)]


def test_perplexity_figures_equal_lm_evals(one_process, lm_eval_hf, files):
    """Rolling log-likelihood per document (its first token scored after the prefix token, the last window
    reaching back), words and bytes counted as lm-eval's rolling tasks do, and lm-eval's weighted aggregations."""
    from lm_eval.api.metrics import bits_per_byte, weighted_perplexity
    from lm_eval.api.task import Task

    document, _, _ = files
    docs = [json.loads(line)["text"] for line in Path(document).read_text().splitlines()]
    lls = lm_eval_hf.loglikelihood_rolling(_requests("loglikelihood_rolling", [(d,) for d in docs]))
    words, sizes = [Task.count_words(d) for d in docs], [Task.count_bytes(d) for d in docs]
    lengths = [len(lm_eval_hf.tok_encode(d)) for d in docs]
    assert max(lengths) > 2 * SEQ and min(lengths) < SEQ  # three windows and more, and less than one
    tokens = sum(lengths)
    result = one_process["perplexity"]
    assert (result["documents"], result["tokens"], result["words"], result["bytes"]) == (
        len(docs), tokens, sum(words), sum(sizes))
    assert result["words"] != sum(len(d.split()) for d in docs)  # lm-eval's count, not whitespace words
    assert result["loglikelihood"] == pytest.approx(sum(lls), rel=1e-5)
    assert result["word_perplexity"] == pytest.approx(weighted_perplexity(list(zip(lls, words))), rel=1e-4)
    assert result["byte_perplexity"] == pytest.approx(weighted_perplexity(list(zip(lls, sizes))), rel=1e-4)
    assert result["bits_per_byte"] == pytest.approx(bits_per_byte(list(zip(lls, sizes))), rel=1e-4)
    assert result["token_perplexity"] == pytest.approx(math.exp(-sum(lls) / tokens), rel=1e-4)


def test_strided_perplexity_equals_transformers_strided_recipe(one_process, hf, files):
    """--overlapping-eval's figures, over the documents joined by the end-of-document token."""
    document, _, tokenizer = files
    result = one_process["perplexity"]["strided"]
    docs = [json.loads(line)["text"] for line in Path(document).read_text().splitlines()]
    stream = [t for d in docs for t in [*tokenizer.tokenize(d), tokenizer.eod]][:-1]
    ids = torch.tensor([stream])
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
    assert result["stride"] == STRIDE
    assert result["tokens"] == n_tokens == seq_len - 1
    assert result["loss"] == pytest.approx(nll_sum / n_tokens, rel=1e-4)
    assert result["perplexity"] == pytest.approx(math.exp(nll_sum / n_tokens), rel=1e-4)
    words = sum(len(d.split()) for d in docs)
    assert result["words"] == words
    assert result["adjusted_perplexity"] == pytest.approx(
        math.exp(nll_sum / n_tokens * n_tokens / (words - 1)), rel=1e-4)


def _lambada_openai() -> dict:
    """lm-eval's lambada_openai task definition (its YAML, as shipped)."""
    import yaml
    from lm_eval import tasks

    return yaml.safe_load((Path(tasks.__file__).parent / "lambada" / "lambada_openai.yaml").read_text())


def test_lambada_strict_acc_and_perplexity_equal_lm_evals_lambada_openai(one_process, lm_eval_hf, hf, files):
    """Strict mode is lambada_openai: its context and target templates, lm-eval's pair encoding, acc = mean
    is-greedy, perplexity = exp(-mean target log-likelihood); each example's line says the same, and its greedy
    continuation is what transformers' model writes greedily (written on past a wrong first token)."""
    from lm_eval.api.metrics import mean, perplexity
    from lm_eval.utils import apply_template

    _, lambada, tokenizer = files
    task = _lambada_openai()
    texts = [json.loads(line)["text"] for line in Path(lambada).read_text().splitlines()]
    pairs = [(apply_template(task["doc_to_text"], {"text": t}), apply_template(task["doc_to_target"], {"text": t}))
             for t in texts]
    theirs = lm_eval_hf.loglikelihood(_requests("loglikelihood", pairs))
    result, examples = one_process["lambada"], one_process["lambada"]["examples.jsonl"]
    assert result["examples"] == len(texts) == len(examples)
    assert result["strict"]["acc"] == pytest.approx(mean([greedy for _, greedy in theirs]))
    assert result["strict"]["correct"] == sum(greedy for _, greedy in theirs)
    assert result["strict"]["perplexity"] == pytest.approx(perplexity([ll for ll, _ in theirs]), rel=1e-4)
    assert 0 < result["strict"]["correct"] < len(texts)  # some right, some wrong: the comparison means something
    for i, (example, (context, target), (ll, greedy)) in enumerate(zip(examples, pairs, theirs)):
        assert (example["index"], example["context"], example["target"]) == (i, context, target)
        assert example["match"] == greedy and example["target_loglikelihood"] == pytest.approx(ll, abs=1e-4)
        assert (example["greedy"] == target) == greedy
        if not greedy:  # what transformers' model writes greedily, as many tokens as the target has
            ids = tokenizer.tokenize(context)
            with torch.no_grad():
                for _ in range(example["target_tokens"]):
                    ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            assert example["greedy"] == tokenizer.detokenize(ids[-example["target_tokens"]:])
    assert any(not e["match"] and e["target_tokens"] > 1 for e in examples)  # a greedy continuation written on


def _hf_cloze(hf, tokenizer, text: str, strict: bool) -> tuple[bool, float]:
    """Megatron-LM's LAMBADA rule, written against transformers' model: (right, the target's log-likelihood)."""
    if strict:
        last = text.split()[-1]
        context, target = tokenizer.tokenize(text[:text.rfind(last)].strip()), tokenizer.tokenize(" " + last)
    else:
        ids = tokenizer.tokenize(text)
        context, target = ids[:-1], ids[-1:]
    tokens = (context + target)[-(SEQ + 1):]
    with torch.no_grad():
        logits = hf(torch.tensor([tokens[:-1]])).logits[0]
    logp = torch.log_softmax(logits[-len(target):].float(), -1)
    wanted = torch.tensor(tokens[-len(target):])
    return logp.argmax(-1).tolist() == wanted.tolist(), float(logp.gather(-1, wanted[:, None]).sum())


def test_lambada_both_modes_follow_megatron_lms_rule(one_process, hf, files):
    """Strict (on these single-spaced texts, Megatron-LM's strict rule too) and non-strict: the decisions and
    the target perplexity of a transformers-based reference, and each example's non-strict line."""
    _, lambada, tokenizer = files
    result, examples = one_process["lambada"], one_process["lambada"]["examples.jsonl"]
    texts = [json.loads(line)["text"] for line in Path(lambada).read_text().splitlines()]
    for mode, strict in (("strict", True), ("non_strict", False)):
        reference = [_hf_cloze(hf, tokenizer, t, strict) for t in texts]
        right = sum(r for r, _ in reference)
        assert result[mode]["correct"] == right and result[mode]["acc"] == pytest.approx(right / len(texts))
        assert result[mode]["perplexity"] == pytest.approx(math.exp(-sum(ll for _, ll in reference) / len(texts)),
                                                           rel=1e-4)
        assert 0 < right < len(texts)
        if not strict:
            for example, (r, ll) in zip(examples, reference):
                line = example["non_strict"]
                assert line["match"] == r and line["target_loglikelihood"] == pytest.approx(ll, abs=1e-4)
                assert line["target_tokens"] == 1


def test_progress_in_a_file_is_plain_lines_from_rank_0(one_process, layouts):
    """stderr is a file here: no ``\\r`` bar, one closing line per scoring pass (megatron/progress.py), on rank 0
    only under two ranks."""
    perplexity, lambada = LOGS["perplexity"], LOGS["lambada"]
    assert "\r" not in perplexity + lambada
    windows = one_process["perplexity"]["windows"], one_process["perplexity"]["strided"]["windows"]
    assert re.search(rf"^perplexity \(rolling\): {windows[0]} windows in \d+:\d\d \(", perplexity, re.M), perplexity
    assert re.search(rf"^perplexity \(strided\): {windows[1]} windows in \d+:\d\d \(", perplexity, re.M), perplexity
    examples = one_process["lambada"]["examples"]
    for mode in ("strict", "non-strict"):
        assert re.search(rf"^lambada \({mode}\): {examples} examples in ", lambada, re.M), lambada
    ranks = LOGS["dp2"].split("--- rank 1\n")
    assert len(ranks) == 2 and "lambada (strict): " in ranks[0] and "lambada (" not in ranks[1], LOGS["dp2"]


@pytest.fixture(scope="module")
def layouts(checkpoint, files, tmp_path_factory) -> dict[str, dict]:
    """Each layout's results, all by one two-rank launch."""
    runs = {name: [*_args(task, files, checkpoint), *LAYOUT_ARGS, *layout] for name, (task, layout) in LAYOUTS.items()}
    return _evaluations(tmp_path_factory.mktemp("evaluate-layouts"), runs, nproc=2)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_gives_the_one_process_results(one_process, layouts, layout):
    task = LAYOUTS[layout][0]
    expected, parallel = one_process[f"{task}-layouts"], layouts[layout]
    if task == "perplexity":
        for key in ("tokens", "words", "bytes", "windows"):
            assert parallel[key] == expected[key]
        for key in ("loglikelihood", "word_perplexity", "byte_perplexity", "bits_per_byte", "token_perplexity"):
            assert parallel[key] == pytest.approx(expected[key], rel=1e-6)
        assert parallel["strided"]["windows"] == expected["strided"]["windows"]
        assert parallel["strided"]["loss"] == pytest.approx(expected["strided"]["loss"], rel=1e-6)
        return
    for mode in ("strict", "non_strict"):
        assert parallel[mode]["correct"] == expected[mode]["correct"]
        assert parallel[mode]["perplexity"] == pytest.approx(expected[mode]["perplexity"], rel=1e-6)
    mine, theirs = parallel["examples.jsonl"], expected["examples.jsonl"]
    assert [(e["greedy"], e["match"], e["non_strict"]["greedy"]) for e in mine] == [
        (e["greedy"], e["match"], e["non_strict"]["greedy"]) for e in theirs]
    for a, b in zip(mine, theirs):
        assert a["target_loglikelihood"] == pytest.approx(b["target_loglikelihood"], rel=1e-6, abs=1e-6)


def test_a_missing_checkpoint_or_input_is_one_line(checkpoint, tmp_path):
    for args, message in ((["--input", str(tmp_path / "none.txt"), "--load", checkpoint], "No such file"),
                          (["--input", str(ROOT / "README.md"), "--load", str(tmp_path / "none")], "no checkpoint at")):
        result = run_tool_here("tools/evaluate.py", "--task", "perplexity", *args)
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


@pytest.mark.parametrize("task, output, path, message", [
    ("perplexity", "--output-examples", "none/x.jsonl", "--output-examples is for --task lambada (one line per "
                                                        "example)."),
    ("lambada", "--output-examples", "t.jsonl/x.jsonl", "--output-examples {path} cannot be written: {tmp}/t.jsonl "
                                                        "is not a folder; give another path."),
    ("perplexity", "--output", "t.jsonl/new/x.json", "--output {path} cannot be written: {tmp}/t.jsonl is not a "
                                                     "folder; give another path."),
    ("lm-eval", "--output", "t.jsonl/x.json", "--output {path} cannot be written: {tmp}/t.jsonl is not a folder; "
                                              "give another path."),
    ("lm-eval", "--output", ".", "--output {path} is a folder: give a file path (for example {path}/results.json).")],
    ids=["examples-of-perplexity", "examples-folder-is-a-file", "output-folder-is-a-file", "lm-eval-folder-is-a-file",
         "lm-eval-output-is-a-folder"])
def test_an_output_that_cannot_be_written_is_refused_before_the_checkpoint_is_read(tmp_path, task, output, path,
                                                                                   message):
    """Said in one line, exit 2, before the checkpoint is read (here there is none), lm-eval's tasks are looked
    up or anything is scored: an evaluation is not lost at its end to an output that cannot be written; nothing
    is written. (A folder that does not exist yet is made once the checkpoint is found: the ``ours`` fixture of
    test_lm_eval.py and ``one_process`` here write into one.)"""
    from tests.functional.launch import run_tool_here

    text = tmp_path / "t.jsonl"
    text.write_text(json.dumps({"text": "the model reads every token"}) + "\n")
    path = tmp_path / path
    done = run_tool_here("tools/evaluate.py", "--task", task, "--input", str(text), "--load", str(tmp_path / "no"),
                         "--lm-eval-tasks", "megatron_cloze", output, str(path))
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.strip().splitlines() == [f"evaluate.py: error: {message.format(path=path, tmp=tmp_path)}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]
