"""Webhook delivery: a job submitted with ``webhook_url`` is POSTed there, as JSON, once it is done,
failed or cancelled.

    POST <webhook_url>
    Content-Type: application/json
    X-Dit-Serve-Event: job.finished
    X-Dit-Serve-Delivery: <unique per attempt>
    X-Dit-Serve-Signature: sha256=<hex HMAC-SHA256 of the body>   (when [webhooks] secret is set)

    {"event": "job.finished", "job": <the job, as GET /v1/jobs/{id} returns it>}

Delivery is at least once: a job is claimed in the store for one attempt; any 2xx answer marks it
sent; anything else (an error status, a timeout, a refused connection) is retried with exponential
backoff, up to ``max_attempts``, then marked failed with the reason. The claim expires, so a
scheduler that dies mid-delivery loses nothing. Receivers should deduplicate on the job id.
The state is on the job (``webhook``: state, attempts, last error).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import uuid

import httpx

from dit_serve.config import WebhookConfig
from dit_serve.store import Store

log = logging.getLogger(__name__)


def sign(secret: str, body: bytes) -> str:
    """The signature header's value: receivers recompute it over the raw body and compare."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class Notifier:
    """Delivers due webhooks from a thread of its own, so a slow receiver never holds up scheduling."""

    def __init__(self, store: Store, config: WebhookConfig, interval_s: float = 0.5):
        self.store, self.cfg, self.interval_s = store, config, interval_s
        self._http = httpx.Client(timeout=config.timeout_s, follow_redirects=False)

    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    self.deliver_due()
                except Exception:  # a store hiccup must not end delivery
                    log.exception("webhook delivery round failed; retrying")
                stop.wait(self.interval_s)
        finally:
            self._http.close()

    def deliver_due(self) -> int:
        """One round: claim the due webhooks and try each once; returns how many were tried."""
        claimed = self.store.claim_webhooks(hold_s=self.cfg.timeout_s + 30)
        for job_id, url, attempts in claimed:
            error = self._post(job_id, url)
            attempt = attempts + 1
            retry = None if attempt >= self.cfg.max_attempts else min(self.cfg.backoff_s * 2 ** (attempt - 1), 600.0)
            self.store.webhook_done(job_id, error, retry)
            if error is not None:
                log.warning("webhook for job %s to %s failed (attempt %d/%d): %s", job_id, url, attempt,
                            self.cfg.max_attempts, error)
        return len(claimed)

    def _post(self, job_id: str, url: str) -> str | None:
        """Send once; None on a 2xx answer, else the reason."""
        job = self.store.get_job(job_id)
        if job is None:  # deleted meanwhile: nothing to tell
            return None
        body = json.dumps({"event": "job.finished", "job": job.model_dump(mode="json")}).encode()
        headers = {"Content-Type": "application/json", "X-Dit-Serve-Event": "job.finished",
                   "X-Dit-Serve-Delivery": uuid.uuid4().hex, "User-Agent": "dit-serve-webhooks"}
        if self.cfg.secret is not None and self.cfg.secret.get_secret_value():
            headers["X-Dit-Serve-Signature"] = sign(self.cfg.secret.get_secret_value(), body)
        try:
            r = self._http.post(url, content=body, headers=headers)
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}"[:500]
        return None if r.is_success else f"HTTP {r.status_code}"
