"""The throughput benchmark's bookkeeping (arrivals, summaries, merging of parts, target checks) and one
seconds-long run of every system (ours, and diffusers' DiTPipeline) on a tiny random DiT with a VAE:
the GPU run must not be the first time any of its code runs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("engine_throughput", ROOT / "bench" / "engine_throughput.py")
et = sys.modules["engine_throughput"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(et)


def test_arrivals_follow_the_offered_load_and_the_size_mix():
    runs = [et.make_jobs(10.0, seed=s, resolutions=(256, 512), classes=1000, window_s=2000.0) for s in range(10)]
    rate = np.mean([sum(j.n for j in jobs) / 2000.0 for jobs in runs])  # std of one run ~5.5%: of ten, ~1.8%
    assert rate == pytest.approx(10.0, rel=0.06)
    jobs = [j for jobs in runs for j in jobs]
    sizes = np.array([j.n for j in jobs])
    assert np.mean(sizes == 1) == pytest.approx(0.70, abs=0.01)
    assert np.mean((sizes >= 2) & (sizes <= 8)) == pytest.approx(0.25, abs=0.01)
    assert np.mean(sizes >= 16) == pytest.approx(0.05, abs=0.005) and sizes.max() <= 100
    assert {j.res for j in jobs} == {256, 512}
    assert all(b.arrival > a.arrival for a, b in zip(runs[0], runs[0][1:]))
    again = et.make_jobs(10.0, seed=0, resolutions=(256, 512), classes=1000, count=50)  # seeded
    assert [(j.n, j.res, j.arrival) for j in again] == [(j.n, j.res, j.arrival) for j in runs[0][:50]]


def test_unfinished_requests_are_censored_at_the_stop():
    jobs = [et.Job(0, 0.0, 2, 256, 1, finished=1.0), et.Job(1, 1.0, 3, 256, 1)]
    row = et.summarise("a", "256", 5.0, jobs, stop_s=4.0)
    assert row["images_per_s"] == 2 / 4.0 and row["unfinished"] == 1
    assert row["p99_ms"] == pytest.approx(3000.0, rel=0.02)  # (stop - arrival), a lower bound


def _part(systems, workload, rows, mx, single=None, padded=None):
    part = {"gpu": "H", "torch": "t", "diffusers": "d", "systems": systems, "workloads": [workload],
            "rows": [{"system": s, "workload": workload, "offered_images_per_s": load, "images_per_s": ips,
                      "p50_ms": p99 / 2, "p99_ms": p99, "requests": 10, "unfinished": unf}
                     for s, load, ips, p99, unf in rows],
            "max_images_per_s": mx, "single_image_ms": single or {}, "padding_fraction": None}
    if padded:
        part.update(padded_rows=padded[0], real_rows=padded[1])
    return part


def test_parts_merge_into_one_report_and_targets_are_checked():
    p256 = _part(["a", "c", "d"], "256",
                 [("a", 5, 5.0, 300, 0), ("a", 10, 10.0, 400, 0), ("d", 5, 4.9, 1000, 0), ("d", 10, 6.0, 9000, 3),
                  ("c", 1, 0.7, 20000, 4)],
                 {"a/256": 30.0, "c/256": 5.0, "d/256": 12.0}, {"a": 180.0, "c": 1400.0}, padded=(10, 90))
    mixed = _part(["a", "c", "d"], "mixed", [("a", 5, 5.0, 700, 0), ("d", 5, 5.0, 1000, 0)],
                  {"a/mixed": 20.0, "c/mixed": 10.0}, padded=(30, 70))
    merged = et.merge([p256, mixed])
    assert merged["padding_fraction"] == pytest.approx(40 / 200)
    assert merged["max_images_per_s"] == {"a/256": 30.0, "c/256": 5.0, "d/256": 12.0, "a/mixed": 20.0,
                                          "c/mixed": 10.0}
    assert len(merged["rows"]) == 7
    checks = {t["target"]: (t["value"], t["met"]) for t in et.targets(merged)}
    assert checks["256: max sustained a >= 3x c"] == (6.0, True)
    assert checks["mixed: max sustained a >= 3x c"] == (2.0, False)
    assert checks["256: p99 a <= 0.6x d at 5 img/s"] == (0.3, True)
    assert "256: p99 a <= 0.6x d at 10 img/s" not in checks  # d does not sustain 10 img/s
    assert checks["mixed: p99 a <= 0.6x d at 5 img/s"] == (0.7, False)
    assert checks["single 256 px image (a) <= 250 ms"] == (180.0, True)
    assert "| single 256 px image (a) <= 250 ms | 180.0 | yes |" in et.markdown(merged)

    rerun = _part(["a", "c", "d"], "256", [("a", 5, 5.0, 250, 0)], {"a/256": 31.0}, padded=(0, 100))
    again = et.merge([p256, mixed, rerun])  # a rerun of the same part replaces it whole
    assert again["max_images_per_s"]["a/256"] == 31.0 and again["padding_fraction"] == pytest.approx(30 / 200)
    assert [r["p99_ms"] for r in again["rows"] if r["system"] == "a" and r["workload"] == "256"] == [250]

    with pytest.raises(SystemExit, match="different machines"):
        et.merge([p256, {**mixed, "gpu": "other"}])


def test_the_harness_runs_end_to_end(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "engine_throughput.py"), "--smoke",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "engine_throughput_smoke.json").read_text())
    assert {r["system"] for r in result["rows"]} == {"a", "b", "c", "d"}  # ours and diffusers' DiTPipeline
    assert all(r["unfinished"] == 0 and r["images_per_s"] > 0 for r in result["rows"])
    assert result["real_rows"] > 0 and 0.0 <= result["padding_fraction"] < 1.0
    assert set(result["max_images_per_s"]) == {"a/single", "b/single", "c/single", "d/single"}
    assert set(result["single_image_ms"]) == {"a", "c"} and result["targets"]
