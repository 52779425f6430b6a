"""The OpenAI-compatible server through the real ``openai`` client: completions (plain, streamed,
logprobs, echo, stop strings, prompt lists) equal to the engine's own results, 16 concurrent clients
batched together, OpenAI-shaped 400s that leave the server up, cancelled work when a client leaves,
a failed batch as a 500 (the ``tools/serve.py`` command line: test_serve_tool.py)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from megatron.inference import Request, SamplingParams
from tests.inference.conftest import PROMPTS

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from megatron.inference.scheduler import Scheduler  # noqa: E402
from megatron.inference.server import HTTPServer, create_app  # noqa: E402

MODEL = "tiny"


@contextmanager
def running(engine, api_key=None, limits=None, template=None, **scheduler_options):
    """A server on a free port in a background thread: (base url, its scheduler)."""
    scheduler = Scheduler(engine, **scheduler_options).start()
    server = HTTPServer(create_app(scheduler, MODEL, limits, api_key, template), "127.0.0.1", 0)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.port}", scheduler
    finally:
        server.should_exit = True
        thread.join(10)
        scheduler.stop()


@pytest.fixture(scope="module")
def served(engine):
    with running(engine) as (url, scheduler):
        yield url, scheduler


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="x", max_retries=0, timeout=60)


def alone(engine, prompt: str, **params):
    return engine.generate([Request(engine.tokenizer.tokenize(prompt), SamplingParams(**params))])[0]


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def post(url: str, data: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


# Completions --------------------------------------------------------------------------------------

def test_health_and_models(served, client):
    assert get(served[0] + "/health") == (200, {"status": "ok"})
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].object == "model"
    status, body = get(served[0] + "/v1/nowhere")
    assert status == 404 and body["error"]["type"] == "invalid_request_error"


def test_plain_completion_equals_the_engine(engine, client):
    reference = alone(engine, PROMPTS[0], max_tokens=12, temperature=0)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    assert len(out.choices) == 1 and out.choices[0].index == 0 and out.choices[0].logprobs is None
    assert out.choices[0].text == reference.text and out.choices[0].finish_reason == reference.finish_reason
    n = len(engine.tokenizer.tokenize(PROMPTS[0]))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == \
        (n, len(reference.tokens), n + len(reference.tokens))


def test_streamed_chunks_concatenate_to_the_greedy_text(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and all(c.object == "text_completion" for c in chunks)
    text_chunks, usage = chunks[:-1], chunks[-1]
    assert len(text_chunks) > 5 and all(c.choices[0].text or c.choices[0].finish_reason for c in text_chunks)
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage.choices == [] and usage.usage.completion_tokens == whole.usage.completion_tokens


def test_logprobs_equal_the_engine(engine, client):
    reference = alone(engine, PROMPTS[0], max_tokens=8, temperature=0, logprobs=3)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    detok = engine.tokenizer.detokenize
    assert lp.tokens == [detok([t]) for t in reference.tokens]
    assert lp.token_logprobs == pytest.approx(reference.logprobs, abs=1e-5)
    for got, want in zip(lp.top_logprobs, reference.top_logprobs, strict=True):
        assert got == pytest.approx({detok([t]): v for t, v in want}, abs=1e-5)
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3, stream=True)]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks for x in getattr(c, key)] == getattr(lp, key)


def test_echo_prepends_the_prompt_and_its_logprobs(engine, client):
    prompt = PROMPTS[3]
    ids = engine.tokenizer.tokenize(prompt)
    reference = engine.generate([Request(ids, SamplingParams(max_tokens=4, temperature=0, logprobs=1,
                                                             prompt_logprobs=True))])[0]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=1, echo=True)
    choice = out.choices[0]
    choice_text = choice.text
    assert choice_text == prompt + reference.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + len(reference.tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(reference.prompt_logprobs[1:], abs=1e-5)
    assert lp.token_logprobs[len(ids):] == pytest.approx(reference.logprobs, abs=1e-5)
    assert lp.text_offset[len(ids)] == len(prompt)
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=1,
                                              echo=True, stream=True))
    assert streamed[0].choices[0].text.startswith(prompt)
    assert "".join(c.choices[0].text for c in streamed) == choice_text
    assert [t for c in streamed for t in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].text == prompt and scored.choices[0].finish_reason == "length"
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(reference.prompt_logprobs[1:], abs=1e-5)
    assert scored.usage.completion_tokens == 0


def test_stop_string_cuts_the_text(engine, client):
    greedy = alone(engine, PROMPTS[1], max_tokens=16, temperature=0, ignore_eos=True).text
    at = next(k for k in range(2, len(greedy) - 1) if greedy.find(greedy[k:k + 2]) == k
              and "\ufffd" not in greedy[k:k + 2])
    stop = greedy[at:at + 2]
    for kwargs in ({"stop": stop}, {"stop": ["never said", stop]}):
        out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True}, **kwargs)
        assert (out.choices[0].text, out.choices[0].finish_reason) == (greedy[:at], "stop")
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=stop,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == greedy[:at]


def test_prompt_lists_and_token_ids(engine, client):
    references = [alone(engine, p, max_tokens=5, temperature=0) for p in PROMPTS]
    out = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=5, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [r.text for r in references]
    ids = engine.tokenizer.tokenize(PROMPTS[0])
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == references[0].text
    two = client.completions.create(model=MODEL, prompt=[ids, engine.tokenizer.tokenize(PROMPTS[1])], max_tokens=5,
                                    temperature=0)
    assert [c.text for c in two.choices] == [r.text for r in references[:2]]


def test_sixteen_concurrent_clients_are_batched_and_each_gets_its_own_answer(served, client):
    requests = [dict(prompt=PROMPTS[i % 4], max_tokens=4 + i % 5, temperature=0) for i in range(12)]
    requests += [dict(prompt=PROMPTS[i], max_tokens=6, temperature=0.8, seed=i, extra_body={"top_k": 20})
                 for i in range(4)]
    stats = served[1].stats
    before = stats.batches
    barrier = threading.Barrier(16)

    def send(kwargs):
        barrier.wait()
        return client.completions.create(model=MODEL, **kwargs).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(send, requests))
    batches = stats.batches - before
    single = [client.completions.create(model=MODEL, **kwargs).choices[0].text for kwargs in requests]
    assert together == single
    assert batches < 16 and stats.largest_batch > 4  # requests shared batches (4: the prompt-list test's)


# Errors -----------------------------------------------------------------------------------------------

BAD = [
    ({"max_tokens": -1}, "max_tokens"),
    ({"prompt": "the model reads " * 40}, "prompt"),
    ({"max_tokens": 1000}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [[1, 2], [99999]]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"n": 2}, "n"),
    ({"logprobs": 50}, "logprobs"),
    ({"top_p": 0}, "top_p"),
    ({"stop": [""]}, "stop"),
    ({"max_tokens": True}, "max_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"max_token": 3}, "max_token"),
    ({"seed": 2**64}, "seed"),  # today: a 500 for every request of its batch
    ({"seed": -2**63 - 1}, "seed"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"top_k": -1}, "top_k"),
    ({"stop": ["x"] * 17}, "stop"),  # --max-stop-strings 16
    ({"stop": "x" * 257}, "stop"),  # --max-stop-chars 256
    ({"prompt": [300, 301]}, "prompt"),  # beyond the tokenizer's vocabulary (and the model's)
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [1] * 97}, "prompt"),  # more ids than the model's 96 positions, refused before decoding
    ({"prompt": ["a"] * 4097}, "prompt"),  # more prompts than --max-prompts
]


def test_a_prompt_the_tokenizer_refuses_is_a_400(served):
    """A lone surrogate (valid JSON: an escape) that the tokenizer cannot encode: was a 500 with a traceback."""
    status, body = post(served[0] + "/v1/completions", b'{"model": "%s", "prompt": "caf\\ud800", "max_tokens": 2}'
                        % MODEL.encode())
    assert status == 400 and body["error"]["param"] == "prompt", body
    assert body["error"]["message"].startswith("prompt cannot be tokenized (")
    assert get(served[0] + "/health")[0] == 200


@pytest.mark.parametrize("fields,param", BAD, ids=[p + str(i) for i, (_, p) in enumerate(BAD)])
def test_bad_requests_are_openai_400s_and_the_server_stays_up(served, client, fields, param):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=body.pop("model"), prompt=body.pop("prompt"), extra_body=body)
    error = raised.value
    assert error.status_code == 400 and error.param == param and error.type == "invalid_request_error"
    assert set(error.body) == {"message", "type", "param", "code"} and "\n" not in error.body["message"]
    assert get(served[0] + "/health")[0] == 200
    assert client.completions.create(model=MODEL, prompt="a", max_tokens=1).choices[0].finish_reason


def test_a_bad_request_never_touches_the_batch_it_would_have_joined(engine):
    """While a batch runs, good requests and bad ones (a seed out of range: today a 500 for every
    request of the next batch) queue together: each bad one gets its 400, the good ones share the
    next batch and get what they get alone."""
    with running(_TestEngine(engine, step_seconds=0.02)) as (url, scheduler):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        busy = client.completions.create(model=MODEL, prompt="a", max_tokens=40, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
        next(iter(busy))  # a batch is running: what comes now queues up for the next one
        good = [dict(prompt=p, max_tokens=5, temperature=0.8, seed=i) for i, p in enumerate(PROMPTS)]
        bad = [dict(prompt=PROMPTS[0], max_tokens=5, seed=2**64), dict(prompt=PROMPTS[1], max_tokens=5, top_p=0)]

        def send(kwargs):
            try:
                return client.completions.create(model=MODEL, **kwargs).choices[0].text
            except openai.BadRequestError as error:
                return error.status_code, error.param

        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(send, [good[0], bad[0], good[1], bad[1], good[2], good[3]]))
        list(busy)
        batches = scheduler.stats.batches
        assert answers[1] == (400, "seed") and answers[3] == (400, "top_p")
        assert [answers[i] for i in (0, 2, 4, 5)] == [alone(engine, **g).text for g in good]
        assert batches <= 3 and scheduler.stats.largest_batch == 4  # the busy one, then the four good together


def test_request_size_limits(engine):
    """A body over --max-request-bytes is a 413, by its Content-Length before a byte of it is read
    (here: never sent) and while read when it has none (chunked); the server answers afterwards."""
    import http.client

    with running(engine) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.putrequest("POST", "/v1/completions")
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(10_000_000))
        connection.endheaders()  # the 10 MB never follow
        response = connection.getresponse()
        assert response.status == 413 and "--max-request-bytes" in json.loads(response.read())["error"]["message"]
        connection.close()
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        prompt = json.dumps({"prompt": "the model reads " * 70_000, "max_tokens": 1}).encode()  # 1.1 MB
        connection.request("POST", "/v1/completions", body=iter([prompt[i:i + 65536] for i in range(0, len(prompt),
                                                                                                    65536)]),
                           headers={"Content-Type": "application/json"}, encode_chunked=True)
        response = connection.getresponse()
        assert response.status == 413, response.read()
        connection.close()
        assert post(url + "/v1/completions", json.dumps({"prompt": "a", "max_tokens": 1}).encode())[0] == 200


def test_the_api_key(engine, caplog, monkeypatch):
    """With a key, every path but /health needs 'Authorization: Bearer <key>' (401 otherwise, before
    the body is read); serving beyond the loopback without a key logs a warning."""
    from megatron.inference import server as server_module
    from megatron.inference.guard import Limits
    from megatron.metrics import get_logger

    with running(engine, api_key="s3cret") as (url, _):
        for key in ("wrong", "s3cret0", "S3CRET"):
            with pytest.raises(openai.AuthenticationError) as raised:
                openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0).completions.create(
                    model=MODEL, prompt="a", max_tokens=1)
            assert raised.value.code == "invalid_api_key"
        assert post(url + "/v1/completions", b'{"prompt": "a"}')[0] == 401
        assert get(url + "/v1/models")[0] == 401 and get(url + "/health")[0] == 200
        keyed = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert keyed.completions.create(model=MODEL, prompt="a", max_tokens=1).usage.completion_tokens == 1
    get_logger().addHandler(caplog.handler)
    monkeypatch.setattr(HTTPServer, "run", lambda self: None)  # no socket: only the start-up lines matter
    try:
        for host, key in (("0.0.0.0", None), ("::1", None), ("10.1.2.3", "k")):
            caplog.clear()
            assert server_module.serve(Scheduler(engine), MODEL, host, 0, Limits(), key) == 0
            warned = [r.message for r in caplog.records if "without an API key" in r.message]
            assert len(warned) == (host == "0.0.0.0"), (host, warned)
    finally:
        get_logger().removeHandler(caplog.handler)


def test_unknown_model_and_malformed_bodies(served, client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="gpt-5", prompt="a", max_tokens=1)
    assert raised.value.param == "model" and raised.value.code == "model_not_found"
    for data in (b'{"prompt": "a", ', b"[1, 2]", b"{}"):
        status, body = post(served[0] + "/v1/completions", data)
        assert status == 400 and body["error"]["type"] == "invalid_request_error", body
    assert post(served[0] + "/v1/completions", b"{}")[1]["error"]["param"] == "prompt"
    assert client.completions.create(model=MODEL, prompt="a", max_tokens=1).usage.completion_tokens == 1


# Clients that leave, batches that fail -------------------------------------------------------------------

def _cancelled_row(scheduler, since: int, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ended = [e for e in scheduler.ended if e.job >= since and e.reason == "cancelled"]
        if ended:
            return ended[0]
        time.sleep(0.02)
    raise AssertionError("no row was cancelled")


class _TestEngine:
    """The engine, slowed to ``step_seconds`` a step (so a test can act while a request runs), and a
    batch with a request seeded 666 raises after its first step."""

    def __init__(self, engine, step_seconds: float = 0.0):
        self.engine, self.step_seconds = engine, step_seconds

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def stream(self, requests, cancelled=None):
        for n, events in enumerate(self.engine.stream(requests, cancelled)):
            if n == 1 and any(r.params.seed == 666 for r in requests):
                raise RuntimeError("injected failure")
            time.sleep(self.step_seconds)
            yield events


def test_a_client_that_leaves_stops_its_work(engine):
    with running(_TestEngine(engine, step_seconds=0.02)) as (url, scheduler):  # 90 tokens: about 2 s
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
        stream = client.completions.create(model=MODEL, prompt="a", max_tokens=90, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()
        row = _cancelled_row(scheduler, 0)
        assert row.tokens < 30, row  # far from the 90 asked for

        hasty = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            hasty.completions.create(model=MODEL, prompt="a", max_tokens=90, temperature=0,
                                     extra_body={"ignore_eos": True})
        row = _cancelled_row(scheduler, row.job + 1)
        assert row.tokens < 60, row
        assert [e.reason for e in scheduler.ended] == ["cancelled", "cancelled"]


def test_a_failed_batch_is_a_500_and_the_server_keeps_serving(engine):
    with running(_TestEngine(engine)) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as raised:
            client.completions.create(model=MODEL, prompt="a", max_tokens=5, seed=666)
        assert raised.value.type == "server_error" and "injected failure" in raised.value.message
        with pytest.raises(openai.APIError, match="injected failure"):
            list(client.completions.create(model=MODEL, prompt="a", max_tokens=5, seed=666, stream=True))
        out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
        assert out.choices[0].text == alone(engine, PROMPTS[0], max_tokens=4, temperature=0).text


def test_an_idle_scheduler_on_several_ranks_sends_keepalives_then_the_stop_batch(engine, monkeypatch):
    import megatron.inference.scheduler as scheduler_module

    sent = []
    monkeypatch.setattr(scheduler_module, "share_batch", lambda batch, device: sent.append(batch))
    scheduler = Scheduler(engine, keepalive_seconds=0.05)
    scheduler.tp = 2  # as on rank 0 of two (the engine itself is one rank)
    scheduler.start()
    deadline = time.monotonic() + 10
    while len(sent) < 3 and time.monotonic() < deadline:  # three keepalives (every 0.05 s), then stop
        time.sleep(0.01)
    scheduler.stop()
    assert len(sent) >= 4 and sent[:-1] == [[]] * (len(sent) - 1) and sent[-1] is None
