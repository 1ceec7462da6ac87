"""bench/preview_cost.py: its summary arithmetic, and the whole benchmark at a tiny size on a CPU (the GPU
run must not be the first time its code runs)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("preview_cost_bench", ROOT / "bench" / "preview_cost.py")
pc = sys.modules["preview_cost_bench"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pc)


def test_summary_is_the_medians_and_their_difference():
    s = pc.summary({"off": [10.0, 30.0, 20.0], "on": [21.0, 22.0, 99.0]})
    assert s == {"off_ms": 20.0, "on_ms": 22.0, "added_ms": 2.0, "added_pct": 10.0}


@pytest.mark.slow
def test_the_smoke_run_times_every_harness_in_pairs(tmp_path):
    pc.main(["--smoke", "--pairs", "2", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "preview_cost_smoke.json").read_text())
    block = result["results"]["1"]
    assert set(block) == set(pc.HARNESSES)
    for r in block.values():
        assert len(r["raw"]["off"]) == len(r["raw"]["on"]) == 2 and min(r["raw"]["off"] + r["raw"]["on"]) > 0
        assert r["summary"] == pc.summary(r["raw"])
    assert "| 1 | poller-noPNG |" in (tmp_path / "preview_cost_smoke.md").read_text()
