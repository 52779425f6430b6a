"""A job's step events shaped into OpenAI's responses: the whole response, or one server-sent event
per step with ``stream``. ``Choice`` is a completions choice (``text_completion``), ``ChatChoice`` a
chat one (``chat.completion``); ``collect`` and ``stream`` drive either."""

from __future__ import annotations

import asyncio
import json
import math
import time

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from megatron.inference.engine import PromptScores
from megatron.inference.scheduler import DONE, BatchFailed
from megatron.inference.server.errors import ApiError

POLL_SECONDS = 0.25  # how often a waiting non-streaming request checks that its client is still there
LOWEST_LOGPROB = -9999.0  # JSON has no -inf (vLLM reports the same floor)


class Choice:
    """One choice's text and logprobs as its events arrive: ``step`` gives a streaming chunk's choice,
    ``whole`` the full one. Token strings are the detokenized single ids; ``text_offset`` is where each
    token starts in the choice's text (the prompt's tokens from 0 with ``echo``, then the completion's
    from the prompt's length; counted from the token strings, so a token completing a stop string may
    point past the cut text)."""

    def __init__(self, index: int, prompt: list[int], echo: str | None, logprobs: int | None, piece):
        self.index, self.prompt, self.echo, self.piece = index, prompt, echo, piece
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

    @staticmethod
    def worth_sending(piece: dict) -> bool:
        return bool(piece["text"] or piece["finish_reason"] or (piece["logprobs"] and piece["logprobs"]["tokens"]))

    def _add(self, lp: dict, token: int, score: float | None, top: list | None) -> None:
        piece = self.piece(token)
        lp["tokens"].append(piece)
        lp["token_logprobs"].append(None if score is None else finite(score))
        lp["top_logprobs"].append(None if top is None else {self.piece(t): finite(v) for t, v in top})
        lp["text_offset"].append(self.offset)
        self.offset += len(piece)


class ChatChoice:
    """The assistant's message as its events arrive: ``step`` gives a chunk's choice (a ``delta``; the
    first one carries the role), ``whole`` the full one. ``logprobs`` (with the request's ``logprobs``)
    is OpenAI's ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def __init__(self, prompt: list[int], logprobs: bool, piece):
        self.index, self.prompt, self.piece = 0, prompt, piece
        self.logprobs = {"content": []} if logprobs else None
        self.text, self.completion_tokens, self.finish_reason, self.started = "", 0, None, False

    def step(self, items: list) -> dict:
        delta: dict = {} if self.started else {"role": "assistant", "content": ""}
        self.started = True
        entries, finish, text = [], None, ""
        for e in items:
            if isinstance(e, PromptScores):
                continue
            if e.token is not None:
                self.completion_tokens += 1
                if self.logprobs is not None:
                    entries.append(self._entry(e.token, e.logprob, e.top_logprobs or []))
            text += e.text
            finish = e.finish_reason or finish
        if text:
            delta["content"] = text
        self.text += text
        self.finish_reason = finish or self.finish_reason
        if self.logprobs is not None:
            self.logprobs["content"].extend(entries)
        return {"index": 0, "delta": delta, "logprobs": None if self.logprobs is None else {"content": entries},
                "finish_reason": finish}

    def whole(self) -> dict:
        self.started = True
        return {"index": 0, "message": {"role": "assistant", "content": self.text}, "logprobs": self.logprobs,
                "finish_reason": self.finish_reason}

    @staticmethod
    def worth_sending(piece: dict) -> bool:
        return bool(piece["delta"] or piece["finish_reason"] or (piece["logprobs"] and piece["logprobs"]["content"]))

    def _entry(self, token: int, score: float | None, top: list) -> dict:
        def one(t, v):
            text = self.piece(t)
            return {"token": text, "logprob": finite(v), "bytes": list(text.encode("utf-8", "replace"))}

        return {**one(token, score), "top_logprobs": [one(t, v) for t, v in top]}


def usage(choices: list) -> dict:
    prompt = sum(len(c.prompt) for c in choices)
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _by_row(items: list, choices: list):
    rows: dict[int, list] = {}
    for item in items:
        rows.setdefault(item.index, []).append(item)
    return [(choices[i], its) for i, its in rows.items()]


async def collect(job, choices: list, request: HTTPRequest) -> None:
    """Feed the job's events to ``choices`` until it is done. Every ``POLL_SECONDS`` (whether or not
    events arrive: a busy job gets one each step) check that the client is still there, and cancel the
    job when it is not. ApiError for a failed batch."""
    checked = time.monotonic()
    try:
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
    finally:
        job.cancel()  # a no-op once done; stops the work when the client left or the server stops


async def stream(job, choices: list, head: dict, include_usage: bool):
    """Server-sent events: a chunk per row per step, then ``data: [DONE]`` (an error mid-stream is
    sent as ``data: {"error": ...}``, which OpenAI's clients raise)."""
    try:
        while (items := await job.queue.get()) is not DONE:
            if isinstance(items, BatchFailed):
                yield _sse(ApiError(items.status, str(items), kind="server_error").response().body.decode())
                return
            for choice, its in _by_row(items, choices):
                piece = choice.step(its)
                if choice.worth_sending(piece):
                    yield _sse(_json({**head, "choices": [piece]}))
        if include_usage:
            yield _sse(_json({**head, "choices": [], "usage": usage(choices)}))
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()


def finite(x: float) -> float:
    return x if math.isfinite(x) else LOWEST_LOGPROB


def _sse(data: str) -> str:
    return f"data: {data}\n\n"


def _json(value) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


class EventStream(StreamingResponse):
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
