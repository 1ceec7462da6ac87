"""What a user reads when a request is refused: the field, what was wrong, what is allowed, in the API's
own words, never the validation library's ("Value error, ...", "Input should be ...")."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from dit_serve.server.api import create_app
from dit_serve.server.metrics import Metrics
from dit_serve.server.service import build_catalog, open_store

from .conftest import service_config

LIBRARY_WORDS = ("Value error", "Input should", "List should", "Value should", "String should", "Unable to parse",
                 "after validation")


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    cfg = service_config(tmp_path_factory.mktemp("messages"), "digits", workers={"models": ("digits", "digits-text")})
    store = open_store(cfg)
    with TestClient(create_app(store, build_catalog(cfg), cfg.server, Metrics())) as client:
        yield client
    store.close()


@pytest.mark.parametrize("body, param, words", [
    ({"model": "digits-text", "prompts": ["x" * 32001]}, "prompts.0", "prompts.0 has 32001 characters; at most 32000"),
    ({"labels": []}, "labels", "labels must not be empty"),
    ({"labels": [1], "seeds": []}, "seeds", "seeds must not be empty"),
    ({"labels": [1], "steps": 1e308}, "steps", "steps must be a whole number"),
    ({"labels": [1], "seed": "1e308"}, "seed", "seed must be a whole number, got '1e308'"),
    ({"labels": [1], "guidance": 1e308}, "guidance", "guidance must be at most 100, got 1e+308"),
    ({"labels": [1], "exact_size": "maybe"}, "exact_size", "exact_size must be true or false"),
    ({"labels": [1.5]}, "labels.0", "labels.0: a label is a class number or a class name, not 1.5"),
    ({"model": "digits-text", "prompts": [" "]}, "prompts.0", "prompts.0: a prompt is a non-empty string"),
    ({"labels": "1"}, "labels", "labels must be a list"),
    ({}, None, "send labels (class-conditional models) or prompts"),
])
def test_job_messages_name_the_field_and_what_is_allowed(http, body, param, words):
    err = http.post("/v1/jobs", json=body).json()["error"]
    assert words in err["message"] and err["param"] == param, err
    assert not any(w in err["message"] for w in LIBRARY_WORDS), err["message"]


@pytest.mark.parametrize("body, words", [
    ({"prompt": "1", "response_format": "png"}, "response_format must be 'url' or 'b64_json', got 'png'"),
    ({"prompt": ""}, "prompt must not be empty"),
    ({"prompt": "1", "size": "9x9"}, "model 'digits' does not make 9x9 images; size must be one of 8x8, or 'auto'"),
])
def test_images_messages(http, body, words):
    err = http.post("/v1/images/generations", json=body).json()["error"]
    assert words in err["message"], err
    assert "width" not in err["message"] and not any(w in err["message"] for w in LIBRARY_WORDS)


def test_a_query_parameter_of_the_wrong_type(http):
    err = http.get("/v1/jobs", params={"limit": "abc"}).json()["error"]
    assert err["message"] == "limit must be a whole number, got 'abc'" and err["param"] == "limit"


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_json_body_sent_as_another_content_type_is_a_415_that_says_so(http, kind):
    r = http.post("/v1/jobs", content=b'{"labels": [1]}', headers={"content-type": kind})
    assert r.status_code == 415, r.text
    assert "Content-Type: application/json" in r.json()["error"]["message"] and kind in r.json()["error"]["message"]
    assert http.post("/v1/jobs", content=b'[1]', headers={"content-type": "application/json"}).status_code == 400
