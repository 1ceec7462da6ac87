"""bench/norm_quant.py runs on a CPU (--smoke): every system it names computes the first one's codes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_the_smoke_run_compares_every_system_with_the_first(tmp_path):
    spec = importlib.util.spec_from_file_location("norm_quant_bench", BENCH / "norm_quant.py")
    nq = sys.modules["norm_quant_bench"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nq)
    nq.main(["--smoke", "--out", str(tmp_path), "--systems", "split", "fused", "kernel"])
    report = json.loads((tmp_path / "norm_quant_smoke.json").read_text())
    assert report["reference"] == "split" and len(report["rows"]) == len(nq.SMOKE_SHAPES)
    for row in report["rows"]:
        assert list(row["vs_first"]) == ["split", "fused", "kernel"]
        assert all(v["codes_differ"] <= 0.01 and v["max_rel"] <= 0.08 for v in row["vs_first"].values()), row
    assert "| kernel |" in (tmp_path / "norm_quant_smoke.md").read_text()
