"""Request-body limits for the HTTP API, as a pure ASGI middleware: how large a body may be and how
long it may take to arrive. Every HTTP request passes through it; lifespan and websocket scopes pass
through untouched.

- ``Content-Length`` over ``max_body_bytes``: 413 at once, before a byte of the body is read (a client
  that sent ``Expect: 100-continue`` is never told to go on).
- ``Content-Length`` that is not a non-negative integer (or several that disagree): 400.
- A body without ``Content-Length`` (chunked) is counted as it arrives; past ``max_body_bytes``, reading
  stops and the answer is 413.
- A body not complete ``read_timeout_s`` after the request began (a client that declares 1000 bytes,
  sends 10 and waits): 408. Without this, such clients hold a connection and a request task forever.

Why ``receive`` is wrapped: counting and timing must happen as the app reads, and only the app knows
whether it reads the body at all. Each ``receive`` of an incomplete body runs under
``asyncio.wait_for`` against the request's deadline; once ``more_body`` is False (or the client has
gone), ``receive`` passes through unchanged, because the app may later wait on it for
``http.disconnect`` for as long as it likes. A limit hit inside the app raises out of its ``receive``;
from then on the app's own messages (its 400 or 500 about the failed read) are dropped and this
middleware answers instead, provided the response has not started; if it has, the connection is
dropped by the server (the exception propagates, or the response ends incomplete).

Errors are JSON in OpenAI's shape, as in ``dit_serve.server.api``, and carry ``Connection: close``: the rest
of the body is left unread (or its framing is unknown), so the connection cannot serve another request.
"""

from __future__ import annotations

import asyncio
import json
import time


class BodyRejected(Exception):
    """Raised out of the wrapped ``receive`` when a limit is hit; the middleware answers ``status``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class LimitsMiddleware:
    """``route_limits``: paths whose bodies may be larger than ``max_body_bytes`` (an edit's image files), and
    their own limit."""

    def __init__(self, app, max_body_bytes: int = 1 << 20, read_timeout_s: float = 30.0,
                 route_limits: dict[str, int] | None = None):
        self.app, self.max_body_bytes, self.read_timeout_s = app, max_body_bytes, read_timeout_s
        self.route_limits = route_limits or {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            declared = _content_length(scope["headers"])
        except ValueError as e:
            return await _reply(send, 400, str(e))
        path = scope.get("path", "")
        limit = self.route_limits.get(path, self.max_body_bytes)
        if declared is not None and declared > limit:
            where = f" on {path}" if path in self.route_limits else ""
            return await _reply(send, 413, f"the request body is {declared} bytes; this service accepts at "
                                           f"most {limit} ({_size(limit)}){where}")
        body = _Body(receive, send, limit, self.read_timeout_s, declared)
        try:
            await self.app(scope, body.receive, body.send)
        except Exception:
            if body.rejected is None or body.started:
                raise
        if body.rejected is not None and not body.started:
            await _reply(send, body.rejected.status, body.rejected.message)


class _Body:
    """One request's body as the app reads it: bytes counted, reads bounded by a deadline."""

    def __init__(self, receive, send, max_bytes: int, timeout_s: float, declared: int | None):
        self._receive, self._send, self.max_bytes, self.timeout_s = receive, send, max_bytes, timeout_s
        self.deadline = time.monotonic() + timeout_s  # the request began now
        self.declared, self.received, self.complete = declared, 0, False
        self.started = False  # the app sent http.response.start
        self.rejected: BodyRejected | None = None

    async def receive(self):
        if self.complete:
            return await self._receive()
        try:
            message = await asyncio.wait_for(self._receive(), max(0.0, self.deadline - time.monotonic()))
        except asyncio.TimeoutError:
            of = f" of {self.declared}" if self.declared is not None else ""
            raise self._reject(408, f"the request body did not arrive within {self.timeout_s:g} s ({self.received}"
                                    f"{of} bytes came); send the whole body without pausing") from None
        if message["type"] != "http.request":  # http.disconnect: the client is gone
            self.complete = True
            return message
        self.received += len(message.get("body", b""))
        if self.received > self.max_bytes:
            raise self._reject(413, f"the request body is larger than {self.max_bytes} bytes "
                                    f"({_size(self.max_bytes)}), the most this service accepts")
        self.complete = not message.get("more_body", False)
        return message

    def _reject(self, status: int, message: str) -> BodyRejected:
        self.rejected = BodyRejected(status, message)
        return self.rejected

    async def send(self, message) -> None:
        if self.rejected is not None:  # the app answering its failed read; this middleware answers instead
            return
        self.started = self.started or message["type"] == "http.response.start"
        await self._send(message)


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The declared body size, None when there is none; ValueError when it is not a valid size."""
    values = {v.strip() for k, v in headers if k.lower() == b"content-length"}
    if not values:
        return None
    if len(values) > 1 or not next(iter(values)).isdigit():  # bytes.isdigit: ASCII digits only, no sign
        shown = ", ".join(sorted(repr(v.decode("latin-1")) for v in values))
        raise ValueError(f"invalid Content-Length header {shown}: it must be one non-negative integer "
                         "(the body's size in bytes)")
    return int(values.pop())


async def _reply(send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": None}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} bytes"
