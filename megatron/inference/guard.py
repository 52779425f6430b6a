"""What the server refuses before a request is parsed: a wrong or missing API key, and a body larger
than the limit; and the limits themselves (``Limits``, set by ``tools/serve.py``'s flags).

``Guard`` wraps the FastAPI app as plain ASGI, so its answers come before FastAPI reads anything:
a protected path (every path but ``GET /health``) without ``Authorization: Bearer <the key>`` is a
401; a ``Content-Length`` over ``max_request_bytes`` is a 413 without reading the body, and so is a
body that grows past it while read (a chunked upload says no length). The body, once read within the
limit, is handed to the app as it arrived. The key is compared in constant time (of SHA-256 digests,
so not even its length leaks).

No FastAPI import here: the errors are OpenAI's JSON shape, written by hand.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from dataclasses import dataclass

API_KEY_ENV = "MEGATRON_API_KEY"  # the environment variable tools/serve.py reads the key from
OPEN_PATHS = ("/health",)  # answered without a key (load balancers probe it)


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (each a ``tools/serve.py`` flag; the defaults are its
    defaults). Each prompt's length in tokens is bounded by the model's positions, not here."""

    max_request_bytes: int = 1 << 20  # 1 MiB: a prompt of the model's length is far smaller
    max_stop_strings: int = 16  # OpenAI allows 4
    max_stop_chars: int = 256  # per stop string
    max_prompts: int = 4096  # per completions request, run --max-batch-size at a time (lm-eval sends its batch)
    max_request_tokens: int = 1 << 20  # the prompts' tokens plus the max_tokens of each, over one request

    def check(self) -> None:
        """ValueError naming the flag that is not a positive number."""
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}.")


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name other than localhost: it may resolve to anything
        return False


class Guard:
    """ASGI middleware around ``app``: the API key (when ``api_key``) and the body size limit."""

    def __init__(self, app, max_request_bytes: int, api_key: str | None = None):
        self.app, self.limit = app, max_request_bytes
        self.key_digest = None if not api_key else hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for name, value in scope.get("headers", ()):
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        if self.key_digest is not None and scope.get("path") not in OPEN_PATHS and not self._authorized(headers):
            return await _answer(send, 401, error_body(
                "missing or wrong API key: send the server's key as 'Authorization: Bearer <key>' (the openai "
                "client's api_key).", code="invalid_api_key"))
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            if not length.isdigit():
                return await _answer(send, 400, error_body(f"Content-Length {length[:20]!r} is not a number."))
            return await _answer(send, 413, error_body(self._too_large(f"{int(length):,} bytes")))
        body, more = [], True
        size = 0
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                return await self.app(scope, _replay([], message, receive), send)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return await _answer(send, 413, error_body(self._too_large(f"more than {self.limit:,} bytes")))
            body.append(chunk)
            more = message.get("more_body", False)
        return await self.app(scope, _replay(body, None, receive), send)

    def _authorized(self, headers: dict) -> bool:
        scheme, _, given = headers.get("authorization", "").partition(" ")
        digest = hashlib.sha256(given.strip().encode()).digest()
        return hmac.compare_digest(digest, self.key_digest) and scheme.lower() == "bearer"

    def _too_large(self, size: str) -> str:
        return (f"the request body has {size}, over the server's limit of {self.limit:,} bytes "
                "(--max-request-bytes): send a shorter prompt or fewer prompts per request.")


def _replay(body: list[bytes], first, receive):
    """A ``receive`` that gives the body read already (or ``first``), then the client's next messages."""
    pending = [first] if first is not None else [{"type": "http.request", "body": b"".join(body),
                                                   "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


async def _answer(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
