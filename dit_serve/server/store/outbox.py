"""The webhook outbox: a finished job's webhook is a row state (pending -> sending -> sent | failed)
claimed by a sender (``dit_serve.server.webhooks``) and recorded after each attempt."""

from __future__ import annotations

import time

from sqlalchemy import select, update

from dit_serve.server.store.base import StoreBase
from dit_serve.server.store.tables import items, jobs


class OutboxMixin(StoreBase):
    """Webhooks due, claimed for a while, and their delivery attempts."""

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
