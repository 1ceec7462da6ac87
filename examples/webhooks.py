"""Webhooks: be told when a job finishes instead of polling, and check that the service sent it.

    python examples/webhooks.py                                        # a local service just for this run
    python examples/webhooks.py --url http://HOST:8000 --listen 0.0.0.0:8099 --public-host MY_HOST \\
        --secret "$DIT_SERVE_WEBHOOK_SECRET"                           # the service's [webhooks] secret

A small HTTP receiver starts here; the job is submitted with ``webhook_url`` pointing at it (and a high
``priority``, so it runs ahead of batch work). When the job is done the service POSTs it here; with a
secret, the receiver recomputes ``X-Dit-Serve-Signature`` (HMAC-SHA256 of the raw body) and rejects a
delivery that does not match, which the service then retries.

A service refuses webhooks to loopback and private addresses unless its ``[webhooks] allow_hosts``
lists them, so a receiver on this machine or a private network needs, on the service side:

    [webhooks]
    allow_hosts = ["MY_HOST"]       # a name, an address, or a network such as "192.168.0.0/16"

The local service this script starts without ``--url`` allows its own receiver (``--public-host``).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import http.server
import json
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dit_serve.client import ApiError, Client


def receiver(listen: str, secret: str | None) -> tuple[http.server.ThreadingHTTPServer, queue.Queue]:
    """An HTTP server that puts each verified delivery's JSON on a queue (401 for a bad signature)."""
    host, port = listen.rsplit(":", 1)
    deliveries: queue.Queue = queue.Queue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if secret:
                want = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
                if not hmac.compare_digest(want, self.headers.get("X-Dit-Serve-Signature", "")):
                    self.send_response(401)
                    self.end_headers()
                    return
            deliveries.put(json.loads(body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer((host, int(port)), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, deliveries


@contextmanager
def service(url: str | None, receiver_host: str, secret: str | None) -> Iterator[str]:
    """``url``; or, without one, a local service for this run (this needs the server side: Ray, torch)
    that signs with ``secret`` and may deliver to ``receiver_host``."""
    if url:
        yield url
        return
    from dit_serve.server.config import Config
    from dit_serve.server.service import local_service

    config = Config().with_overrides(webhooks={"allow_hosts": (receiver_host,), "secret": secret})
    with local_service(config) as svc:
        yield svc.url


def run(url: str, out: Path, listen: str, public_host: str, secret: str | None, timeout: float = 300) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    server, deliveries = receiver(listen, secret)
    hook = f"http://{public_host}:{server.server_address[1]}/dit-serve"
    try:
        with Client(url) as client:
            try:
                job = client.submit(labels=[4, 2], num_per_label=2, seed=9, priority=50, webhook_url=hook)
            except ApiError as e:
                if e.param != "webhook_url":
                    raise
                raise SystemExit(f"the service refused the receiver {hook}: {e.message}\nTo try it on one machine, "
                                 f"list the receiver's host in the service's config and restart it:\n"
                                 f"    [webhooks]\n    allow_hosts = [\"{public_host}\"]\n"
                                 "or run this script without --url: it starts a local service that allows it") from None
            print(f"submitted job {job.id}; waiting for its webhook at {hook}")
            event = deliveries.get(timeout=timeout)  # no polling: the service calls us
            finished = event["job"]
            print(f"webhook: {event['event']} for job {finished['id']}: {finished['state']} "
                  f"({'signature checked' if secret else 'unsigned'})")
            paths = []
            for index, image in enumerate(client.images(finished["id"])):
                paths.append(out / f"webhook_{index:02d}.png")
                image.save(paths[-1])
            (out / "webhook_event.json").write_text(json.dumps(event, indent=1))
    finally:
        server.shutdown()
    print(f"wrote {len(paths)} PNGs and webhook_event.json to {out}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running service; default: start a local one for this run")
    p.add_argument("--out", type=Path, default=Path("out/webhooks"))
    p.add_argument("--listen", default="127.0.0.1:0", help="where the receiver listens (port 0: a free one)")
    p.add_argument("--public-host", default="127.0.0.1", help="the receiver's host as the service reaches it")
    p.add_argument("--secret", help="the service's [webhooks] secret: check each delivery's signature")
    args = p.parse_args()
    with service(args.url, args.public_host, args.secret) as url:
        run(url, args.out, args.listen, args.public_host, args.secret)


if __name__ == "__main__":
    main()
