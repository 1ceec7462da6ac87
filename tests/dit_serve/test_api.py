"""The HTTP API over real uvicorn and httpx, in an API-only service (no workers): validation, errors,
listing, cancel, the schema, health and metrics. Generation itself is in test_service.py."""

from __future__ import annotations

import httpx
import pytest

from dit_serve.server.service import Service

from .conftest import service_config


@pytest.fixture(scope="module")
def api(digits_model, tmp_path_factory):
    cfg = service_config(tmp_path_factory.mktemp("api"), digits_model,
                         limits={"max_items_per_job": 50, "max_steps": 200, "max_images_per_request": 4})
    with Service(cfg, roles=("api",)) as svc:
        with httpx.Client(base_url=svc.url, timeout=10) as http:
            yield svc, http


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def _stored_jobs(api) -> int:
    return api[1].get("/v1/jobs").json()["total"]


@pytest.mark.parametrize("body, param, words", [
    ({"model": "nope", "labels": [1]}, "model", "unknown model 'nope'"),
    ({"labels": [10]}, "labels", "outside model 'digits'"),
    ({"labels": ["eleven"]}, "labels", "unknown class name 'eleven'"),
    ({"labels": [1], "num_per_label": 51}, "labels", "the limit is 50"),
    ({"labels": [1], "steps": 201}, "steps", "at most 200"),
    ({"labels": [1], "sampler": "warp"}, "sampler", "unknown sampler 'warp'"),
    ({"labels": [1], "sampler": "euler", "eta": 0.5}, "eta", "eta"),
    ({"labels": [1], "colour": "red"}, "colour", "unknown field 'colour'"),
    ({"labels": []}, "labels", "labels must not be empty"),
    ({"labels": [1.5]}, "labels.0", ""),
    ({"labels": [1], "guidance": -1}, "guidance", "guidance must be at least 0, got -1"),
    ({"labels": [1, 2], "seeds": [1]}, None, "seeds has 1 entries but the job has 2 items"),
    ({"labels": [1], "priority": 101}, "priority", "priority must be at most 100, got 101"),
    ({"labels": [1], "webhook_url": "ftp://example.com/x"}, "webhook_url", "must be an http:// or https:// URL"),
])
def test_bad_jobs_are_4xx_and_store_nothing(api, body, param, words):
    before = _stored_jobs(api)
    err = _error(api[1].post("/v1/jobs", json=body), 400)
    assert words in err["message"] and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    assert _stored_jobs(api) == before


@pytest.mark.parametrize("content, words", [
    (b'{"labels": [1', "malformed JSON body"),
    (b'[1, 2]', "JSON object"),
    (b'', "needs a JSON body"),
])
def test_malformed_bodies(api, content, words):
    r = api[1].post("/v1/jobs", content=content, headers={"content-type": "application/json"})
    assert words in _error(r, 400)["message"]


def test_unknown_ids_and_indices(api):
    http = api[1]
    assert "no job with id 'nope'" in _error(http.get("/v1/jobs/nope"), 404)["message"]
    assert _error(http.delete("/v1/jobs/nope"), 404)["type"] == "not_found"
    _error(http.get("/v1/jobs/nope/images/0"), 404)
    _error(http.get("/v1/jobs/nope/archive"), 404)
    job = http.post("/v1/jobs", json={"labels": [3], "num_per_label": 2}).json()
    assert "has 2 images (0..1), not 2" in _error(http.get(f"/v1/jobs/{job['id']}/images/2"), 404)["message"]
    assert "is not ready yet (queued, step 0 of" in _error(http.get(f"/v1/jobs/{job['id']}/images/0"), 409)["message"]
    _error(http.get("/v1/jobs/x/images/minus-one"), 400)
    _error(http.get("/v1/no-such-route"), 404)


def test_a_failed_or_cancelled_items_image_is_gone_and_says_why(api):
    svc, http = api
    job = http.post("/v1/jobs", json={"labels": [3], "num_per_label": 2, "priority": 100}).json()["id"]
    leases = sorted(svc.store.lease("test-api", ["digits"], 1, 60.0), key=lambda ls: ls.index)
    assert [(ls.job_id, ls.index) for ls in leases] == [(job, 0)]
    assert svc.store.fail_item(leases[0], "dpmpp_2m with 1000 steps is degenerate")
    err = _error(http.get(f"/v1/jobs/{job}/images/0"), 410)
    assert f"image 0 of job {job} failed: dpmpp_2m with 1000 steps is degenerate" in err["message"]
    assert f"/v1/jobs/{job}/retry" in err["message"] and err["param"] == "index"
    http.delete(f"/v1/jobs/{job}")
    assert "was cancelled" in _error(http.get(f"/v1/jobs/{job}/images/1"), 410)["message"]


def test_submit_resolves_names_defaults_and_seeds(api):
    r = api[1].post("/v1/jobs", json={"labels": ["seven", 2], "num_per_label": 2, "seed": 40})
    assert r.status_code == 202 and r.headers["location"] == f"/v1/jobs/{r.json()['id']}"
    job = r.json()
    assert job["state"] == "queued" and job["num_items"] == 4 and job["params"]["sampler"]
    assert [(it["label"], it["seed"]) for it in job["items"]] == [(7, 40), (7, 41), (2, 42), (2, 43)]
    again = api[1].get(f"/v1/jobs/{job['id']}", params={"items": False}).json()
    assert again["items"] is None and again["steps_total"] == 4 * job["params"]["steps"]
    assert job["priority"] == 0
    assert api[1].post("/v1/jobs", json={"labels": [1], "priority": -3}).json()["priority"] == -3


def test_list_and_cancel(api):
    http = api[1]
    ids = [http.post("/v1/jobs", json={"labels": [i]}).json()["id"] for i in range(3)]
    page = http.get("/v1/jobs", params={"limit": 2}).json()
    assert [j["id"] for j in page["data"]] == ids[::-1][:2] and page["next_offset"] == 2
    assert page["data"][0]["items"] is None
    _error(http.get("/v1/jobs", params={"limit": 0}), 400)
    job = http.delete(f"/v1/jobs/{ids[0]}").json()
    assert job["state"] == "cancelled" and job["counts"] == {"cancelled": 1}
    assert http.delete(f"/v1/jobs/{ids[0]}").json()["state"] == "cancelled"  # idempotent
    total = _stored_jobs(api)
    gone = http.delete(f"/v1/jobs/{ids[1]}", params={"purge": True})  # cancels, then deletes
    assert gone.status_code == 200 and gone.json()["state"] == "cancelled" and gone.json()["id"] == ids[1]
    _error(http.get(f"/v1/jobs/{ids[1]}"), 404)
    _error(http.delete(f"/v1/jobs/{ids[1]}", params={"purge": True}), 404)
    assert _stored_jobs(api) == total - 1


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a cat"}, "prompt"),
    ({"prompt": "7", "size": "256x256"}, "size"),
    ({"prompt": "7", "n": 5}, "n"),
    ({"prompt": "7", "model": "dall-e-3"}, "model"),
    ({"prompt": "7", "response_format": "jpeg"}, "response_format"),
    ({"prompt": "7", "stream": True}, "stream"),
    ({"prompt": "7", "priority": 1000}, "priority"),
])
def test_bad_openai_requests(api, body, param):
    before = _stored_jobs(api)
    assert _error(api[1].post("/v1/images/generations", json=body), 400)["param"] == param
    assert _stored_jobs(api) == before


def test_models_health_metrics_schema(api):
    http = api[1]
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert (card["id"], card["num_classes"], card["image_size"]) == ("digits", 10, 8)
    assert card["class_names"][7] == "seven"
    health = http.get("/healthz").json()
    assert health["status"] == "ok" and health["workers"] is None and health["queue_depth"] >= 0
    metrics = http.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "dit_serve_queue_depth" in metrics.text
    paths = http.get("/openapi.json").json()["paths"]
    for path in ("/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/images/{index}", "/v1/jobs/{job_id}/archive",
                 "/v1/images/generations", "/v1/models", "/healthz", "/metrics"):
        assert path in paths


def test_api_processes_share_a_postgres_store(digits_model, postgres_url, tmp_path):
    """Several API servers in front of one PostgreSQL store see the same jobs."""
    cfg = service_config(tmp_path, digits_model, store={"url": postgres_url})
    with Service(cfg, roles=("api",)) as a, Service(cfg, roles=("api",)) as b:
        job = httpx.post(f"{a.url}/v1/jobs", json={"labels": [1, 2]}).json()
        assert httpx.get(f"{b.url}/v1/jobs/{job['id']}").json()["state"] == "queued"
        assert httpx.delete(f"{b.url}/v1/jobs/{job['id']}").json()["state"] == "cancelled"
        assert httpx.get(f"{a.url}/v1/jobs").json()["data"][0]["state"] == "cancelled"


def test_an_idempotency_key_makes_a_retried_submit_safe(api):
    svc, http = api
    before = _stored_jobs(api)
    body, key = {"labels": [1, 2], "steps": 5}, {"Idempotency-Key": "retry-me-42"}
    first = http.post("/v1/jobs", json=body, headers=key)
    again = http.post("/v1/jobs", json=body, headers=key)
    assert first.status_code == again.status_code == 202
    assert again.json()["id"] == first.json()["id"] and again.headers["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first.headers and _stored_jobs(api) == before + 1
    err = _error(http.post("/v1/jobs", json={"labels": [3], "steps": 5}, headers=key), 409)
    assert "already used for a different request" in err["message"] and err["param"] == "Idempotency-Key"
    err = _error(http.post("/v1/jobs", json=body, headers={"Idempotency-Key": "x" * 201}), 400)
    assert err["param"] == "Idempotency-Key"  # the header as the 409 above names it
    assert _stored_jobs(api) == before + 1


def test_the_client_submits_once_however_often_it_retries(api):
    """The SDK sends a fresh Idempotency-Key per submit and retries 503s and dropped connections with it."""
    from dit_serve.client import ApiError, Client

    svc, _ = api
    failures = {"n": 0}
    seen: list[str] = []

    def flaky(request: httpx.Request) -> httpx.Response | None:
        seen.append(request.headers.get("Idempotency-Key", ""))
        failures["n"] += 1
        if failures["n"] == 1:
            raise httpx.ConnectError("connection reset", request=request)
        if failures["n"] == 2:
            return httpx.Response(503, json={"error": {"message": "restarting"}})
        return None  # the real service answers

    real = httpx.HTTPTransport()

    class Flaky(httpx.BaseTransport):
        def handle_request(self, request):
            return flaky(request) or real.handle_request(request)

    before = _stored_jobs(api)
    with Client(svc.url, http=httpx.Client(base_url=svc.url, transport=Flaky())) as client:
        job = client.submit([4], steps=5)
        assert len(seen) == 3 and len(set(seen)) == 1 and seen[0]
        assert client.submit([4], steps=5, idempotency_key=seen[0]).id == job.id
        assert client.submit([4], steps=5).id != job.id  # a new call is a new job
    assert _stored_jobs(api) == before + 2

    calls = {"n": 0}

    class Down(httpx.BaseTransport):
        def handle_request(self, request):
            calls["n"] += 1
            return httpx.Response(503, json={"error": {"message": "restarting"}})

    with Client(svc.url, http=httpx.Client(base_url=svc.url, transport=Down()), retries=2) as client:
        with pytest.raises(ApiError, match="restarting"):
            client.get("abc")
    assert calls["n"] == 3  # one try and two retries, then the error


def test_api_keys_guard_v1_but_not_probes(digits_model, tmp_path, monkeypatch):
    from dit_serve.client import ApiError, Client

    monkeypatch.delenv("DIT_SERVE_API_KEY", raising=False)
    cfg = service_config(tmp_path, digits_model, server={"api_keys": ["old-key-123", "new-key-456"]})
    with Service(cfg, roles=("api",)) as svc, httpx.Client(base_url=svc.url, timeout=10) as http:
        for path in ("/v1/models", "/v1/jobs"):
            err = _error(http.get(path), 401)
            assert "Authorization: Bearer" in err["message"] and err["type"] == "authentication_error"
        r = http.post("/v1/jobs", json={"labels": [1]}, headers={"Authorization": "Bearer wrong-key-0"})
        assert _error(r, 401)["message"] == "invalid API key" and r.headers["WWW-Authenticate"] == "Bearer"
        r = http.post("/v1/jobs", json={"labels": [99]})  # unauthenticated: 401 before any validation
        assert r.status_code == 401
        assert http.get("/healthz").status_code == 200 and http.get("/metrics").status_code == 200
        schema = http.get("/openapi.json").json()
        assert "HTTPBearer" in schema["components"]["securitySchemes"]

        for key in ("old-key-123", "new-key-456"):  # either key works: rotation
            with Client(svc.url, api_key=key) as client:
                job = client.submit([1, 2], steps=5)
                assert client.get(job).num_items == 2 and client.models().data
        with Client(svc.url) as client:
            with pytest.raises(ApiError) as e:
                client.list()
            assert e.value.status == 401
        monkeypatch.setenv("DIT_SERVE_API_KEY", "new-key-456")
        with Client(svc.url) as client:  # the key from the environment
            assert client.list().total == 2

        from openai import OpenAI

        oa = OpenAI(base_url=f"{svc.url}/v1", api_key="new-key-456")
        assert [m.id for m in oa.models.list()] == [m.id for m in Client(svc.url).models().data]
        with pytest.raises(Exception, match="401"):
            OpenAI(base_url=f"{svc.url}/v1", api_key="nope-nope-nope").models.list()


def test_api_keys_must_look_like_keys(tmp_path):
    from dit_serve.server.config import ConfigError, Config

    with pytest.raises(ConfigError, match="^the command line or environment: server.api_keys: an API key must be at "
                                          "least 8 printable"):
        Config().with_overrides(server={"api_keys": ["short"]})
    assert "k-123456789" not in repr(Config().with_overrides(server={"api_keys": ["k-123456789"]}))


def test_the_cli_uses_the_key_from_the_environment(digits_model, tmp_path, monkeypatch, capsys):
    from dit_serve.cli import main

    cfg = service_config(tmp_path, digits_model, server={"api_keys": ["cli-key-7890"]})
    with Service(cfg, roles=("api",)) as svc:
        monkeypatch.delenv("DIT_SERVE_API_KEY", raising=False)
        assert main(["submit", "--url", svc.url, "--labels", "1,2", "--steps", "5"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("dit-serve: error: this service needs an API key") and "\n" not in err
        monkeypatch.setenv("DIT_SERVE_API_KEY", "cli-key-7890")
        assert main(["submit", "--url", svc.url, "--labels", "1,2", "--steps", "5"]) == 0
        job_id = capsys.readouterr().out.strip()
        assert main(["status", job_id, "--url", svc.url]) == 0
        assert capsys.readouterr().out.startswith(f"{job_id} queued")


def test_serve_takes_its_key_from_the_environment(monkeypatch):
    import argparse

    from dit_serve.commands import _config

    monkeypatch.setenv("DIT_SERVE_API_KEY", "env-key-2468")
    cfg = _config(argparse.Namespace())
    assert [k.get_secret_value() for k in cfg.server.api_keys] == ["env-key-2468"]
    monkeypatch.delenv("DIT_SERVE_API_KEY")
    assert _config(argparse.Namespace()).server.api_keys == ()
