"""Admission: the one place a submission (``POST /v1/jobs`` or the OpenAI endpoint) is checked against
its caller's limits and committed to the store. A full queue is a 429 whose Retry-After is paced by
how fast the service has been finishing items (``Pace``)."""

from __future__ import annotations

import math
import time

from dit_serve.schemas import Job
from dit_serve.server.catalog import NewJob, RequestError
from dit_serve.server.config import LimitsConfig
from dit_serve.server.keys import Principal
from dit_serve.server.metrics import Metrics
from dit_serve.server.netguard import check_webhook_url
from dit_serve.server.store import IdempotencyConflict, QueueFull, Store


class Pace:
    """Retry-After for a full queue: how long the service needs to finish as many items as a rejected
    job has, at the rate it finished items in the last minute (read at most every 5 s), within 1-300 s."""

    def __init__(self, store: Store):
        self.store, self._rate, self._read = store, 0.0, -1e9

    def retry_after(self, n: int) -> int:
        now = time.monotonic()
        if now - self._read > 5.0:
            self._rate, self._read = self.store.recent_rate(), now
        return 30 if self._rate <= 0 else max(1, min(300, math.ceil(n / self._rate)))


class Admission:
    """Checks a caller's limits (webhook host, priority, queued items) and stores its job."""

    def __init__(self, store: Store, limits: LimitsConfig, metrics: Metrics, allow_hosts: tuple[str, ...]):
        self.store, self.limits, self.metrics, self.allow_hosts = store, limits, metrics, allow_hosts
        self.pace = Pace(store)

    def submit(self, new: NewJob, who: Principal, idempotency_key: str | None = None) -> tuple[str, bool, Job | None]:
        """(job id, created, the new job as stored): not created, and no job, when ``idempotency_key``
        names an earlier submission."""
        if new.webhook_url is not None and (why := check_webhook_url(new.webhook_url, self.allow_hosts)) is not None:
            raise RequestError(why, "webhook_url")
        limits = self.limits
        top = limits.tenant_max_priority if who.max_priority is None else who.max_priority
        if not who.admin and new.priority > top:
            raise RequestError(f"priority {new.priority} is above your tenant's highest, {top}", "priority",
                               status=403)
        tenant_bound = None if who.admin else (who.max_queued or limits.tenant_max_queued_items)
        try:
            return self.store.submit(new.model, new.params, new.labels, new.seeds, idempotency_key, new.priority,
                                     new.webhook_url, tenant=who.tenant, max_active=limits.max_queued_items,
                                     tenant_max_active=tenant_bound, prompts=new.prompts, view=True,
                                     reserve=limits.reserved_items, inputs=new.inputs)
        except IdempotencyConflict as e:
            raise RequestError(str(e), "Idempotency-Key", status=409) from None
        except QueueFull as e:
            if e.never:
                raise RequestError(str(e), "labels") from None
            self.metrics.rejected.inc()
            raise RequestError(str(e), status=429, retry_after=self.pace.retry_after(len(new.labels))) from None
