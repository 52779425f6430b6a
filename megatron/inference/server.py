"""The OpenAI-compatible HTTP server: ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``.

The HTTP side only parses, validates and shapes: a request becomes one engine ``Request`` per prompt,
checked by the engine before it is queued (so a bad request is a 400 and never reaches a batch), and
handed to the ``Scheduler`` (``scheduler.py``), whose thread batches it with whatever else is queued.
The step events come back on the job's asyncio queue and are shaped into OpenAI's ``text_completion``
objects: the whole response, or one server-sent event per step with ``stream``.

Every field is checked here, on the rank that parses HTTP, before the request is queued: one
request's error never reaches a batch (nor, under tensor parallelism, the other ranks). The
``Guard`` (``guard.py``) answers first: the API key (401) and the body size (413).

Every error is OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
field (FastAPI's 422 for a malformed body included), 401 for a missing or wrong API key, 404
``model_not_found`` for another model's name, 413 for a body over ``--max-request-bytes``, 500 when
the batch the request ran in failed, 503 while shutting down.

FastAPI and uvicorn are the optional ``[serve]`` extra: only this module imports them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
import threading
import time
import uuid
from dataclasses import replace
from typing import Any

try:
    import uvicorn
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from pydantic import BaseModel, ConfigDict
    from starlette.exceptions import HTTPException
except ImportError as error:  # pragma: no cover - depends on the installation
    raise ImportError(f'the server needs FastAPI and uvicorn ({error.name} is missing): pip install -e ".[serve]"') \
        from error

from megatron.inference.engine import PromptScores, Request
from megatron.inference.guard import Guard, Limits, is_loopback
from megatron.inference.sampling import RequestError, SamplingParams
from megatron.inference.scheduler import DONE, BatchFailed, Scheduler, Unavailable
from megatron.metrics import get_logger

POLL_SECONDS = 0.25  # how often a waiting non-streaming request checks that its client is still there
LOWEST_LOGPROB = -9999.0  # JSON has no -inf (vLLM reports the same floor)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class CompletionBody(BaseModel):
    """The fields of OpenAI's completions request, with vLLM's ``top_k``, ``repetition_penalty`` and
    ``ignore_eos``. Strict types: ``"hot"`` is not a temperature and ``true`` is not a ``max_tokens``.
    ``None`` means the default, as in OpenAI's API; unknown fields are an error (a typo is not ignored)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: Any = None  # parsed by _prompts, for a clearer message
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


def create_app(scheduler: Scheduler, model_name: str, limits: Limits | None = None,
               api_key: str | None = None) -> Guard:
    """The ASGI app serving ``scheduler``'s engine under the name ``model_name``: FastAPI's, behind the
    ``Guard`` of ``api_key`` (None: no key) and ``limits``."""
    engine, created = scheduler.engine, int(time.time())
    tokenizer, limits = engine.tokenizer, limits or Limits()
    app = FastAPI(title="megatron-gpt", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request, error: ApiError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, error: RequestValidationError):
        return _validation_error(error.errors()).response()

    @app.exception_handler(HTTPException)
    async def _http_error(request, error: HTTPException):
        return ApiError(error.status_code, f"{request.method} {request.url.path}: {error.detail}; the endpoints are "
                        "POST /v1/completions, GET /v1/models and GET /health.").response()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "megatron", "max_model_len": engine.max_positions}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: HTTPRequest):
        if body.model is not None and body.model != model_name:
            raise ApiError(404, f"model {body.model!r} does not exist: this server serves {model_name!r}.",
                           "model", "model_not_found")
        _unsupported(body)
        params = _sampling_params(body, limits)
        prompts = await _prompts(body.prompt, engine, scheduler.max_batch_size)
        rows = [Request(ids, replace(params, stop=list(params.stop))) for ids, _ in prompts]
        job = _submit(scheduler, rows)
        choices = [_Choice(i, ids, text if body.echo else None, params.logprobs, tokenizer.detokenize)
                   for i, (ids, text) in enumerate(prompts)]
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return _EventStream(job, _stream(job, choices, head, usage))
        try:
            await _collect(job, choices, request)
        finally:
            job.cancel()  # a no-op once done; stops the work when the client left or the server stops
        return {**head, "choices": [c.whole() for c in choices], "usage": _usage(choices)}

    return Guard(app, limits.max_request_bytes, api_key)


# Request parsing -----------------------------------------------------------------------------------

def _validation_error(errors: list[dict]) -> ApiError:
    """OpenAI's 400 for FastAPI's validation errors (its default is a 422 with another shape)."""
    first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    kind = first.get("type")
    if kind == "json_invalid":
        why = first.get("ctx", {}).get("error") or first["msg"]
        return ApiError(400, f"the request body is not valid JSON ({why}): send a JSON object.")
    if param is None:
        return ApiError(400, f"the request body must be a JSON object of the completion's fields, sent with "
                        f"Content-Type: application/json ({first['msg']}).")
    if kind == "missing":
        return ApiError(400, f"{param} is required.", param)
    if kind == "extra_forbidden":
        return ApiError(400, f"unrecognized request argument supplied: {param} (see docs/inference.md for the "
                        "fields).", param)
    shown = repr(first.get("input"))
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return ApiError(400, f"{param} is invalid: {first['msg'][0].lower()}{first['msg'][1:]}, got {shown}.", param)


def _unsupported(body: CompletionBody) -> None:
    for name, ok in (("n", body.n in (None, 1)), ("best_of", body.best_of in (None, 1)),
                     ("suffix", not body.suffix), ("logit_bias", not body.logit_bias)):
        if not ok:
            raise ApiError(400, f"{name} is not supported by this server (got {getattr(body, name)!r}): leave it "
                           "out" + (" and send the request again for more completions." if name == "n" else "."),
                           name)


async def _prompts(value: Any, engine, most: int) -> list[tuple[list[int], str]]:
    """(token ids, text) of each prompt: a string, a list of strings, a list of token ids or a list
    of such lists; at most ``most`` of them. Token ids are checked against the vocabulary and the
    model's positions before they are decoded; texts are tokenized off the event loop (a long one
    does not hold up the other clients)."""
    if value is None:
        raise ApiError(400, "prompt is required.", "prompt")
    if isinstance(value, str) or (isinstance(value, list) and value and all(_is_id(t) for t in value)):
        value = [value]
    if not isinstance(value, list):
        raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of token-id "
                       f"lists, got {str(value)[:40]!r}.", "prompt")
    if not value:
        raise ApiError(400, "prompt is empty: give a string, a list of strings or token ids.", "prompt")
    if len(value) > most:
        raise ApiError(400, f"prompt has {len(value)} prompts but a batch holds at most {most} (--max-batch-size): "
                       "send fewer per request.", "prompt")
    which = (lambda i: f"prompt {i} ") if len(value) > 1 else (lambda i: "prompt ")
    texts = {}
    for i, prompt in enumerate(value):
        if isinstance(prompt, str):
            texts[i] = prompt
        elif isinstance(prompt, list) and all(_is_id(t) for t in prompt):
            if len(prompt) > engine.max_positions:
                raise ApiError(400, f"{which(i)}has {len(prompt)} tokens but the model has {engine.max_positions} "
                               "positions: shorten it.", "prompt")
            bad = next((t for t in prompt if not 0 <= t < engine.vocab_size), None)
            if bad is not None:
                raise ApiError(400, f"{which(i)}has token id {bad}, outside the vocabulary (0..{engine.vocab_size - 1}"
                               ").", "prompt")
        else:
            raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                           f"token-id lists, got {str(prompt)[:40]!r}.", "prompt")
    tokenize, detokenize = engine.tokenizer.tokenize, engine.tokenizer.detokenize

    def encode(i: int) -> list[int]:
        """A text prompt's ids: a text the tokenizer refuses (NullTokenizer's non-ids, a lone surrogate) or ids it
        gives outside the model's vocabulary are the client's 400, never a 500."""
        try:
            ids = list(tokenize(texts[i]))
        except Exception as err:  # noqa: BLE001 - any tokenizer's refusal of this text
            raise ApiError(400, f"{which(i)}cannot be tokenized ({type(err).__name__}: "
                           f"{' '.join(str(err).split())[:200]}).", "prompt") from None
        bad = next((t for t in ids if not 0 <= t < engine.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"{which(i)}gives token id {bad}, outside the vocabulary (0..{engine.vocab_size - 1}).",
                           "prompt")
        return ids

    return await asyncio.to_thread(lambda: [(encode(i), texts[i]) if i in texts
                                            else (list(p), detokenize(list(p))) for i, p in enumerate(value)])


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sampling_params(body: CompletionBody, limits: Limits) -> SamplingParams:
    """The request's sampling fields, every one checked (ApiError naming the first bad one)."""
    given = {name: getattr(body, name) for name in ("max_tokens", "temperature", "top_p", "top_k", "seed",
                                                    "presence_penalty", "frequency_penalty", "repetition_penalty")}
    params = SamplingParams(**{k: v for k, v in given.items() if v is not None})
    params.stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(params.stop) > limits.max_stop_strings:
        raise ApiError(400, f"stop has {len(params.stop)} strings, more than this server's "
                       f"{limits.max_stop_strings} (--max-stop-strings).", "stop")
    longest = max((len(s) for s in params.stop), default=0)
    if longest > limits.max_stop_chars:
        raise ApiError(400, f"stop has a string of {longest} characters, longer than this server's "
                       f"{limits.max_stop_chars} (--max-stop-chars).", "stop")
    params.ignore_eos = bool(body.ignore_eos)
    params.logprobs = body.logprobs
    params.prompt_logprobs = bool(body.echo) and body.logprobs is not None
    try:
        params.check()
    except RequestError as error:
        raise ApiError(400, str(error), error.param) from error
    return params


def _submit(scheduler: Scheduler, rows: list[Request]):
    """Queue ``rows``; ApiError naming the field for a row the engine refuses (checked here first, so
    the message can say which prompt), 503 while the server stops."""
    for i, row in enumerate(rows):
        try:
            scheduler.engine.check(row)
        except RequestError as error:
            raise ApiError(400, (f"prompt {i}: " if len(rows) > 1 else "") + str(error), error.param) from error
    try:
        return scheduler.submit(rows)
    except Unavailable as error:
        raise ApiError(503, str(error), kind="server_error") from error


# Responses ---------------------------------------------------------------------------------------

class _Choice:
    """One choice's text and logprobs as its events arrive: ``step`` gives a streaming chunk's choice,
    ``whole`` the full one. Token strings are the detokenized single ids; ``text_offset`` is where each
    token starts in the choice's text (the prompt's tokens from 0 with ``echo``, then the completion's
    from the prompt's length; counted from the token strings, so a token completing a stop string may
    point past the cut text)."""

    def __init__(self, index: int, prompt: list[int], echo: str | None, logprobs: int | None, detokenize):
        self.index, self.prompt, self.echo, self.detokenize = index, prompt, echo, detokenize
        self.logprobs = None if logprobs is None else {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                       "text_offset": []}
        self.text, self.offset, self.completion_tokens, self.finish_reason = "", 0, 0, None
        self.started = False

    def step(self, items: list) -> dict:
        lp = None if self.logprobs is None else {key: [] for key in self.logprobs}
        text, finish = "", None
        if not self.started:
            self.started = True
            if self.echo is not None:
                text = self.echo
                if lp is not None:
                    scores = next((i for i in items if isinstance(i, PromptScores)), None)
                    values = scores.logprobs if scores is not None else [None] * len(self.prompt)
                    tops = scores.top_logprobs if scores is not None and scores.top_logprobs else [None] * len(values)
                    for token, score, top in zip(self.prompt, values, tops, strict=True):
                        self._add(lp, token, score, top)
                self.offset = len(self.echo)
        for e in items:
            if isinstance(e, PromptScores):
                continue
            if e.token is not None:
                self.completion_tokens += 1
                if lp is not None:
                    self._add(lp, e.token, e.logprob, e.top_logprobs or [])
            text += e.text
            finish = e.finish_reason or finish
        self.text += text
        self.finish_reason = finish or self.finish_reason
        if lp is not None:
            for key, values in lp.items():
                self.logprobs[key].extend(values)
        return {"index": self.index, "text": text, "logprobs": lp, "finish_reason": finish}

    def whole(self) -> dict:
        if not self.started:
            self.step([])
        return {"index": self.index, "text": self.text, "logprobs": self.logprobs, "finish_reason": self.finish_reason}

    def _add(self, lp: dict, token: int, score: float | None, top: list | None) -> None:
        piece = self.detokenize([token])
        lp["tokens"].append(piece)
        lp["token_logprobs"].append(None if score is None else _finite(score))
        lp["top_logprobs"].append(None if top is None else {self.detokenize([t]): _finite(v) for t, v in top})
        lp["text_offset"].append(self.offset)
        self.offset += len(piece)


def _by_row(items: list, choices: list[_Choice]):
    rows: dict[int, list] = {}
    for item in items:
        rows.setdefault(item.index, []).append(item)
    return [(choices[i], its) for i, its in rows.items()]


def _usage(choices: list[_Choice]) -> dict:
    prompt = sum(len(c.prompt) for c in choices)
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _collect(job, choices: list[_Choice], request: HTTPRequest) -> None:
    """Feed the job's events to ``choices`` until it is done. Every ``POLL_SECONDS`` (whether or not
    events arrive: a busy job gets one each step) check that the client is still there, and cancel the
    job when it is not. ApiError for a failed batch."""
    checked = time.monotonic()
    while True:
        try:
            items = await asyncio.wait_for(job.queue.get(), POLL_SECONDS)
        except asyncio.TimeoutError:
            items = []
        if time.monotonic() - checked >= POLL_SECONDS:
            checked = time.monotonic()
            if await request.is_disconnected():
                job.cancel()
                raise ApiError(499, "the client closed the connection.")
        if items is DONE:
            return
        if isinstance(items, BatchFailed):
            raise ApiError(items.status, str(items), kind="server_error")
        for choice, its in _by_row(items, choices):
            choice.step(its)


async def _stream(job, choices: list[_Choice], head: dict, usage: bool):
    """Server-sent events: a chunk per row per step, then ``data: [DONE]`` (an error mid-stream is
    sent as ``data: {"error": ...}``, which OpenAI's clients raise)."""
    try:
        while (items := await job.queue.get()) is not DONE:
            if isinstance(items, BatchFailed):
                yield _sse(ApiError(items.status, str(items), kind="server_error").response().body.decode())
                return
            for choice, its in _by_row(items, choices):
                piece = choice.step(its)
                if piece["text"] or piece["finish_reason"] or (piece["logprobs"] and piece["logprobs"]["tokens"]):
                    yield _sse(_json({**head, "choices": [piece]}))
        if usage:
            yield _sse(_json({**head, "choices": [], "usage": _usage(choices)}))
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()


def _finite(x: float) -> float:
    return x if math.isfinite(x) else LOWEST_LOGPROB


def _sse(data: str) -> str:
    return f"data: {data}\n\n"


def _json(value) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


class _EventStream(StreamingResponse):
    """A streaming response that cancels its job however it ends: finished, the client gone (the
    generator is cancelled), or never started."""

    def __init__(self, job, content):
        super().__init__(content, media_type="text/event-stream")
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


# Running ---------------------------------------------------------------------------------------------

class HTTPServer(uvicorn.Server):
    """uvicorn's server that reports the port it bound (``--port 0`` picks a free one) and, on
    SIGINT/SIGTERM, shuts down gracefully without re-raising the signal afterwards (uvicorn does, which
    would kill the process before the followers are told to stop)."""

    def __init__(self, app, host: str, port: int, on_ready=None, graceful_seconds: float = 5.0):
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                        timeout_graceful_shutdown=graceful_seconds))
        self.port, self.on_ready = port, on_ready

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            self.port = self.servers[0].sockets[0].getsockname()[1]
            if self.on_ready is not None:
                self.on_ready(self.port)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(scheduler: Scheduler, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          limits: Limits | None = None, api_key: str | None = None) -> int:
    """Run the server until SIGINT/SIGTERM (or a fatal scheduler error); then stop the scheduler, which
    tells the other tensor-parallel ranks to stop. Exit status: 0, or 1 after a fatal error."""
    log = get_logger()
    if not api_key and not is_loopback(host):
        log.warning(f"serving on {host} without an API key: anyone who can reach this port can use the model; set "
                    "--api-key or MEGATRON_API_KEY (clients send it as 'Authorization: Bearer <key>').")
    server = HTTPServer(create_app(scheduler, model_name, limits, api_key), host, port,
                        on_ready=lambda bound: log.info(f"serving {model_name} on http://{host}:{bound} "
                                                        f"(tp {scheduler.tp})"))

    def fatal():
        server.should_exit = True

    scheduler.on_fatal = fatal
    scheduler.start()
    try:
        server.run()
    except SystemExit:  # uvicorn exits when it cannot listen, after logging why
        if server.started:
            raise
        raise OSError(f"cannot listen on {host}:{port} (the line above says why): choose another --port or --host.") \
            from None
    finally:
        scheduler.stop()
    if scheduler.error:  # already logged, with the reason
        log.error(f"stopped serving {model_name} after that error")
        return 1
    log.info(f"stopped serving {model_name}")
    return 0
