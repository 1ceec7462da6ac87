"""The durable job store: jobs and their items in SQL (SQLite in WAL mode, or PostgreSQL), images as
PNG files under a data directory.

State machine of an item: ``queued -> running -> done | failed | cancelled``; a running item holds
a *lease* (owner, token, expiry). Schedulers renew the leases of the items they run; an item whose
lease expired (its scheduler or worker died) is leasable again, so restarting anything loses
nothing. A job's state is derived from its items' states, never stored twice.

Exactly-once results: ``commit_result`` writes the PNG to a temporary file, then in one transaction
marks the item done *only if* the caller still holds its lease (state running, same token) and
renames the file to its final name ``images/<job>/<index>.png`` before committing. A late or
duplicate result finds no matching row and is dropped; a crash between rename and commit leaves a
file that the item's re-run replaces with the same bytes (seeded generation is deterministic).

Concurrency: on SQLite every writing transaction is ``BEGIN IMMEDIATE`` (one writer at a time, no
lock upgrades that fail with "database is locked"); on PostgreSQL leasing uses ``FOR UPDATE SKIP
LOCKED``, so several schedulers or API processes may share one database. Times are ``time.time()``
of the writing host: schedulers on several hosts need synchronised clocks (NTP) for leases.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Collection

from sqlalchemy import and_, bindparam, case, create_engine, event, func, or_, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError

from dit_serve.schemas import TERMINAL_STATES, ItemStatus, Job, JobParams, WebhookStatus
from dit_serve.server.store.tables import (DEFAULT_TENANT, MIGRATIONS, SCHEMA_VERSION, api_keys, items, jobs, meta,
                                           schema, tenants)
from workers import admission
from workers.spec import ItemSpec

log = logging.getLogger(__name__)
class IdempotencyConflict(ValueError):
    """An Idempotency-Key already used for a different request."""


class StoreError(RuntimeError):
    """A database this version of dit-serve cannot use (for example, one written by a newer version)."""


class QueueFull(RuntimeError):
    """A submission over the bound of queued items (the service's or its tenant's): nothing was stored.
    ``never`` when the job alone is larger than the bound, so retrying cannot help."""

    def __init__(self, message: str, never: bool = False):
        super().__init__(message)
        self.never = never


@dataclass
class Lease:
    """One item leased to a worker: what the worker needs to run it, and the token that proves the
    lease when its result is committed."""

    job_id: str
    index: int
    model: str
    label: int
    seed: int
    params: JobParams
    token: str
    step: int = 0  # progress, reported by the worker
    prompt: str | None = None
    requeues: int = 0  # the item's counters when it was leased (failure accounting)
    crashes: int = 0
    suspect: bool = False  # leased in an isolated group of items that crashed workers before
    solo: bool = False     # ... a group of one
    created_at: float = 0.0  # when its job was submitted, when it was leased, and when its scheduler sent
    leased_at: float = 0.0   # it to a worker (time.time(), for the latency phases in /metrics)
    sent_at: float = 0.0
    returned_at: float = 0.0  # when the lease's transaction had returned to the scheduler (sub-phases)

    @property
    def key(self) -> str:
        return f"{self.job_id}/{self.index}"

    @property
    def spec(self) -> ItemSpec:
        """What the worker runs: built here once, then passed on unchanged."""
        p = self.params
        return ItemSpec(id=self.key, seed=self.seed, sampler=p.sampler, steps=p.steps, guidance=p.guidance,
                        eta=p.eta, label=self.label, model=self.model, prompt=self.prompt or "",
                        negative_prompt=p.negative_prompt, width=p.width, height=p.height,
                        out_width=p.output_width, out_height=p.output_height, preview_every=p.preview_every)


def requeue_backoff(requeues: int) -> float:
    """Seconds an item waits before it is leased again after its ``requeues``-th infrastructure failure:
    none for the first three (a lone crash costs nothing), then doubling from 1 s up to a minute."""
    return 0.0 if requeues <= 3 else min(60.0, 0.5 * 2.0 ** (requeues - 3))


CHANNEL = "dit_serve_changes"  # PostgreSQL NOTIFY channel of Changes


class Store:
    """Jobs, items, leases and results. Thread-safe: each call uses its own pooled connection.

    ``max_requeues`` bounds the infrastructure failures an item survives; ``poison_crashes`` the crashes
    of its worker while it ran alone (docs/reliability.md, failure accounting)."""

    def __init__(self, url: str, data_dir: Path, max_requeues: int = 50, poison_crashes: int = 2):
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.max_requeues, self.poison_crashes = max_requeues, poison_crashes
        sqlite = make_url(_driver_url(url)).get_backend_name() == "sqlite"
        # a database server's connections can drop (restarts, idle timeouts): each is pinged before use;
        # an SQLite file's cannot, and the ping would be one more statement in every transaction
        self.engine = create_engine(_driver_url(url), pool_pre_ping=not sqlite)
        if self.engine.dialect.name == "sqlite":
            _sqlite_setup(self.engine)
        postgres = self.engine.dialect.name == "postgresql"
        self.local_reads = not postgres  # a read is a local file's, not a round trip to a database server
        self.changes = Changes(publish=self._publish if postgres else None)
        # set when items may have become queued (a submission, a retry, a release; on PostgreSQL any change
        # another process publishes): the scheduler waits on it instead of finding new work a tick later
        self.work = threading.Event()
        # set with ``work`` by the store only (never by the scheduler's own wake-ups, its answers arriving):
        # items may really have become queued, so leasing before committing finished images can pay off
        self.queued = threading.Event()
        self._migrate()

    def _migrate(self) -> None:
        """Create the tables in an empty database, or bring an older one up to ``SCHEMA_VERSION`` (one
        transaction, so a failed upgrade leaves the database as it was). A newer one is refused."""
        from sqlalchemy import inspect, text

        with self._tx() as conn:  # SQLite: BEGIN IMMEDIATE; PostgreSQL: a lock, so one process migrates
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(7346120984)"))
            tables = set(inspect(conn).get_table_names())
            if "jobs" not in tables:
                meta.create_all(conn)
                conn.execute(schema.insert().values(version=SCHEMA_VERSION))
                return
            if "dit_serve_schema" not in tables:  # the first layout
                schema.create(conn)
                version = 1
            else:
                version = conn.execute(select(func.max(schema.c.version))).scalar() or 1
            if version > SCHEMA_VERSION:
                raise StoreError(f"the database has schema version {version}, newer than this dit-serve's "
                                 f"({SCHEMA_VERSION}): upgrade dit-serve to use it")
            if version == SCHEMA_VERSION:
                return
            for v in range(version, SCHEMA_VERSION):
                for statement in MIGRATIONS[v]:
                    if statement == "tables":
                        meta.create_all(conn, tables=[tenants, api_keys])
                    else:
                        conn.execute(text(statement))
                log.warning("job store upgraded from schema version %d to %d", v, v + 1)
            conn.execute(schema.delete())
            conn.execute(schema.insert().values(version=SCHEMA_VERSION))

    def close(self) -> None:
        self.engine.dispose()

    def _publish(self, job_ids: list[str]) -> None:
        """PostgreSQL: tell the other processes (``listen``) which jobs changed, after the write committed."""
        from sqlalchemy import text

        try:
            with self.engine.connect() as conn:
                for i in range(0, len(job_ids), 200):  # NOTIFY payloads stay under 8000 bytes
                    conn.execute(text("SELECT pg_notify(:c, :p)"), {"c": CHANNEL, "p": ",".join(job_ids[i:i + 200])})
                conn.commit()
        except Exception as e:  # waiters fall back to their slow poll; the write itself stands
            log.warning("could not publish a change notification: %s", e)

    def listen(self, stop: threading.Event) -> None:
        """PostgreSQL: wake this process's waiters (images endpoint, event streams) on changes other
        processes publish (LISTEN/NOTIFY), until ``stop`` is set; reconnects after a lost connection."""
        import psycopg

        url = self.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        while not stop.is_set():
            try:
                with psycopg.connect(url, autocommit=True) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    while not stop.is_set():
                        for note in conn.notifies(timeout=1.0):
                            self._new_work()
                            self.changes.notify(note.payload.split(","), local=True)
            except Exception as e:  # the database restarted, a network blip: waiters poll meanwhile
                log.warning("change notifications lost (%s); reconnecting", e)
                stop.wait(1.0)

    def _new_work(self) -> None:
        self.queued.set()
        self.work.set()

    @contextmanager
    def _tx(self, write: bool = True):
        options = {} if write else {"dit_serve_read": True}
        with self.engine.connect().execution_options(**options) as conn, conn.begin():
            yield conn

    # -- jobs --------------------------------------------------------------------------------------
    def create_job(self, model: str, params: JobParams, labels: list[int], seeds: list[int],
                   idempotency_key: str | None = None, priority: int = 0, webhook_url: str | None = None,
                   **kwargs) -> str:
        """Store a job and its items in one transaction; returns the job id. With an
        ``idempotency_key`` that an earlier job was stored under, returns that job's id and stores
        nothing (``IdempotencyConflict`` if the earlier request asked for something else)."""
        return self.submit(model, params, labels, seeds, idempotency_key, priority, webhook_url, **kwargs)[0]

    def submit(self, model: str, params: JobParams, labels: list[int], seeds: list[int],
               idempotency_key: str | None = None, priority: int = 0, webhook_url: str | None = None, *,
               tenant: str = DEFAULT_TENANT, max_active: int | None = None,
               tenant_max_active: int | None = None, prompts: list[str] | None = None, view: bool = False) -> tuple:
        """``create_job`` that also says whether the job is new (False: an earlier submission's) and
        belongs to ``tenant`` (Idempotency-Keys are per tenant). ``QueueFull``, and nothing stored, when
        the queued and running items would exceed ``max_active`` (all tenants) or ``tenant_max_active``.
        With ``view``, a third element: the new job as ``get_job`` would read it right after (None for an
        earlier submission's), made from what was written rather than read back."""
        stored = params.model_dump_json()
        if JobParams.model_validate_json(stored) != params:  # a row this store writes is one it can read
            raise ValueError(f"job parameters do not survive storage: {stored[:200]}")
        digest = None
        if idempotency_key is not None:
            digest = hashlib.sha256(json.dumps([model, params.model_dump(mode="json"), labels, seeds, priority,
                                                webhook_url, prompts], sort_keys=True).encode()).hexdigest()
        def earlier(found: str) -> tuple:
            return (found, False, None) if view else (found, False)

        job_id, now = uuid.uuid4().hex, time.time()
        job_row = dict(id=job_id, model=model, params=stored, num_items=len(labels), created_at=now, cancelled=False,
                       priority=priority, tenant=tenant, idempotency_key=idempotency_key, request_hash=digest,
                       webhook_url=webhook_url, webhook_state="pending" if webhook_url else None,
                       webhook_attempts=0, webhook_next=0.0 if webhook_url else None, webhook_error=None)
        item_rows = [dict(job_id=job_id, idx=i, model=model, created_at=now, priority=priority, tenant=tenant, label=lb,
                          prompt=prompts[i] if prompts else None, seed=sd, state="queued", step=0,
                          total_steps=params.steps, attempts=0)
                     for i, (lb, sd) in enumerate(zip(labels, seeds))]
        try:
            with self._tx() as conn:  # the key's lookup inside the writing transaction: one transaction, not two
                if idempotency_key is not None and (found := self._by_key(tenant, idempotency_key, digest, conn)):
                    return earlier(found)
                self._check_room(conn, len(labels), tenant, max_active, tenant_max_active)
                conn.execute(_INSERT_JOB, job_row)
                conn.execute(_INSERT_ITEMS, item_rows)
        except IntegrityError:  # the same key committed by a concurrent submission: that one stands
            if idempotency_key is None or (found := self._by_key(tenant, idempotency_key, digest)) is None:
                raise
            return earlier(found)
        self._new_work()
        self.changes.notify([job_id])  # on PostgreSQL: wakes the scheduler of another process
        if not view:
            return job_id, True
        rows = [SimpleNamespace(**_ITEM_DEFAULTS, **r) for r in item_rows]  # read as result rows are
        return job_id, True, _job(SimpleNamespace(**job_row), _stats_of_rows(rows), rows)

    def _check_room(self, conn, n: int, tenant: str, max_active: int | None, tenant_max_active: int | None) -> None:
        """Raise ``QueueFull`` if ``n`` more items would pass a bound; inside the submitting transaction
        (PostgreSQL: serialised by a lock, so concurrent submissions cannot pass it together)."""
        if max_active is None and tenant_max_active is None:
            return
        if conn.dialect.name == "postgresql":
            from sqlalchemy import text

            conn.execute(text("SELECT pg_advisory_xact_lock(7346120985)"))
        for bound, query, whose in ((max_active, _ACTIVE_ALL, "the service"),
                                    (tenant_max_active, _ACTIVE_OF_TENANT, "your tenant")):
            if bound is None:
                continue
            if n > bound:
                raise QueueFull(f"the job has {n} items but {whose} may hold at most {bound} queued or running "
                                "items: split it into smaller jobs", never=True)
            held = conn.execute(query, {"tenant": tenant}).scalar_one()
            if held + n > bound:
                raise QueueFull(f"{whose} has {held} items queued or running and may hold at most {bound}; "
                                f"this job of {n} would pass that: retry later")

    def _by_key(self, tenant: str, key: str, digest: str, conn=None) -> str | None:
        if conn is None:
            with self._tx(write=False) as conn:
                return self._by_key(tenant, key, digest, conn)
        row = conn.execute(_BY_KEY, {"tenant": tenant, "key": key}).first()
        if row is not None and row.request_hash != digest:
            raise IdempotencyConflict(f"Idempotency-Key {key[:80]!r} was already used for a different request "
                                      f"(job {row.id}); use a new key for a new job")
        return None if row is None else row.id

    def get_job(self, job_id: str, with_items: bool = True, tenant: str | None = None,
                items_up_to: int | None = None) -> Job | None:
        """The job, or None if there is none (or it belongs to another tenant than ``tenant``, when given).
        With ``items_up_to``: with its items if it has at most that many, whatever ``with_items`` says."""
        with self._tx(write=False) as conn:
            row = conn.execute(_JOB if tenant is None else _JOB_OF, {"id": job_id, "tenant": tenant}).first()
            if row is None:
                return None
            if items_up_to is not None:
                with_items = row.num_items <= items_up_to
            if with_items:  # one read of the items gives both (one snapshot: counts and items agree)
                rows = conn.execute(_ITEMS_OF, {"id": job_id}).all()
                stats = _stats_of_rows(rows)
            else:
                rows = None
                stats = _stats_by_job(conn.execute(_STATS_OF, {"id": job_id}).all()).get(job_id, _no_stats())
        job = _job(row, stats, rows)
        if job.error is not None and job.state != "failed":  # unreadable: it fails alone, once
            self.quarantine(job_id, job.error)
            return self.get_job(job_id, with_items, tenant, items_up_to)
        return job

    def list_jobs(self, limit: int, offset: int, tenant: str | None = None) -> tuple[list[Job], int]:
        """Newest first; only ``tenant``'s jobs when given."""
        with self._tx(write=False) as conn:
            total = conn.execute(select(func.count()).select_from(jobs).where(*_of(tenant))).scalar_one()
            rows = conn.execute(select(jobs).where(*_of(tenant)).order_by(jobs.c.created_at.desc(), jobs.c.id)
                                .limit(limit).offset(offset)).all()
            stats = _item_stats(conn, [r.id for r in rows])
        out = [_job(r, stats.get(r.id, {}), None) for r in rows]
        for job in out:
            if job.error is not None and job.state != "failed":
                self.quarantine(job.id, job.error)
        return out, total

    def quarantine(self, job_id: str, reason: str) -> None:
        """Fail a job whose stored row cannot be read: its queued and running items fail with ``reason``;
        every other job is untouched."""
        log.error("job %s cannot be read back from the store and is failed: %s", job_id, reason)
        with self._tx() as conn:
            conn.execute(update(items).where(items.c.job_id == job_id, items.c.state.in_(("queued", "running")))
                         .values(state="failed", error=reason[:2000], finished_at=time.time(), **_NO_LEASE))
        self.changes.notify([job_id])

    def active_items(self, job_id: str) -> int:
        """The job's queued and running items (a cheap check for waiters)."""
        with self._tx(write=False) as conn:
            return conn.execute(_ACTIVE_OF_JOB, {"id": job_id}).scalar_one()

    def finished_items(self, job_id: str, since: float | None = None) -> list:
        """The job's ended items (done, failed, cancelled) whose ``finished_at`` is at or after ``since``
        (every ended one when None), as rows of (idx, state, error, finished_at): the event streams' read."""
        with self._tx(write=False) as conn:
            return conn.execute(_ENDED_OF if since is None else _ENDED_SINCE, {"id": job_id, "since": since}).all()

    def cancel_job(self, job_id: str, tenant: str | None = None) -> bool:
        """Queued and running items become cancelled (a worker drops a running one at its next step
        boundary, when its scheduler sees the lease is gone). A job that had already finished keeps
        its state. False for an unknown job (or another tenant's)."""
        with self._tx() as conn:
            if conn.execute(select(jobs.c.id).where(jobs.c.id == job_id, *_of(tenant))).first() is None:
                return False
            stopped = conn.execute(update(items).where(items.c.job_id == job_id,
                                                       items.c.state.in_(("queued", "running")))
                                   .values(state="cancelled", finished_at=time.time(), **_NO_LEASE)).rowcount
            if stopped:
                conn.execute(update(jobs).where(jobs.c.id == job_id).values(cancelled=True))
        shutil.rmtree(self.data_dir / "previews" / job_id, ignore_errors=True)
        self.changes.notify([job_id])
        return True

    def retry_failed(self, job_id: str, tenant: str | None = None) -> int | None:
        """Queue a job's failed items again, with their failure counters reset (and its webhook armed
        again); returns how many, or None for an unknown job."""
        with self._tx() as conn:
            row = conn.execute(select(jobs.c.id, jobs.c.webhook_url).where(jobs.c.id == job_id, *_of(tenant))).first()
            if row is None:
                return None
            n = conn.execute(update(items).where(items.c.job_id == job_id, items.c.state == "failed").values(
                state="queued", step=0, error=None, finished_at=None, requeues=0, crashes=0, solo_crashes=0,
                not_before=0.0, **_NO_LEASE)).rowcount
            if n and row.webhook_url:
                conn.execute(update(jobs).where(jobs.c.id == job_id).values(
                    webhook_state="pending", webhook_attempts=0, webhook_next=0.0, webhook_error=None))
        if n:
            self._new_work()
            self.changes.notify([job_id])
        return n

    def delete_job(self, job_id: str, tenant: str | None = None) -> bool | None:
        """Delete a finished job: its rows, then its images. None for an unknown job; False, and nothing
        deleted, while any of its items is queued or running (cancel it first)."""
        with self._tx() as conn:
            if conn.execute(select(jobs.c.id).where(jobs.c.id == job_id, *_of(tenant))).first() is None:
                return None
            if conn.execute(select(items.c.idx).where(items.c.job_id == job_id,
                                                      items.c.state.in_(("queued", "running"))).limit(1)).first():
                return False
            conn.execute(items.delete().where(items.c.job_id == job_id))
            conn.execute(jobs.delete().where(jobs.c.id == job_id))
        # after the commit: a crash here leaves files no row points at, never a row without its file
        shutil.rmtree(self.data_dir / "images" / job_id, ignore_errors=True)
        shutil.rmtree(self.data_dir / "previews" / job_id, ignore_errors=True)
        return True

    def purge_finished(self, older_than_s: float, limit: int = 100) -> list[str]:
        """Delete up to ``limit`` jobs whose items all ended more than ``older_than_s`` seconds ago;
        returns their ids (the retention policy: ``[store] retention_hours``)."""
        cutoff = time.time() - older_than_s
        active = func.sum(case((items.c.state.in_(("queued", "running")), 1), else_=0))
        with self._tx(write=False) as conn:
            ids = conn.execute(select(items.c.job_id).group_by(items.c.job_id)
                               .having(and_(active == 0, func.max(items.c.finished_at) < cutoff))
                               .order_by(func.max(items.c.finished_at)).limit(limit)).scalars().all()
        return [job_id for job_id in ids if self.delete_job(job_id)]

    # -- webhooks ----------------------------------------------------------------------------------
    def claim_webhooks(self, hold_s: float, limit: int = 20) -> list[tuple[str, str, int]]:
        """Claim finished jobs whose webhook is due (pending, or a claim that expired): returns
        (job id, url, attempts so far). A claim holds for ``hold_s``; another process (or this one,
        after a crash) takes it over when it expires, so every webhook is delivered at least once."""
        now = time.time()
        active = select(items.c.idx).where(items.c.job_id == jobs.c.id,
                                           items.c.state.in_(("queued", "running"))).exists()
        with self._tx() as conn:
            rows = conn.execute(select(jobs.c.id, jobs.c.webhook_url, jobs.c.webhook_attempts)
                                .where(jobs.c.webhook_state.in_(("pending", "sending")), jobs.c.webhook_next <= now,
                                       ~active).order_by(jobs.c.webhook_next).limit(limit)
                                .with_for_update(skip_locked=True, of=jobs)).all()
            if rows:
                conn.execute(update(jobs).where(jobs.c.id.in_([r.id for r in rows]))
                             .values(webhook_state="sending", webhook_next=now + hold_s))
        return [(r.id, r.webhook_url, r.webhook_attempts) for r in rows]

    def webhook_done(self, job_id: str, error: str | None, retry_in: float | None) -> None:
        """Record a delivery attempt: sent (no error); else pending again in ``retry_in`` seconds,
        or failed for good when ``retry_in`` is None."""
        values: dict = {"webhook_attempts": jobs.c.webhook_attempts + 1, "webhook_error": error}
        if error is None:
            values.update(webhook_state="sent", webhook_next=None)
        elif retry_in is None:
            values.update(webhook_state="failed", webhook_next=None)
        else:
            values.update(webhook_state="pending", webhook_next=time.time() + retry_in)
        with self._tx() as conn:
            conn.execute(update(jobs).where(jobs.c.id == job_id).values(**values))

    def image_path(self, job_id: str, index: int, tenant: str | None = None) -> Path | None:
        query = select(items.c.path).where(items.c.job_id == job_id, items.c.idx == index)
        if tenant is not None:
            query = query.where(items.c.tenant == tenant)
        with self._tx(write=False) as conn:
            path = conn.execute(query).scalar()
        return self.data_dir / path if path else None

    def counts(self) -> dict[str, int]:
        """Items per state, over all jobs."""
        with self._tx(write=False) as conn:
            rows = conn.execute(select(items.c.state, func.count()).group_by(items.c.state)).all()
        return {state: n for state, n in rows}

    def recent_rate(self, window_s: float = 60.0) -> float:
        """Items finished per second over the last ``window_s`` seconds (for Retry-After estimates)."""
        with self._tx(write=False) as conn:
            n = conn.execute(select(func.count()).select_from(items).where(
                items.c.state == "done", items.c.finished_at > time.time() - window_s)).scalar_one()
        return n / window_s

    # -- leases ------------------------------------------------------------------------------------
    def lease(self, owner: str, models: list[str], limit: int, ttl: float, isolate: bool = False,
              announce: bool = True, expect: bool = False, prefer: Collection[tuple] | None = None,
              capacity: int | None = None) -> list[Lease]:
        """Lease up to ``limit`` queued or lease-expired items of ``models``: highest priority first, then
        oldest job first. Items that crashed workers twice or more (suspects) are leased only with
        ``isolate`` (the caller's worker holds nothing else), in groups that halve with each further crash
        (``limit >> (crashes - 1)``, down to one), so the batch that crashes is split until its poison item
        is alone. A lease is committed only once everything the worker needs from the row was read.
        ``announce=False``: the caller calls ``changes.notify`` for the leased jobs itself (the scheduler does,
        once the items are on their way to a worker, so that the event streams woken by it do not compete
        with the sending). ``expect``: the caller knows items were just queued (a submission's signal), so
        the read-only check that spares an idle poll the write lock is skipped. ``prefer``: the shapes
        ((model, width, height) as stored) the caller's worker runs now: the lease reads up to
        ``workers.admission.WINDOW`` x ``limit`` candidates and takes ``limit`` of them by shape-aware
        admission (the queue's head always, then items of those shapes and the head's, never past a
        higher priority; with ``capacity``, the most items the worker holds, no other shape started for a
        handful of items: ``workers.admission`` rule 4); None: the first ``limit`` in queue order."""
        now = time.time()
        if limit <= 0:
            return []
        args = {"models": list(models), "now": now}
        if not expect and not self._any(_ANY_LEASABLE, args):  # an idle poll: a read, no write lock
            return []
        with self._tx() as conn:
            level = conn.execute(_LEASE_LEVEL, args).scalar() if isolate else None
            if level is None and prefer is not None:
                rows = conn.execute(_LEASE_FRESH, {**args, "size": limit * admission.WINDOW}).all()
                rows = [rows[i] for i in admission.choose(rows, limit, prefer, shape=_row_shape,
                                                          priority=lambda r: r.priority, capacity=capacity)]
            elif level is None:
                rows = conn.execute(_LEASE_FRESH, {**args, "size": limit}).all()
            else:
                rows = conn.execute(_LEASE_AT_LEVEL, {**args, "size": max(1, limit >> (level - 1)),
                                                      "level": level}).all()
            rows = self._take_over_expired(conn, rows, now)
            leases, token = [], uuid.uuid4().hex
            for r in rows:
                try:
                    params = _params(r.params)
                except ValueError as e:
                    _set(conn, [(r.job_id, r.idx)], state="failed", finished_at=now, **_NO_LEASE,
                         error=f"the stored job cannot be read: {str(e)[:300]}")
                    continue
                leases.append(Lease(r.job_id, r.idx, r.model, r.label, r.seed, params, token, prompt=r.prompt,
                                    requeues=r.requeues, crashes=r.crashes, suspect=level is not None,
                                    created_at=r.created_at, leased_at=now))
            if level is not None and len(leases) == 1:
                leases[0].solo = True
            if leases:
                conn.execute(_SET_RUNNING, [dict(j=ls.job_id, i=ls.index, owner=owner, token=token,
                                                 expires=now + ttl) for ls in leases])
        if announce:
            self.changes.notify(sorted({ls.job_id for ls in leases}))
        return leases

    def _take_over_expired(self, conn, rows, now: float) -> list:
        """Rows whose lease expired (their scheduler went away) count an infrastructure failure; those
        past ``max_requeues`` fail instead of being leased."""
        expired = [r for r in rows if r.state == "running"]
        if not expired:
            return rows
        _set(conn, [(r.job_id, r.idx) for r in expired], requeues=items.c.requeues + 1)
        spent = {(r.job_id, r.idx) for r in expired if r.requeues + 1 >= self.max_requeues}
        if spent:
            _set(conn, sorted(spent), state="failed", finished_at=now, **_NO_LEASE,
                 error=f"gave up after {self.max_requeues} infrastructure failures (the last: its lease expired, "
                       "its scheduler or worker gone)")
        return [r for r in rows if (r.job_id, r.idx) not in spent]

    def _any(self, query, params: dict | None = None) -> bool:
        """Whether ``query`` (a select of at most one row) finds a row: a cheap read before taking the write
        lock, which an idle scheduler makes often."""
        with self._tx(write=False) as conn:
            return conn.execute(query, params or {}).first() is not None

    def has_suspects(self, models: list[str]) -> bool:
        """Whether items that crashed workers repeatedly wait to be run in isolation."""
        return self._any(select(items.c.idx).where(items.c.model.in_(models), items.c.state == "queued",
                                                   items.c.crashes >= 2).limit(1))

    def heartbeat(self, leases: list[Lease], ttl: float) -> list[Lease]:
        """Renew leases and record progress; returns the leases no longer held (cancelled, or
        expired and taken by someone else): their workers should drop them."""
        if not leases:
            return []
        expires = time.time() + ttl
        with self._tx() as conn:
            conn.execute(update(items).where(
                items.c.job_id == bindparam("j"), items.c.idx == bindparam("i"), items.c.state == "running",
                items.c.lease_token == bindparam("t")).values(lease_expires=expires, step=bindparam("s")),
                [dict(j=ls.job_id, i=ls.index, t=ls.token, s=ls.step) for ls in leases])
            held = set(conn.execute(select(items.c.job_id, items.c.idx, items.c.lease_token).where(
                items.c.job_id.in_(sorted({ls.job_id for ls in leases})), items.c.state == "running")).all())
        self.changes.notify(sorted({ls.job_id for ls in leases}))  # progress: event streams wake
        return [ls for ls in leases if (ls.job_id, ls.index, ls.token) not in held]

    def release(self, leases: list[Lease], reason: str = "stop", error: str | None = None) -> list[Lease]:
        """Return leased items to the queue now instead of waiting for their leases to expire.

        ``stop``: a graceful stop; not counted at all. ``infra``: an infrastructure failure (a node left);
        counts a requeue. ``crash``: the worker holding them died or its step raised; counts a requeue
        and a crash, and for an isolated item alone a solo crash. Never charged as the item's failure,
        except: past ``max_requeues`` requeues the item fails, and past ``poison_crashes`` solo crashes
        it fails as the cause (``error`` says why). Returns the leases that failed."""
        if not leases:
            return []
        if reason not in ("stop", "infra", "crash"):
            raise ValueError(f"unknown release reason {reason!r}")
        now, crash = time.time(), reason == "crash"
        failed = []
        with self._tx() as conn:
            for ls in leases:
                values: dict = dict(state="queued", step=0, **_NO_LEASE)
                if reason == "stop":
                    values["attempts"] = items.c.attempts - 1
                else:
                    values.update(requeues=items.c.requeues + 1, not_before=now + requeue_backoff(ls.requeues + 1),
                                  crashes=items.c.crashes + int(crash), solo_crashes=items.c.solo_crashes + int(crash and ls.solo))
                if conn.execute(update(items).where(*_HELD).values(**values), _held_params(ls)).rowcount != 1:
                    continue
                self._drop_preview(ls.job_id, ls.index)
                why = self._give_up(conn, ls, error)
                if why is not None:
                    _set(conn, [(ls.job_id, ls.index)], state="failed", error=why[:2000], finished_at=now)
                    failed.append(ls)
        self._new_work()
        self.changes.notify(sorted({ls.job_id for ls in leases}))
        return failed

    def _give_up(self, conn, ls: Lease, error: str | None) -> str | None:
        row = conn.execute(select(items.c.requeues, items.c.solo_crashes).where(
            items.c.job_id == ls.job_id, items.c.idx == ls.index)).first()
        cause = f" (the last: {error})" if error else ""
        if row.solo_crashes >= self.poison_crashes:
            return (f"this item crashed its worker {row.solo_crashes} times while it ran alone{cause}; "
                    "the items it was batched with were not charged")
        if row.requeues >= self.max_requeues:
            return f"gave up after {row.requeues} infrastructure failures{cause}"
        return None

    # -- results -----------------------------------------------------------------------------------
    def commit_result(self, lease: Lease, png: bytes) -> bool:
        """Record an item's PNG once; False (and nothing written) when the lease is no longer held."""
        rel = Path("images") / lease.job_id / f"{lease.index:05d}.png"
        final = self.data_dir / rel
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{lease.index:05d}-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(png)
                f.flush()
                os.fsync(f.fileno())
            with self._tx() as conn:
                won = conn.execute(_COMMIT_DONE, dict(_held_params(lease), path=str(rel),
                                                      finished_at=time.time())).rowcount == 1
                if won:
                    os.replace(tmp, final)  # before commit: a failed commit leaves an orphan a re-run replaces
            if won:
                self._drop_preview(lease.job_id, lease.index)
                self.changes.notify([lease.job_id])
            return won
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def sweep_temp_files(self, older_than_s: float = 600.0) -> int:
        """Delete result temp files a killed process left behind (written, never renamed nor removed);
        only old ones, since another scheduler may be writing a fresh one. Returns how many."""
        cutoff, n = time.time() - older_than_s, 0
        temps = [*(self.data_dir / "images").glob("*/.*.tmp"), *(self.data_dir / "previews").glob("*/.*.tmp")]
        for tmp in temps:
            try:
                if tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
                    n += 1
            except FileNotFoundError:  # removed meanwhile
                pass
        return n

    def fail_item(self, lease: Lease, error: str) -> bool:
        """An error raised for this item: it fails (a user may retry it, POST /v1/jobs/{id}/retry)."""
        with self._tx() as conn:
            won = conn.execute(update(items).where(*_HELD).values(
                state="failed", error=error[:2000], finished_at=time.time(), **_NO_LEASE),
                _held_params(lease)).rowcount == 1
        self._drop_preview(lease.job_id, lease.index)
        self.changes.notify([lease.job_id])
        return won

    # -- previews (ephemeral: files beside the images, no rows) --------------------------------------
    def put_preview(self, lease: Lease, step: int, png: bytes) -> None:
        """Keep ``png`` as the latest preview of a leased item (``previews/<job>/<index>.<step>.png``,
        renamed into place so readers on any process see a whole file; older steps removed after).
        No fsync and no row: a preview lost in a crash costs nothing. The step in the name lets event
        streams see a new preview from a directory listing."""
        folder = self.data_dir / "previews" / lease.job_id
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{lease.index:05d}-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(png)
            os.replace(tmp, folder / f"{lease.index:05d}.{step:06d}.png")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        for old in folder.glob(f"{lease.index:05d}.*.png"):
            if (key := _preview_key(old.name)) is not None and key < (lease.index, step):
                old.unlink(missing_ok=True)
        self.changes.notify([lease.job_id])

    def preview_steps(self, job_id: str) -> dict[int, int]:
        """Index -> step of the latest preview of each of the job's running items (the event streams' read:
        a listing, and a query only when the job has previews)."""
        latest: dict[int, int] = {}
        try:
            names = os.listdir(self.data_dir / "previews" / job_id)
        except FileNotFoundError:
            return latest
        for name in names:
            if (key := _preview_key(name)) is not None and key[1] > latest.get(key[0], -1):
                latest[key[0]] = key[1]
        if not latest:
            return latest
        with self._tx(write=False) as conn:
            running = set(conn.execute(select(items.c.idx).where(items.c.job_id == job_id,
                                                                 items.c.state == "running")).scalars())
        return {i: step for i, step in latest.items() if i in running}

    def preview(self, job_id: str, index: int, tenant: str | None = None) -> tuple[int, bytes] | None:
        """(step, PNG) of a running item's latest preview; None when it has none (or is not running)."""
        query = select(items.c.state).where(items.c.job_id == job_id, items.c.idx == index)
        if tenant is not None:
            query = query.where(items.c.tenant == tenant)
        with self._tx(write=False) as conn:
            if conn.execute(query).scalar() != "running":
                return None
        folder = self.data_dir / "previews" / job_id
        for _ in range(3):  # a newer preview may replace the one listed between listing and reading
            found = sorted(k for p in folder.glob(f"{index:05d}.*.png") if (k := _preview_key(p.name)))
            if not found:
                return None
            try:
                return found[-1][1], (folder / f"{index:05d}.{found[-1][1]:06d}.png").read_bytes()
            except FileNotFoundError:
                continue
        return None

    def _drop_preview(self, job_id: str, index: int) -> None:
        for p in (self.data_dir / "previews" / job_id).glob(f"{index:05d}.*.png"):
            p.unlink(missing_ok=True)


class Changes:
    """Notifications of item changes (leased, progress written, ended), so that waiters (the images
    endpoint, the event streams) wake when a job changed instead of polling it. In-process always; on
    PostgreSQL also across processes: ``publish`` NOTIFYs the other processes, whose ``Store.listen``
    thread wakes their waiters. Waiters still check every second in case a notification is lost."""

    def __init__(self, publish=None):
        self._publish = publish
        self._lock = threading.Lock()
        self._waiters: dict[str, list] = {}  # job id -> [(loop, asyncio.Event)]

    def watch(self, job_id: str):
        """An asyncio.Event set on the next change of ``job_id``; call ``unwatch`` when done."""
        import asyncio

        event = asyncio.Event()
        with self._lock:
            self._waiters.setdefault(job_id, []).append((asyncio.get_running_loop(), event))
        return event

    def unwatch(self, job_id: str, event) -> None:
        with self._lock:
            waiters = [w for w in self._waiters.get(job_id, []) if w[1] is not event]
            if waiters:
                self._waiters[job_id] = waiters
            else:
                self._waiters.pop(job_id, None)

    def notify(self, job_ids: list[str], local: bool = False) -> None:
        """Wake this process's waiters on ``job_ids``, and (unless ``local``) publish to the others."""
        if self._publish is not None and not local and job_ids:
            self._publish(job_ids)
        with self._lock:
            hits = [w for j in job_ids for w in self._waiters.get(j, ())]
        for loop, waiter in hits:
            try:
                loop.call_soon_threadsafe(waiter.set)
            except RuntimeError:  # its loop has closed
                pass


_NO_LEASE = dict(lease_owner=None, lease_token=None, lease_expires=None)

# The lease's statements, built once: building SQLAlchemy expressions on every call cost about 90% of a
# lease's time (its SQL takes some tens of microseconds), and a lease is on every image's path.
_LEASABLE = and_(items.c.model.in_(bindparam("models", expanding=True)), items.c.not_before <= bindparam("now"),
                 or_(items.c.state == "queued",
                     and_(items.c.state == "running", items.c.lease_expires < bindparam("now"))))
_ANY_LEASABLE = select(items.c.idx).where(_LEASABLE).limit(1)
_LEASE_LEVEL = select(func.max(items.c.crashes)).where(_LEASABLE, items.c.crashes >= 2)


def _lease_rows(condition):
    return (select(items.c.job_id, items.c.idx, items.c.model, items.c.label, items.c.prompt, items.c.seed,
                   items.c.state, items.c.requeues, items.c.crashes, items.c.created_at, items.c.priority,
                   jobs.c.params)
            .join(jobs, jobs.c.id == items.c.job_id)
            .where(_LEASABLE, condition).order_by(items.c.priority.desc(), items.c.created_at, items.c.job_id,
                                                  items.c.idx)
            .limit(bindparam("size")).with_for_update(skip_locked=True, of=items))


_LEASE_FRESH = _lease_rows(items.c.crashes < 2)
_LEASE_AT_LEVEL = _lease_rows(items.c.crashes == bindparam("level"))
_SET_RUNNING = (update(items).where(items.c.job_id == bindparam("j"), items.c.idx == bindparam("i"))
                .values(state="running", step=0, lease_owner=bindparam("owner"), lease_token=bindparam("token"),
                        lease_expires=bindparam("expires"), attempts=items.c.attempts + 1))


def lease_shape(model: str, params: JobParams) -> tuple[str, int, int]:
    """A stored item's ``workers.admission.shape_key``, for shape-aware leasing."""
    return admission.shape_key(model, params.width, params.height)


def _row_shape(row) -> tuple:
    try:
        return lease_shape(row.model, _parsed_params(row.params))
    except ValueError:  # unreadable: failed when it is leased (as the head, at the latest)
        return (row.model, None, None)


def _params(stored: str) -> JobParams:
    """A job's stored parameters: parsed once per distinct text (a job's items share it), a copy each."""
    return _parsed_params(stored).model_copy()


_HELD = (items.c.job_id == bindparam("held_job"), items.c.idx == bindparam("held_idx"), items.c.state == "running",
         items.c.lease_token == bindparam("held_token"))  # the lease still holds the item (``_held_params``)
_COMMIT_DONE = update(items).where(*_HELD).values(state="done", step=items.c.total_steps, path=bindparam("path"),
                                                  finished_at=bindparam("finished_at"), **_NO_LEASE)


# A job's reads and a submission's writes, built once for the same reason: each image's submission and
# its event stream's reads are on its path, and building the expressions cost more than running them.
_JOB = select(jobs).where(jobs.c.id == bindparam("id"))
_JOB_OF = select(jobs).where(jobs.c.id == bindparam("id"), jobs.c.tenant == bindparam("tenant"))
_ITEMS_OF = select(items).where(items.c.job_id == bindparam("id")).order_by(items.c.idx)
_STATS = (select(items.c.job_id, items.c.state, func.count(), func.sum(items.c.step), func.sum(items.c.total_steps),
                 func.max(items.c.finished_at)).group_by(items.c.job_id, items.c.state))
_STATS_OF = _STATS.where(items.c.job_id == bindparam("id"))
_INSERT_JOB, _INSERT_ITEMS = jobs.insert(), items.insert()
_BY_KEY = select(jobs.c.id, jobs.c.request_hash).where(jobs.c.tenant == bindparam("tenant"),
                                                       jobs.c.idempotency_key == bindparam("key"))
_ACTIVE = items.c.state.in_(("queued", "running"))
_ACTIVE_ALL = select(func.count()).select_from(items).where(_ACTIVE)
_ACTIVE_OF_TENANT = select(func.count()).select_from(items).where(_ACTIVE, items.c.tenant == bindparam("tenant"))
_ACTIVE_OF_JOB = select(func.count()).select_from(items).where(_ACTIVE, items.c.job_id == bindparam("id"))
_ENDED_OF = (select(items.c.idx, items.c.state, items.c.error, items.c.finished_at)
             .where(items.c.job_id == bindparam("id"), items.c.state.in_(TERMINAL_STATES))
             .order_by(items.c.finished_at, items.c.idx))
_ENDED_SINCE = _ENDED_OF.where(items.c.finished_at >= bindparam("since"))
# what a new item row holds besides what ``submit`` writes (its columns' defaults), for the job it returns
_ITEM_DEFAULTS = dict(requeues=0, crashes=0, error=None, finished_at=None)


@functools.lru_cache(maxsize=256)
def _parsed_params(stored: str) -> JobParams:
    return JobParams.model_validate_json(stored)


def _preview_key(name: str) -> tuple[int, int] | None:
    """(index, step) of a preview file's name ``<index>.<step>.png``; None for other files."""
    parts = name.split(".")
    if len(parts) != 3 or parts[2] != "png" or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    return int(parts[0]), int(parts[1])


def _held_params(lease: Lease) -> dict:
    """``_HELD``'s parameters for ``lease``."""
    return {"held_job": lease.job_id, "held_idx": lease.index, "held_token": lease.token}


def _of(tenant: str | None) -> tuple:
    """The condition restricting a jobs query to one tenant (none: every tenant, for admins)."""
    return () if tenant is None else (jobs.c.tenant == tenant,)


def _set(conn, keys: list[tuple[str, int]], **values) -> None:
    if keys:
        conn.execute(update(items).where(items.c.job_id == bindparam("j"), items.c.idx == bindparam("i"))
                     .values(**values), [dict(j=j, i=i) for j, i in keys])


def _item_stats(conn, job_ids: list[str]) -> dict[str, dict]:
    """Per job: counts per state, steps done, steps total and the last finish time."""
    if not job_ids:
        return {}
    return _stats_by_job(conn.execute(_STATS.where(items.c.job_id.in_(job_ids))).all())


def _stats_by_job(rows) -> dict[str, dict]:
    """``_item_stats`` from ``_STATS``'s rows."""
    out: dict[str, dict] = {}
    for job_id, state, n, steps, total, finished in rows:
        _count(out.setdefault(job_id, _no_stats()), state, n, steps, total, finished)
    return out


def _stats_of_rows(rows) -> dict:
    """``_item_stats`` of one job, from its item rows already read."""
    s = _no_stats()
    for r in rows:
        _count(s, r.state, 1, r.step, r.total_steps, r.finished_at)
    return s


def _no_stats() -> dict:
    return {"counts": {}, "steps_done": 0, "steps_total": 0, "finished_at": None}


def _count(s: dict, state: str, n: int, steps, total, finished: float | None) -> None:
    """Add ``n`` items in ``state`` (their summed steps and total steps, their last finish) to ``s``:
    steps done count running and done items, steps total all but cancelled ones."""
    s["counts"][state] = s["counts"].get(state, 0) + n
    s["steps_done"] += int(steps or 0) if state in ("running", "done") else 0
    s["steps_total"] += int(total or 0) if state != "cancelled" else 0
    if finished is not None:
        s["finished_at"] = max(finished, s["finished_at"] or 0.0)


def job_state(cancelled: bool, counts: dict[str, int]) -> str:
    """A job's state from its items': any running -> running; a cancel wins over the rest; then
    all done -> done; queued items left -> queued (none started yet) or running; else failed."""
    if counts.get("running"):
        return "running"
    if cancelled:
        return "cancelled"
    n, done, queued = sum(counts.values()), counts.get("done", 0), counts.get("queued", 0)
    if done == n:
        return "done"
    if queued:
        return "queued" if queued == n else "running"
    return "failed"


def _job(row, stats: dict, item_rows) -> Job:
    """A job from its rows. A row that cannot be parsed gives a job with ``error`` set and no params
    (the caller fails it alone), never an exception that would break a listing."""
    counts = stats.get("counts", {})
    state = job_state(row.cancelled, counts)
    params, error = None, None
    try:
        params = JobParams.model_validate_json(row.params)
    except ValueError as e:
        error = f"the stored job cannot be read: {str(e)[:300]}"
    webhook = None if row.webhook_url is None else WebhookStatus(
        url=row.webhook_url, state=row.webhook_state, attempts=row.webhook_attempts, error=row.webhook_error)
    return Job(id=row.id, state=state, model=row.model, params=params, error=error, tenant=row.tenant,
               priority=row.priority, webhook=webhook, created_at=row.created_at, num_items=row.num_items, counts=counts,
               finished_at=stats.get("finished_at") if state in TERMINAL_STATES else None,
               steps_done=stats.get("steps_done", 0), steps_total=stats.get("steps_total", 0),
               items=None if item_rows is None else [
                   ItemStatus(index=r.idx, label=None if r.prompt is not None else r.label, prompt=r.prompt,
                              seed=r.seed, state=r.state, step=r.step,
                              total_steps=r.total_steps, attempts=r.attempts, requeues=r.requeues, crashes=r.crashes,
                              error=r.error, finished_at=r.finished_at if r.state in TERMINAL_STATES else None)
                   for r in item_rows])


def _driver_url(url: str) -> str:
    """``postgresql://`` means psycopg 3 (the driver this project installs), not psycopg2."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


def _sqlite_setup(engine) -> None:
    """WAL (readers never block the writer), a busy timeout, and BEGIN IMMEDIATE for writes."""

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # let the "begin" hook below issue BEGIN itself
        cur = dbapi_conn.cursor()
        for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "busy_timeout=30000"):
            cur.execute(f"PRAGMA {pragma}")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn):
        conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get("dit_serve_read") else "BEGIN IMMEDIATE")


def dump_manifest(job: Job) -> str:
    """The archive's manifest.json: the job and, per image, its file name, label and seed."""
    images = [{"file": f"{it.index:05d}.png", "index": it.index, "label": it.label, "prompt": it.prompt,
               "seed": it.seed, "state": it.state} for it in job.items or []]
    return json.dumps({"job": job.model_dump(exclude={"items"}), "images": images}, indent=2) + "\n"
