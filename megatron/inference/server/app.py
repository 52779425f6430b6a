"""The endpoints: a request becomes one engine ``Request`` per prompt, checked before it is queued
(``parsing``), handed to the ``Scheduler``, and its step events shaped into OpenAI's responses
(``responses``)."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from megatron.inference.guard import Guard, Limits
from megatron.inference.scheduler import Scheduler
from megatron.inference.server import parsing
from megatron.inference.server.chat import ChatTemplate, chat_template, messages_of
from megatron.inference.server.errors import ApiError, unknown_model, validation_error
from megatron.inference.server.protocol import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody
from megatron.inference.server.responses import ChatChoice, Choice, EventStream, collect, stream, usage
from megatron.inference.server.tokens import Vocabulary

ENDPOINTS = ("POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/ID], GET /tokenizer_info, "
             "POST /tokenize, POST /detokenize and GET /health")


def create_app(scheduler: Scheduler, model_name: str, limits: Limits | None = None, api_key: str | None = None,
               template: ChatTemplate | None = None) -> Guard:
    """The ASGI app serving ``scheduler``'s engine under the name ``model_name``: FastAPI's, behind the
    ``Guard`` of ``api_key`` (None: no key) and ``limits``. ``template``: the chat template (default: the
    tokenizer's, else the plain one; ValueError for one that cannot be read)."""
    engine, created = scheduler.engine, int(time.time())
    limits = limits or Limits()
    vocab = Vocabulary(engine.tokenizer, engine.vocab_size, engine.max_positions)
    template = template or chat_template(engine.tokenizer)
    app = FastAPI(title="megatron-gpt", docs_url=None, redoc_url=None)
    card = {"id": model_name, "object": "model", "created": created, "owned_by": "megatron",
            "max_model_len": engine.max_positions}

    @app.exception_handler(ApiError)
    async def _api_error(request, error: ApiError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, error: RequestValidationError):
        return validation_error(error.errors()).response()

    @app.exception_handler(HTTPException)
    async def _http_error(request, error: HTTPException):
        return ApiError(error.status_code, f"{request.method} {request.url.path}: {error.detail}; the endpoints are "
                        f"{ENDPOINTS}.").response()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise unknown_model(model_id, model_name, param=None)
        return card

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: HTTPRequest):
        parsing.check_model(body.model, model_name)
        parsing.unsupported(body)
        params = parsing.sampling_params(body, limits, body.max_tokens, body.logprobs,
                                         prompt_logprobs=bool(body.echo) and body.logprobs is not None)
        prompts = await parsing.prompts(body.prompt, vocab, limits)
        job = parsing.submit(scheduler, parsing.rows_of([ids for ids, _ in prompts], params, limits))
        choices = [Choice(i, ids, text if body.echo else None, params.logprobs, vocab.piece)
                   for i, (ids, text) in enumerate(prompts)]
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}
        return await _respond(job, choices, head, body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: HTTPRequest):
        parsing.check_model(body.model, model_name)
        parsing.unsupported(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true.", "top_logprobs")
        ids = await _chat_ids(body.messages, body.add_generation_prompt)
        wanted = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        room = engine.max_positions - len(ids)
        if room <= 0 or (wanted is not None and wanted > room):
            asked = "" if wanted is None else f" and {wanted} in the completion (max_tokens)"
            raise ApiError(400, f"this model's maximum context length is {engine.max_positions} tokens, but the "
                           f"request has {len(ids)} in the messages{asked}: shorten the messages"
                           f"{'' if wanted is None else ' or lower max_tokens'}.",
                           "messages" if wanted is None or len(ids) >= engine.max_positions else "max_tokens")
        params = parsing.sampling_params(body, limits, room if wanted is None else wanted,
                                         (body.top_logprobs or 0) if body.logprobs else None)
        job = parsing.submit(scheduler, parsing.rows_of([ids], params, limits), prompt="messages")
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": model_name}
        return await _respond(job, [ChatChoice(ids, bool(body.logprobs), vocab.piece)], head, body, request)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return vocab.info(template.source)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        parsing.check_model(body.model, model_name)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give either prompt (a text) or messages (a chat), not both or neither.",
                           "prompt" if body.prompt is not None else None)
        if body.prompt is not None:
            ids = await asyncio.to_thread(vocab.encode, body.prompt)
        else:
            ids = await _chat_ids(body.messages, body.add_generation_prompt)
        return {"count": len(ids), "max_model_len": engine.max_positions, "tokens": ids,
                "token_strs": [vocab.piece(t) for t in ids] if body.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody):
        parsing.check_model(body.model, model_name)
        vocab.check(body.tokens, "tokens ", "tokens")
        return {"prompt": await asyncio.to_thread(vocab.decode, body.tokens)}

    async def _chat_ids(messages, add_generation_prompt: bool | None) -> list[int]:
        chat_messages = messages_of(messages)
        generation = add_generation_prompt is None or add_generation_prompt
        return await asyncio.to_thread(lambda: vocab.encode(template.render(chat_messages, generation),
                                                            "the chat's text ", "messages"))

    async def _respond(job, choices: list, head: dict, body, request: HTTPRequest):
        if body.stream:
            include = body.stream_options is not None and body.stream_options.include_usage
            chunk = {**head, "object": head["object"] + ".chunk"} if head["object"] == "chat.completion" else head
            return EventStream(job, stream(job, choices, chunk, include))
        await collect(job, choices, request)
        return {**head, "choices": [c.whole() for c in choices], "usage": usage(choices)}

    return Guard(app, limits.max_request_bytes, api_key)
