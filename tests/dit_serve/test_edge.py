"""Hostile input at the HTTP edge, in an API-only service: numbers that JSON cannot carry, integers
past SQLite's range, huge strings, HTTP conformance (405 + Allow, the statuses in the schema, models
by id), the queue bound (429 + Retry-After, nothing stored) and the SDK honouring it."""

from __future__ import annotations

import httpx
import pytest

from dit_serve.server.service import Service

from .conftest import service_config


@pytest.fixture(scope="module")
def api(digits_model, tmp_path_factory):
    cfg = service_config(tmp_path_factory.mktemp("edge"), digits_model,
                         limits={"max_items_per_job": 50, "max_queued_items": 60, "reserve_fraction": 0})
    with Service(cfg, roles=("api",)) as svc:
        with httpx.Client(base_url=svc.url, timeout=10) as http:
            yield svc, http


def _total(http) -> int:
    r = http.get("/v1/jobs")
    assert r.status_code == 200, r.text  # listing always works
    return r.json()["total"]


@pytest.mark.parametrize("raw, param", [
    (b'{"labels": [5], "guidance": Infinity}', "guidance"),  # Python reads these non-JSON literals
    (b'{"labels": [5], "guidance": NaN}', "guidance"),
    (b'{"labels": [5], "guidance": 1e999}', "guidance"),  # parses as inf
    (b'{"labels": [5], "guidance": -1e999}', "guidance"),
    (b'{"labels": [5], "eta": 1e999}', "eta"),
    (b'{"labels": [5], "guidance": 100.5}', "guidance"),
    (b'{"labels": [5], "steps": 100000000000000000000000}', "steps"),
    (b'{"labels": [99999999999999999999]}', "labels.0"),
    (b'{"labels": [5], "num_per_label": 9223372036854775808}', "num_per_label"),
    (b'{"labels": [5], "seeds": []}', "seeds"),
    (b'{"labels": [5], "seeds": [-1]}', "seeds.0"),
])
def test_numbers_are_finite_and_bounded_and_store_nothing(api, raw, param):
    svc, http = api
    before = _total(http)
    r = http.post("/v1/jobs", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert _total(http) == before
    r = http.post("/v1/images/generations", content=raw.replace(b'"labels": [5]', b'"prompt": "5"'),
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and _total(http) == before


def test_query_and_path_integers_are_bounded(api):
    _, http = api
    for path in ("/v1/jobs?offset=9223372036854775808", "/v1/jobs?limit=99999999999999999999",
                 "/v1/jobs/abc/images/100000000000000000000", "/v1/jobs/abc/images/-1"):
        r = http.get(path)
        assert r.status_code == 400, (path, r.text)
    assert http.get("/v1/jobs/" + "x" * 65).status_code == 400
    assert http.get("/v1/jobs/abc/images/3").status_code == 404


def test_echoed_input_is_truncated(api):
    _, http = api
    big = "7" * 500_000  # under the body limit, far over what a message should echo
    for body in ({"labels": [big]}, {"labels": [1], "model": big}, {"labels": [1], "sampler": big}):
        r = http.post("/v1/jobs", json=body)
        assert r.status_code == 400 and len(r.content) < 2000, r.text[:300]
    r = http.post("/v1/images/generations", json={"prompt": "x" * 30000})
    assert r.status_code == 400 and len(r.content) < 2000


def test_http_conformance(api):
    svc, http = api
    r = http.put("/v1/jobs")
    assert r.status_code == 405 and set(r.headers["Allow"].replace(" ", "").split(",")) == {"GET", "POST"}
    assert r.json()["error"]["message"]
    assert http.get("/v1/models/digits").json()["id"] == "digits"
    assert http.get("/v1/models/nope").status_code == 404
    r = http.post("/v1/images/generations", json={"prompt": "3", "output_compression": 50, "n": 11})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"  # output_compression itself is accepted
    schema = http.get("/openapi.json").json()
    assert schema["components"]["schemas"]["JobRequest"]["properties"]["seeds"]["anyOf"][0]["minItems"] == 1
    for path, methods in schema["paths"].items():
        for method, op in methods.items():
            documented = set(op["responses"])
            assert {"400", "405", "413", "500"} <= documented, (method, path)
            if path.startswith("/v1"):
                assert "401" in documented, (method, path)
    assert {"429", "504"} <= set(schema["paths"]["/v1/images/generations"]["post"]["responses"])
    assert "429" in schema["paths"]["/v1/jobs"]["post"]["responses"]

    from openai import OpenAI

    assert OpenAI(base_url=f"{svc.url}/v1", api_key="unused").models.retrieve("digits").id == "digits"


def test_a_full_queue_answers_429_with_retry_after_and_stores_nothing(api):
    svc, http = api
    while free := 60 - svc.store.counts().get("queued", 0):
        r = http.post("/v1/jobs", json={"labels": [1], "num_per_label": min(free, 50)})
        assert r.status_code == 202
    before = _total(http)
    r = http.post("/v1/jobs", json={"labels": [1]})
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1, r.text
    assert "may hold at most 60" in r.json()["error"]["message"] and r.json()["error"]["type"] == "rate_limit_error"
    r = http.post("/v1/images/generations", json={"prompt": "3"})
    assert r.status_code == 429 and "Retry-After" in r.headers
    assert _total(http) == before and svc.store.counts()["queued"] == 60
    assert b"dit_serve_submissions_rejected_total 2.0" in http.get("/metrics").content
    for job in svc.store.list_jobs(100, 0)[0]:  # room again for the other tests
        svc.store.cancel_job(job.id)
    assert http.post("/v1/jobs", json={"labels": [1]}).status_code == 202


def test_the_sdk_waits_out_retry_after():
    from dit_serve.client import ApiError, Client

    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.headers.get("Idempotency-Key"))
        if len(calls) < 3:
            return httpx.Response(429, headers={"Retry-After": "0"}, json={"error": {"message": "queue full"}})
        return httpx.Response(202, json={"id": "j", "state": "queued", "model": "digits", "params": None,
                                         "created_at": 0, "num_items": 1, "counts": {}, "steps_done": 0,
                                         "steps_total": 1})

    http = httpx.Client(base_url="http://svc", transport=httpx.MockTransport(handler))
    with Client("http://svc", http=http) as client:
        assert client.submit([1]).id == "j"
    assert len(calls) == 3 and len(set(calls)) == 1  # the same Idempotency-Key each time

    def too_long(request):
        return httpx.Response(429, headers={"Retry-After": "3600"}, json={"error": {"message": "queue full"}})

    http = httpx.Client(base_url="http://svc", transport=httpx.MockTransport(too_long))
    with Client("http://svc", http=http, max_retry_after=10) as client:
        with pytest.raises(ApiError) as e:
            client.submit([1])
    assert e.value.status == 429 and e.value.retry_after == "3600"


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/internal", "http://localhost/x", "http://169.254.169.254/meta",
                                 "http://[::1]:8000/", "http://10.0.0.7/hook"])
def test_internal_webhook_destinations_are_refused_at_submission(api, url):
    _, http = api
    before = _total(http)
    r = http.post("/v1/jobs", json={"labels": [1], "webhook_url": url})
    assert r.status_code == 400 and r.json()["error"]["param"] == "webhook_url", r.text
    assert "allow_hosts" in r.json()["error"]["message"] and _total(http) == before
