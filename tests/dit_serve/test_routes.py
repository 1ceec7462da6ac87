"""The routers are module-level and shared by every app ``create_app`` builds; what a route uses comes
from its own app (``app.state``), and every /v1 route, whichever router it is in, needs a key."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from dit_serve.server.api import create_app
from dit_serve.server.metrics import Metrics
from dit_serve.server.service import build_catalog, open_store

from .conftest import service_config

SAMPLES = {"job_id": "abc", "index": "0", "model_id": "digits", "name": "image",
           "upload_id": "upl_" + "0" * 24}  # values for the schema's path parameters


@pytest.fixture
def make_app(digits_model, tmp_path):
    stores = []

    def make(name: str, key: str):
        cfg = service_config(tmp_path / name, digits_model, server={"api_keys": [key]})
        stores.append(store := open_store(cfg))
        return store, TestClient(create_app(store, build_catalog(cfg), cfg.server, Metrics()))

    yield make
    for store in stores:
        store.close()


def test_every_v1_operation_in_the_schema_needs_a_key(make_app):
    store, http = make_app("a", "key-a-123456")
    operations = [(method, re.sub(r"\{(\w+)\}", lambda m: SAMPLES[m[1]], path))
                  for path, ops in http.get("/openapi.json").json()["paths"].items() for method in ops]
    v1 = [(method, path) for method, path in operations if path.startswith("/v1/")]
    assert len(v1) == 22  # jobs 10, openai 2, uploads 3, models 2, workers 1, loras 4
    for method, path in v1:
        for headers in ({}, {"Authorization": "Bearer wrong-key-0"}):
            r = http.request(method, path, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (method, path)
    assert store.list_jobs(10, 0)[1] == 0  # nothing a refused request sent was stored
    for method, path in set(operations) - set(v1):  # /healthz and /metrics: open, for probes
        assert http.request(method, path).status_code == 200, (method, path)


def test_two_apps_in_one_process_answer_from_their_own_objects(make_app):
    store_a, a = make_app("a", "key-a-123456")
    store_b, b = make_app("b", "key-b-123456")
    key_a, key_b = {"Authorization": "Bearer key-a-123456"}, {"Authorization": "Bearer key-b-123456"}
    r = a.post("/v1/jobs", json={"labels": [1, 2], "steps": 4}, headers=key_a)
    assert r.status_code == 202 and r.headers["Location"] == f"/v1/jobs/{r.json()['id']}"
    assert b.get("/v1/jobs", headers=key_a).status_code == 401  # b's key ring, not a's
    assert b.get("/v1/jobs", headers=key_b).json()["total"] == 0  # b's store
    assert b.get(r.headers["Location"], headers=key_b).status_code == 404
    assert a.get("/healthz").json()["queue_depth"] == 2 and b.get("/healthz").json()["queue_depth"] == 0
    assert store_a.list_jobs(10, 0)[1] == 1 and store_b.list_jobs(10, 0)[1] == 0
