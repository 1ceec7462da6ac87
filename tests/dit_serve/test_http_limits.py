"""LimitsMiddleware: unit tests through httpx's ASGITransport (a lazy body stream, so "stopped reading"
is observable), then end to end over uvicorn and raw sockets: a stalled body gets a 408, a 10 MB body
a fast 413, and /healthz keeps answering within 100 ms while slow or large bodies are in flight."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import select
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field

from dit_serve.server.http_limits import LimitsMiddleware

LIMIT = 1 << 20
READ_TIMEOUT_S = 0.5
CHUNK = 64 << 10


class Items(BaseModel):
    values: list[int] = Field(max_length=10000)


def make_app(max_body_bytes: int = LIMIT, read_timeout_s: float = READ_TIMEOUT_S) -> FastAPI:
    """/echo answers with the body it read; ``app.state.calls`` counts its calls."""
    app = FastAPI()
    app.state.calls = 0

    @app.post("/echo")
    async def echo(request: Request) -> Response:
        app.state.calls += 1
        return Response(await request.body(), media_type="application/octet-stream")

    @app.post("/items")
    def items(req: Items) -> dict:
        return {"n": len(req.values)}

    @app.get("/healthz")
    def health() -> dict:  # sync, as dit_serve's: it runs in the thread pool
        return {"status": "ok"}

    @app.exception_handler(RequestValidationError)  # as dit_serve.server.api: the first error only, no input echoed
    async def invalid(_request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": {"message": e.errors()[0]["msg"], "type": "invalid_request_error",
                                       "param": None, "code": None}}, status_code=400)

    app.add_middleware(LimitsMiddleware, max_body_bytes=max_body_bytes, read_timeout_s=read_timeout_s)
    return app


def post(app, content, headers: dict | None = None) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as client:
            return await client.post("/echo", content=content, headers=headers)
    return asyncio.run(go())


def error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert body == {"error": {"message": body["error"]["message"], "type": "invalid_request_error",
                              "param": None, "code": None}}
    return body["error"]["message"]


def test_declared_too_large_is_413_before_the_app_runs():
    app = make_app()
    r = post(app, b"x" * (10 << 20))
    assert error(r, 413) == "the request body is 10485760 bytes; this service accepts at most 1048576 (1 MiB)"
    assert r.headers["connection"] == "close"
    assert app.state.calls == 0


def test_chunked_over_limit_is_413_and_reading_stops():
    sent = 0

    async def chunks():  # 32 x 64 KiB = 2 MiB, no Content-Length
        nonlocal sent
        for _ in range(32):
            sent += 1
            yield b"x" * CHUNK

    r = post(make_app(), chunks())
    assert "larger than 1048576 bytes (1 MiB)" in error(r, 413)
    assert r.headers["connection"] == "close"
    assert sent == LIMIT // CHUNK + 1  # the 17th chunk crossed the limit; nothing was read after it


@pytest.mark.parametrize("chunked", [False, True])
def test_body_at_the_limit_reaches_the_app_intact(chunked):
    data = os.urandom(LIMIT)

    async def chunks():
        for i in range(0, LIMIT, CHUNK):
            yield data[i:i + CHUNK]

    r = post(make_app(), chunks() if chunked else data)
    assert r.status_code == 200 and r.content == data


@pytest.mark.parametrize("value", ["abc", "-5", "1e3", "+5"])
def test_bad_content_length_is_400(value):
    app = make_app()
    message = error(post(app, b"hello", headers={"Content-Length": value}), 400)
    assert f"invalid Content-Length header {value!r}" in message and "non-negative integer" in message
    assert app.state.calls == 0


def test_lifespan_passes_through():
    app = make_app()
    events = []
    app.router.on_startup.append(lambda: events.append("startup"))
    with TestClient(app) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
    assert events == ["startup"]


def test_receive_passes_through_once_the_body_is_complete():
    """After more_body=False the app may wait on receive (for http.disconnect) longer than the read
    timeout: that wait is the app's business, not a 408."""
    got, sent = [], []

    async def app(scope, receive, send):
        got.append(await receive())  # the body
        got.append(await receive())  # waits 0.2 s > read_timeout_s = 0.05 s
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    messages = [{"type": "http.request", "body": b"hi", "more_body": False}, {"type": "http.disconnect"}]

    async def receive():
        if len(messages) == 1:
            await asyncio.sleep(0.2)
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"content-length", b"2")]}
    asyncio.run(LimitsMiddleware(app, read_timeout_s=0.05)(scope, receive, send))
    assert [m["type"] for m in got] == ["http.request", "http.disconnect"]
    assert sent[0]["status"] == 204


# end to end: uvicorn (h11) on a free port, as dit_serve.server.service runs it


@contextmanager
def serving(app):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1))
    server.install_signal_handlers = lambda: None
    thread = threading.Thread(target=server.run, args=([sock],), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def port():
    with serving(make_app()) as p:
        yield p


def head(path: str, length: int | None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return f"POST {path} HTTP/1.1\r\nHost: t\r\n{framing}\r\n\r\n".encode()


def read_response(conn: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything until the server closes; a reset after some bytes ends the response too."""
    conn.settimeout(timeout)
    data = b""
    try:
        while chunk := conn.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def health_latency(port: int) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        t = time.perf_counter()
        conn.request("GET", "/healthz")
        r = conn.getresponse()
        assert r.status == 200 and r.read() == b'{"status":"ok"}'
        return time.perf_counter() - t
    finally:
        conn.close()


def stalled_client(port: int) -> socket.socket:
    """Declares 1000 bytes, sends 10, waits."""
    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(head("/echo", 1000) + b"x" * 10)
    return conn


def test_stalled_body_gets_408_within_the_read_timeout(port):
    t = time.perf_counter()
    with stalled_client(port) as conn:
        response = read_response(conn)
    elapsed = time.perf_counter() - t
    assert status(response) == 408, response
    assert b"connection: close" in response.lower()
    assert b"did not arrive within 0.5 s (10 of 1000 bytes came)" in response
    assert elapsed > READ_TIMEOUT_S - 0.05  # not before the timeout; the message says the timeout ended it


def send_until_answered(conn: socket.socket, total: int, chunked: bool) -> tuple[bytes, int]:
    """Send ``total`` body bytes in 64 KiB pieces, stopping once the server answers (or hangs up);
    then (the response, if one came; the body bytes sent before it)."""
    piece = b"x" * CHUNK
    if chunked:
        piece = f"{CHUNK:x}\r\n".encode() + piece + b"\r\n"
    sent = 0
    try:
        for _ in range(total // CHUNK):
            if select.select([conn], [], [], 0)[0]:
                break
            conn.sendall(piece)
            sent += CHUNK
    except (BrokenPipeError, ConnectionResetError):
        pass
    return read_response(conn), sent


@pytest.mark.parametrize("chunked", [False, True])
def test_10_mb_body_is_rejected_fast(port, chunked):
    """With Content-Length the 413 comes before the body is read; chunked, after the first 1 MiB. The
    server then closes with the rest unread, so the client may see a reset, but only after the 413.
    "Fast" is counted in bytes, not seconds (a loaded machine slows both ends alike): the answer comes
    before the whole body is sent (a server that read it all would answer only after the last byte)."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(head("/echo", None if chunked else 10 << 20))
        response, sent = send_until_answered(conn, 10 << 20, chunked)
    assert status(response) == 413, response
    assert b"connection: close" in response.lower()
    assert sent < 10 << 20, "the 413 came only after the whole body was sent"


def test_healthz_answers_while_bodies_stall_or_stream(port):
    """Stalled clients on one server (answered at 0.5 s); on another, which allows 16 MiB, a 10 MB body
    streamed in 64 KiB pieces 5 ms apart (~1 s). Both answer /healthz meanwhile."""
    stalled = [stalled_client(port) for _ in range(3)]
    with serving(make_app(max_body_bytes=16 << 20, read_timeout_s=5.0)) as big:
        answer = []

        def stream():
            with socket.create_connection(("127.0.0.1", big)) as conn:
                conn.sendall(head("/echo", 10 << 20))
                for _ in range((10 << 20) // CHUNK):
                    conn.sendall(b"x" * CHUNK)
                    time.sleep(0.005)
                answer.append(status(conn.recv(100)))

        streamer = threading.Thread(target=stream)
        streamer.start()
        time.sleep(0.05)
        latencies = []
        for _ in range(4):  # ~0.25 s: within the stall and the stream
            latencies += [health_latency(port), health_latency(big)]
            time.sleep(0.05)
        in_flight = streamer.is_alive()
        streamer.join(10)
    for conn in stalled:
        conn.close()
    assert in_flight and answer == [200]
    # the median probe: a loop held by the bodies would slow every probe, an overloaded test machine only some
    assert sorted(latencies)[len(latencies) // 2] < 0.1, latencies


def test_1_mb_json_of_100k_ints_does_not_hold_healthz(port):
    """json.loads and pydantic run on the event loop: ~5 ms for this body (json.loads ~4-6 ms, pydantic
    under 1 ms), so /healthz waits about that long. Each round is the slowest probe during one POST;
    the best of five rounds is asserted: a parse holding the loop for 100 ms would slow every round, an
    overloaded test machine only some. The list is over max_length, so each POST is a 400."""
    body = json.dumps({"values": list(range(1_000_000, 1_110_000))}, separators=(", ", ": ")).encode()
    assert 0.95e6 < len(body) < LIMIT
    answers, rounds = [], []

    def post_items():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("POST", "/items", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        answers.append((r.status, json.loads(r.read())["error"]["message"]))
        conn.close()

    for _ in range(5):
        poster = threading.Thread(target=post_items)
        poster.start()
        latencies = [health_latency(port)]
        while poster.is_alive():
            latencies.append(health_latency(port))
        poster.join()
        rounds.append(max(latencies))
    assert answers == [(400, "List should have at most 10000 items after validation, not 110000")] * 5
    assert min(rounds) < 0.1, rounds
