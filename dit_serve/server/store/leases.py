"""Leases and failure accounting: lease (priority, FIFO, shape-aware admission), renew, release
(requeues not charged to the item), fail; the crash-loop bound (``max_requeues``) and the isolation of
poison items (``poison_crashes``) of docs/reliability.md."""

from __future__ import annotations

import functools
import time
import uuid
from dataclasses import dataclass, field
from typing import Collection

from sqlalchemy import and_, bindparam, case, func, or_, select, update

from dit_serve.schemas import JobParams
from dit_serve.server.store.base import NO_LEASE, StoreBase
from dit_serve.server.store.tables import items, jobs
from dit_serve.server.store.uploads import InputMissing, read_inputs
from workers.request import admission
from workers.request.spec import ItemSpec


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
    image: bytes = field(default=b"", repr=False)  # an edit's input image and mask, as the job stored them
    mask: bytes = field(default=b"", repr=False)   # (one bytes object per job and lease: sent to a worker once)
    extra_images: tuple[bytes, ...] = field(default=(), repr=False)  # an instruction edit's images 2, 3, ...

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
                        out_width=p.output_width, out_height=p.output_height, preview_every=p.preview_every,
                        image=self.image, mask=self.mask, strength=p.strength or 1.0, extra_images=self.extra_images,
                        loras=tuple((u.name, u.scale) for u in p.loras))


def requeue_backoff(requeues: int) -> float:
    """Seconds an item waits before it is leased again after its ``requeues``-th infrastructure failure:
    none for the first three (a lone crash costs nothing), then doubling from 1 s up to a minute."""
    return 0.0 if requeues <= 3 else min(60.0, 0.5 * 2.0 ** (requeues - 3))


class LeasesMixin(StoreBase):
    """Items leased to schedulers, renewed while they run, and returned or failed."""

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
        ``workers.request.admission.WINDOW`` x ``limit`` candidates and takes ``limit`` of them by shape-aware
        admission (the queue's head always, then items of those shapes and the head's, never past a
        higher priority; with ``capacity``, the most items the worker holds, no other shape started for a
        handful of items: ``workers.request.admission`` rule 4); None: the first ``limit`` in queue order."""
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
                    image, extra, mask = read_inputs(self.data_dir, r.job_id, params) if params.image else \
                        (b"", (), b"")
                except InputMissing as e:
                    _set(conn, [(r.job_id, r.idx)], state="failed", finished_at=now, **NO_LEASE, error=str(e)[:2000])
                    continue
                except ValueError as e:
                    _set(conn, [(r.job_id, r.idx)], state="failed", finished_at=now, **NO_LEASE,
                         error=f"the stored job cannot be read: {str(e)[:300]}")
                    continue
                leases.append(Lease(r.job_id, r.idx, r.model, r.label, r.seed, params, token, prompt=r.prompt,
                                    requeues=r.requeues, crashes=r.crashes, suspect=level is not None,
                                    created_at=r.created_at, leased_at=now, image=image, mask=mask,
                                    extra_images=extra))
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
            _set(conn, sorted(spent), state="failed", finished_at=now, **NO_LEASE,
                 error=f"gave up after {self.max_requeues} infrastructure failures (the last: its lease expired, "
                       "its scheduler or worker gone)")
        return [r for r in rows if (r.job_id, r.idx) not in spent]

    def backlog(self) -> dict[str, dict[str, int]]:
        """Per model, the work waiting for workers: ``queued`` and ``running`` items, and ``steps``, the denoising
        steps left (a queued item's whole plan, a running item's rest, by the progress its heartbeats wrote).
        A running item whose lease expired (its scheduler died) counts as queued, with its whole plan: it waits
        for a worker to lease it again, and no worker holds it. What autoscaling sizes the workers by
        (``dit_serve.server.autoscale``)."""
        with self._tx(write=False) as conn:
            rows = conn.execute(_BACKLOG, {"now": time.time()}).all()
        return {model: {"queued": int(n) - int(running or 0), "running": int(running or 0), "steps": int(steps or 0)}
                for model, running, n, steps in rows}

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
                values: dict = dict(state="queued", step=0, **NO_LEASE)
                if reason == "stop":
                    values["attempts"] = items.c.attempts - 1
                else:
                    values.update(requeues=items.c.requeues + 1, not_before=now + requeue_backoff(ls.requeues + 1),
                                  crashes=items.c.crashes + int(crash), solo_crashes=items.c.solo_crashes + int(crash and ls.solo))
                if conn.execute(update(items).where(*HELD).values(**values), held_params(ls)).rowcount != 1:
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

    def fail_item(self, lease: Lease, error: str) -> bool:
        """An error raised for this item: it fails (a user may retry it, POST /v1/jobs/{id}/retry)."""
        with self._tx() as conn:
            won = conn.execute(update(items).where(*HELD).values(
                state="failed", error=error[:2000], finished_at=time.time(), **NO_LEASE),
                held_params(lease)).rowcount == 1
        self._drop_preview(lease.job_id, lease.index)
        self.changes.notify([lease.job_id])
        return won


# The lease's statements, built once: building SQLAlchemy expressions on every call cost about 90% of a
# lease's time (its SQL takes some tens of microseconds), and a lease is on every image's path.
_LEASABLE = and_(items.c.model.in_(bindparam("models", expanding=True)), items.c.not_before <= bindparam("now"),
                 or_(items.c.state == "queued",
                     and_(items.c.state == "running", items.c.lease_expires < bindparam("now"))))
_ANY_LEASABLE = select(items.c.idx).where(_LEASABLE).limit(1)
_LEASE_LEVEL = select(func.max(items.c.crashes)).where(_LEASABLE, items.c.crashes >= 2)
# grouped by the model alone: PostgreSQL takes a parameter repeated in GROUP BY for another expression
_LIVE_LEASE = and_(items.c.state == "running", items.c.lease_expires >= bindparam("now"))
_BACKLOG = (select(items.c.model, func.sum(case((_LIVE_LEASE, 1), else_=0)), func.count(),
                   func.sum(items.c.total_steps - case((_LIVE_LEASE, items.c.step), else_=0)))
            .where(items.c.state.in_(("queued", "running"))).group_by(items.c.model))


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
    """A stored item's ``workers.request.admission.shape_key``, for shape-aware leasing."""
    return admission.shape_key(model, params.width, params.height)


def _row_shape(row) -> tuple:
    try:
        return lease_shape(row.model, _parsed_params(row.params))
    except ValueError:  # unreadable: failed when it is leased (as the head, at the latest)
        return (row.model, None, None)


def _params(stored: str) -> JobParams:
    """A job's stored parameters: parsed once per distinct text (a job's items share it), a copy each."""
    return _parsed_params(stored).model_copy()


@functools.lru_cache(maxsize=256)
def _parsed_params(stored: str) -> JobParams:
    return JobParams.model_validate_json(stored)


HELD = (items.c.job_id == bindparam("held_job"), items.c.idx == bindparam("held_idx"), items.c.state == "running",
        items.c.lease_token == bindparam("held_token"))  # the lease still holds the item (``held_params``)


def held_params(lease: Lease) -> dict:
    """``HELD``'s parameters for ``lease``."""
    return {"held_job": lease.job_id, "held_idx": lease.index, "held_token": lease.token}


def _set(conn, keys: list[tuple[str, int]], **values) -> None:
    if keys:
        conn.execute(update(items).where(items.c.job_id == bindparam("j"), items.c.idx == bindparam("i"))
                     .values(**values), [dict(j=j, i=i) for j, i in keys])
