"""lm-evaluation-harness on the checkpoint (``MegatronLM``, ``tools/evaluate.py --task lm-eval``) against
lm-eval's own ``hf`` backend on the ``to-hf`` export, over three offline tasks (``lm_eval_tasks``: a cloze
scored by ``loglikelihood``, documents by ``loglikelihood_rolling``, ``generate_until``), on one process and
at tp 2 and pp 2 under torchrun."""

from __future__ import annotations

import json
import sys

import pytest

from megatron.inference import initialize, load_model, tokenizer_for
from tests.functional.launch import outcome, run_several, run_tool_here
from tests.inference.conftest import greedy_tokens, last_word_guesses
from tests.inference.lm_eval_tasks import MAX_GEN_TOKS, TASKS, hf_lm, write_tasks

pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install -e .[eval]")

MAX_LENGTH = 48  # shorter than the model's 96 positions: the licence's documents take several rolling windows
BATCH = 16  # requests per forward: each kind of request in one or two calls
METRICS = {"megatron_cloze": ("acc,none", "perplexity,none"),
           "megatron_rolling": ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"),
           "megatron_generate": ("exact_match,none",)}


@pytest.fixture(scope="module")
def task_dir(checkpoint, tmp_path_factory):
    """The three tasks, with examples the random model gets right and others it gets wrong (from the inference
    loader's model, not the code under test): cloze passages of the Python licence completed by the model's
    argmax word, and prompts whose answer is its greedy continuation (or another)."""
    from tests.inference.test_evaluate import _document

    initialize()
    model, config = load_model(checkpoint)
    tokenizer, vocab = tokenizer_for(config), config.model.vocab_size
    lines = [" ".join(line.split()) for line in _document().splitlines() if len(line.split()) >= 6]
    guessed = last_word_guesses(model, tokenizer, vocab, lines, 4)
    documents = [_document()[:700], _document()[700:1000], "the model reads every token"]
    generate = []
    for i, line in enumerate(lines[:6]):
        prompt = " ".join(line.split()[:4])
        text = tokenizer.detokenize(greedy_tokens(model, vocab, tokenizer.tokenize(prompt), MAX_GEN_TOKS))
        generate.append((prompt, text.split("\n")[0] if i % 2 == 0 else " no"))
    return write_tasks(tmp_path_factory.mktemp("lm-eval-tasks"), lines[:6] + guessed, documents, generate)


def _args(task_dir, checkpoint, out) -> list[str]:
    return ["--task", "lm-eval", "--lm-eval-tasks", ",".join(TASKS), "--include-path", str(task_dir), "--load",
            checkpoint, "--max-seq-len", str(MAX_LENGTH), "--batch-size", str(BATCH), "--micro-batch-size", "2",
            "--log-samples", "--bootstrap-iters", "0", "--output", str(out)]


STDOUT: dict[str, str] = {}  # tools/evaluate.py's standard output, by fixture


@pytest.fixture(scope="module")
def ours(checkpoint, task_dir, tmp_path_factory) -> dict:
    """tools/evaluate.py --task lm-eval on one process (in this one)."""
    out = tmp_path_factory.mktemp("lm-eval-ours") / "new" / "results.json"  # its folder made before the scoring
    done = run_tool_here("tools/evaluate.py", *_args(task_dir, checkpoint, out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1])["results"] == json.loads(out.read_text())["results"]
    STDOUT["ours"] = done.stdout
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def hf(checkpoint, task_dir, tmp_path_factory) -> dict:
    """lm-eval's hf backend on the to-hf export of the checkpoint."""
    pytest.importorskip("transformers")
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable

    export = tmp_path_factory.mktemp("lm-eval-hf")
    assert run_tool_here("tools/convert_checkpoint.py", "to-hf", checkpoint, str(export)).returncode == 0
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    results = lm_eval.simple_evaluate(model=hf_lm(str(export), MAX_LENGTH, BATCH), tasks=list(TASKS),
                                      task_manager=manager, log_samples=True, bootstrap_iters=0)
    return json.loads(json.dumps(results, default=handle_non_serializable))  # as tools/evaluate.py writes it


def assert_same(got: dict, want: dict) -> None:
    """Every metric and every example's response of ``got`` equal ``want``'s: accuracies and exact matches
    exactly, log-likelihoods (and the perplexities made of them) within 1e-4."""
    for task, metrics in METRICS.items():
        for metric in metrics:
            exact = metric.startswith(("acc", "exact_match"))
            assert got["results"][task][metric] == (want["results"][task][metric] if exact else
                                                    pytest.approx(want["results"][task][metric], rel=1e-4)), metric
        assert len(got["samples"][task]) == len(want["samples"][task])
        for mine, theirs in zip(got["samples"][task], want["samples"][task], strict=True):
            assert mine["doc"] == theirs["doc"]
            ((response,),), ((expected,),) = mine["resps"], theirs["resps"]  # one request, one response
            if task == "megatron_cloze":  # (log-likelihood, greedy)
                assert response[0] == pytest.approx(expected[0], abs=1e-4) and response[1] == expected[1]
            elif task == "megatron_rolling":  # the document's log-likelihood
                assert response == pytest.approx(expected, abs=1e-4)
            else:  # the generated text
                assert response == expected


@pytest.mark.slow  # evaluates the model three ways
def test_our_lm_gives_lm_evals_hf_backend_results(ours, hf):
    """Same accuracy and exact match, per-example log-likelihoods within 1e-4, the same generated texts; the
    comparison means something: some answers right and some wrong, documents over several windows."""
    assert_same(ours, hf)
    assert 0 < ours["results"]["megatron_cloze"]["acc,none"] < 1
    assert 0 < ours["results"]["megatron_generate"]["exact_match,none"] < 1
    assert ours["megatron"]["max_length"] == MAX_LENGTH and ours["megatron"]["layout"]["tp"] == 1


@pytest.mark.slow
def test_lm_evals_results_table_comes_before_the_json_line(ours):
    """Stdout holds lm-eval's own table (``make_table``: its header, a row per task and metric), then the JSON."""
    lines = STDOUT["ours"].splitlines()
    json.loads(lines[-1])
    header = [i for i, line in enumerate(lines) if line.startswith("|") and "Tasks" in line]
    assert len(header) == 1, STDOUT["ours"]
    cells = [c.strip() for c in lines[header[0]].strip("|").split("|")]
    assert cells[:5] == ["Tasks", "Version", "Filter", "n-shot", "Metric"] and "Value" in cells and "Stderr" in cells
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[header[0] + 2:-1] if line.startswith("|")]
    cloze = next(row for row in rows if row[0] == "megatron_cloze")
    assert cloze[4] == "acc"
    assert float(cloze[6]) == pytest.approx(ours["results"]["megatron_cloze"]["acc,none"], abs=1e-4)
    assert {row[4] for row in rows} >= {"acc", "perplexity", "word_perplexity", "exact_match"}


def test_lm_evals_local_completions_against_the_server_gives_the_same(ours, engine, task_dir):
    """The fourth path: lm-eval's local-completions with its defaults (batch size 1, the server's tokenizer) but
    base_url and max_length, against tools/serve.py's server (the KV-cache engine, left-padded batches of
    BATCH): the same results, per example too."""
    pytest.importorskip("tenacity")  # lm-eval's [api] extra
    from lm_eval.evaluator import evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable

    from tests.inference.test_server import MODEL, running

    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    with running(engine, max_batch_size=BATCH) as (url, _):
        # lm-eval's API models keep max_length - 1 tokens, the scored ones included, and roll windows of
        # max_length - 2 predictions; HFLM feeds max_length tokens and scores the next: + 2 cuts as HFLM does
        lm = LocalCompletionsAPI(base_url=url + "/v1/completions", model=MODEL, max_length=MAX_LENGTH + 2)
        served = evaluate(lm, manager.load(list(TASKS)), log_samples=True, bootstrap_iters=0)
    assert_same(json.loads(json.dumps(served, default=handle_non_serializable)), ours)


@pytest.mark.slow
def test_the_python_api_by_lm_evals_registered_name(checkpoint, task_dir, ours):
    """lm-eval builds MegatronLM from its registered name and a model_args string (the layout flags as
    ``args``), and it answers as the command does; an empty continuation and sampling."""
    import lm_eval
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    import megatron.evaluation.lm_eval_model  # noqa: F401 - registers megatron-gpt
    from megatron.initialize import shutdown

    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    try:
        lm = get_model("megatron-gpt").create_from_arg_string(
            f"load={checkpoint},args=--max-seq-len {MAX_LENGTH}", {"batch_size": BATCH, "device": None})
        results = lm_eval.simple_evaluate(model=lm, tasks=["megatron_cloze"], task_manager=manager, limit=3,
                                          log_samples=True, bootstrap_iters=0)
        got = [sample["resps"][0][0] for sample in results["samples"]["megatron_cloze"]]
        want = [sample["resps"][0][0] for sample in ours["samples"]["megatron_cloze"][:3]]
        assert [g[1] for g in got] == [w[1] for w in want]
        assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-6)
        # An empty continuation scores nothing, as HFLM's: (0, greedy).
        assert lm.loglikelihood([Instance("loglikelihood", {}, ("the model", ""), 0)]) == [(0.0, True)]
        # Sampling: drawn from the seeded generator (every rank draws the same), top_k 1 is the greedy choice.
        def generate(**kwargs):
            lm.generator.manual_seed(7)
            gen_kwargs = {"until": ["\n"], "max_gen_toks": 6, **kwargs}
            return lm.generate_until([Instance("generate_until", {}, ("the model reads", gen_kwargs), 0)] * 3)

        sampled = generate(do_sample=True, temperature=1.0, top_p=0.95)
        assert sampled == generate(do_sample=True, temperature=1.0, top_p=0.95) and len(set(sampled)) > 1
        assert generate(do_sample=True, temperature=1.0, top_k=1) == generate(do_sample=False)
    finally:
        shutdown()


@pytest.mark.slow
def test_tp2_and_pp2_give_the_one_process_results(checkpoint, task_dir, ours, tmp_path):
    """tools/evaluate.py --task lm-eval under torchrun at tp 2 and at pp 2 (one two-rank launch)."""
    runs = [(tmp_path / name, [*_args(task_dir, checkpoint, tmp_path / f"{name}.json"), *layout])
            for name, layout in (("tp2", ["--tp", "2"]), ("pp2", ["--pp", "2"]))]
    launch = run_several(runs, 2, program="tools/evaluate.py")
    for out, _ in runs:
        outcome(out, 2, launch).check()
        result = json.loads((tmp_path / f"{out.name}.json").read_text())
        assert result["megatron"]["layout"][out.name[:2]] == 2
        assert_same(result, ours)
        assert json.loads(outcome(out, 2, launch).stdout.splitlines()[-1])["results"] == result["results"]
        assert not (out / "rank1.out").read_text()  # rank 0 writes


def test_an_unknown_task_is_one_line_before_the_checkpoint_is_read(tmp_path, monkeypatch):
    """(lm-eval's own thousands of tasks are left out of the search here: indexing them takes 20 s.)"""
    import lm_eval.tasks

    class OnlyIncluded(lm_eval.tasks.TaskManager):
        def __init__(self, include_path=None, include_defaults=True, **kwargs):
            super().__init__(include_path=include_path, include_defaults=False, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", OnlyIncluded)
    task_dir = write_tasks(tmp_path / "tasks", ["a cloze passage"], ["a document"], [("a prompt", " an answer")])
    done = run_tool_here("tools/evaluate.py", "--task", "lm-eval", "--lm-eval-tasks", "megatron_cloze,no_such_task",
                         "--include-path", str(task_dir), "--load", str(tmp_path / "none"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("evaluate.py: error: unknown lm-eval task no_such_task: ")


LIMIT = "give a number of examples per task (a whole number, 1 or more) or a share of them (a fraction above 0 and " \
        "below 1)."


@pytest.mark.parametrize("flags, message", [
    (["--limit", "0"], f"--limit 0: {LIMIT}"), (["--limit", "-1"], f"--limit -1: {LIMIT}"),
    (["--limit", "2.5"], f"--limit 2.5: {LIMIT}"), (["--limit", "inf"], f"--limit inf: {LIMIT}"),
    (["--batch-size", "0"], "--batch-size 0: give 1 or more."),
    (["--bootstrap-iters", "-1"], "--bootstrap-iters -1: give 0 or more."),
    (["--include-path", "{tasks}"], "{tasks}/megatron_cloze.yaml is not valid YAML (line 2, column 19: mapping values "
                                    "are not allowed in this context): fix it, or move it out of the --include-path "
                                    "folder."),
    (["--include-path", "{tasks}"], "{tasks}/broken/b.yaml is not valid YAML (line 3, column 1: found unexpected "
                                    "end of stream, while scanning a quoted scalar from line 2, column 14): fix it, or "
                                    "move it out of the --include-path folder.")],
    ids=["limit-0", "limit-negative", "limit-not-whole", "limit-inf", "batch-size-0", "bootstrap-negative",
         "yaml-mapping", "yaml-unclosed-quote"])
def test_a_bad_request_is_one_line_naming_it_before_anything_is_read(tmp_path, request, flags, message):
    """Each refused in one line, exit 2, before lm-eval's tasks are looked up or the checkpoint (here none) is
    read; nothing written. A task YAML lm-eval's index would skip without a word (the task then 'unknown') is named
    with YAML's line and column."""
    tasks = write_tasks(tmp_path / "tasks", ["a cloze passage"], ["a document"], [("a prompt", " an answer")])
    if request.node.callspec.id == "yaml-mapping":
        (tasks / "megatron_cloze.yaml").write_text("task: megatron_cloze\ndataset_path: json: x\n")
    if request.node.callspec.id == "yaml-unclosed-quote":
        (tasks / "broken").mkdir()
        (tasks / "broken" / "b.yaml").write_text("task: b\ndoc_to_text: '{{text}}\n")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    done = run_tool_here("tools/evaluate.py", "--task", "lm-eval", "--lm-eval-tasks", "megatron_cloze", "--load",
                         str(tmp_path / "none"), "--output", str(tmp_path / "out" / "r.json"),
                         *[f.format(tasks=tasks) for f in flags])
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.strip().splitlines() == [f"evaluate.py: error: {message.format(tasks=tasks)}"]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_task_folder_with_python_is_said_in_one_note(tmp_path):
    """lm-eval imports the module a task YAML names with ``!function`` (a .py beside it): the folder is code, and
    the tool says so in one line on stderr before going on (here to the missing checkpoint)."""
    tasks = write_tasks(tmp_path / "tasks", ["a cloze passage"], ["a document"], [("a prompt", " an answer")])
    cloze = tasks / "megatron_cloze.yaml"
    cloze.write_text(cloze.read_text() + "process_docs: !function utils.keep\n")
    (tasks / "utils.py").write_text("def keep(docs):\n    return docs\n")
    done = run_tool_here("tools/evaluate.py", "--task", "lm-eval", "--lm-eval-tasks", "megatron_cloze",
                         "--include-path", str(tasks), "--load", str(tmp_path / "none"))
    assert done.returncode == 2, done.stderr
    note, error = done.stderr.strip().splitlines()[-2:]
    assert note == (f"evaluate.py: note: --include-path {tasks} holds Python that lm-eval may run (!function in "
                    f"megatron_cloze.yaml; utils.py): a task folder is code, pass only folders you trust.")
    assert error.startswith(f"evaluate.py: error: no checkpoint at {tmp_path / 'none'}")
    plain = write_tasks(tmp_path / "plain", ["a cloze passage"], ["a document"], [("a prompt", " an answer")])
    done = run_tool_here("tools/evaluate.py", "--task", "lm-eval", "--lm-eval-tasks", "megatron_cloze",
                         "--include-path", str(plain), "--load", str(tmp_path / "none"))
    assert done.returncode == 2 and "note:" not in done.stderr, done.stderr


def test_without_lm_eval_the_command_says_how_to_install_it(tmp_path, monkeypatch):
    """Said before the checkpoint (here none) is read."""
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    done = run_tool_here("tools/evaluate.py", "--task", "lm-eval", "--lm-eval-tasks", "x", "--load", str(tmp_path))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "pip install -e .[eval]" in done.stderr.strip().splitlines()[-1]


def test_the_other_tasks_still_need_an_input():
    """--input is optional now (lm-eval reads its tasks' data): perplexity and lambada without it are one line."""
    done = run_tool_here("tools/evaluate.py", "--task", "perplexity", "--load", "anything")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == ["evaluate.py: error: --task perplexity needs --input FILE: the text to "
                                                "evaluate."]
