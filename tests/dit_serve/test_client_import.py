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
