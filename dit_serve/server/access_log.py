"""The access log: one line per HTTP request at info level, ``GET /v1/jobs 200 4 ms``, on the logger
``dit_serve.access`` (uvicorn's own access log is off). A pure ASGI middleware, outermost, so it logs the
status the client got, a 413 of the body limits included. The line is written when the response has been
sent: for an event stream, when the stream ends. The path is logged without its query string (where a
client may put what it should not); a request that raised before answering is logged as 500.
"""

from __future__ import annotations

import logging
import time

LOGGER = "dit_serve.access"
log = logging.getLogger(LOGGER)


class AccessLogMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            log.info("%s %s %d %.0f ms", scope["method"], scope["path"], status, (time.perf_counter() - start) * 1e3)
