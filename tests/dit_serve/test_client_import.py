"""The SDK and the client commands import neither torch nor ray (checked in a fresh interpreter
where importing either raises), so a laptop without them can submit to a remote cluster."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import sys

class Forbid:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "ray"}:
            raise ImportError(f"forbidden import: {name}")

sys.meta_path.insert(0, Forbid())
import dit_serve.client, dit_serve.schemas, dit_serve.outputs, dit_serve.commands
from dit_serve.client import AsyncClient, Client, ApiError
from dit_serve.cli import main

assert main(["submit", "--url", "http://127.0.0.1:9", "--labels", "1"]) == 1  # unreachable, not ImportError
assert main(["status", "--url", "http://127.0.0.1:9", "abc"]) == 1
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "ray"})
assert not loaded, loaded
print("ok")
"""


def test_client_imports_without_torch_or_ray():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "ok"
    assert "cannot reach dit-serve" in r.stderr


API_SCRIPT = r"""
import sys, threading

class Forbid:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "ray"}:
            raise ImportError(f"forbidden import: {name}")

sys.meta_path.insert(0, Forbid())
from dit_serve.cli import main

sys.argv = ["dit-serve", "serve", "--role", "api", "--port", "0", "--data-dir", sys.argv[1],
            "--model", "digits", "--model", "digits-flow"]
sys.exit(main(sys.argv[1:]))
"""


def test_the_api_serves_without_torch_or_ray(tmp_path):
    """``serve --role api`` validates and stores jobs with the models' cards and the sampler rules only."""
    import re
    import signal

    import httpx

    proc = subprocess.Popen([sys.executable, "-c", API_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        url = re.search(r"at (http://\S+);", line)
        assert url, line + proc.stderr.read()[-2000:]
        with httpx.Client(base_url=url.group(1), timeout=10) as http:
            r = http.post("/v1/jobs", json={"model": "digits-flow", "labels": ["seven"], "num_per_label": 2})
            assert r.status_code == 202, r.text
            job = http.get(f"/v1/jobs/{r.json()['id']}").json()
            assert (job["params"]["sampler"], job["num_items"], job["items"][0]["label"]) == ("flow_euler", 2, 7)
            bad = http.post("/v1/jobs", json={"labels": [1], "sampler": "flow_euler"})  # digits predicts noise
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampler"
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["digits", "digits-flow"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()


GRAPH_SCRIPT = r"""
import sys
import dit_serve.client, dit_serve.schemas, dit_serve.outputs
from dit_serve.cli import main
main(["submit", "--url", "http://127.0.0.1:9", "--labels", "1"])
main(["status", "--url", "http://127.0.0.1:9", "abc"])
print(" ".join(sorted(m for m in sys.modules if m.startswith("dit_serve."))))
"""


def test_the_sdk_side_imports_nothing_from_the_server_side():
    """The import graph: the SDK, the output writer and the client commands load no server-side module
    (the HTTP app, the store, the scheduler, local generation), so `pip install dit-serve` suffices."""
    r = subprocess.run([sys.executable, "-c", GRAPH_SCRIPT], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = {m.split(".")[1] for m in r.stdout.split()}
    assert "server" not in loaded, sorted(m for m in r.stdout.split() if m.startswith("dit_serve.server"))
    assert {"client", "schemas", "outputs", "cli"} <= loaded


def test_the_server_side_is_one_subpackage():
    """Every module that needs the server's dependencies (FastAPI, SQLAlchemy, Ray, torch) lives under
    dit_serve.server; the top level holds the SDK side only."""
    top = {p.stem for p in (ROOT / "dit_serve").glob("*.py")} - {"__init__"}
    assert top == {"cli", "client", "commands", "errors", "outputs", "schemas"}, top
    for path in (ROOT / "dit_serve").glob("*.py"):
        heads = [ln for ln in path.read_text().splitlines() if ln.startswith(("import ", "from "))]
        assert not [ln for ln in heads if "dit_serve.server" in ln], (path.name, "imports the server side at import time")
