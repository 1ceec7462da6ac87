"""Jobs: submit (idempotency keys, queue bounds), read, list, cancel, retry, delete, and the counts the
service reports. A job's state is derived from its items' states, never stored twice."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
import uuid
from types import SimpleNamespace

from sqlalchemy import bindparam, func, select, text, update
from sqlalchemy.exc import IntegrityError

from dit_serve.schemas import (TERMINAL_STATES, Failure, ItemStatus, Job, JobParams, Manifest, ManifestImage,
                               WebhookStatus, failure_summary)
from dit_serve.server.store.base import NO_LEASE, StoreBase
from dit_serve.server.store.tables import DEFAULT_TENANT, items, jobs

log = logging.getLogger("dit_serve.server.store")  # the store's parts log as one


class IdempotencyConflict(ValueError):
    """An Idempotency-Key already used for a different request."""


class QueueFull(RuntimeError):
    """A submission over the bound of queued items (the service's or its tenant's): nothing was stored.
    ``never`` when the job alone is larger than the bound, so retrying cannot help."""

    def __init__(self, message: str, never: bool = False):
        super().__init__(message)
        self.never = never


class JobsMixin(StoreBase):
    """A job's life from submission to deletion (its items' leases: ``LeasesMixin``)."""

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
               tenant_max_active: int | None = None, prompts: list[str] | None = None, view: bool = False,
               reserve: int = 0, inputs: dict[str, bytes] | None = None) -> tuple:
        """``create_job`` that also says whether the job is new (False: an earlier submission's) and
        belongs to ``tenant`` (Idempotency-Keys are per tenant). ``QueueFull``, and nothing stored, when
        the queued and running items would exceed ``max_active`` (all tenants) or ``tenant_max_active``,
        or would pass ``max_active - reserve`` while the tenant then holds more than ``reserve`` items.
        With ``view``, a third element: the new job as ``get_job`` would read it right after (None for an
        earlier submission's), made from what was written rather than read back. ``inputs``: an edit's images
        and mask bytes ({"image": ..., "image2": ..., "mask": ...}), stored once for the job
        (``inputs/<job>/<name>``, renamed into place inside the transaction; ``params`` names their SHA-256)."""
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
        staged = self._stage_inputs(job_id, inputs) if inputs else None  # written before the write lock is taken
        stored = False
        try:
            with self._tx() as conn:  # the key's lookup inside the writing transaction: one transaction, not two
                if idempotency_key is not None and (found := self._by_key(tenant, idempotency_key, digest, conn)):
                    return earlier(found)
                self._check_room(conn, len(labels), tenant, max_active, tenant_max_active, reserve)
                conn.execute(_INSERT_JOB, job_row)
                conn.execute(_INSERT_ITEMS, item_rows)
                if staged is not None:  # before the commit; a failed one removes them below
                    self._place_inputs(job_id, staged)
            stored = True
        except IntegrityError:  # the same key committed by a concurrent submission: that one stands
            if idempotency_key is None or (found := self._by_key(tenant, idempotency_key, digest)) is None:
                raise
            return earlier(found)
        finally:
            if staged is not None and not stored:  # nothing stored for a refused, replayed or failed submission
                self._drop_inputs(job_id)
        self._new_work()
        self.changes.notify([job_id])  # on PostgreSQL: wakes the scheduler of another process
        if not view:
            return job_id, True
        rows = [SimpleNamespace(**_ITEM_DEFAULTS, **r) for r in item_rows]  # read as result rows are
        return job_id, True, _job(SimpleNamespace(**job_row), _stats_of_rows(rows), rows)

    def _check_room(self, conn, n: int, tenant: str, max_active: int | None, tenant_max_active: int | None,
                    reserve: int = 0) -> None:
        """Raise ``QueueFull`` if ``n`` more items would pass a bound; inside the submitting transaction
        (PostgreSQL: serialised by a lock, so concurrent submissions cannot pass it together).

        The last ``reserve`` places of ``max_active`` take only jobs whose tenant then holds at most
        ``reserve`` items: a tenant holding more stops at ``max_active - reserve``, so while the queue is
        as full as one tenant (or several large ones) can make it, a small tenant's job still fits."""
        if max_active is None and tenant_max_active is None:
            return
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(7346120985)"))
        held = {}
        for bound, query, whose in ((max_active, _ACTIVE_ALL, "the service"),
                                    (tenant_max_active, _ACTIVE_OF_TENANT, "your tenant")):
            if bound is None:
                continue
            if n > bound:
                raise QueueFull(f"the job has {n} items but {whose} may hold at most {bound} queued or running "
                                "items: split it into smaller jobs", never=True)
            held[whose] = conn.execute(query, {"tenant": tenant}).scalar_one()
            if held[whose] + n > bound:
                raise QueueFull(f"{whose} has {held[whose]} items queued or running and may hold at most {bound}; "
                                f"this job of {n} would pass that: retry later")
        if max_active is None or not reserve or held["the service"] + n <= max_active - reserve:
            return
        mine = held.get("your tenant")
        mine = conn.execute(_ACTIVE_OF_TENANT, {"tenant": tenant}).scalar_one() if mine is None else mine
        if mine + n > reserve:
            raise QueueFull(f"the service's queue holds {held['the service']} of {max_active} items; its last "
                            f"{reserve} places are kept for tenants holding at most {reserve}, and this job of {n} "
                            f"would make yours hold {mine + n}: retry later")

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
                failures = _failures_of_rows(rows)
            else:
                rows = None
                stats = _stats_by_job(conn.execute(_STATS_OF, {"id": job_id}).all()).get(job_id, _no_stats())
                failures = _failures(conn, [job_id], stats).get(job_id, [])
        job = _job(row, stats, rows, failures)
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
            failures = _failures(conn, [r.id for r in rows if stats.get(r.id, {}).get("counts", {}).get("failed")])
        out = [_job(r, stats.get(r.id, {}), None, failures.get(r.id, [])) for r in rows]
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
                         .values(state="failed", error=reason[:2000], finished_at=time.time(), **NO_LEASE))
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
                                   .values(state="cancelled", finished_at=time.time(), **NO_LEASE)).rowcount
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
                not_before=0.0, **NO_LEASE)).rowcount
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
        shutil.rmtree(self.data_dir / "inputs" / job_id, ignore_errors=True)
        return True

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


# A job's reads and a submission's writes, built once (as the lease's, ``store.leases``): each image's
# submission and its event stream's reads are on its path, and building the expressions cost more than
# running them.
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
_FAILURES = (select(items.c.job_id, items.c.error, func.count(), func.min(items.c.idx))
             .where(items.c.state == "failed").group_by(items.c.job_id, items.c.error))
_ENDED_SINCE = _ENDED_OF.where(items.c.finished_at >= bindparam("since"))
# what a new item row holds besides what ``submit`` writes (its columns' defaults), for the job it returns
_ITEM_DEFAULTS = dict(requeues=0, crashes=0, error=None, finished_at=None)


def _of(tenant: str | None) -> tuple:
    """The condition restricting a jobs query to one tenant (none: every tenant, for admins)."""
    return () if tenant is None else (jobs.c.tenant == tenant,)


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


def _failures(conn, job_ids: list[str], stats: dict | None = None) -> dict[str, list[Failure]]:
    """Per job: its failed items' distinct reasons (read only for jobs with failed items: ``stats``, when
    given, are the one job's counts, so a job without failures costs no query)."""
    if not job_ids or (stats is not None and not stats["counts"].get("failed")):
        return {}
    rows = conn.execute(_FAILURES.where(items.c.job_id.in_(job_ids))).all()
    out: dict[str, dict] = {}
    for job_id, error, n, first in rows:
        out.setdefault(job_id, {})[error] = (n, first)
    return {job_id: _ranked(reasons) for job_id, reasons in out.items()}


def _failures_of_rows(rows) -> list[Failure]:
    """``_failures`` of one job, from its item rows already read."""
    reasons: dict = {}
    for r in rows:
        if r.state == "failed":
            n, first = reasons.get(r.error, (0, r.idx))
            reasons[r.error] = (n + 1, min(first, r.idx))
    return _ranked(reasons)


def _ranked(reasons: dict) -> list[Failure]:
    """{error: (count, first index)} as Failures, the most common first (then the earliest)."""
    ranked = sorted(reasons.items(), key=lambda kv: (-kv[1][0], kv[1][1]))
    return [Failure(error=error or "no reason recorded", items=n, first=first) for error, (n, first) in ranked]


def _no_stats() -> dict:
    return {"counts": {}, "steps_done": 0, "steps_total": 0, "finished_at": None}


def _count(s: dict, state: str, n: int, steps, total, finished: float | None) -> None:
    """Add ``n`` items in ``state`` (their summed steps and total steps, their last finish) to ``s``:
    steps done count running, done and cancelled items (a cancel keeps the progress made), steps
    total every item."""
    s["counts"][state] = s["counts"].get(state, 0) + n
    s["steps_done"] += int(steps or 0) if state in ("running", "done", "cancelled") else 0
    s["steps_total"] += int(total or 0)
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


def _job(row, stats: dict, item_rows, failures: list[Failure] = ()) -> Job:
    """A job from its rows. A row that cannot be parsed gives a job with ``error`` set and no params
    (the caller fails it alone), never an exception that would break a listing. A failed job's ``error``
    sums up its ``failures``."""
    counts = stats.get("counts", {})
    state = job_state(row.cancelled, counts)
    params, error = None, None
    try:
        params = JobParams.model_validate_json(row.params)
    except ValueError as e:
        error = f"the stored job cannot be read: {str(e)[:300]}"
    if error is None and state == "failed" and failures:
        error = failure_summary(list(failures), counts.get("failed", 0), row.num_items)
    webhook = None if row.webhook_url is None else WebhookStatus(
        url=row.webhook_url, state=row.webhook_state, attempts=row.webhook_attempts, error=row.webhook_error)
    return Job(id=row.id, state=state, model=row.model, params=params, error=error, failures=list(failures),
               tenant=row.tenant,
               priority=row.priority, webhook=webhook, created_at=row.created_at, num_items=row.num_items, counts=counts,
               finished_at=stats.get("finished_at") if state in TERMINAL_STATES else None,
               steps_done=stats.get("steps_done", 0), steps_total=stats.get("steps_total", 0),
               items=None if item_rows is None else [
                   ItemStatus(index=r.idx, label=None if r.prompt is not None else r.label, prompt=r.prompt,
                              seed=r.seed, state=r.state, step=r.step,
                              total_steps=r.total_steps, attempts=r.attempts, requeues=r.requeues, crashes=r.crashes,
                              error=r.error, finished_at=r.finished_at if r.state in TERMINAL_STATES else None)
                   for r in item_rows])


def dump_manifest(job: Job) -> str:
    """The archive's manifest.json (``schemas.Manifest``, as every writer writes it): the job's settings and,
    per item, its file name, label or prompt, seed and state (the PNGs are those of the done items)."""
    images = [ManifestImage.of(f"{it.index:05d}.png", it) for it in job.items or []]
    return Manifest(job=job.id, model=job.model, state=job.state, params=job.params, grid=None,
                    images=images).dumps()
