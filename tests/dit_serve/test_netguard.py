"""Webhook destinations: which addresses are refused, what the allowlist lets through, and deliveries
that reach (or never reach) a receiver on 127.0.0.1. No network beyond loopback: names under .test
answer from a fake resolver, and public addresses are only ever checked, never connected to."""

from __future__ import annotations

import http.server
import shutil
import socket
import ssl
import subprocess
import threading

import httpx
import pytest

from dit_serve.server.config import WebhookConfig
from dit_serve.server.netguard import Allowlist, UnsafeDestination, check_url, check_webhook_url, forbidden, resolve_safe
from dit_serve.schemas import JobParams
from dit_serve.server.store import Store
from dit_serve.server.webhooks import Notifier

PARAMS = JobParams(sampler="ddim", steps=10, guidance=2.0)

REFUSED = [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("::ffff:127.0.0.1", "loopback"),
    ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"), ("fd00::1", "private"),
    ("100.64.0.1", "private"),  # shared address space (carrier-grade NAT)
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),  # the first: cloud metadata
    ("224.0.0.1", "multicast"), ("ff02::1", "multicast"),
    ("240.0.0.1", "reserved"),
    ("0.0.0.0", "unspecified"), ("0.1.2.3", "unspecified"), ("::", "unspecified"),
]


def _url(ip: str, scheme: str = "http") -> str:
    return f"{scheme}://[{ip}]:8080/hook" if ":" in ip else f"{scheme}://{ip}:8080/hook"


@pytest.mark.parametrize("ip, reason", REFUSED)
def test_each_internal_address_class_is_refused(ip, reason):
    assert forbidden(ip) == reason
    with pytest.raises(UnsafeDestination, match=rf"resolves to .*, a {reason} address: refused \(.*allow_hosts\)"):
        check_url(_url(ip), Allowlist())


@pytest.mark.parametrize("url", ["http://localhost/hook", "http://LOCALHOST./hook", "http://2130706433/hook",
                                 "http://127.1/hook", "http://0x7f.1/hook"])
def test_names_and_odd_spellings_of_loopback_are_refused(url):
    """'localhost' names are loopback (RFC 6761); the numeric spellings parse without a lookup."""
    with pytest.raises(UnsafeDestination, match="loopback address"):
        check_url(url, Allowlist())
    assert "loopback" in check_webhook_url(url, ())


@pytest.mark.parametrize("url", ["http://127.0.0.1.:8000/hook", "http://%31%32%37.0.0.1:8000/hook",
                                 "http://127.0.0.1%2e:80/hook", "http://%6c%6f%63%61%6c%68%6f%73%74/hook",
                                 "http://%2531%2532%2537.0.0.1/hook"])
def test_a_final_dot_or_percent_escapes_do_not_hide_loopback(url):
    """Spellings a resolver would not take as they are, read as the address they spell, at submission
    and at delivery alike (both read the host through host_of)."""
    assert "loopback" in check_webhook_url(url, ())
    with pytest.raises(UnsafeDestination, match="loopback"):
        resolve_safe(httpx.URL(url).raw_host.decode("ascii"), 80, Allowlist())


def test_a_host_that_is_not_a_name_or_an_address_is_refused():
    assert "is not a host name or an address" in check_webhook_url("http://a%20b/hook", ())


def test_localhost_is_refused_even_without_resolving():
    with pytest.raises(UnsafeDestination, match="loopback"):
        check_url("http://api.localhost/hook", Allowlist(), resolve=False)


@pytest.mark.parametrize("ip", ["93.184.216.34", "8.8.8.8", "2606:4700:4700::1111"])
def test_a_public_address_is_accepted(ip):
    assert forbidden(ip) is None
    check_url(_url(ip, "https"), Allowlist())  # a literal: parsed, not looked up
    assert check_webhook_url(_url(ip), ()) is None


def test_the_message_says_what_was_refused_and_how_to_allow_it():
    assert check_webhook_url("http://127.0.0.1:9/x", ()) == (
        "webhook_url http://127.0.0.1:9/x resolves to 127.0.0.1, a loopback address: refused "
        "(a deployment can allow internal receivers with [webhooks] allow_hosts)")
    assert "needs http:// or https://" in check_webhook_url("ftp://example.com/x", ())


@pytest.mark.parametrize("entries, url", [
    (["127.0.0.1"], "http://127.0.0.1:9/x"),
    (["10.0.0.0/8"], "http://10.1.2.3/x"),
    (["10.0.0.0/8"], "http://[::ffff:10.1.2.3]/x"),  # a mapped address is matched as its IPv4 one
    (["fd00::/8"], "http://[fd12::1]/x"),
    (["169.254.169.254"], "http://169.254.169.254/latest"),
    (["LocalHost"], "http://localhost./x"),  # names: any case, a trailing dot ignored
])
def test_the_allowlist_lets_its_destinations_through(entries, url):
    check_url(url, Allowlist.parse(entries))
    assert check_webhook_url(url, tuple(entries)) is None


def test_the_allowlist_lets_nothing_else_through():
    allow = Allowlist.parse(["10.0.0.0/8", "hooks.internal", "127.0.0.1"])
    for url in ["http://172.16.0.1/x", "http://192.168.0.1/x", "http://[::1]/x", "http://169.254.169.254/x"]:
        with pytest.raises(UnsafeDestination):
            check_url(url, allow)


@pytest.mark.parametrize("entry", ["http://hooks.internal", "hooks.internal:8080", "*.internal", "10.0.0.1/8",
                                   "10.0.0.0/33", "10.0.0.256", "", "a b"])
def test_a_malformed_allowlist_entry_is_an_error(entry):
    with pytest.raises(ValueError, match="allow_hosts"):
        Allowlist.parse([entry])


class FakeDNS:
    """getaddrinfo for names under .test: each name answers its address lists in turn, the last one for
    every later lookup; any other host goes to the real resolver. Records each .test lookup."""

    def __init__(self, real):
        self.real, self.answers, self.lookups = real, {}, []

    def __call__(self, host, port, *args, **kwargs):
        if not str(host).endswith(".test"):
            return self.real(host, port, *args, **kwargs)
        self.lookups.append(host)
        queue = self.answers.get(host)
        if not queue:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        ips = queue.pop(0) if len(queue) > 1 else queue[0]
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port or 0))
                for ip in ips]


@pytest.fixture
def dns(monkeypatch) -> FakeDNS:
    fake = FakeDNS(socket.getaddrinfo)
    monkeypatch.setattr(socket, "getaddrinfo", fake)
    return fake


def test_a_name_is_refused_if_any_of_its_addresses_is(dns):
    dns.answers["mixed.test"] = [["93.184.216.34", "10.0.0.7"]]
    with pytest.raises(UnsafeDestination, match="mixed.test resolves to 10.0.0.7, a private address"):
        resolve_safe("mixed.test", 443, Allowlist())
    assert "10.0.0.7" in check_webhook_url("https://mixed.test/x", ())
    assert resolve_safe("mixed.test", 443, Allowlist.parse(["10.0.0.7"])) == ["93.184.216.34", "10.0.0.7"]


def test_a_name_that_does_not_resolve_is_accepted_at_submission_and_fails_at_delivery(dns):
    assert check_webhook_url("https://later.test/hook", ()) is None
    with pytest.raises(OSError):
        resolve_safe("later.test", 443, Allowlist())


# -- deliveries ------------------------------------------------------------------------------------

class Receiver:
    """A webhook receiver on 127.0.0.1 (https with ``tls``): records each POST's path and headers, and
    the TLS server name the client asked for; answers ``status``."""

    def __init__(self, status: int = 204, tls: ssl.SSLContext | None = None):
        self.posts: list[dict] = []
        self.server_names: list[str | None] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                receiver.posts.append(dict(self.headers))
                self.send_response(status)
                if status in (301, 302, 307, 308):
                    self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        if tls is not None:
            tls.sni_callback = lambda sock, name, ctx: self.server_names.append(name)
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def url(self, host: str = "127.0.0.1", scheme: str = "http") -> str:
        return f"{scheme}://{host}:{self.port}/hook"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def store(tmp_path):
    s = Store(f"sqlite:///{tmp_path / 'jobs.db'}", tmp_path)
    yield s
    s.close()


def _finished_job(store: Store, webhook_url: str) -> str:
    """A job whose webhook is due: cancelling it before it runs finishes it."""
    job_id = store.create_job("digits", PARAMS, [3], [7], webhook_url=webhook_url)
    assert store.cancel_job(job_id)
    return job_id


def _notifier(store: Store, **webhooks) -> Notifier:
    return Notifier(store, WebhookConfig(max_attempts=3, backoff_s=0.01, timeout_s=5.0, **webhooks))


def test_a_loopback_receiver_is_refused_before_any_request(store, receiver):
    job_id = _finished_job(store, receiver.url())
    assert _notifier(store).deliver_due() == 1
    hook = store.get_job(job_id).webhook
    assert (hook.state, hook.attempts) == ("failed", 1)  # at once: no retries for a refused destination
    assert "127.0.0.1, a loopback address: refused" in hook.error and "allow_hosts" in hook.error
    assert receiver.posts == []


def test_an_allowed_loopback_receiver_gets_the_delivery(store, receiver):
    job_id = _finished_job(store, receiver.url())
    assert _notifier(store, allow_hosts=("127.0.0.1",)).deliver_due() == 1
    hook = store.get_job(job_id).webhook
    assert (hook.state, hook.attempts, hook.error) == ("sent", 1, None)
    assert len(receiver.posts) == 1 and receiver.posts[0]["Host"] == f"127.0.0.1:{receiver.port}"


def test_a_redirect_is_a_failed_attempt_and_not_followed(store):
    receiver = Receiver(status=302)  # to the metadata address: following it would be the forgery
    try:
        job_id = _finished_job(store, receiver.url())
        _notifier(store, allow_hosts=("127.0.0.1",)).deliver_due()
        hook = store.get_job(job_id).webhook
        assert (hook.state, hook.attempts) == ("pending", 1) and hook.error.startswith("HTTP 302")
        assert len(receiver.posts) == 1
    finally:
        receiver.close()


def test_the_request_goes_to_the_address_that_was_checked(store, receiver, dns):
    """DNS rebinding: the first answer (checked, allowed by name) is 127.0.0.1; any later lookup would
    answer 127.0.0.2, where nothing listens. The delivery arrives, so it used the checked address, and
    the name was looked up once."""
    dns.answers["receiver.test"] = [["127.0.0.1"], ["127.0.0.2"]]
    job_id = _finished_job(store, receiver.url("receiver.test"))
    _notifier(store, allow_hosts=("receiver.test",)).deliver_due()
    assert store.get_job(job_id).webhook.state == "sent"
    assert dns.lookups == ["receiver.test"]
    assert receiver.posts[0]["Host"] == f"receiver.test:{receiver.port}"


def test_a_name_that_rebinds_to_a_refused_address_is_refused_at_delivery(store, receiver, dns):
    """Accepted at submission while public, refused when the delivery finds it internal."""
    dns.answers["moving.test"] = [["93.184.216.34"], ["127.0.0.1"]]
    assert check_webhook_url(receiver.url("moving.test"), ()) is None
    job_id = _finished_job(store, receiver.url("moving.test"))
    _notifier(store).deliver_due()
    hook = store.get_job(job_id).webhook
    assert hook.state == "failed" and "moving.test resolves to 127.0.0.1, a loopback address" in hook.error
    assert receiver.posts == []


def test_a_name_that_does_not_resolve_is_retried(store, dns):
    job_id = _finished_job(store, "https://later.test/hook")
    _notifier(store).deliver_due()
    hook = store.get_job(job_id).webhook
    assert (hook.state, hook.attempts) == ("pending", 1) and hook.error.startswith("cannot resolve later.test")


@pytest.fixture
def certificate(tmp_path):
    """A self-signed certificate for receiver.test (openssl's command line): (cert, key) paths."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=receiver.test",
                    "-addext", "subjectAltName=DNS:receiver.test"], check=True, capture_output=True)
    return cert, key


def test_https_to_the_checked_address_verifies_the_certificate_for_the_name(store, dns, certificate,
                                                                           monkeypatch):
    """The connection goes to 127.0.0.1, yet TLS asks for receiver.test (SNI) and verifies the
    certificate against it: receiver.test is delivered; impostor.test, also 127.0.0.1, fails."""
    cert, key = certificate
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the notifier's client trusts only this certificate
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    receiver = Receiver(tls=tls)
    dns.answers["receiver.test"] = dns.answers["impostor.test"] = [["127.0.0.1"]]
    try:
        good = _finished_job(store, receiver.url("receiver.test", "https"))
        bad = _finished_job(store, receiver.url("impostor.test", "https"))
        _notifier(store, allow_hosts=("receiver.test", "impostor.test")).deliver_due()
        assert store.get_job(good).webhook.state == "sent"
        hook = store.get_job(bad).webhook
        assert hook.state == "pending" and "CERTIFICATE_VERIFY_FAILED" in hook.error, hook.error
        assert len(receiver.posts) == 1 and receiver.posts[0]["Host"] == f"receiver.test:{receiver.port}"
        assert "receiver.test" in receiver.server_names
    finally:
        receiver.close()
