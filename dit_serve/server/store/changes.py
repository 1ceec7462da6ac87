"""Notifications of item changes, in this process and (on PostgreSQL) across processes."""

from __future__ import annotations

import threading

CHANNEL = "dit_serve_changes"  # PostgreSQL NOTIFY channel of Changes


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
