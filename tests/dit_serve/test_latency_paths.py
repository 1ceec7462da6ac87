"""What keeps a single image's trip through the service short: accepted HTTP connections without
Nagle's algorithm (else every response waits ~40 ms for the client's delayed ACK), the store's new-work
signal that wakes the scheduler at a submission, and long polls that hand a finished image over at once."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from dit_serve.client import Client
from dit_serve.schemas import JobParams
from dit_serve.server.service import Service, _bind
from dit_serve.server.store import Store

from .conftest import patient, service_config


def test_connections_accepted_on_the_service_socket_have_nagle_off():
    """uvicorn serves on the socket ``_bind`` made, through ``loop.create_server(sock=...)``, as here."""
    sock = _bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    seen: list[int] = []

    async def main():
        class Proto(asyncio.Protocol):
            def connection_made(self, transport):
                seen.append(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Proto, sock=sock)
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()

    asyncio.run(main())
    assert seen and seen[0] != 0


def test_the_store_signals_new_work_on_submit_retry_and_release(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/s.db", tmp_path)
    assert not store.work.is_set() and not store.queued.is_set()
    store.submit("digits", JobParams(sampler="ddim", steps=5, guidance=1.0), [1, 2], [0, 1])
    assert store.work.is_set() and store.queued.is_set()
    store.work.clear()
    store.queued.clear()
    leases = store.lease("me", ["digits"], 2, 30.0)
    assert len(leases) == 2 and not store.work.is_set() and not store.queued.is_set()
    store.release(leases[:1], "stop")
    assert store.work.is_set() and store.queued.is_set()


def test_a_finished_image_is_committed_without_a_lease_first_when_nothing_new_is_queued(tmp_path):
    """The scheduler's own wake-up (an answer arriving sets ``work``) is not new work: the early refill
    before the commits happens only when the store says items may be queued (``queued``)."""
    from types import SimpleNamespace

    from dit_serve.server.config import SchedulerConfig, WorkerConfig
    from dit_serve.server.scheduler import Scheduler, _Worker

    store = Store(f"sqlite:///{tmp_path}/s.db", tmp_path)
    calls: list[str] = []
    real_lease, real_commit = store.lease, store.commit_result
    store.lease = lambda *a, **k: calls.append("lease") or real_lease(*a, **k)
    store.commit_result = lambda *a, **k: calls.append("commit") or real_commit(*a, **k)
    sched = Scheduler(store, WorkerConfig(), SchedulerConfig(), 30.0)
    for queued in (False, True):
        store.submit("digits", JobParams(sampler="ddim", steps=5, guidance=1.0), [1], [0])
        (lease,) = real_lease(f"{sched.owner}/w", ["digits"], 1, 30.0)
        w = _Worker("w", None, SimpleNamespace(submit=SimpleNamespace(remote=lambda specs: None)), None,
                    models=["digits"], leases={lease.key: lease})
        store.work.set()  # as the answer's future sets it
        store.queued.set() if queued else store.queued.clear()
        calls.clear()
        sched._apply_report(w, {"progress": {}, "finished": [(lease.key, b"png")], "failed": [], "step_seconds": [],
                                "busy_s": 0.0, "window_s": 0.0, "stats": {}})
        assert calls == (["lease", "commit"] if queued else ["commit"]), (queued, calls)


@pytest.mark.slow
def test_a_submission_is_leased_and_committed_without_waiting_for_ticks(tmp_path, digits_model):
    """Ticks of 30 s and heartbeats of 60 s: without the new-work signal the job would wait for a tick
    (or an idle worker's 30 s long poll) before it is leased, and without long polls its image would
    wait as long to be committed. With both, a 5-step digit comes back in well under one tick. Then
    back-to-back single images: a worker is polled at most once a tick, but right after an answer that
    ended items it is polled again at once, so the next image is committed as soon as it ends, not when
    the tick since the last poll is over. (Ticks this long leave a loaded machine seconds to spare.)"""
    cfg = service_config(tmp_path, digits_model, scheduler={"tick_seconds": 30.0, "heartbeat_seconds": 60.0},
                         store={"lease_seconds": 120.0})
    with Service(cfg) as svc, Client(svc.url) as client:
        assert svc.wait_ready(patient(120))
        time.sleep(1.0)  # the worker's first long poll is out
        t0 = time.monotonic()
        job = client.wait(client.submit([7], steps=5), progress=False, timeout=patient(60))
        took = time.monotonic() - t0
        after = []
        for label in (2, 3):
            t0 = time.monotonic()
            assert client.wait(client.submit([label], steps=2), progress=False, timeout=patient(60)).state == "done"
            after.append(time.monotonic() - t0)
    assert job.state == "done"
    assert took < 10.0, f"one image took {took:.1f} s: leasing or committing waited for a tick"
    assert max(after) < 10.0, f"back-to-back images took {[round(t, 2) for t in after]} s: one waited for a tick"


def test_an_event_stream_reads_in_short_bursts_then_at_the_paced_rate(monkeypatch):
    """``read_burst`` reads go at once (a lease's read, then the ending right after it); beyond them one
    read per ``min_read_gap_s``: a job whose items end every few milliseconds costs a bounded read rate."""
    from dit_serve.server.events import JobEvents, StreamLimits

    ev = JobEvents.__new__(JobEvents)
    ev.limits = StreamLimits(min_read_gap_s=0.05, read_burst=3)
    ev.credit, ev.credit_at = 3.0, time.monotonic()
    waits, real_sleep = [], asyncio.sleep

    async def sleep(seconds):
        waits.append(seconds)
        await real_sleep(seconds)

    monkeypatch.setattr(asyncio, "sleep", sleep)

    async def reads(n: int) -> list[tuple[float, int]]:
        t0, out = time.monotonic(), []
        for _ in range(n):
            await ev._pace()
            out.append((time.monotonic() - t0, len(waits)))
        return out

    at = asyncio.run(reads(8))
    assert at[2][1] == 0, "the first reads of a burst waited"  # counted, not timed: a loaded machine is slow anyway
    assert at[7][0] >= 0.2, f"8 reads with a burst of 3 need about 5 gaps of 50 ms, took {at[7][0]:.3f} s"


@pytest.mark.slow
def test_a_worker_gets_its_next_items_before_the_finished_ones_are_committed(tmp_path, digits_model, monkeypatch):
    """With a queue behind a full worker, the scheduler leases the next items as soon as a poll reports
    endings, and commits the PNGs after: the worker's next batch does not wait for the store writes."""
    import ray

    from dit_serve.server.store import Changes
    from dit_serve.server.store import Store as RealStore

    calls: list[str] = []
    real_lease, real_commit, real_notify = RealStore.lease, RealStore.commit_result, Changes.notify

    def lease(self, *a, **k):
        got = real_lease(self, *a, **k)
        if got:
            calls.append("lease")
        return got

    monkeypatch.setattr(RealStore, "lease", lease)
    monkeypatch.setattr(RealStore, "commit_result",
                        lambda self, *a, **k: calls.append("commit") or real_commit(self, *a, **k))
    monkeypatch.setattr(Changes, "notify", lambda self, *a, **k: calls.append("notify") or real_notify(self, *a, **k))

    class BatchWorker:  # finishes what it holds 0.3 s after it got it
        def __init__(self, spec):
            self.items = {}

        def info(self):
            return {"models": ["digits"], "device": "cpu", "backend": "fake"}

        def submit(self, items):
            self.items.update({it.id: time.monotonic() for it in items})
            return [True] * len(items)

        def cancel(self, ids):
            return [True] * len(ids)

        def poll(self, wait_s=0.0):
            done = [i for i, t0 in self.items.items() if time.monotonic() - t0 > 0.3]
            for i in done:
                del self.items[i]
            return {"progress": {}, "finished": [(i, b"png") for i in done], "failed": [], "crashed": [],
                    "step_seconds": [], "busy_s": 0.0, "window_s": 0.0, "stats": {}}

    monkeypatch.setattr("dit_serve.server.scheduler._actor_class",
                        lambda: ray.remote(max_restarts=0, concurrency_groups={"poll": 1})(BatchWorker))
    cfg = service_config(tmp_path, digits_model, workers={"max_batch": 2})
    with Service(cfg, roles=("scheduler",)) as sched:
        assert sched.wait_ready(patient(60))
        job_id = sched.store.create_job("digits", JobParams(sampler="ddim", steps=5, guidance=1.0), [1] * 6, list(range(6)))
        deadline = time.monotonic() + 60
        while not sched.store.get_job(job_id).finished:
            assert time.monotonic() < deadline, "the job did not finish"
            time.sleep(0.05)
    # the scheduler announces a lease once its items are on their way (Store.lease itself does not)
    assert all(calls[i + 1] == "notify" for i, c in enumerate(calls) if c == "lease"), calls
    calls = [c for c in calls if c != "notify"]
    first_commit = calls.index("commit")
    assert calls[:first_commit] == ["lease", "lease"], f"the second pair was leased after the first commits: {calls}"
    assert calls.count("lease") == 3
    assert sched.store.get_job(job_id).counts == {"done": 6}


@pytest.mark.slow
def test_metrics_split_a_finished_images_time_into_phases(tmp_path, digits_model):
    """/metrics' ``dit_serve_item_phase_seconds`` has the seven phases of each committed image, and for a
    one-image job they add up to its time in the service (submitted -> committed)."""
    import httpx

    from dit_serve.server.metrics import PHASES

    cfg = service_config(tmp_path, digits_model)
    with Service(cfg) as svc, Client(svc.url) as client:
        assert svc.wait_ready(patient(120))
        job = client.wait(client.submit([3], steps=30), progress=False, timeout=patient(60))
        text = httpx.get(f"{svc.url}/metrics").text

    def sample(name: str, phase: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(f'{name}{{phase="{phase}"}}'))
        return float(line.rsplit(" ", 1)[1])

    counts = {p: sample("dit_serve_item_phase_seconds_count", p) for p in PHASES}
    sums = {p: sample("dit_serve_item_phase_seconds_sum", p) for p in PHASES}
    assert counts == {p: 1.0 for p in PHASES}
    assert sums["run"] > 0.0 and all(v >= 0.0 for v in sums.values())
    total = job.finished_at - job.created_at
    assert abs(sum(sums.values()) - total) < 0.05, (sums, total)
    # the finer cuts of lease and handoff add up to them (one host: one clock)
    from dit_serve.server.metrics import SUBPHASES

    subs = {p: sample("dit_serve_item_subphase_seconds_sum", p) for p in SUBPHASES}
    assert {p: sample("dit_serve_item_subphase_seconds_count", p) for p in SUBPHASES} == {p: 1.0 for p in SUBPHASES}
    assert all(v >= 0.0 for v in subs.values())
    assert abs(subs["lease_txn"] + subs["send"] - sums["lease"]) < 1e-3, (subs, sums)
    assert abs(subs["reply"] + subs["transport"] + subs["pickup"] - sums["handoff"]) < 1e-3, (subs, sums)


def test_a_turn_asks_the_store_for_work_when_signalled_or_once_a_tick(tmp_path):
    """``_dispatch`` leases at once after a submission (``queued``) or when a worker became ready, and
    otherwise at most once per tick, so a turn woken by a worker's answer does not query the store."""
    from types import SimpleNamespace

    from dit_serve.server.config import SchedulerConfig, WorkerConfig
    from dit_serve.server.scheduler import Scheduler, _Worker

    store = Store(f"sqlite:///{tmp_path}/s.db", tmp_path)
    asked: list[int] = []
    store.lease = lambda *a, **k: asked.append(1) or []
    sched = Scheduler(store, WorkerConfig(), SchedulerConfig(tick_seconds=30.0), 30.0)
    sched.workers["w"] = _Worker("w", None, SimpleNamespace(), None, models=["digits"])
    sched._dispatch()  # the first turn: a tick has passed since the epoch
    assert len(asked) == 1
    store.work.set()  # an answer's wake-up alone
    sched._dispatch()
    assert len(asked) == 1 and not store.work.is_set()
    store.submit("digits", JobParams(sampler="ddim", steps=5, guidance=1.0), [1], [0])
    sched._dispatch()
    assert len(asked) == 2 and not store.queued.is_set()
    sched._fill_now = True  # a worker became ready
    sched._dispatch()
    assert len(asked) == 3 and not sched._fill_now
    sched._last_fill -= 30.0  # a tick later
    sched._dispatch()
    assert len(asked) == 4
