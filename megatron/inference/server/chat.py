"""Chat messages to a prompt: the tokenizer's chat template where it has one, else the plain one.

A Hugging Face tokenizer (``--tokenizer-type HuggingFaceTokenizer``) has one when its folder's
``tokenizer_config.json`` has a ``chat_template`` (a string, or a list of named templates: the one
named ``default``) or the folder has a ``chat_template.jinja``. It is rendered as transformers renders
it: jinja2's sandbox with ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception`` and
``strftime_now``, and ``messages``, ``add_generation_prompt``, ``bos_token`` and ``eos_token`` (from
tokenizer_config.json) as variables. Every other tokenizer gets ``PLAIN``: each message as
``ROLE: CONTENT`` and a newline, then ``assistant:`` (the model's answer follows it).

A template that cannot be read is refused when the server starts (``ValueError``, one line); a
template that refuses the messages (its ``raise_exception``) is the client's 400.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

from megatron.inference.server.errors import ApiError

PLAIN = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}assistant:{% endif %}")
ROLES = ("system", "user", "assistant")


class ChatTemplate:
    """``source``: the jinja template; ``origin``: where it came from (a file, or ``plain``)."""

    def __init__(self, source: str, origin: str, variables: dict[str, Any] | None = None):
        try:
            import jinja2
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ValueError(f"the chat template of {origin} needs jinja2: pip install jinja2.") from None

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda format: datetime.now().strftime(format))
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateError as err:
            raise ValueError(f"the chat template of {origin} is not a valid jinja template ({err}): fix it or remove "
                             "it.") from None
        self.source, self.origin, self.variables = source, origin, dict(variables or {})
        self.error = jinja2.exceptions.TemplateError

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.variables)
        except self.error as err:
            raise ApiError(400, f"the chat template refuses these messages: {' '.join(str(err).split())[:300]}",
                           "messages") from None
        except Exception as err:  # noqa: BLE001 - a template's bug on these messages
            raise ApiError(400, f"the chat template cannot render these messages ({type(err).__name__}: "
                           f"{' '.join(str(err).split())[:200]}).", "messages") from None


def chat_template(tokenizer) -> ChatTemplate:
    """The tokenizer's chat template, else the plain one. ValueError (one line) for one that cannot be read."""
    path = getattr(tokenizer, "tokenizer_json", None)
    folder = os.path.dirname(path) if path else None
    config_path = os.path.join(folder, "tokenizer_config.json") if folder else None
    config: dict = {}
    if config_path and os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot read {config_path} ({err}): fix it or remove it.") from None
    source, origin = config.get("chat_template"), config_path
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    jinja_path = os.path.join(folder, "chat_template.jinja") if folder else None
    if not source and jinja_path and os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            source, origin = f.read(), jinja_path
    if not source:
        return ChatTemplate(PLAIN, "plain")
    if not isinstance(source, str):
        raise ValueError(f"{origin}'s chat_template is not a string (nor a list with one named 'default').")
    variables = {name: _token(config.get(name)) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return ChatTemplate(source, origin, variables)


def _token(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def messages_of(value: Any) -> list[dict]:
    """The chat's messages as ``{"role", "content"}`` with text content; ApiError naming the first bad one.
    A content may be a string or a list of ``{"type": "text", "text": ...}`` parts (joined)."""
    if not isinstance(value, list) or not value:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects, got "
                       f"{str(value)[:40]!r}.", "messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object with role and content, got {str(message)[:40]!r}.",
                           "messages")
        extra = sorted(set(message) - {"role", "content", "name"})
        if extra:
            raise ApiError(400, f"{where} has {extra[0]!r}, which this server does not support (it takes role, "
                           "content and name).", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {str(role)[:40]!r}.",
                           "messages")
        out.append({"role": role, "content": _text(message.get("content"), where)})
    return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts ({{\"type\": \"text\", \"text\": "
                   f"...}}), got {str(content)[:40]!r}.", "messages")
