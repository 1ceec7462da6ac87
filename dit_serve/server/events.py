"""Server-Sent Events of one job, ``GET /v1/jobs/{id}/events`` (the route is in ``dit_serve.server.routes.jobs``).

The stream (``text/event-stream``), in order::

    retry: 1000                          reconnect delay asked of EventSource clients (ms)

    event: progress                      state, counts, running items, steps done / total
    id: 0.1
    data: {"event":"progress","state":"running","counts":{"running":2},"running":2,...}

    event: item                          an item ended: index, state, url (done), error (failed)
    id: 1.2.1520413.0
    data: {"event":"item","index":0,"state":"done","url":"/v1/jobs/<id>/images/0",...}

    event: preview                       a running item has a new preview (jobs with preview_every)
    id: 1.3.1520413.0
    data: {"event":"preview","index":1,"step":4,"url":"/v1/jobs/<id>/items/1/preview"}

    event: end                           the job ended: state, counts, steps; the stream closes
    id: 1.3.1520413.0
    data: {"event":"end","state":"done",...}

    : keep-alive                         a comment when nothing was sent for ``keepalive_s``

**Ids** are ``<items>.<seq>`` until the first item event, then ``<items>.<seq>.<t>.<index>``: ``items``
item events sent, ``seq`` events sent (it grows by one per event, so ids increase), and the *cursor*
``(t, index)``: the latest-ending item sent (in the order in which items end), ``t`` being its ``finished_at`` in
microseconds after the job's ``created_at``, ties broken by index. A reconnect with ``Last-Event-ID``
gets the current progress, then every item that ended after the cursor (the ones it missed, none that
it had), then live events; its ids go on from the one it sent.

Why a cursor and not a count of items seen: an item retried after failing leaves the ended set and ends
again later, and a count would then skip an item. Its new ending lies after the cursor, so it is sent
again, as what it is: a new ending. What the cursor assumes: endings are stamped in the order they
commit. The store stamps them inside the writing transaction (on SQLite under the database's single
write lock), so it holds there and with one scheduler. With several schedulers on PostgreSQL, two endings
of one job committed at the same moment may be stamped out of order: a live stream still sends both (each
read looks ``slack_s`` back before the cursor and remembers what it sent); a reconnect that falls between
the two could miss the earlier-stamped one. The end event's counts and ``GET /v1/jobs/{id}`` stay
authoritative.

**Previews** are ephemeral: a ``preview`` event is sent when a running item's latest preview
(``Store.preview_steps``: a listing of the job's preview files, then which items run) has a later step
than the last one this connection sent for it. Each takes an id like any non-item event (``seq`` grows,
the cursor stays), so a ``Last-Event-ID`` after a preview resumes exactly as after a progress event;
a reconnect gets each running item's latest preview again, not the ones it missed. The read takes
previews after the ended items, of running items only, so an item's previews come before its item event.
An item event resets what was sent for that index (an item retried after failing starts again at step 0).

**Wake-ups.** A stream reads the store when ``Store.changes`` says the job changed (a lease, progress
written by a heartbeat, an ending), at most one read per ``min_read_gap_s`` on average, in bursts of
up to ``read_burst`` (a batch of commits is one read, and a single image's ending right after the read
of its lease is not held back), and at least every ``poll_s`` (in case a notification is lost; with PostgreSQL, notifications cross
processes by LISTEN/NOTIFY). Progress is
sent when it changed, at most every ``progress_interval_s``: a change inside that time goes out at its
end, as the latest state. Items and the end go out at the read that finds them. A read queries, in
this order, the job's counts, then its ended items (for a job of up to ``END_EVENT_ITEMS`` items: all its
items, with when each ended, in the same read); counts that say the job ended therefore come with all its
ended items, so no item event follows the end event. A client that hangs up cancels the
response (Starlette listens for the disconnect), which ends the generator at its await; its ``finally``
stops watching the job, and the response gives its stream slot back.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable, NamedTuple

from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from dit_serve.schemas import EndEvent, ItemEvent, Job, PreviewEvent, ProgressEvent

log = logging.getLogger(__name__)
END_EVENT_ITEMS = 100  # the end event of a job of up to this many items carries the job and its items, so a
                       # client's wait returns without another request (a single image: a few ms sooner)
_ID = re.compile(r"^(\d{1,12})\.(\d{1,15})(?:\.(-?\d{1,18})\.(\d{1,9}))?$")


class _Ended(NamedTuple):
    """An ended item as the stream needs it (the columns of ``Store.finished_items``)."""

    idx: int
    state: str
    error: str | None
    finished_at: float


@dataclass(frozen=True)
class StreamLimits:
    """Bounds and pacing of event streams; the bounds are per API process."""

    max_streams: int = 256        # open streams; one more is a 429 (each costs reads, at most 1/min_read_gap_s)
    tenant_max_streams: int = 64  # ... of one tenant
    retry_after_s: int = 10
    keepalive_s: float = 15.0
    progress_interval_s: float = 0.25
    poll_s: float = 1.0
    min_read_gap_s: float = 0.05  # reads of one stream: at most one per this on average ...
    read_burst: int = 3           # ... in bursts of this many (an ending just after a lease's read goes out at once)
    slack_s: float = 2.0
    retry_ms: int = 1000
    inline_reads: int = 4         # streams open at most, for a small job's reads to run on the event loop


@dataclass(frozen=True)
class Cursor:
    """What a client was sent: ``items`` item events, ``seq`` events, and the last item ``key``."""

    items: int = 0
    seq: int = 0
    key: tuple[int, int] | None = None  # (microseconds after created_at, index)

    def __str__(self) -> str:
        return f"{self.items}.{self.seq}" + ("" if self.key is None else f".{self.key[0]}.{self.key[1]}")

    @classmethod
    def parse(cls, text: str | None) -> "Cursor":
        """The cursor of a ``Last-Event-ID`` (none: a new stream); ValueError for one this service never sent."""
        if text is None or not text.strip():
            return cls()
        m = _ID.match(text.strip())
        if m is None:
            raise ValueError(f"Last-Event-ID {text[:40]!r} is not an id of this stream (e.g. '3.17.1520413.2'); "
                             "send the id of the last event received, or none")
        key = None if m[3] is None else (int(m[3]), int(m[4]))
        return cls(int(m[1]), int(m[2]), key)

    def next(self, key: tuple[int, int] | None = None) -> "Cursor":
        """The cursor after one more event; ``key`` for an item event."""
        if key is None:
            return replace(self, seq=self.seq + 1)
        return Cursor(self.items + 1, self.seq + 1, key if self.key is None else max(self.key, key))


class Streams:
    """The open event streams of this process, bounded overall and per tenant. Counted from the event
    loop's thread only (the route and the response are async), so the counts need no lock.

    ``close()`` ends every open stream within ``poll_s`` (without an end event: clients resume with
    ``Last-Event-ID``, elsewhere or later). The HTTP server's graceful shutdown waits for open responses,
    so whoever stops the server should call it first."""

    def __init__(self, limits: StreamLimits):
        self.limits, self.open, self.per_tenant = limits, 0, Counter()
        self.closing = threading.Event()

    def close(self) -> None:
        self.closing.set()

    def acquire(self, tenant: str) -> str | None:
        """Take a slot for ``tenant``; None when taken, else why not."""
        if self.open >= self.limits.max_streams:
            return f"this service has {self.open} event streams open, its most; poll GET /v1/jobs/{{id}} instead"
        if self.per_tenant[tenant] >= self.limits.tenant_max_streams:
            return (f"your tenant has {self.per_tenant[tenant]} event streams open, its most; close one or poll "
                    "GET /v1/jobs/{id} instead")
        self.open += 1
        self.per_tenant[tenant] += 1
        return None

    def reads_inline(self, store, opening: bool = False) -> bool:
        """Whether a small job's reads run on the event loop rather than in the thread pool: a read from a
        local SQLite file takes a fraction of a millisecond, less than the two thread hops around it (on an
        image's path: its ending reaches the client that much sooner), and with few streams open (the
        reader's among them; ``opening``: not acquired yet) the loop has nothing else to serve. Many streams
        or a database server: the thread pool."""
        return store.local_reads and self.open + opening <= self.limits.inline_reads

    def release(self, tenant: str) -> None:
        self.open -= 1
        self.per_tenant[tenant] -= 1
        if not self.per_tenant[tenant]:
            del self.per_tenant[tenant]


class EventResponse(StreamingResponse):
    """``text/event-stream`` that calls ``release`` however it ends: finished, the client gone, or never
    started (a generator that never ran has no ``finally`` to run)."""

    def __init__(self, content: AsyncIterator[str], release: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # no proxy buffering
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


class JobEvents:
    """One connection's stream of one job's events (the module docstring is its contract)."""

    def __init__(self, store, job: Job, cursor: Cursor, streams: Streams, changed: asyncio.Event | None = None):
        """``job``: as read when the stream was asked for; with its items, it is the first read (the
        route then watches the job, ``changed``, from before that read, so no change after it is missed)."""
        self.store, self.job_id, self.created_at, self.num_items = store, job.id, job.created_at, job.num_items
        self.first = job if changed is not None and job.items is not None else None
        self.changed = changed
        self.streams, self.limits = streams, streams.limits
        self.cursor, self.since = cursor, cursor.key  # items at or before ``since``: sent on an earlier connection
        self.sent: set[tuple[int, int]] = set()       # item keys sent on this connection
        self.previewed: dict[int, int] = {}            # index -> the step of the last preview sent
        self.shown: ProgressEvent | None = None       # the last progress sent ...
        self.shown_at = -1e9                          # ... then (monotonic s)
        self.pending = False                          # a change not sent yet: it was too soon
        self.sent_at = time.monotonic()               # the last bytes sent (for the keep-alive)
        self.credit, self.credit_at = float(self.limits.read_burst), self.sent_at  # reads allowed now (a bucket)

    async def stream(self) -> AsyncIterator[str]:
        changed = self.changed or self.store.changes.watch(self.job_id)
        try:
            yield f"retry: {self.limits.retry_ms}\n\n"
            while not self.streams.closing.is_set():
                await self._pace()
                read_at = time.monotonic()
                try:
                    if self.first is not None:  # read by the route, watched since before: no read now, and
                        job, self.first = self.first, None  # ``changed`` kept: it is set if the job changed since
                        job, rows, previews = self._of(job)
                    else:
                        changed.clear()
                        if self._inline():
                            job, rows, previews = self._read()
                        else:
                            job, rows, previews = await run_in_threadpool(self._read)
                except Exception:  # the store is unreachable: end; the client reconnects with its last id
                    log.warning("event stream of job %s: reading the store failed", self.job_id, exc_info=True)
                    return
                out = self._items(rows)
                if job is None or job.finished:
                    yield "".join(out) + self._end(job)
                    return
                if out := out + self._previews(previews) + self._progress(job, read_at):
                    yield self._sending("".join(out))
                await _wait(changed, self._timeout())
                if time.monotonic() - self.sent_at >= self.limits.keepalive_s:
                    yield self._sending(": keep-alive\n\n")
        finally:
            self.store.changes.unwatch(self.job_id, changed)

    def _inline(self) -> bool:
        """Read on the event loop (``Streams.reads_inline``), for a small job only."""
        return self.num_items <= END_EVENT_ITEMS and self.streams.reads_inline(self.store)

    async def _pace(self) -> None:
        """Take one read from the bucket (``read_burst`` deep, refilled one per ``min_read_gap_s``), waiting
        for it when empty: a job whose items end every few milliseconds costs its stream a bounded read rate."""
        gap, now = self.limits.min_read_gap_s, time.monotonic()
        self.credit = min(float(self.limits.read_burst), self.credit + (now - self.credit_at) / gap)
        self.credit_at = now
        if self.credit < 1.0:
            await asyncio.sleep((1.0 - self.credit) * gap)
            self.credit, self.credit_at = 1.0, time.monotonic()
        self.credit -= 1.0

    def _progress(self, job: Job, now: float) -> list[str]:
        """The progress event when the job's progress changed and the last one is old enough; else none
        (``pending``: the next read that is late enough sends the state then)."""
        snap = ProgressEvent(state=job.state, counts=job.counts, running=job.counts.get("running", 0),
                             steps_done=job.steps_done, steps_total=job.steps_total)
        self.pending = snap != self.shown
        if not self.pending or now - self.shown_at < self.limits.progress_interval_s:
            return []
        self.shown, self.shown_at, self.pending = snap, now, False
        return [self._event("progress", snap)]

    def _timeout(self) -> float:
        """Until the next read without a notification: the slow poll, a pending progress, the keep-alive."""
        now, lim = time.monotonic(), self.limits
        due = [lim.poll_s, self.sent_at + lim.keepalive_s - now]
        if self.pending:
            due.append(self.shown_at + lim.progress_interval_s - now)
        return max(0.0, min(due))

    def _sending(self, text: str) -> str:
        self.sent_at = time.monotonic()
        return text

    def _read(self) -> tuple[Job | None, list, dict[int, int]]:
        """The job's counts, then its ended items, then its running items' previews (in this order: see
        the module docstring). A job of up to END_EVENT_ITEMS items is read with its items, in one read:
        their endings are the ended items, and the end event carries the job whole."""
        job = self.store.get_job(self.job_id, items_up_to=END_EVENT_ITEMS)
        return (None, [], {}) if job is None else self._of(job)

    def _since(self) -> float | None:
        """Endings at or after this were not sent on an earlier connection (with ``slack_s`` of doubt)."""
        key = self.cursor.key
        return None if key is None else self.created_at + key[0] / 1e6 - self.limits.slack_s

    def _of(self, job: Job) -> tuple[Job, list, dict[int, int]]:
        """``_read``'s answer from the job as read: its ended items (from its items when it has them), then
        its running items' previews."""
        since = self._since()
        if job.items is None:
            rows = self.store.finished_items(self.job_id, since)
        else:
            rows = [_Ended(it.index, it.state, it.error, it.finished_at) for it in job.items
                    if it.finished_at is not None and (since is None or it.finished_at >= since)]
        return job, rows, ({} if job.finished else self.store.preview_steps(self.job_id))

    def _previews(self, latest: dict[int, int]) -> list[str]:
        """Events of the previews newer than the last sent of each item, by index."""
        out = []
        for index, step in sorted(latest.items()):
            if step > self.previewed.get(index, 0):
                self.previewed[index] = step
                out.append(self._event("preview", PreviewEvent(
                    index=index, step=step, url=f"/v1/jobs/{self.job_id}/items/{index}/preview")))
        return out

    def _items(self, rows) -> list[str]:
        """Events of the ended items not sent yet, in the order they ended."""
        keyed = sorted(((self._key(r.finished_at), r.idx), r) for r in rows)
        out = []
        for key, r in keyed:
            if (self.since is not None and key <= self.since) or key in self.sent:
                continue
            self.sent.add(key)
            self.previewed.pop(r.idx, None)
            self.cursor = self.cursor.next(key)
            out.append(self._format("item", ItemEvent(
                index=r.idx, state=r.state, error=r.error, finished_at=r.finished_at or self.created_at,
                url=f"/v1/jobs/{self.job_id}/images/{r.idx}" if r.state == "done" else None)))
        return out

    def _key(self, finished_at: float | None) -> int:
        return round(((finished_at or self.created_at) - self.created_at) * 1e6)

    def _end(self, job: Job | None) -> str:
        if job is None:  # purged while streamed
            return self._event("end", EndEvent(state="deleted"))
        return self._event("end", EndEvent(state=job.state, counts=job.counts, steps_done=job.steps_done,
                                           steps_total=job.steps_total, finished_at=job.finished_at,
                                           job=job if job.items is not None else None))

    def _event(self, name: str, data) -> str:
        self.cursor = self.cursor.next()
        return self._format(name, data)

    def _format(self, name: str, data) -> str:
        return f"event: {name}\nid: {self.cursor}\ndata: {data.model_dump_json()}\n\n"


async def _wait(event: asyncio.Event, timeout: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        pass
