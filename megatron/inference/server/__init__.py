"""The OpenAI-compatible HTTP server: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models`` (and ``/v1/models/{id}``), vLLM's ``GET /tokenizer_info``, ``POST /tokenize`` and
``POST /detokenize``, and ``GET /health`` -- what lm-eval's ``local-completions`` and
``local-chat-completions`` and the ``openai`` client use with their defaults.

The HTTP side only parses, validates and shapes (``app``): a request becomes one engine ``Request``
per prompt, any number of prompts, every field checked on the rank that parses HTTP before the
request is queued (``parsing``), so a bad request is a 400 that never reaches a batch (nor, under
tensor parallelism, the other ranks); the ``Scheduler`` (``scheduler.py``) batches its rows with
whatever else is queued, ``--max-batch-size`` at a time. The step events come back on the job's
asyncio queue and are shaped into OpenAI's objects (``responses``): the whole response, or one
server-sent event per step with ``stream``. Text and token ids go through one ``Vocabulary``
(``tokens``); chat messages through the tokenizer's chat template or the plain one (``chat``). The
``Guard`` (``guard.py``) answers first: the API key (401) and the body size (413).

Every error is OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}`` (``errors``):
400 for a bad field (FastAPI's 422 for a malformed body included), 401 for a missing or wrong API key,
404 ``model_not_found`` for another model's name, 413 for a body over ``--max-request-bytes``, 500 when
the batch the request ran in failed, 503 while shutting down.

FastAPI and uvicorn are the optional ``[serve]`` extra: only this package imports them.
"""

try:
    import fastapi  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the installation
    raise ImportError(f'the server needs FastAPI and uvicorn ({error.name} is missing): pip install -e ".[serve]"') \
        from error

from megatron.inference.server.app import create_app
from megatron.inference.server.chat import ChatTemplate, chat_template
from megatron.inference.server.errors import ApiError
from megatron.inference.server.running import HTTPServer, serve

__all__ = ["ApiError", "ChatTemplate", "HTTPServer", "chat_template", "create_app", "serve"]
