"""The main job, as the README runs it: `dit-serve demo` starts the service on the embedded default
(local Ray, SQLite, digits on the CPU), submits through the SDK, writes PNGs + grid + manifest and
shuts down cleanly (exit 0)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from dit_serve.schemas import JobParams, Manifest, ManifestImage

from .conftest import oracle, patient

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo(digits_model, tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "dit_serve.cli", "demo", "--out", str(out), "--num-per-label", "2"],
                       capture_output=True, text=True, timeout=patient(300), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    entries = manifest["images"]
    assert sorted(manifest) == sorted(Manifest.model_fields)  # the schema every writer writes (test_cli_usage.py)
    assert sorted(manifest["params"]) == sorted(JobParams.model_fields)
    assert {k for e in entries for k in e} == set(ManifestImage.model_fields)
    assert manifest["state"] == "done" and [e["label"] for e in entries] == [d for d in range(10) for _ in range(2)]
    images = [Image.open(out / e["file"]) for e in entries]
    assert oracle(images, [e["label"] for e in entries]) >= 0.8
    assert Image.open(out / "grid.png").size == (2 * 68 + 4, 10 * 68 + 4)  # one row per digit: 64 px tiles, 4 px gaps
    assert sorted(p.name for p in out.iterdir()) == sorted([e["file"] for e in entries] + ["grid.png", "manifest.json"])
