"""The request bodies: OpenAI's completions and chat completions (with vLLM's ``top_k``,
``repetition_penalty`` and ``ignore_eos``), and vLLM's ``/tokenize`` and ``/detokenize``.

Strict types: ``"hot"`` is not a temperature and ``true`` is not a ``max_tokens``. ``None`` means the
default, as in OpenAI's API; unknown fields are an error (a typo is not ignored). Fields whose
message says more when checked by hand (``prompt``, ``messages``) are ``Any`` here."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """What both generation endpoints take."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionBody(_Sampling):
    prompt: Any = None
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatBody(_Sampling):
    messages: Any = None
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = None  # vLLM's: end with the assistant's turn opened (default true)


class TokenizeBody(_Strict):
    """vLLM's: ``prompt`` (a text) or ``messages`` (a chat, rendered by the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: Any = None
    add_special_tokens: bool | None = None  # accepted: this server's tokenizers add no BOS/EOS either way
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeBody(_Strict):
    model: str | None = None
    tokens: list[int]
