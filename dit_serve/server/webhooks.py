"""Webhook delivery: a job submitted with ``webhook_url`` is POSTed there, as JSON, once it is done,
failed or cancelled.

    POST <webhook_url>
    Content-Type: application/json
    X-Dit-Serve-Event: job.finished
    X-Dit-Serve-Delivery: <unique per attempt>
    X-Dit-Serve-Signature: sha256=<hex HMAC-SHA256 of the body>   (when [webhooks] secret is set)

    {"event": "job.finished", "job": <the job, as GET /v1/jobs/{id} returns it>}

Delivery is at least once: a job is claimed in the store for one attempt; any 2xx answer marks it
sent; anything else (an error status, a redirect, a timeout, a refused connection, a name that does
not resolve) is retried with exponential backoff, up to ``max_attempts``, then marked failed with the
reason. Redirects are never followed: a 3xx is a failed attempt, since following one would go to a
destination nobody checked. The claim expires, so a scheduler that dies mid-delivery loses nothing.
Receivers should deduplicate on the job id. The state is on the job (``webhook``: state, attempts,
last error).

Each attempt resolves the destination and checks every address (``netguard.resolve_safe``: no
loopback, private, link-local... unless ``[webhooks] allow_hosts`` lists it). A refused destination
fails the webhook at once, without retries. The request then goes to a checked address, not to the
name, so DNS that changes its answer after the check (rebinding) cannot redirect it; the name is kept
in the Host header and, for https, as the TLS server name (SNI), against which the certificate is
verified.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import uuid

import httpx

from dit_serve.server.config import WebhookConfig
from dit_serve.server.netguard import Allowlist, UnsafeDestination, parse_url, resolve_safe
from dit_serve.server.store import Store

log = logging.getLogger(__name__)


def sign(secret: str, body: bytes) -> str:
    """The signature header's value: receivers recompute it over the raw body and compare."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class Notifier:
    """Delivers due webhooks from a thread of its own, so a slow receiver never holds up scheduling."""

    def __init__(self, store: Store, config: WebhookConfig, interval_s: float = 0.5):
        self.store, self.cfg, self.interval_s = store, config, interval_s
        self.allow = Allowlist.parse(config.allow_hosts)
        # A transport of its own: no proxy from the environment (it would resolve the name again, out
        # of reach of the check), and no kept-alive connections (a pool keys them by address, so one
        # host's verified TLS connection could carry another host's delivery to the same address).
        transport = httpx.HTTPTransport(limits=httpx.Limits(max_keepalive_connections=0))
        self._http = httpx.Client(transport=transport, timeout=config.timeout_s, follow_redirects=False)

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
            attempt = attempts + 1
            retry = None if attempt >= self.cfg.max_attempts else min(self.cfg.backoff_s * 2 ** (attempt - 1), 600.0)
            try:
                error = self._post(job_id, url)
            except UnsafeDestination as e:  # refused: no retry would change that
                error, retry = str(e)[:500], None
            self.store.webhook_done(job_id, error, retry)
            if error is not None:
                log.warning("webhook for job %s to %s failed (attempt %d/%d): %s", job_id, url, attempt,
                            self.cfg.max_attempts, error)
        return len(claimed)

    def _post(self, job_id: str, url: str) -> str | None:
        """Send once; None on a 2xx answer, else the reason. UnsafeDestination for a refused one."""
        job = self.store.get_job(job_id)
        if job is None:  # deleted meanwhile: nothing to tell
            return None
        target = parse_url(url)
        body = json.dumps({"event": "job.finished", "job": job.model_dump(mode="json")}).encode()
        headers = {"Content-Type": "application/json", "X-Dit-Serve-Event": "job.finished",
                   "X-Dit-Serve-Delivery": uuid.uuid4().hex, "User-Agent": "dit-serve-webhooks"}
        if self.cfg.secret is not None and self.cfg.secret.get_secret_value():
            headers["X-Dit-Serve-Signature"] = sign(self.cfg.secret.get_secret_value(), body)
        try:
            r = self._send(target, body, headers)
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}"[:500]
        except OSError as e:  # the name did not resolve (socket.gaierror)
            return f"cannot resolve {target.host}: {e}"[:500]
        if r.is_redirect:
            return f"HTTP {r.status_code}: redirects are not followed; use the final URL as webhook_url"
        return None if r.is_success else f"HTTP {r.status_code}"

    def _send(self, url: httpx.URL, body: bytes, headers: dict[str, str]) -> httpx.Response:
        """POST to the addresses ``resolve_safe`` checked, in order, until one accepts the connection
        (a connect error means nothing was sent). httpcore's ``sni_hostname`` extension becomes the
        ``server_hostname`` of the TLS handshake: sent as SNI, and what ``ssl`` verifies the
        certificate against (``check_hostname``), so https keeps checking the URL's name, not the IP."""
        addresses = resolve_safe(url.raw_host.decode("ascii"), url.port, self.allow)
        for ip in addresses[:-1]:
            try:
                return self._http.send(self._request(url, ip, body, headers))
            except httpx.ConnectError:
                pass
        return self._http.send(self._request(url, addresses[-1], body, headers))

    def _request(self, url: httpx.URL, ip: str, body: bytes, headers: dict[str, str]) -> httpx.Request:
        extensions = {"sni_hostname": url.raw_host.decode("ascii")} if url.scheme == "https" else {}
        request = self._http.build_request("POST", url, content=body, headers=headers, extensions=extensions)
        request.url = url.copy_with(host=ip)  # the Host header was set from the name above, and stays
        return request
