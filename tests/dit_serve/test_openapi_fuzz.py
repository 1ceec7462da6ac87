"""The OpenAPI schema says what the service accepts and answers: schemathesis (its CLI, `--checks all`)
generates requests from /openapi.json, valid and invalid, and checks every answer against the schema.
An API-only service (real HTTP, no workers: jobs stay queued), with a key. About ten seconds (the stateful phase, which follows links between operations, would
take most of a minute and is left to bench/chaos.py's fuzz)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dit_serve.server.service import Service

from .conftest import patient, service_config

KEY = "fuzz-key-0123456789"
# Two answers the schema cannot know of, said here rather than hidden:
CONFIG = """
[checks.positive_data_acceptance]
# a request the schema accepts may still be one the chosen model cannot run: which conditioning it takes
# (labels or prompts), its class names, samplers, sizes and step bounds are the model card's, checked by
# the catalog with a 400 that names the field; an item's image is 409 while not made yet, 410 once it failed
# or was cancelled
expected-statuses = ["2XX", "400", "401", "403", "404", "409", "410", "429"]

[[operations]]
include-path-regex = "^/v1/images/(generations|edits)$"
# no worker here: the images endpoints wait for a job that never runs and answer their schema's 504 (an edit's
# generated image is rarely a decodable one: mostly a 400 naming it)
checks.not_a_server_error.expected-statuses = ["2XX", "3XX", "4XX", "504"]
checks.positive_data_acceptance.expected-statuses = ["2XX", "400", "401", "403", "404", "409", "410", "413", "429",
                                                     "504"]
"""


@pytest.mark.slow
def test_schemathesis_finds_nothing_the_schema_does_not_say(digits_model, tmp_path):
    exe = Path(sys.executable).with_name("schemathesis")
    if not exe.exists():
        pytest.skip("schemathesis is not installed (the dev extra)")
    (tmp_path / "schemathesis.toml").write_text(CONFIG)
    cfg = service_config(tmp_path / "data", digits_model, workers={"models": ("digits", "digits-text")},
                         limits={"generation_timeout_s": 0.2}, server={"api_keys": [KEY]})
    with Service(cfg, roles=("api",)) as svc:
        run = subprocess.run([str(exe), "--config-file", str(tmp_path / "schemathesis.toml"), "run",
                              f"{svc.url}/openapi.json", "--checks", "all", "--max-examples", "10",
                              "--generation-deterministic", "--phases", "examples,coverage,fuzzing", "--header", f"Authorization: Bearer {KEY}",
                              "--request-timeout", "10", "--no-color"],
                             capture_output=True, text=True, timeout=patient(120), cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]


def test_the_schema_refuses_what_the_service_refuses(digits_model, tmp_path):
    """The four places a schema-driven client tripped on: the schema now says what the service does."""
    import jsonschema
    from fastapi.testclient import TestClient

    from dit_serve.server.api import create_app
    from dit_serve.server.metrics import Metrics
    from dit_serve.server.service import build_catalog, open_store

    cfg = service_config(tmp_path / "data", digits_model)
    http = TestClient(create_app(open_store(cfg), build_catalog(cfg), cfg.server, Metrics()))
    doc = http.get("/openapi.json").json()

    def valid(schema: dict, value) -> bool:
        try:
            jsonschema.validate(value, {**schema, "components": doc["components"]})
        except jsonschema.ValidationError:
            return False
        return True

    images = {"$ref": "#/components/schemas/ImageGenerationRequest"}
    jobs = {"$ref": "#/components/schemas/JobRequest"}
    assert not valid(images, {"prompt": "1", "model": ""})
    assert http.post("/v1/images/generations", json={"prompt": "1", "model": ""}).status_code == 400
    for prompt in ("", "   "):
        assert not valid(jobs, {"prompts": [prompt]})
    assert not valid(jobs, {"labels": [""]}) and valid(jobs, {"labels": [3, "seven"]})
    events = doc["paths"]["/v1/jobs/{job_id}/events"]["get"]
    (header,) = [p for p in events["parameters"] if p["name"].lower() == "last-event-id"]
    assert not valid(header["schema"], None) and not valid(header["schema"], "null")
    assert valid(header["schema"], "3.17") and valid(header["schema"], "3.17.1520413.2")
    stream = events["responses"]["200"]["content"]["text/event-stream"]
    data = stream["itemSchema"]["properties"]["data"]
    assert data["contentMediaType"] == "application/json"
    item = {"event": "item", "index": 0, "state": "cancelled", "url": None, "error": None, "finished_at": 1.0}
    assert valid(data["contentSchema"], item) and not valid(data["contentSchema"], "an event")
