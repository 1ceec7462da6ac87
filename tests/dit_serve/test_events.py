"""GET /v1/jobs/{id}/events (Server-Sent Events) and the SDK's ``wait`` on it.

Most tests run an API-only service (no Ray) and move the job along themselves through the store, as a
scheduler would (lease, heartbeat, commit or fail): every ending is placed exactly where the test needs it,
so a reconnect "in the middle" is really in the middle. The last tests run the whole service (real local
Ray, a worker with the digits model) and check the stream and ``wait`` end to end."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from fastapi.responses import JSONResponse

from dit_serve.server.api import create_app
from dit_serve.client import AsyncClient, Client
from dit_serve.server.config import ServerConfig
from dit_serve.server.events import StreamLimits
from dit_serve.server.keys import create_key
from dit_serve.server.metrics import Metrics
from dit_serve.server.service import Service, build_catalog
from dit_serve.server.store import Store

from .conftest import patient, running_service, service_config

ADMIN = "events-admin-key"  # a configured key: admin of the tenant 'default'
AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def api(digits_model, tmp_path_factory):
    cfg = service_config(tmp_path_factory.mktemp("events"), digits_model, server={"api_keys": [ADMIN]})
    with Service(cfg, roles=("api",)) as svc:
        yield svc


@pytest.fixture
def http(api):
    with httpx.Client(base_url=api.url, headers=AUTH, timeout=10) as h:
        yield h
    for job in api.store.list_jobs(100, 0)[0]:  # nothing left queued for the next test's leases
        api.store.cancel_job(job.id)


def _submit(http, n: int, steps: int = 4) -> str:
    r = http.post("/v1/jobs", json={"labels": [1] * n, "steps": steps})
    assert r.status_code == 202, r.text
    return r.json()["id"]


def _lease(store: Store, job_id: str, n: int) -> list:
    """Lease the job's n items, as a scheduler would; in index order."""
    leases = store.lease("test-events", ["digits"], n, 60.0)
    assert sorted((ls.job_id, ls.index) for ls in leases) == [(job_id, i) for i in range(n)]
    return sorted(leases, key=lambda ls: ls.index)


def _events(r: httpx.Response):
    """(event, id, data) of a raw text/event-stream, parsed here independently of the SDK."""
    name, eid, data = None, None, []
    for line in r.iter_lines():
        if line.startswith(("retry:", ":")):
            continue
        if line:
            field, _, value = line.partition(": ")
            if field == "event":
                name = value
            elif field == "id":
                eid = value
            else:
                data.append(value)
            continue
        if name is not None:
            yield name, eid, json.loads("\n".join(data))
        name, data = None, []


def _until(events, name: str, pred=lambda d: True, seen: list | None = None) -> tuple:
    """The next event called ``name`` whose data satisfies ``pred``; the events passed are added to ``seen``."""
    for event in events:
        if seen is not None:
            seen.append(event)
        if event[0] == name and pred(event[2]):
            return event
    raise AssertionError(f"the stream closed before a {name} event")


def _seq(event_id: str) -> int:
    return int(event_id.split(".")[1])


def test_a_job_streams_progress_each_item_once_and_end(api, http):
    job_id = _submit(http, 3, steps=10)
    seen: list = []
    with http.stream("GET", f"/v1/jobs/{job_id}/events") as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r)
        assert _until(events, "progress", seen=seen)[2]["state"] == "queued"
        leases = _lease(api.store, job_id, 3)
        assert _until(events, "progress", lambda d: d["running"] == 3, seen)[2]["steps_total"] == 30
        for step in range(1, 11):  # ten heartbeats in ~0.1 s: coalesced, and the latest state goes out
            for ls in leases:
                ls.step = step
            api.store.heartbeat(leases, 60.0)
            time.sleep(0.01)
        _until(events, "progress", lambda d: d["steps_done"] == 30, seen)
        api.store.commit_result(leases[0], b"png")
        api.store.fail_item(leases[1], "boom")
        api.store.commit_result(leases[2], b"png")
        _until(events, "end", seen=seen)
        assert next(events, None) is None  # the stream closed
    items = [d for name, _, d in seen if name == "item"]
    assert sorted(d["index"] for d in items) == [0, 1, 2]
    by_index = {d["index"]: d for d in items}
    assert by_index[0]["url"] == f"/v1/jobs/{job_id}/images/0" and by_index[0]["state"] == "done"
    assert by_index[1]["state"] == "failed" and by_index[1]["error"] == "boom" and by_index[1]["url"] is None
    end = seen[-1][2]
    assert end["state"] == "failed" and end["counts"] == {"done": 2, "failed": 1}
    seqs = [_seq(eid) for _, eid, _ in seen]
    assert seqs == sorted(set(seqs)), "ids increase"
    assert http.get(by_index[0]["url"]).status_code == 200


def test_the_streams_first_read_is_the_routes_and_a_change_right_after_it_is_not_missed(api, http, monkeypatch):
    """The route reads the job (with its items: it is small) and the stream starts from that read, without
    reading again; the route watches the job from before its read, so an ending committed between the
    read and the stream's start wakes the stream at once, not at its one-second check."""
    from dit_serve.server.routes import jobs as jobs_routes

    job_id = _submit(http, 1)
    calls: list[str] = []
    real_get, real_read = Store.get_job, jobs_routes._job_for_stream
    monkeypatch.setattr(Store, "get_job", lambda self, *a, **k: calls.append("get_job") or real_get(self, *a, **k))

    def read_then_end(store, job_id_, who):
        job = real_read(store, job_id_, who)  # queued, as read
        (lease,) = _lease(store, job_id_, 1)
        store.commit_result(lease, b"png")  # ends after the read, before the stream runs
        return job

    monkeypatch.setattr(jobs_routes, "_job_for_stream", read_then_end)
    # the slow check 30 s apart: a loaded machine may take seconds, and still only the notification ends it soon
    with _serve(_app(api, poll_s=30.0)) as url, httpx.Client(base_url=url, headers=AUTH, timeout=60) as h:
        t0 = time.monotonic()
        with h.stream("GET", f"/v1/jobs/{job_id}/events") as r:
            seen: list = []
            end = _until(_events(r), "end", seen=seen)
        assert time.monotonic() - t0 < 10.0  # woken by the commit's notification, not the check
    assert [name for name, _, _ in seen] == ["progress", "item", "end"] and seen[0][2]["state"] == "queued"
    assert end[2]["state"] == "done"
    assert calls == ["get_job", "get_job"]  # the route's read, then one read after the change; none before it


def test_small_jobs_on_sqlite_are_read_on_the_loop_while_few_streams_are_open(api, http):
    """Reads on the event loop only where they are short: a small job, a local SQLite file, few streams
    open; a job streamed with reads in the thread pool sends the same events."""
    from dit_serve.server import events as ev

    job = api.store.get_job(_submit(http, 2))
    streams = ev.Streams(StreamLimits(inline_reads=2))
    small = ev.JobEvents(api.store, job, ev.Cursor(), streams)
    assert small._inline()
    streams.open = 3
    assert not small._inline()
    streams.open = 0
    large = job.model_copy(update={"num_items": ev.END_EVENT_ITEMS + 1})
    assert not ev.JobEvents(api.store, large, ev.Cursor(), streams)._inline()
    api.store.local_reads = False
    try:
        assert not small._inline()
    finally:
        api.store.local_reads = True

    async def collect(limits: StreamLimits) -> list[str]:
        streams, out = ev.Streams(limits), []
        assert streams.acquire("default") is None  # as the route does: this stream counts as open
        events = ev.JobEvents(api.store, job, ev.Cursor(), streams)
        assert events._inline() == (limits.inline_reads >= 1)
        async for chunk in events.stream():
            out.append(chunk)
        return out

    for lease in _lease(api.store, job.id, 2):
        api.store.commit_result(lease, b"png")
    on_loop, in_pool = (asyncio.run(collect(StreamLimits(inline_reads=n))) for n in (4, 0))
    assert on_loop == in_pool and "event: end" in on_loop[-1]


def test_progress_is_sent_at_most_every_quarter_second(api, http):
    job_id = _submit(http, 2, steps=100)
    with http.stream("GET", f"/v1/jobs/{job_id}/events") as r:
        events = _events(r)
        _until(events, "progress")
        leases = _lease(api.store, job_id, 2)
        stop = threading.Event()

        def heartbeats():  # a heartbeat every 20 ms, 12 times faster than progress may be sent
            step = 0
            while not stop.wait(0.02) and step < 99:
                step += 1
                for ls in leases:
                    ls.step = step
                api.store.heartbeat(leases, 60.0)

        beater = threading.Thread(target=heartbeats)
        beater.start()
        times = []
        try:
            for name, _, data in events:
                if name == "progress":
                    times.append(time.monotonic())
                if len(times) == 6:
                    break
        finally:
            stop.set()
            beater.join()
    gaps = [b - a for a, b in zip(times[1:], times[2:])]  # after the first, which the lease woke
    assert min(gaps) >= 0.2, gaps


def test_a_reconnect_with_last_event_id_gets_what_it_missed_and_nothing_twice(api, http):
    job_id = _submit(http, 6)
    store = api.store
    leases = _lease(store, job_id, 6)
    for ls in leases[:2]:
        store.commit_result(ls, b"png")
    first: list = []
    with http.stream("GET", f"/v1/jobs/{job_id}/events") as r:
        events = _events(r)
        _until(events, "item", lambda d: d["index"] == 1, first)
    last_id = first[-1][1]
    store.commit_result(leases[2], b"png")  # while disconnected
    store.fail_item(leases[3], "boom")
    second: list = []
    with http.stream("GET", f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": last_id}) as r:
        events = _events(r)
        _until(events, "item", lambda d: d["index"] == 3, second)
        store.commit_result(leases[4], b"png")  # live again
        _until(events, "item", lambda d: d["index"] == 4, second)
        store.commit_result(leases[5], b"png")
        _until(events, "end", seen=second)
    items = [d["index"] for name, _, d in first + second if name == "item"]
    assert sorted(items) == list(range(6)), items  # every item once: none missed, none repeated
    assert [d["index"] for name, _, d in first if name == "item"] == [0, 1]
    assert _seq(second[0][1]) > _seq(last_id), "ids go on from the resumed one"
    assert second[-1][2]["state"] == "failed"


def test_a_finished_job_streams_its_items_and_end_at_once(api, http):
    job_id = _submit(http, 2)
    for ls in _lease(api.store, job_id, 2):
        api.store.commit_result(ls, b"png")
    with _serve(_app(api, poll_s=30.0)) as url:  # the check 30 s apart: "at once" is not waiting for it
        t0 = time.monotonic()
        r = httpx.get(f"{url}/v1/jobs/{job_id}/events", headers=AUTH, timeout=60)  # the stream closes by itself
        assert time.monotonic() - t0 < 10.0
    events = list(_events(r))
    assert [(name, d.get("index")) for name, _, d in events] == [("item", 0), ("item", 1), ("end", None)]
    assert events[-1][2]["state"] == "done" and events[-1][2]["steps_done"] == events[-1][2]["steps_total"] == 8
    ended = events[-1][2]["job"]  # a small job's end carries it, as GET /v1/jobs/{id} returns it
    assert ended == http.get(f"/v1/jobs/{job_id}").json() and [it["state"] for it in ended["items"]] == ["done"] * 2
    again = list(_events(http.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": events[-1][1]})))
    assert [name for name, _, _ in again] == ["end"]  # resumed after everything: only the end
    cancelled = _submit(http, 3)
    http.delete(f"/v1/jobs/{cancelled}")
    events = list(_events(http.get(f"/v1/jobs/{cancelled}/events")))
    assert [d["state"] for _, _, d in events] == ["cancelled"] * 4
    big = _submit(http, 101)
    http.delete(f"/v1/jobs/{big}")
    end = list(_events(http.get(f"/v1/jobs/{big}/events")))[-1][2]
    assert end["state"] == "cancelled" and end["job"] is None  # past 100 items the end stays small


def test_a_retried_item_ends_again_and_is_sent_again(api, http):
    job_id = _submit(http, 2)
    leases = _lease(api.store, job_id, 2)
    api.store.commit_result(leases[0], b"png")
    api.store.fail_item(leases[1], "boom")
    first = list(_events(http.get(f"/v1/jobs/{job_id}/events")))
    assert first[-1][2]["state"] == "failed"
    assert http.post(f"/v1/jobs/{job_id}/retry").status_code == 200
    (again,) = api.store.lease("test-events", ["digits"], 1, 60.0)
    api.store.commit_result(again, b"png")
    second = list(_events(http.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": first[-1][1]})))
    assert [(name, d.get("index"), d["state"]) for name, _, d in second] == [("item", 1, "done"), ("end", None, "done")]


def test_another_tenants_job_is_404_and_keys_are_needed(api, http):
    _, alice_key = create_key(api.store, "alice")
    _, bob_key = create_key(api.store, "bob")
    r = httpx.post(f"{api.url}/v1/jobs", json={"labels": [1]}, headers={"Authorization": f"Bearer {alice_key}"})
    job_id = r.json()["id"]
    path = f"{api.url}/v1/jobs/{job_id}/events"
    r = httpx.get(path, headers={"Authorization": f"Bearer {bob_key}"})
    assert r.status_code == 404 and job_id in r.json()["error"]["message"], r.text
    assert httpx.get(path).status_code == 401
    assert httpx.get(f"{api.url}/v1/jobs/nope/events", headers=AUTH).status_code == 404
    for key in (alice_key, ADMIN):  # the owner, and an admin
        with httpx.stream("GET", path, headers={"Authorization": f"Bearer {key}"}, timeout=10) as r:
            assert r.status_code == 200
            assert _until(_events(r), "progress")[2]["state"] == "queued"
    bad = http.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "not-an-id"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"


def test_without_notifications_the_stream_checks_every_second(api, http, tmp_path):
    """An API process without the scheduler gets no notifications: a second Store on the same database
    stands in for a scheduler in another process."""
    job_id = _submit(http, 1)
    other = Store(api.config.store.database_url(), api.config.store.data_dir)
    try:
        with http.stream("GET", f"/v1/jobs/{job_id}/events") as r:
            events = _events(r)
            _until(events, "progress")
            (lease,) = _lease(other, job_id, 1)
            other.commit_result(lease, b"png")
            t0 = time.monotonic()
            _until(events, "end")
            assert time.monotonic() - t0 < 10.0  # the check every second (later on a loaded machine); without it, never
    finally:
        other.close()


def test_api_processes_on_postgres_stream_a_job_another_process_runs(digits_model, postgres_url, tmp_path):
    """Two API processes' worth of services on one PostgreSQL store, and a scheduler elsewhere (a Store of
    its own, whose writes reach the APIs by LISTEN/NOTIFY): both streams deliver every item once, then end."""
    cfg = service_config(tmp_path, digits_model, store={"url": postgres_url})
    scheduler = Store(postgres_url, tmp_path)
    with Service(cfg, roles=("api",)) as a, Service(cfg, roles=("api",)) as b, \
            httpx.Client(base_url=a.url, timeout=10) as ha, httpx.Client(base_url=b.url, timeout=10) as hb:
        job_id = _submit(ha, 3)
        with ha.stream("GET", f"/v1/jobs/{job_id}/events") as ra, hb.stream("GET", f"/v1/jobs/{job_id}/events") as rb:
            streams = [_events(ra), _events(rb)]
            leases = _lease(scheduler, job_id, 3)
            scheduler.commit_result(leases[0], b"png")
            first = [_until(events, "item") for events in streams]
            for ls in leases[1:]:
                scheduler.commit_result(ls, b"png")
            rest = [list(events) for events in streams]
    scheduler.close()
    for head, tail in zip(first, rest):
        assert sorted(d["index"] for name, _, d in [head, *tail] if name == "item") == [0, 1, 2]
        assert tail[-1][0] == "end" and tail[-1][2]["state"] == "done"


def test_the_schema_documents_the_route(http):
    op = http.get("/openapi.json").json()["paths"]["/v1/jobs/{job_id}/events"]["get"]
    assert {"200", "400", "401", "404", "429"} <= set(op["responses"])
    assert "text/event-stream" in op["responses"]["200"]["content"]


# -- a second app over the same store, with small limits ---------------------------------------------
@contextmanager
def _serve(app, asgi=None):
    """The app (or ``asgi`` in front of it) on uvicorn in a thread, on a free port; its event streams are
    closed before it stops."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(asgi or app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, args=([sock],), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        app.state.event_streams.close()
        server.should_exit = True
        thread.join(10)
        assert not thread.is_alive(), "open event streams held the server up"


def _app(api, **limits):
    return create_app(api.store, build_catalog(api.config), ServerConfig(api_keys=[ADMIN]), Metrics(),
                      stream_limits=StreamLimits(**limits))


def test_stream_limits_keepalive_and_disconnect(api, http):
    app = _app(api, max_streams=3, tenant_max_streams=2, keepalive_s=0.2)
    streams = app.state.event_streams
    job_id = _submit(http, 1)
    with _serve(app) as url, httpx.Client(base_url=url, headers=AUTH, timeout=10) as h:
        path = f"/v1/jobs/{job_id}/events"
        with h.stream("GET", path) as a, h.stream("GET", path) as b:
            lines = a.iter_lines()
            assert ": keep-alive" in [next(lines) for _ in range(8)]  # retry, progress (4 lines), keep-alive
            assert streams.open == 2
            r = h.get(path)
            assert r.status_code == 429 and int(r.headers["Retry-After"]) > 0, r.text
            assert "event streams open" in r.json()["error"]["message"]
            b.close()
            t0 = time.monotonic()
            while streams.open > 1:  # the server noticed the hang-up: the generator ended, the slot is free
                assert time.monotonic() - t0 < 10.0, "the closed stream lingers"
                time.sleep(0.02)
            with h.stream("GET", path) as c:
                assert c.status_code == 200
        t0 = time.monotonic()
        while streams.open:
            assert time.monotonic() - t0 < 10.0
            time.sleep(0.02)
        with h.stream("GET", path) as d:  # stopping the server: close() ends open streams, without an end
            streams.close()
            t0 = time.monotonic()
            assert "end" not in [name for name, _, _ in _events(d)]
            assert time.monotonic() - t0 < 10.0  # within poll_s (1 s) on a quiet machine; without close(), never


def test_wait_falls_back_to_polling_on_a_service_without_the_route(api, http):
    app = _app(api)

    async def older(scope, receive, send):  # a service from before the events route
        if scope["type"] == "http" and scope["path"].endswith("/events"):
            return await JSONResponse({"detail": "Not Found"}, 404)(scope, receive, send)
        return await app(scope, receive, send)

    calls: list[str] = []

    def drive(job_id: str, n: int):
        time.sleep(0.3)
        for ls in _lease(api.store, job_id, n):
            api.store.commit_result(ls, b"png")

    with _serve(app, older) as url:
        hooks = {"request": [lambda req: calls.append(req.url.path)]}
        with Client(url, api_key=ADMIN, http=httpx.Client(base_url=url, timeout=10, event_hooks=hooks)) as c:
            job = c.submit([1, 2])
            threading.Thread(target=drive, args=(job.id, 2)).start()
            assert c.wait(job, progress=False, timeout=10, interval=0.05).state == "done"
        assert calls.count(f"/v1/jobs/{job.id}/events") == 1  # a 404, once
        assert calls.count(f"/v1/jobs/{job.id}") >= 3  # then polls

        async def run():
            async with AsyncClient(url, api_key=ADMIN) as c:
                job = await c.submit([3])
                threading.Thread(target=drive, args=(job.id, 1)).start()
                return await c.wait(job, progress=False, timeout=10, interval=0.05)

        assert asyncio.run(run()).state == "done"


class _Cut(httpx.HTTPTransport):
    """Cuts the first event stream after its first item event, as a dropped connection would."""

    def __init__(self):
        super().__init__()
        self.resumed_from: list[str | None] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if not request.url.path.endswith("/events"):
            return response
        self.resumed_from.append(request.headers.get("Last-Event-ID"))
        if len(self.resumed_from) > 1:
            return response
        upstream = response.stream

        class Cut(httpx.SyncByteStream):
            def __iter__(self):
                for chunk in upstream:
                    yield chunk
                    if b"event: item" in chunk:
                        raise httpx.ReadError("connection dropped (test)")

            def close(self):
                upstream.close()

        return httpx.Response(response.status_code, headers=response.headers, stream=Cut(), request=request)


def test_wait_resumes_a_dropped_stream_with_last_event_id(api, http):
    job_id = _submit(http, 3)
    leases = _lease(api.store, job_id, 3)
    api.store.commit_result(leases[0], b"png")
    transport = _Cut()
    seen: list = []
    with Client(api.url, api_key=ADMIN, http=httpx.Client(base_url=api.url, transport=transport, timeout=10)) as c:
        events = c.events(job_id)
        for event in events:
            seen.append(event)
            if len(transport.resumed_from) == 2:
                break  # resumed (its first event is the progress): finish the job
        for ls in leases[1:]:
            api.store.commit_result(ls, b"png")
        seen.extend(events)
        assert transport.resumed_from[0] is None and transport.resumed_from[1]
        assert sorted(e.index for e in seen if e.event == "item") == [0, 1, 2]
        assert seen[-1].event == "end" and seen[-1].state == "done"
        assert c.wait(job_id, progress=False, timeout=patient(60)).state == "done"


# -- the whole service: real Ray, a worker with the digits model ---------------------------------------
@pytest.fixture(scope="module")
def svc(digits_model, tmp_path_factory):
    with running_service(tmp_path_factory.mktemp("events-svc"), digits_model) as service:
        yield service


@pytest.mark.slow
def test_a_real_job_streams_to_its_end_and_resumes_in_the_middle(svc):
    with httpx.Client(base_url=svc.url, timeout=60) as h:
        job_id = h.post("/v1/jobs", json={"labels": [1, 2, 3], "steps": 150}).json()["id"]
        first: list = []
        with h.stream("GET", f"/v1/jobs/{job_id}/events") as r:  # until the job is part-way, then hang up
            _until(_events(r), "progress", lambda d: 0 < d["steps_done"] < d["steps_total"], first)
        second: list = []
        with h.stream("GET", f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": first[-1][1]}) as r:
            events = _events(r)
            _until(events, "end", seen=second)
            assert next(events, None) is None  # closed after the end
        items = [d for name, _, d in first + second if name == "item"]
        assert sorted(d["index"] for d in items) == [0, 1, 2] and all(d["state"] == "done" for d in items)
        assert second[-1][2]["state"] == "done" and second[-1][2]["steps_done"] == 450
        png = h.get(items[0]["url"])
        assert png.status_code == 200 and png.headers["content-type"] == "image/png"


@pytest.mark.slow
def test_wait_returns_as_the_job_ends_and_does_not_poll(svc):
    calls: list[str] = []
    hooks = {"request": [lambda req: calls.append(req.url.path)]}
    with Client(svc.url, http=httpx.Client(base_url=svc.url, timeout=60, event_hooks=hooks)) as c:
        job = c.submit(labels=[4, 5], steps=100)
        job = c.wait(job, progress=False, timeout=patient(120))
        returned_at = time.time()
    assert job.state == "done" and len(job.items) == 2
    assert returned_at - job.finished_at <= 1.0, returned_at - job.finished_at  # ~0.05 s on an idle machine
    assert calls.count(f"/v1/jobs/{job.id}/events") == 1
    assert calls.count(f"/v1/jobs/{job.id}") == 0  # no polls, and the end event carried the finished job

    async def three():
        async with AsyncClient(svc.url) as c:
            jobs = await asyncio.gather(*[c.submit(labels=[d], num_per_label=2, steps=50) for d in (1, 4, 8)])
            done = await asyncio.gather(*[c.wait(j, progress=False, timeout=patient(120)) for j in jobs])
            return done, time.time()

    done, returned_at = asyncio.run(three())
    assert [j.state for j in done] == ["done"] * 3
    assert returned_at - max(j.finished_at for j in done) <= 1.0


def test_a_small_jobs_stream_reads_the_job_once_and_finds_the_same_endings(api, http, monkeypatch):
    """A job of up to END_EVENT_ITEMS items is read with its items in one ``get_job`` per wake-up, and
    the endings taken from its items (``ItemStatus.finished_at``) are the ones ``finished_items`` gives."""
    from dit_serve.server import events as ev

    job_id = _submit(http, 3)
    leases = _lease(api.store, job_id, 3)
    api.store.commit_result(leases[0], b"png")
    api.store.fail_item(leases[2], "boom")
    job = api.store.get_job(job_id, with_items=False)
    ended = {it["index"]: it["finished_at"] for it in http.get(f"/v1/jobs/{job_id}").json()["items"]}
    assert ended[1] is None and ended[0] > job.created_at and ended[2] >= ended[0]
    calls: list[str] = []
    for name in ("get_job", "finished_items"):
        real = getattr(Store, name)
        monkeypatch.setattr(Store, name, lambda self, *a, _n=name, _r=real, **k: calls.append(_n) or _r(self, *a, **k))
    streams = ev.Streams(StreamLimits())
    small = ev.JobEvents(api.store, job, ev.Cursor(), streams)._read()
    assert calls == ["get_job"] and small[0].items is not None
    calls.clear()
    monkeypatch.setattr(ev, "END_EVENT_ITEMS", 2)  # the same job read as a large one
    large = ev.JobEvents(api.store, job, ev.Cursor(), streams)._read()
    assert calls == ["get_job", "finished_items"] and large[0].items is None
    as_rows = lambda rows: sorted((r.idx, r.state, r.error, r.finished_at) for r in rows)
    assert as_rows(small[1]) == as_rows(large[1]) == [(0, "done", None, ended[0]), (2, "failed", "boom", ended[2])]
