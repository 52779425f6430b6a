"""Requests to engine rows, every field checked on the rank that parses HTTP before anything is
queued: one request's error never reaches a batch (nor, under tensor parallelism, the other ranks)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from megatron.inference.engine import Request
from megatron.inference.guard import Limits
from megatron.inference.sampling import RequestError, SamplingParams
from megatron.inference.scheduler import Scheduler, Unavailable
from megatron.inference.server.errors import ApiError, unknown_model
from megatron.inference.server.tokens import Vocabulary


def check_model(name: str | None, served: str) -> None:
    if name is not None and name != served:
        raise unknown_model(name, served)


def unsupported(body) -> None:
    for name, ok in (("n", body.n in (None, 1)), ("best_of", getattr(body, "best_of", None) in (None, 1)),
                     ("suffix", not getattr(body, "suffix", None)), ("logit_bias", not body.logit_bias)):
        if not ok:
            raise ApiError(400, f"{name} is not supported by this server (got {getattr(body, name)!r}): leave it "
                           "out" + (" and send the request again for more completions." if name == "n" else "."),
                           name)


async def prompts(value: Any, vocab: Vocabulary, limits: Limits) -> list[tuple[list[int], str]]:
    """(token ids, text) of each prompt: a string, a list of strings, a list of token ids or a list
    of such lists; at most ``limits.max_prompts`` of them. Token ids are checked against the vocabulary and
    the model's positions before they are decoded; texts are tokenized off the event loop (a long one
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
    if len(value) > limits.max_prompts:
        raise ApiError(400, f"prompt has {len(value)} prompts, more than this server's {limits.max_prompts} per "
                       "request (--max-prompts): send them in several requests.", "prompt")
    which = (lambda i: f"prompt {i} ") if len(value) > 1 else (lambda i: "prompt ")
    for i, prompt in enumerate(value):
        if isinstance(prompt, str):
            continue
        if not (isinstance(prompt, list) and all(_is_id(t) for t in prompt)):
            raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                           f"token-id lists, got {str(prompt)[:40]!r}.", "prompt")
        if len(prompt) > vocab.positions:
            raise ApiError(400, f"{which(i)}has {len(prompt)} tokens but the model has {vocab.positions} "
                           "positions: shorten it.", "prompt")
        vocab.check(prompt, which(i))
    return await asyncio.to_thread(lambda: [(vocab.encode(p, which(i)), p) if isinstance(p, str)
                                            else (list(p), vocab.decode(list(p))) for i, p in enumerate(value)])


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def sampling_params(body, limits: Limits, max_tokens: int | None, logprobs: int | None = None,
                    prompt_logprobs: bool = False) -> SamplingParams:
    """The request's sampling fields, every one checked (ApiError naming the first bad one)."""
    given = {name: getattr(body, name) for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty",
                                                    "frequency_penalty", "repetition_penalty")}
    given["max_tokens"] = max_tokens
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
    params.logprobs = logprobs
    params.prompt_logprobs = prompt_logprobs
    try:
        params.check()
    except RequestError as error:
        raise ApiError(400, str(error), error.param) from error
    return params


def rows_of(prompt_ids: list[list[int]], params: SamplingParams, limits: Limits) -> list[Request]:
    """One engine row per prompt; a 400 when the prompts' tokens and their ``max_tokens`` pass
    ``--max-request-tokens`` together."""
    total = sum(len(ids) + params.max_tokens for ids in prompt_ids)
    if total > limits.max_request_tokens:
        raise ApiError(400, f"the request asks for {total:,} tokens (its prompts' tokens plus max_tokens for each), "
                       f"more than this server's {limits.max_request_tokens:,} (--max-request-tokens): send fewer "
                       "or shorter prompts per request.", "prompt")
    return [Request(ids, replace(params, stop=list(params.stop))) for ids in prompt_ids]


def submit(scheduler: Scheduler, rows: list[Request], prompt: str = "prompt"):
    """Queue ``rows``; ApiError naming the field for a row the engine refuses (checked here first, so
    the message can say which prompt), 503 while the server stops."""
    for i, row in enumerate(rows):
        try:
            scheduler.engine.check(row)
        except RequestError as error:
            param = prompt if error.param == "prompt" else error.param
            raise ApiError(400, (f"prompt {i}: " if len(rows) > 1 else "") + str(error), param) from error
    try:
        return scheduler.submit(rows)
    except Unavailable as error:
        raise ApiError(503, str(error), kind="server_error") from error
