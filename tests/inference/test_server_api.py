"""The server as lm-eval and the OpenAI clients drive it with their defaults: lm-eval's
``local-completions`` (its remote tokenizer found through ``/tokenizer_info``, its default batch size and
64) gives the engine's own log-likelihoods on a cloze task; chat completions through the ``openai`` client
and lm-eval's ``local-chat-completions``; a tokenizer's chat template rendered as transformers renders it;
``/tokenize`` and ``/detokenize``; ``/v1/models/{id}``; a request of many prompts split over batches."""

from __future__ import annotations

import json
import random

import pytest

from megatron.inference import Request, SamplingParams
from tests.inference.conftest import PROMPTS, WORDS
from tests.inference.test_server import MODEL, _TestEngine, alone, get, post, running

openai = pytest.importorskip("openai")
from megatron.inference.guard import Limits  # noqa: E402
from megatron.inference.server import ChatTemplate, chat_template  # noqa: E402
from megatron.inference.server.chat import PLAIN  # noqa: E402

BATCH = 8  # --max-batch-size of the server here: a request of 12 prompts runs in two batches


@pytest.fixture(scope="module")
def served(engine):
    with running(engine, max_batch_size=BATCH) as (url, scheduler):
        yield url, scheduler


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="x", max_retries=0, timeout=60)


def _scores(engine, ids: list[int]):
    """The engine's log-probability of each of ``ids`` after those before it, and whether it was the
    most likely token there."""
    out = engine.generate([Request(ids, SamplingParams(max_tokens=0, logprobs=1, prompt_logprobs=True))])[0]
    greedy = [None] + [top[0][0] == token for top, token in zip(out.prompt_top_logprobs[1:], ids[1:], strict=True)]
    return out.prompt_logprobs, greedy


# lm-eval -------------------------------------------------------------------------------------------

def _tasks(folder) -> str:
    """Two lm-eval tasks (YAML) over a local JSONL file of short texts: a LAMBADA-style cloze (context, next
    word) and the rolling log-likelihood of the whole text."""
    rng = random.Random(5)
    rows = []
    for _ in range(12):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
        rows.append({"context": " ".join(words[:-1]), "target": " " + words[-1]})
    (folder / "cloze.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = ("dataset_path: json\ndataset_kwargs:\n"
            f"  data_files:\n    test: {folder / 'cloze.jsonl'}\n  cache_dir: {folder / 'cache'}\ntest_split: test\n")
    (folder / "cloze_serve.yaml").write_text(
        f"task: cloze_serve\n{data}output_type: loglikelihood\ndoc_to_text: '{{{{context}}}}'\n"
        "doc_to_target: '{{target}}'\nmetric_list:\n  - metric: acc\n")
    (folder / "rolling_serve.yaml").write_text(
        f"task: rolling_serve\n{data}output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{context}}{{target}}'\nmetric_list:\n  - metric: word_perplexity\n")
    return str(folder)


def test_lm_eval_local_completions_gives_the_engines_loglikelihoods(engine, served, tmp_path):
    """lm-eval's local-completions with its defaults but base_url and max_length (auto tokenizer: the
    server's, found through /tokenizer_info; batch size 1) and with batch_size 64 (one request of 12
    prompts): each example's log-likelihood within 1e-4 of the engine's, the same accuracy; each text's
    rolling log-likelihood (its first token scored after the end-of-document token, whose id lm-eval
    found by tokenizing its spelling) within 1e-4 of the engine's."""
    pytest.importorskip("tenacity")  # lm-eval's [api] extra
    from lm_eval.evaluator import evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    # lm_eval's own tasks not indexed, and evaluate() rather than simple_evaluate(): the same evaluation
    # without 25 s of indexing and of collecting the environment's description
    manager = TaskManager(include_path=_tasks(tmp_path), include_defaults=False)
    tokenize = engine.tokenizer.tokenize
    for extra, names in (({}, ["cloze_serve", "rolling_serve"]), ({"batch_size": 64}, ["cloze_serve"])):
        lm = LocalCompletionsAPI(base_url=served[0] + "/v1/completions", model=MODEL, max_length=96, **extra)
        assert lm.tokenizer_backend == "remote" and lm.eot_token_id == engine.tokenizer.eod
        out = evaluate(lm, manager.load(names), log_samples=True, bootstrap_iters=0)
        samples = out["samples"]["cloze_serve"]
        assert len(samples) == 12
        hits = []
        for sample in samples:
            context, target = sample["doc"]["context"], sample["doc"]["target"]
            whole, start = tokenize(context + target), len(tokenize(context))
            logprobs, greedy = _scores(engine, whole)
            ll, is_greedy = sample["resps"][0][0]
            assert ll == pytest.approx(sum(logprobs[start:]), abs=1e-4)
            assert is_greedy == all(greedy[start:])
            hits.append(all(greedy[start:]))
        assert out["results"]["cloze_serve"]["acc,none"] == pytest.approx(sum(hits) / len(hits))
        for sample in out["samples"].get("rolling_serve", []):
            logprobs, _ = _scores(engine, [engine.tokenizer.eod, *tokenize(sample["doc"]["context"] +
                                                                         sample["doc"]["target"])])
            assert sample["resps"][0][0] == pytest.approx(sum(logprobs[1:]), abs=1e-4)
    assert served[1].stats.largest_batch == BATCH  # the request of 12 ran in two batches


# Chat -------------------------------------------------------------------------------------------------

def test_chat_through_the_openai_client_and_lm_eval(engine, served, client):
    """A chat is the plain template's text, generated as a completion would be: whole, streamed (the first
    chunk opens the assistant's message), through lm-eval's local-chat-completions; its bounds are 400s."""
    messages = [{"role": "system", "content": "the model reads"}, {"role": "user", "content": "every token"}]
    text = "system: the model reads\nuser: every token\nassistant:"
    reference = alone(engine, text, max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == reference.text
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens == len(engine.tokenizer.tokenize(text))
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks) and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reference.text
    assert chunks[-1].choices[0].finish_reason == "length"
    lp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0, logprobs=True,
                                        top_logprobs=2, extra_body={"ignore_eos": True}).choices[0].logprobs.content
    assert [e.logprob for e in lp] == pytest.approx(reference.logprobs[:3], abs=1e-5)
    assert [t.logprob for t in lp[0].top_logprobs] == pytest.approx([v for _, v in reference.top_logprobs[0]], abs=1e-5)
    # no max_tokens: the rest of the model's positions, as vLLM does
    rest = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert rest.usage.total_tokens == 96 and rest.choices[0].finish_reason == "length"

    pytest.importorskip("tenacity")
    from lm_eval.api.instance import Instance
    from lm_eval.models.api_models import JsonChatStr
    from lm_eval.models.openai_completions import LocalChatCompletion

    lm = LocalChatCompletion(base_url=served[0] + "/v1/chat/completions", model=MODEL)
    request = Instance("generate_until", {}, (JsonChatStr(json.dumps(messages)), {"until": ["never said"],
                                                                                    "max_gen_toks": 8}), 0)
    assert lm.generate_until([request]) == [alone(engine, text, max_tokens=8, temperature=0).text]

    for fields, param in (({"messages": [{"role": "user", "content": "the model reads " * 30}]}, "messages"),
                          ({"messages": messages, "max_tokens": 90}, "max_tokens"),
                          ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
                          ({"messages": []}, "messages"),
                          ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
                          ({"messages": messages, "top_logprobs": 2}, "top_logprobs"),
                          ({"messages": messages, "tools": []}, "tools"), ({"messages": messages, "n": 2}, "n")):
        status, body = post(served[0] + "/v1/chat/completions", json.dumps({"model": MODEL, **fields}).encode())
        assert status == 400 and body["error"]["param"] == param and "\n" not in body["error"]["message"], body
    assert "maximum context length is 96 tokens" in post(served[0] + "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "the model reads " * 30}]}).encode())[1]["error"]["message"]


TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' and loop.first %}"
            "{{ raise_exception('the first message must not be the assistant') }}{% endif %}"
            "{{ m['role'] }}|{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant|{% endif %}")


def _hf_folder(engine, folder, template: str) -> str:
    """The engine's tokenizer as a Hugging Face tokenizer.json, with a tokenizer_config.json holding ``template``."""
    engine.tokenizer._tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                              "chat_template": template}))
    return str(folder / "tokenizer.json")


def test_a_tokenizer_chat_template_renders_as_transformers_does(engine, checkpoint, tmp_path, capsys):
    """A tokenizer_config.json's chat_template gives the ids transformers' apply_chat_template gives (its
    eos_token read as that token); the template's raise_exception is a 400; a broken template stops
    tools/serve.py at start with one line."""
    transformers = pytest.importorskip("transformers")
    from megatron.tokenizer import HuggingFaceTokenizer
    from tests.inference.conftest import _tool

    path = _hf_folder(engine, tmp_path, TEMPLATE)
    template = chat_template(HuggingFaceTokenizer(path))
    assert template.origin.endswith("tokenizer_config.json")
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=path, eos_token="<|endoftext|>",
                                                  chat_template=TEMPLATE)
    messages = [{"role": "user", "content": "the model reads"}, {"role": "assistant", "content": "every token"},
                {"role": "user", "content": "again tomorrow"}]
    with running(engine, template=template) as (url, _):
        status, body = post(url + "/tokenize", json.dumps({"messages": messages}).encode())
        rendered = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert rendered == template.render(messages)
        assert status == 200 and body["tokens"] == theirs(rendered, add_special_tokens=False)["input_ids"]
        assert body["tokens"].count(engine.tokenizer.eod) == 3
        status, body = post(url + "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "assistant", "content": "x"}], "max_tokens": 2}).encode())
        assert status == 400 and body["error"]["param"] == "messages"
        assert body["error"]["message"] == ("the chat template refuses these messages: the first message must not "
                                            "be the assistant")
        assert get(url + "/tokenizer_info")[1]["chat_template"] == TEMPLATE
    broken = tmp_path / "broken"
    broken.mkdir()
    bad = _hf_folder(engine, broken, "{% for m in messages %}")
    capsys.readouterr()
    assert _tool("serve").main(["--load", checkpoint, "--tokenizer-type", "HuggingFaceTokenizer",
                                "--tokenizer-model", bad]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"serve.py: error: the chat template of {broken / 'tokenizer_config.json'} is not a valid jinja template "
        "(Unexpected end of template. Jinja was looking for the following tags: 'endfor' or 'else'. The innermost "
        "block that needs to be closed is 'for'.): fix it or remove it."]


def test_the_plain_template_renders_the_same_in_lm_eval():
    """/tokenizer_info's plain template, rendered by lm-eval's remote tokenizer, is the server's text."""
    lm_utils = pytest.importorskip("lm_eval.utils")
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b\nc"}, {"role": "user",
                                                                                             "content": "d"}]
    ours = ChatTemplate(PLAIN, "plain").render(messages)
    assert ours == "user: a\nassistant: b\nc\nuser: d\nassistant:"
    assert lm_utils.env.from_string(PLAIN).render(messages=messages, add_generation_prompt=True) == ours


# Tokens and models ------------------------------------------------------------------------------------

def test_tokenize_and_detokenize(engine, served):
    url, tokenizer = served[0], engine.tokenizer
    text = PROMPTS[2]
    status, body = post(url + "/tokenize", json.dumps({"model": MODEL, "prompt": text, "add_special_tokens": False,
                                                       "return_token_strs": True}).encode())
    assert status == 200 and body["tokens"] == tokenizer.tokenize(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 96 and "".join(body["token_strs"]) == text
    assert post(url + "/detokenize", json.dumps({"tokens": body["tokens"]}).encode()) == (200, {"prompt": text})
    info = get(url + "/tokenizer_info")[1]
    assert info["eos_token"] == "<|endoftext|>" and info["chat_template"] == PLAIN
    eos = post(url + "/tokenize", json.dumps({"prompt": "a" + info["eos_token"] + "b"}).encode())[1]["tokens"]
    assert eos == [*tokenizer.tokenize("a"), tokenizer.eod, *tokenizer.tokenize("b")]
    for path, fields, param in (("/detokenize", {"tokens": [300]}, "tokens"), ("/detokenize", {"tokens": [True]},
                                                                                   "tokens"),
                                ("/tokenize", {}, None), ("/tokenize", {"prompt": "a", "messages": []}, "prompt")):
        status, body = post(url + path, json.dumps(fields).encode())
        assert status == 400 and body["error"]["param"] == param, body
    status, body = post(url + "/tokenize", json.dumps({"model": "gpt-5", "prompt": "a"}).encode())
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_models_by_id(client, served):
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.max_model_len == 96
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("org/other")
    assert raised.value.code == "model_not_found"


# Many prompts -----------------------------------------------------------------------------------------

def test_many_prompts_in_one_request_equal_the_same_prompts_one_at_a_time(engine, served, client):
    """20 prompts (2.5 batches of 8): each choice is what the prompt gets alone, greedy and seeded, with
    lm-eval's echo and logprobs; a request over --max-request-tokens is a 400."""
    prompts = [PROMPTS[i % 4] + " " + WORDS[i] for i in range(20)]
    before = served[1].stats.batches
    many = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0.7, seed=3)
    assert served[1].stats.batches - before == 3 and [c.index for c in many.choices] == list(range(20))
    assert [c.text for c in many.choices] == [alone(engine, p, max_tokens=4, temperature=0.7, seed=3).text
                                              for p in prompts]
    scored = client.completions.create(model=MODEL, prompt=prompts, max_tokens=1, temperature=0, echo=True,
                                       logprobs=1)
    for prompt, choice in zip(prompts, scored.choices, strict=True):
        one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                        logprobs=1).choices[0]
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(one.logprobs.token_logprobs[1:], abs=1e-5)
        assert choice.text == one.text
    with running(engine, limits=Limits(max_request_tokens=100)) as (url, _):
        status, body = post(url + "/v1/completions", json.dumps({"prompt": ["a"] * 20, "max_tokens": 5}).encode())
        assert status == 400 and "--max-request-tokens" in body["error"]["message"], body
        assert post(url + "/v1/completions", json.dumps({"prompt": ["a"] * 16, "max_tokens": 5}).encode())[0] == 200


def test_stopping_cancels_the_batch_that_runs(engine):
    """stop() cancels the rows of the batch in progress, after its first step too (it used to forget the
    batch once a step was delivered, so a shutdown waited for every row's max_tokens)."""
    with running(_TestEngine(engine, step_seconds=0.02)) as (url, scheduler):
        stream = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30).completions.create(
            model=MODEL, prompt="a", max_tokens=90, stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        next(iter(stream))
        scheduler.stop()
        assert [e.reason for e in scheduler.ended] == ["cancelled"] and scheduler.ended[0].tokens < 60
        assert scheduler.stats.tokens == scheduler.ended[0].tokens


def test_a_large_request_is_sliced_behind_the_requests_waiting(engine):
    """A job of 20 rows with batches of 8: its first 8, then the job queued after it together with the
    rest of the first, then the last 4: the smaller request does not wait for the whole large one."""
    import asyncio

    from megatron.inference.scheduler import Job, Scheduler

    scheduler, loop = Scheduler(engine, max_batch_size=8), asyncio.new_event_loop()
    try:
        large, small = Job([Request([1])] * 20, loop), Job([Request([2])] * 3, loop)
        scheduler._pending.extend([large, small])
        taken = [[(job is large, start, end) for job, start, end in scheduler._take()] for _ in range(3)]
    finally:
        loop.close()
    assert taken == [[(True, 0, 8)], [(False, 0, 3), (True, 8, 13)], [(True, 13, 20)]]
