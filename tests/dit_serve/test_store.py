"""The job store on SQLite (always) and PostgreSQL (when DIT_SERVE_TEST_POSTGRES_URL names a server,
as .ci/run sets up): leases, expiry, exactly-once results, cancel, restart."""

from __future__ import annotations

import os
import threading
import time

import pytest
from sqlalchemy import create_engine, select, text

from dit_serve.schemas import JobParams
from dit_serve.server.store import (SCHEMA_VERSION, IdempotencyConflict, QueueFull, Store, StoreError, items,
                             job_state, jobs, meta, requeue_backoff)

PARAMS = JobParams(sampler="ddim", steps=10, guidance=2.0)


@pytest.fixture(params=["sqlite", "postgresql"])
def kind(request) -> str:
    return request.param


@pytest.fixture
def db_url(kind, tmp_path, request) -> str:
    """An SQLite file, or an emptied PostgreSQL schema (conftest's ``postgres_url``; skips without a server)."""
    return f"sqlite:///{tmp_path / 'jobs.db'}" if kind == "sqlite" else request.getfixturevalue("postgres_url")


@pytest.fixture
def store(db_url, tmp_path):
    s = Store(db_url, tmp_path)
    yield s
    s.close()


def _job(store: Store, n: int = 3, model: str = "digits") -> str:
    return store.create_job(model, PARAMS, list(range(n)), [100 + i for i in range(n)])


def test_job_lifecycle(store):
    job_id = _job(store)
    job = store.get_job(job_id)
    assert (job.state, job.counts, job.steps_total) == ("queued", {"queued": 3}, 30)
    assert [(it.label, it.seed) for it in job.items] == [(0, 100), (1, 101), (2, 102)]

    leases = store.lease("w1", ["digits"], 2, ttl=30)
    assert [ls.index for ls in leases] == [0, 1] and leases[0].params == PARAMS
    leases[0].step = 4
    assert store.heartbeat(leases, ttl=30) == []
    job = store.get_job(job_id)
    assert job.state == "running" and job.items[0].step == 4 and job.steps_done == 4

    for ls in leases:
        assert store.commit_result(ls, b"png-%d" % ls.index)
    last = store.lease("w1", ["digits"], 5, ttl=30)
    assert [ls.index for ls in last] == [2]
    assert store.commit_result(last[0], b"png-2")
    job = store.get_job(job_id)
    assert (job.state, job.steps_done, job.finished_at is not None) == ("done", 30, True)
    assert store.image_path(job_id, 1).read_bytes() == b"png-1"


def test_result_recorded_exactly_once(store):
    job_id = _job(store, 1)
    (lease,) = store.lease("w1", ["digits"], 1, ttl=30)
    assert store.commit_result(lease, b"first")
    assert not store.commit_result(lease, b"second")  # a duplicate finds no running item
    assert store.image_path(job_id, 0).read_bytes() == b"first"
    files = list((store.data_dir / "images" / job_id).iterdir())
    assert [f.name for f in files] == ["00000.png"]  # no temp file left behind


def test_expired_lease_is_taken_over_and_the_old_holder_loses(store):
    job_id = _job(store, 1)
    (old,) = store.lease("dead", ["digits"], 1, ttl=1.0)
    assert store.lease("w2", ["digits"], 1, ttl=30) == []  # not expired yet
    time.sleep(1.1)
    (new,) = store.lease("w2", ["digits"], 1, ttl=30)
    assert [ls.key for ls in store.heartbeat([old], ttl=30)] == [old.key]  # the old holder learns it lost
    assert not store.commit_result(old, b"late")
    assert store.commit_result(new, b"new")
    job = store.get_job(job_id)
    assert job.state == "done" and job.items[0].attempts == 2 and job.items[0].requeues == 1
    assert store.image_path(job_id, 0).read_bytes() == b"new"


def test_infrastructure_failures_requeue_uncharged_up_to_a_bound(store):
    store.max_requeues = 3
    job_id = _job(store, 1)
    for n in range(1, 4):
        (ls,) = store.lease("w", ["digits"], 1, ttl=30)
        assert ls.requeues == n - 1
        failed = store.release([ls], "infra", "node left")  # requeue_backoff(1..3) == 0: leasable at once
    assert failed == [ls] and store.lease("w", ["digits"], 1, ttl=30) == []
    item = store.get_job(job_id).items[0]
    assert (item.state, item.requeues, item.attempts) == ("failed", 3, 3)
    assert item.error == "gave up after 3 infrastructure failures (the last: node left)"


def test_a_crash_loop_backs_off():
    assert [requeue_backoff(n) for n in (1, 3, 4, 5, 6, 20)] == [0.0, 0.0, 1.0, 2.0, 4.0, 60.0]


def test_requeues_past_three_wait_their_backoff(store):
    job_id = _job(store, 1)
    for _ in range(4):
        (ls,) = store.lease("w", ["digits"], 1, ttl=30)
        store.release([ls], "infra", "node left")
    assert store.lease("w", ["digits"], 1, ttl=30) == []  # the 4th requeue waits 1 s
    time.sleep(1.05)
    (ls,) = store.lease("w", ["digits"], 1, ttl=30)
    item = store.get_job(job_id).items[0]
    assert (ls.requeues, ls.crashes, item.state, item.requeues) == (4, 0, "running", 4)


def test_graceful_release_does_not_count(store):
    job_id = _job(store, 1)
    (ls,) = store.lease("w", ["digits"], 1, ttl=30)
    store.release([ls], "stop")
    item = store.get_job(job_id).items[0]
    assert (item.state, item.attempts, item.requeues, item.step) == ("queued", 0, 0, 0)


def _run_with_poison(store: Store, poison: set[int], batch: int) -> int:
    """A worker of ``batch`` rows that dies whenever it holds a poison item; returns the crashes."""
    crashes = 0
    while leases := store.lease("w", ["digits"], batch, ttl=30, isolate=True):
        if any(ls.index in poison for ls in leases):
            crashes += 1
            store.release(leases, "crash", "worker died: SIGSEGV")
        else:
            for ls in leases:
                assert store.commit_result(ls, b"png")
    return crashes


def test_a_poison_item_is_isolated_and_failed_alone(store, monkeypatch):
    # 16 items in batches of 8; item 5 kills its worker every time. Its batch [0..7] crashes twice
    # (crashes=2: suspects), then runs as halves: [0..3] finish, [4..7] crash (crashes=3); as quarters:
    # [4, 5] crash (crashes=4), [6, 7] finish; alone: [4] finishes, [5] crashes twice alone: failed.
    monkeypatch.setattr("dit_serve.server.store.leases.requeue_backoff", lambda n: 0.0)
    job_id = _job(store, 16)
    assert _run_with_poison(store, {5}, batch=8) == 2 + 1 + 1 + 2
    job = store.get_job(job_id)
    assert job.counts == {"done": 15, "failed": 1}
    bad = job.items[5]
    assert bad.error.startswith("this item crashed its worker 2 times while it ran alone (the last: worker died")
    assert all(it.state == "done" for it in job.items if it.index != 5)
    assert max(it.crashes for it in job.items if it.index >= 8) == 0  # the other batch never crashed


def test_suspects_run_only_in_isolation(store):
    job_id = _job(store, 4)
    leases = store.lease("w", ["digits"], 4, ttl=30)
    for _ in range(2):
        store.release(leases, "crash", "boom")
        leases = store.lease("w", ["digits"], 4, ttl=30, isolate=True) or leases
    store.release(leases, "crash", "boom")  # 3 crashes each: suspects
    other = _job(store, 2)
    assert {ls.job_id for ls in store.lease("w2", ["digits"], 8, ttl=30)} == {other}  # normal work only
    assert store.has_suspects(["digits"])
    group = store.lease("w3", ["digits"], 4, ttl=30, isolate=True)
    assert [ls.job_id for ls in group] == [job_id] and len(group) == 1 and group[0].solo  # 4 >> (3 - 1)


def test_an_unreadable_row_fails_its_job_alone(store):
    bad, good = _job(store, 2), _job(store, 2)
    with store.engine.begin() as conn:  # as an older version could have written: guidance Infinity -> null
        conn.execute(jobs.update().where(jobs.c.id == bad).values(
            params='{"sampler": "ddim", "steps": 10, "guidance": null, "eta": 0.0}'))
    leases = store.lease("w", ["digits"], 10, ttl=30)
    assert {ls.job_id for ls in leases} == {good}  # built before commit: the bad rows failed, not leased
    listed, total = store.list_jobs(10, 0)
    assert total == 2 and {j.id: j.state for j in listed} == {bad: "failed", good: "running"}
    job = store.get_job(bad)
    assert job.params is None and "cannot be read" in job.error
    assert all(it.state == "failed" and "cannot be read" in it.error for it in job.items)


def test_parameters_that_cannot_be_stored_are_refused():
    with pytest.raises(ValueError):
        JobParams(sampler="ddim", steps=10, guidance=float("inf"))
    with pytest.raises(ValueError):
        JobParams(sampler="ddim", steps=10, guidance=float("nan"))


def test_queue_bounds_refuse_and_store_nothing(store):
    store.submit("digits", PARAMS, [1] * 3, [1, 2, 3], tenant="a", max_active=5)
    with pytest.raises(QueueFull, match="the service has 3 items queued or running and may hold at most 5"):
        store.submit("digits", PARAMS, [1] * 3, [1, 2, 3], tenant="b", max_active=5)
    with pytest.raises(QueueFull, match="your tenant has 3 items") as e:
        store.submit("digits", PARAMS, [1] * 2, [1, 2], tenant="a", max_active=100, tenant_max_active=4)
    assert not e.value.never
    with pytest.raises(QueueFull, match="split it") as e:
        store.submit("digits", PARAMS, [1] * 9, list(range(9)), tenant="c", max_active=8)
    assert e.value.never
    assert store.list_jobs(10, 0)[1] == 1 and store.counts() == {"queued": 3}
    store.submit("digits", PARAMS, [1] * 2, [1, 2], tenant="b", max_active=5, tenant_max_active=4)  # fits


def test_a_submissions_view_is_the_job_as_read_back(store):
    """``submit(view=True)`` makes the new job from what it wrote, not by reading it back; it must be
    the job ``get_job`` reads, field for field, for class labels (with a webhook, key, priority and
    tenant) and for prompts; a replayed key gives no view."""
    cases = [dict(labels=[3, 1], seeds=[7, 8], kw=dict(idempotency_key="v-1", priority=2, tenant="t",
                                                      webhook_url="http://example.com/hook")),
             dict(labels=[0, 0, 0], seeds=[1, 2, 3], kw=dict(prompts=["a seven", "the number 2", "9"]))]
    for case in cases:
        job_id, created, view = store.submit("digits", PARAMS, case["labels"], case["seeds"], view=True,
                                             max_active=100, tenant_max_active=100, **case["kw"])
        assert created and view == store.get_job(job_id)
        assert view.state == "queued" and view.counts == {"queued": len(case["labels"])}
    assert store.submit("digits", PARAMS, [3, 1], [7, 8], view=True, **cases[0]["kw"])[1:] == (False, None)


def test_tenants_see_their_own_jobs_only(store):
    a = store.submit("digits", PARAMS, [1], [1], idempotency_key="k", tenant="a")[0]
    b, created = store.submit("digits", PARAMS, [2], [2], idempotency_key="k", tenant="b")
    assert created and a != b  # Idempotency-Keys are per tenant
    assert store.get_job(a, tenant="b") is None and store.get_job(a, tenant="a").tenant == "a"
    assert [j.id for j in store.list_jobs(10, 0, tenant="b")[0]] == [b]
    assert store.list_jobs(10, 0)[1] == 2  # an admin sees both
    assert not store.cancel_job(a, tenant="b") and store.get_job(a).state == "queued"
    assert store.delete_job(a, tenant="b") is None and store.retry_failed(a, tenant="b") is None
    (ls,) = [ls for ls in store.lease("w", ["digits"], 2, ttl=30) if ls.job_id == a]
    assert store.commit_result(ls, b"png")
    assert store.image_path(a, 0, tenant="b") is None and store.image_path(a, 0, tenant="a") is not None


def test_retry_requeues_failed_items(store):
    job_id = store.create_job("digits", PARAMS, [1, 2], [1, 2], webhook_url="http://example.com/hook")
    leases = store.lease("w", ["digits"], 2, ttl=30)
    assert store.fail_item(leases[0], "ValueError: bad")
    assert store.commit_result(leases[1], b"png")
    assert store.get_job(job_id).state == "failed"
    store.claim_webhooks(hold_s=30)
    store.webhook_done(job_id, None, None)
    assert store.retry_failed(job_id) == 1 and store.retry_failed("nope") is None
    job = store.get_job(job_id)
    assert job.counts == {"queued": 1, "done": 1} and job.items[0].error is None and job.webhook.state == "pending"


def test_cancel(store):
    job_id = _job(store, 3)
    leases = store.lease("w", ["digits"], 2, ttl=30)
    assert store.commit_result(leases[0], b"done before the cancel")
    assert store.cancel_job(job_id)
    assert [ls.key for ls in store.heartbeat(leases[1:], ttl=30)] == [leases[1].key]
    assert not store.commit_result(leases[1], b"too late")
    assert store.lease("w", ["digits"], 5, ttl=30) == []  # the queued item never runs
    job = store.get_job(job_id)
    assert job.state == "cancelled" and job.counts == {"done": 1, "cancelled": 2}
    assert store.image_path(job_id, 1) is None
    assert not store.cancel_job("no-such-job")


def test_the_queues_reserve_is_for_tenants_that_hold_little(store):
    bounds = dict(max_active=10, reserve=3)
    store.submit("digits", PARAMS, [1] * 7, list(range(7)), tenant="a", **bounds)  # 7 = 10 - 3: fits
    with pytest.raises(QueueFull, match="last 3 places are kept for tenants holding at most 3") as e:
        store.submit("digits", PARAMS, [1], [7], tenant="a", **bounds)  # a would hold 8 > 3
    assert not e.value.never
    store.submit("digits", PARAMS, [1] * 3, [1, 2, 3], tenant="b", **bounds)  # b holds 3 <= 3: fits, 10 of 10
    with pytest.raises(QueueFull, match="the service has 10 items"):
        store.submit("digits", PARAMS, [1], [1], tenant="c", **bounds)


def test_a_cancel_keeps_the_progress_made(store):
    job_id = _job(store, 3)
    (running,) = store.lease("w", ["digits"], 1, ttl=30)
    running.step = 4
    assert store.heartbeat([running], ttl=30) == []
    assert store.cancel_job(job_id)
    for job in (store.get_job(job_id), store.get_job(job_id, with_items=False), store.list_jobs(10, 0)[0][0]):
        # 4 of item 0's 10 steps, of 3 x 10: the bar stays where it was, beside "cancelled"
        assert (job.state, job.steps_done, job.steps_total) == ("cancelled", 4, 30)
    assert [it.step for it in store.get_job(job_id).items] == [4, 0, 0]


def test_a_failed_job_says_why_with_counts(store):
    job_id = _job(store, 4)
    leases = store.lease("w", ["digits"], 4, ttl=30)
    for ls, why in zip(leases, ["out of memory", "bad plan", "out of memory", None]):
        if why:
            assert store.fail_item(ls, why)
        else:
            assert store.commit_result(ls, b"png")
    for job in (store.get_job(job_id), store.get_job(job_id, with_items=False), store.list_jobs(10, 0)[0][0]):
        assert job.state == "failed"
        assert [(f.error, f.items, f.first) for f in job.failures] == [("out of memory", 2, 0), ("bad plan", 1, 1)]
        assert job.error == "3 of 4 items failed: out of memory (2); bad plan (1)"
    ok = _job(store, 1)
    assert store.get_job(ok).failures == [] and store.get_job(ok).error is None


def test_leases_follow_models_and_fifo(store):
    a = _job(store, 2, model="digits")
    b = _job(store, 2, model="other")
    c = _job(store, 2, model="digits")
    assert [(ls.job_id, ls.index) for ls in store.lease("w", ["digits"], 3, ttl=30)] == [(a, 0), (a, 1), (c, 0)]
    assert {ls.job_id for ls in store.lease("w", ["other"], 5, ttl=30)} == {b}


def test_concurrent_leases_never_overlap(store):
    _job(store, 60)
    got: list[list[str]] = [[] for _ in range(4)]

    def worker(k: int) -> None:
        while leases := store.lease(f"w{k}", ["digits"], 3, ttl=30):
            got[k] += [ls.key for ls in leases]

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    keys = [k for g in got for k in g]
    assert len(keys) == 60 and len(set(keys)) == 60


def test_a_reopened_store_keeps_everything(tmp_path, db_url):
    store = Store(db_url, tmp_path)
    job_id = _job(store, 2)
    (ls,) = store.lease("crashed", ["digits"], 1, ttl=0.05)
    store.engine.dispose()  # the "process" goes away without releasing its lease
    again = Store(store.engine.url.render_as_string(hide_password=False), tmp_path)
    time.sleep(0.1)
    assert sorted(x.index for x in again.lease("new", ["digits"], 5, ttl=30)) == [0, 1]
    assert again.get_job(job_id).state == "running"


def test_list_jobs_pages_newest_first(store):
    ids = [_job(store, 1) for _ in range(5)]
    page, total = store.list_jobs(limit=2, offset=0)
    assert total == 5 and [j.id for j in page] == ids[::-1][:2] and page[0].items is None
    page, _ = store.list_jobs(limit=2, offset=4)
    assert [j.id for j in page] == ids[:1]


@pytest.mark.parametrize("cancelled, counts, state", [
    (False, {"queued": 2}, "queued"),
    (False, {"queued": 1, "running": 1}, "running"),
    (False, {"queued": 1, "done": 1}, "running"),
    (False, {"done": 2}, "done"),
    (False, {"done": 1, "failed": 1}, "failed"),
    (True, {"done": 1, "cancelled": 1}, "cancelled"),
    (True, {"running": 1, "cancelled": 1}, "running"),
])
def test_job_state(cancelled, counts, state):
    assert job_state(cancelled, counts) == state


def test_an_idempotency_key_stores_one_job(store):
    first, new = store.submit("digits", PARAMS, [1, 2], [5, 6], idempotency_key="k-1")
    again, new_again = store.submit("digits", PARAMS, [1, 2], [5, 6], idempotency_key="k-1")
    assert new and not new_again and again == first
    assert store.list_jobs(10, 0)[1] == 1 and store.counts() == {"queued": 2}
    other = store.create_job("digits", PARAMS, [1, 2], [5, 6], idempotency_key="k-2")
    plain = [store.create_job("digits", PARAMS, [1], [5]) for _ in range(2)]  # no key: always a new job
    assert len({first, other, *plain}) == 4
    with pytest.raises(IdempotencyConflict, match="already used for a different request"):
        store.submit("digits", PARAMS, [1, 3], [5, 6], idempotency_key="k-1")
    assert store.list_jobs(10, 0)[1] == 4  # the refused reuse stored nothing


def test_concurrent_submissions_with_one_key_make_one_job(store):
    ids, start = [], threading.Barrier(6)

    def submit():
        start.wait()
        ids.append(store.submit("digits", PARAMS, [4] * 3, [1, 2, 3], idempotency_key="race")[0])

    threads = [threading.Thread(target=submit) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ids) == 6 and len(set(ids)) == 1
    assert store.list_jobs(10, 0)[1] == 1 and store.counts() == {"queued": 3}


def _first_layout(engine) -> None:
    """The tables as the first version of the store made them (no idempotency columns, no version)."""
    from sqlalchemy import BigInteger, Boolean, Column, Float, Index, Integer, MetaData, String, Table, Text

    old = MetaData()
    Table("jobs", old, Column("id", String(32), primary_key=True), Column("model", String(200), nullable=False),
          Column("params", Text, nullable=False), Column("num_items", Integer, nullable=False),
          Column("created_at", Float, nullable=False, index=True),
          Column("cancelled", Boolean, nullable=False, default=False))
    Table("items", old, Column("job_id", String(32), primary_key=True), Column("idx", Integer, primary_key=True),
          Column("model", String(200), nullable=False), Column("created_at", Float, nullable=False),
          Column("label", Integer, nullable=False), Column("seed", BigInteger, nullable=False),
          Column("state", String(10), nullable=False), Column("step", Integer, nullable=False, default=0),
          Column("total_steps", Integer, nullable=False), Column("attempts", Integer, nullable=False, default=0),
          Column("lease_owner", String(200)), Column("lease_token", String(32)), Column("lease_expires", Float),
          Column("path", String(300)), Column("error", Text), Column("finished_at", Float),
          Index("items_leasable", "state", "model", "created_at"))
    old.create_all(engine)


def test_an_older_database_is_upgraded_in_place(tmp_path, db_url):
    store = Store(db_url, tmp_path)
    job_id = _job(store, n=2)
    url = str(store.engine.url.render_as_string(hide_password=False))
    store.close()
    engine = create_engine(url)
    with engine.begin() as conn:  # turn it back into the first layout, keeping the job
        rows = conn.execute(jobs.select()).mappings().all()
        item_rows = conn.execute(items.select()).mappings().all()
    meta.drop_all(engine)
    _first_layout(engine)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO jobs (id, model, params, num_items, created_at, cancelled) "
                          "VALUES (:id, :model, :params, :num_items, :created_at, :cancelled)"),
                     [{k: r[k] for k in ("id", "model", "params", "num_items", "created_at", "cancelled")}
                      for r in rows])
        conn.execute(text("INSERT INTO items (job_id, idx, model, created_at, label, seed, state, step, total_steps, "
                          "attempts) VALUES (:job_id, :idx, :model, :created_at, :label, :seed, :state, :step, "
                          ":total_steps, :attempts)"), [dict(r) for r in item_rows])
    engine.dispose()

    store = Store(url, tmp_path)  # upgrades: the job is kept, and keys and priorities work
    try:
        assert store.get_job(job_id).counts == {"queued": 2} and store.get_job(job_id).priority == 0
        urgent = store.create_job("digits", PARAMS, [0], [1], priority=5)
        assert [ls.job_id for ls in store.lease("w", ["digits"], 1, ttl=30)] == [urgent]
        assert store.submit("digits", PARAMS, [0], [1], idempotency_key="k")[1]
        assert store.submit("digits", PARAMS, [0], [1], idempotency_key="k")[1] is False
        upload = store.put_upload("default", b"png", "PNG", 1, 1)  # its table made by the upgrade
        assert store.get_upload(upload.id)[0] == upload and store.upload_bytes("default") == 3
        with store.engine.begin() as conn:
            assert conn.execute(text("SELECT version FROM dit_serve_schema")).scalars().all() == [SCHEMA_VERSION]
    finally:
        store.close()
    Store(url, tmp_path).close()  # opening an up-to-date database changes nothing


def test_a_newer_database_is_refused(tmp_path, db_url):
    store = Store(db_url, tmp_path)
    job_id = _job(store)
    url = str(store.engine.url.render_as_string(hide_password=False))
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE dit_serve_schema SET version = :v"), {"v": SCHEMA_VERSION + 1})
    store.close()
    with pytest.raises(StoreError, match=f"schema version {SCHEMA_VERSION + 1}, newer than"):
        Store(url, tmp_path)
    engine = create_engine(url)
    with engine.begin() as conn:  # untouched
        assert conn.execute(text("SELECT count(*) FROM jobs WHERE id = :id"), {"id": job_id}).scalar() == 1
        conn.execute(text("UPDATE dit_serve_schema SET version = :v"), {"v": SCHEMA_VERSION})
    engine.dispose()


def _finish(store: Store, job_id: str, n: int, png: bytes = b"png") -> None:
    leases = [ls for ls in store.lease("w", ["digits"], 100, ttl=30) if ls.job_id == job_id]
    assert len(leases) == n
    for ls in leases:
        assert store.commit_result(ls, png)


def test_delete_a_finished_job_and_its_images(store, tmp_path):
    assert store.delete_job("nope") is None
    job_id = store.create_job("digits", PARAMS, [1, 2], [5, 6], idempotency_key="del-1")
    assert store.delete_job(job_id) is False and store.get_job(job_id).counts == {"queued": 2}  # not yet
    _finish(store, job_id, 2)
    other = _job(store, n=1)
    images = tmp_path / "images" / job_id
    assert sorted(p.name for p in images.iterdir()) == ["00000.png", "00001.png"]
    assert store.delete_job(job_id) is True
    assert store.get_job(job_id) is None and not images.exists() and store.image_path(job_id, 0) is None
    assert store.get_job(other).counts == {"queued": 1}  # other jobs untouched
    again, created = store.submit("digits", PARAMS, [1, 2], [5, 6], idempotency_key="del-1")
    assert created and again != job_id  # a deleted job's key is free again


def test_purge_deletes_only_jobs_finished_long_enough_ago(store):
    old = _job(store, n=2)
    _finish(store, old, 2)
    recent = _job(store, n=2)
    _finish(store, recent, 2)
    active, cancelled = _job(store, n=2), _job(store, n=2)
    store.cancel_job(cancelled)
    with store.engine.begin() as conn:  # the old job ended two hours ago, the cancelled one too
        conn.execute(items.update().where(items.c.job_id.in_((old, cancelled))).values(finished_at=time.time() - 7200))
        conn.execute(items.update().where(items.c.job_id == active).values(finished_at=time.time() - 7200))
    assert sorted(store.purge_finished(3600)) == sorted([old, cancelled])
    assert store.get_job(old) is None and store.get_job(cancelled) is None
    assert store.get_job(recent).state == "done" and store.get_job(active).state == "queued"
    assert store.purge_finished(3600) == []
    assert store.purge_finished(0) == [recent]


def test_cancelling_a_finished_job_keeps_its_state(store):
    job_id = _job(store, n=1)
    _finish(store, job_id, 1)
    assert store.cancel_job(job_id) is True and store.get_job(job_id).state == "done"
    assert store.cancel_job("nope") is False


def test_higher_priority_jobs_are_leased_first(store):
    batch = _job(store, n=4)                                                  # priority 0, oldest
    low = store.create_job("digits", PARAMS, [1, 2], [1, 2], priority=-5)
    urgent = store.create_job("digits", PARAMS, [3, 4], [3, 4], priority=10)
    later = store.create_job("digits", PARAMS, [5], [5], priority=10)        # same priority: FIFO
    order = [(ls.job_id, ls.index) for ls in store.lease("w", ["digits"], 5, ttl=30)]
    assert order == [(urgent, 0), (urgent, 1), (later, 0), (batch, 0), (batch, 1)]
    order = [(ls.job_id, ls.index) for ls in store.lease("w", ["digits"], 5, ttl=30)]
    assert order == [(batch, 2), (batch, 3), (low, 0), (low, 1)]
    assert store.get_job(urgent).priority == 10 and store.get_job(low).priority == -5


def test_a_lease_prefers_the_sizes_in_flight_after_the_head_and_never_past_a_priority(store):
    def sized(w: int, n: int, priority: int = 0) -> str:
        params = PARAMS.model_copy(update={"width": w, "height": w})
        return store.create_job("digits", params, list(range(n)), list(range(n)), priority=priority)

    a1, b1, a2, c1, b2 = sized(32, 1), sized(48, 2), sized(32, 2), sized(64, 1), sized(48, 1)
    keys = lambda leases: [(ls.job_id, ls.index) for ls in leases]  # noqa: E731
    # the head (a1, 32 px) first, then 32 px (its size) and 64 px (in flight), then the rest in order
    got = store.lease("w", ["digits"], 4, ttl=30, prefer={("digits", 64, 64)})
    assert keys(got) == [(a1, 0), (a2, 0), (a2, 1), (c1, 0)]
    assert all(store.get_job(j).state == "queued" for j in (b1, b2))  # the rows it read and skipped: untouched
    urgent = sized(32, 1, priority=5)
    got = store.lease("w", ["digits"], 2, ttl=30, prefer={("digits", 32, 32)})
    assert keys(got) == [(urgent, 0), (b1, 0)]  # the head, then the queue's order (no 32 px left)
    got = store.lease("w", ["digits"], 9, ttl=30, prefer=set())
    assert keys(got) == [(b1, 1), (b2, 0)]
    assert store.lease("w", ["digits"], 9, ttl=30, prefer=set()) == []


def test_a_lease_given_the_capacity_starts_no_size_for_a_handful_of_items(store):
    """Admission rule 4 through the store: 8 in flight at most, so no other size starts for fewer than 2."""
    def sized(w: int, n: int) -> str:
        params = PARAMS.model_copy(update={"width": w, "height": w})
        return store.create_job("digits", params, list(range(n)), list(range(n)))

    a, b, c = sized(32, 5), sized(48, 1), sized(64, 6)
    keys = lambda leases: [(ls.job_id, ls.index) for ls in leases]  # noqa: E731
    got = store.lease("w", ["digits"], 6, ttl=30, prefer=set(), capacity=8)
    assert keys(got) == [(a, i) for i in range(5)]  # the lone 48 px item would replay alone: it waits
    assert store.get_job(b).state == "queued"
    # the head (48 px) is not in flight and the room is under 2: nothing; then it starts, with 64 px items
    assert store.lease("w", ["digits"], 1, ttl=30, prefer={("digits", 32, 32)}, capacity=8) == []
    got = store.lease("w", ["digits"], 3, ttl=30, prefer={("digits", 32, 32)}, capacity=8)
    assert keys(got) == [(b, 0), (c, 0), (c, 1)]


def test_a_preferring_lease_takes_over_only_the_expired_rows_it_chose(store):
    small, big = (PARAMS.model_copy(update={"width": w, "height": w}) for w in (32, 64))
    first = store.create_job("digits", small, [0, 1], [0, 1])
    other = store.create_job("digits", big, [0], [0])

    def requeues() -> dict:
        with store.engine.connect() as conn:
            return {(r.job_id, r.idx): r.requeues for r in conn.execute(select(items.c.job_id, items.c.idx,
                                                                               items.c.requeues))}

    store.lease("gone", ["digits"], 3, ttl=0.01)
    time.sleep(0.05)
    got = store.lease("w", ["digits"], 1, ttl=30, prefer={("digits", 32, 32)})
    assert [(ls.job_id, ls.index) for ls in got] == [(first, 0)]
    assert requeues() == {(first, 0): 1, (first, 1): 0, (other, 0): 0}  # the rows read but not chosen: as they were
    got = store.lease("w", ["digits"], 5, ttl=30, prefer=set())
    assert sorted((ls.job_id, ls.index) for ls in got) == sorted([(first, 1), (other, 0)])
    assert set(requeues().values()) == {1}


def test_webhooks_are_claimed_once_finished_and_retried(store):
    hooked = store.create_job("digits", PARAMS, [1, 2], [1, 2], webhook_url="http://hooks.example/a")
    plain = _job(store, n=1)
    assert store.get_job(hooked).webhook.state == "pending" and store.get_job(plain).webhook is None
    assert store.claim_webhooks(hold_s=30) == []  # not finished yet
    _finish(store, hooked, 2)
    assert store.claim_webhooks(hold_s=30) == [(hooked, "http://hooks.example/a", 0)]
    assert store.claim_webhooks(hold_s=30) == []  # claimed: no second delivery meanwhile
    assert store.get_job(hooked).webhook.state == "sending"

    store.webhook_done(hooked, "HTTP 500", retry_in=0.0)
    hook = store.get_job(hooked).webhook
    assert (hook.state, hook.attempts, hook.error) == ("pending", 1, "HTTP 500")
    assert store.claim_webhooks(hold_s=-1) == [(hooked, "http://hooks.example/a", 1)]  # due again
    assert store.claim_webhooks(hold_s=30) == [(hooked, "http://hooks.example/a", 1)]  # that claim expired
    store.webhook_done(hooked, None, retry_in=None)
    hook = store.get_job(hooked).webhook
    assert (hook.state, hook.attempts, hook.error) == ("sent", 2, None)
    assert store.claim_webhooks(hold_s=30) == []

    failing = store.create_job("digits", PARAMS, [3], [3], webhook_url="http://hooks.example/b")
    store.cancel_job(failing)  # a cancelled job is finished too
    assert [c[0] for c in store.claim_webhooks(hold_s=30)] == [failing]
    store.webhook_done(failing, "ConnectError: refused", retry_in=None)
    assert store.get_job(failing).webhook.state == "failed" and store.claim_webhooks(hold_s=30) == []


def test_temp_files_of_killed_writers_are_swept(store):
    job_id = _job(store, 1)
    folder = store.data_dir / "images" / job_id
    folder.mkdir(parents=True)
    old, fresh, png = folder / ".00000-abc.tmp", folder / ".00001-def.tmp", folder / "00000.png"
    for f in (old, fresh, png):
        f.write_bytes(b"x")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    os.utime(png, (time.time() - 3600, time.time() - 3600))
    assert store.sweep_temp_files(older_than_s=600) == 1
    assert not old.exists() and fresh.exists() and png.exists()


def test_postgres_notifies_other_processes_of_changes(tmp_path, postgres_url):
    """A write by one store (another process's scheduler) wakes waiters of another store (an API process)
    through LISTEN/NOTIFY. Nothing else wakes them here (no waiter polls in this test): being woken is the
    proof, however long a loaded machine takes."""
    import asyncio
    import threading

    api, scheduler = Store(postgres_url, tmp_path), Store(postgres_url, tmp_path)
    stop = threading.Event()
    listener = threading.Thread(target=api.listen, args=(stop,), daemon=True)
    listener.start()
    try:
        job = _job(scheduler, 2)

        async def listening() -> None:  # the listener's LISTEN is in place once a published probe comes back
            probe = api.changes.watch("probe")
            while not probe.is_set():
                scheduler.changes.notify(["probe"])
                try:
                    await asyncio.wait_for(probe.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
            api.changes.unwatch("probe", probe)

        async def woken() -> None:
            await asyncio.wait_for(listening(), 30)
            event = api.changes.watch(job)
            await asyncio.get_running_loop().run_in_executor(None, lambda: scheduler.lease("w", ["digits"], 2, ttl=30))
            await asyncio.wait_for(event.wait(), 30)
            api.changes.unwatch(job, event)

        asyncio.run(woken())
    finally:
        stop.set()
        listener.join(30)
        scheduler.close()
        api.close()
    assert not listener.is_alive()


def test_a_lease_announces_its_jobs_unless_the_caller_will(store):
    """``Store.lease`` wakes the leased jobs' waiters; with ``announce=False`` it leaves that to the caller
    (the scheduler, after sending the items)."""
    seen: list[list[str]] = []
    store.changes.notify = lambda job_ids, local=False: seen.append(list(job_ids))
    first, second = _job(store, 1), _job(store, 1)
    seen.clear()  # the submissions' own
    assert [ls.job_id for ls in store.lease("w", ["digits"], 1, ttl=30, announce=False)] == [first]
    assert seen == []
    assert [ls.job_id for ls in store.lease("w", ["digits"], 1, ttl=30)] == [second]
    assert seen == [[second]]


def test_connections_are_pinged_before_use_on_a_database_server_only(store, kind):
    """A server's connections can drop between uses, so PostgreSQL's are pinged at checkout; an SQLite
    file's cannot, and there a ping would only add a statement to every transaction."""
    assert store.engine.pool._pre_ping is (kind == "postgresql")


def test_a_job_read_with_its_items_has_the_counts_of_a_job_read_without(store):
    """``get_job(with_items=True)`` takes counts, steps and the finish time from the items it read (one
    statement); they equal the aggregate query's, in every mix of states."""
    job_id = _job(store, 5)
    leases = store.lease("w", ["digits"], 4, ttl=30)
    leases[0].step = 3
    store.heartbeat(leases, ttl=30)
    store.commit_result(leases[1], b"png")
    store.fail_item(leases[2], "boom")
    for with_items in (True, False):
        job = store.get_job(job_id, with_items=with_items)
        got = (job.state, job.counts, job.steps_done, job.steps_total, job.finished_at)
        if with_items:
            want = got
        assert got == want
    assert want[1] == {"running": 2, "done": 1, "failed": 1, "queued": 1}
    store.cancel_job(job_id)
    full, bare = store.get_job(job_id), store.get_job(job_id, with_items=False)
    assert (full.counts, full.steps_done, full.steps_total, full.finished_at) == \
        (bare.counts, bare.steps_done, bare.steps_total, bare.finished_at)


def test_an_expected_lease_skips_the_idle_check_and_every_lease_gets_its_own_params(store, monkeypatch):
    """``lease(expect=True)`` (the scheduler was signalled that items were queued) goes straight to the
    write transaction; an idle poll reads first and leases nothing without the write lock. Leases of one
    job parse its stored parameters once but never share them: a change to one lease's is its own."""
    reads = []
    real = store._any
    monkeypatch.setattr(store, "_any", lambda *a, **k: reads.append(1) or real(*a, **k))
    assert store.lease("w", ["digits"], 4, ttl=30) == [] and reads == [1]  # nothing queued: read only
    _job(store, 3)
    leases = store.lease("w", ["digits"], 2, ttl=30, expect=True)
    assert [ls.index for ls in leases] == [0, 1] and reads == [1]
    assert leases[0].params == leases[1].params == PARAMS and leases[0].params is not leases[1].params
    leases[0].params.steps = 99
    (last,) = store.lease("w", ["digits"], 2, ttl=30)
    assert last.index == 2 and last.params == PARAMS and reads == [1, 1]
    assert store.lease("w", ["digits"], 2, ttl=30, expect=True) == []  # expected, but none left: nothing leased
