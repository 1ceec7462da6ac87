"""The access log: one line per request at info level (method, path, status, ms) from the API's own
middleware, shown by `dit-serve serve`; none of uvicorn's format."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from dit_serve.server.access_log import LOGGER
from dit_serve.server.service import Service

from .conftest import service_config, serving_url
from .test_cli_usage import ROOT

LINE = re.compile(r"^(GET|POST|PUT|DELETE) (\S+) (\d{3}) \d+ ms$")


@pytest.fixture(scope="module")
def api(digits_model, tmp_path_factory):
    cfg = service_config(tmp_path_factory.mktemp("access"), digits_model, server={"max_body_bytes": 1024})
    with Service(cfg, roles=("api",)) as svc:
        with httpx.Client(base_url=svc.url, timeout=10) as http:
            yield http


def _lines(caplog) -> list[tuple[str, str, int]]:
    out = []
    for record in caplog.records:
        if record.name == LOGGER:
            m = LINE.match(record.getMessage())
            assert m and record.levelno == logging.INFO, record.getMessage()
            out.append((m[1], m[2], int(m[3])))
    return out


def test_each_request_is_one_line_with_the_status_the_client_got(api, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    api.get("/v1/models")
    api.post("/v1/jobs", json={"labels": [10]})
    api.get("/v1/nope", params={"secret": "x"})
    api.post("/v1/images/generations", content=b"{" + b" " * 4096 + b"}",  # over max_body_bytes (1024) there
             headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + 10  # a line is written once its response has gone: on a busy machine a moment
    while len(_lines(caplog)) < 4 and time.monotonic() < deadline:  # after the client has it
        time.sleep(0.05)
    assert _lines(caplog) == [("GET", "/v1/models", 200), ("POST", "/v1/jobs", 400), ("GET", "/v1/nope", 404),
                              ("POST", "/v1/images/generations", 413)]  # the path without its query; the body
    # limit's own 413


def test_access_log_off(digits_model, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    cfg = service_config(tmp_path, digits_model, server={"access_log": False})
    with Service(cfg, roles=("api",)) as svc:
        httpx.get(f"{svc.url}/healthz", timeout=10)
    assert _lines(caplog) == []


def test_serve_prints_the_access_log(digits_model, tmp_path):
    """The real CLI: `serve --role api` shows each request at its default log level, in this format only."""
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "dit_serve.cli", "serve", "--role", "api", "--port", "0",
                             "--data-dir", str(tmp_path / "data"), "--model", digits_model],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=log.open("wb"), text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        url = serving_url(proc, log)
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
        assert httpx.get(f"{url}/v1/jobs/nope", timeout=10).status_code == 404
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    text = log.read_text()
    assert re.search(r" INFO dit_serve\.access: GET /healthz 200 \d+ ms$", text, re.M), text
    assert re.search(r" INFO dit_serve\.access: GET /v1/jobs/nope 404 \d+ ms$", text, re.M), text
    assert "HTTP/1.1" not in text  # not uvicorn's access format
