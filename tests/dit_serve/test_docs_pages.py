"""/docs and /redoc work offline: their pages name only this service's own assets, which it serves."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from dit_serve.server.api import create_app
from dit_serve.server.metrics import Metrics
from dit_serve.server.routes import docs
from dit_serve.server.service import build_catalog, open_store

from .conftest import service_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_assets_package_is_in_the_server_extra():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["server"]
    assert any(dep.startswith("fastapi-offline") for dep in extra)


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_the_docs_pages_load_nothing_from_elsewhere(digits_model, tmp_path, page):
    if docs.assets_dir() is None:
        pytest.skip("fastapi-offline (the server extra) is not installed")
    cfg = service_config(tmp_path, digits_model, server={"api_keys": ["docs-key-0123456"]})
    http = TestClient(create_app(open_store(cfg), build_catalog(cfg), cfg.server, Metrics()))
    html = http.get(page)
    assert html.status_code == 200
    urls = re.findall(r"""(?:src|href)=["']([^"']+)["']|url:\s*["']([^"']+)["']""", html.text)
    urls = [u for pair in urls for u in pair if u]
    assert urls and not [u for u in urls if "://" in u or u.startswith("//")], urls
    for url in urls:  # no key needed: the pages hold no data, /openapi.json is open as before
        r = http.get(url)
        assert r.status_code == 200 and r.content, url
    assert http.get("/docs/assets/../pyproject.toml").status_code == 404
