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
    runs = [et.make_jobs(10.0, seed=s, resolutions=(256, 512), classes=1000, window_s=200.0) for s in range(10)]
    rate = np.mean([sum(j.n for j in jobs) / 200.0 for jobs in runs])
    assert rate == pytest.approx(10.0, rel=0.06)
    jobs = [j for jobs in runs for j in jobs]
    sizes = np.array([j.n for j in jobs])
    assert np.mean(sizes == 1) == pytest.approx(0.70, abs=0.01)
    assert np.mean((sizes >= 2) & (sizes <= 8)) == pytest.approx(0.25, abs=0.01)
    assert np.mean(sizes >= 16) == pytest.approx(0.05, abs=0.005) and sizes.max() <= 100
    assert {j.res for j in jobs} == {256, 512}
    assert all(b.arrival >= a.arrival for a, b in zip(runs[0], runs[0][1:]))
    assert 0.0 <= runs[0][0].arrival and runs[0][-1].arrival <= 200.0
    again = et.make_jobs(10.0, seed=0, resolutions=(256, 512), classes=1000, window_s=200.0)  # seeded
    assert [(j.n, j.res, j.arrival) for j in again] == [(j.n, j.res, j.arrival) for j in runs[0]]
    short = [sum(j.n for j in et.make_jobs(4.0, seed=s, resolutions=(256,), classes=10, window_s=12.0)) / 12.0
             for s in range(50)]  # a short window still offers about the nominal load (no lottery)
    assert np.median(short) == pytest.approx(4.0, rel=0.25)


def test_the_backlog_has_exactly_the_workload_mix():
    jobs = et.backlog((256, 512), classes=1000)
    sizes = sorted(j.n for j in jobs)
    assert sizes == [1] * 14 + [2, 4, 5, 6, 8, 58] and sum(sizes) / len(sizes) == pytest.approx(4.85)
    assert all(j.arrival == 0.0 for j in jobs) and {j.res for j in jobs} == {256, 512}
    assert [j.n for j in et.backlog((256,), 1000)] == [j.n for j in et.backlog((256,), 1000)]  # seeded


class _Recorder:
    """Stands in for the engine: every request takes ``steps`` steps; records how many are in flight."""

    def __init__(self, steps=3):
        self.active, self.steps, self.in_flight, self.starts = {}, steps, [], []

    @property
    def num_active(self):
        return len(self.active)

    def add(self, req):
        self.active[req.id] = self.steps
        self.starts.append(req.id)

    def progress(self):
        return dict(self.active)

    def cancel(self, rid):
        return self.active.pop(rid, None) is not None

    def step(self):
        self.in_flight.append(len(self.active))
        for k in self.active:
            self.active[k] -= 1
        done = [k for k, v in self.active.items() if v == 0]
        for k in done:
            del self.active[k]
        return [type("R", (), {"request": type("Q", (), {"id": k})})() for k in done]


@pytest.mark.parametrize("step_level", [True, False])
def test_engine_admission_holds_at_most_max_batch_images_in_flight(step_level):
    s = et.Setup({256: type("M", (), {"name": "m"})()}, steps=3, guidance=1.0, max_batch=8, wait_s=0.0,
                 window_s=1.0, drain_s=1.0)
    jobs = [et.Job(0, 0.0, 5, 256, 1), et.Job(1, 0.0, 2, 256, 1), et.Job(2, 0.0, 3, 256, 1), et.Job(3, 0.0, 12, 256, 1)]
    rec = _Recorder()
    et.run_engine(rec, jobs, s, step_level=step_level, stop_s=60.0)
    assert all(j.finished is not None and j.done_images == j.n for j in jobs)
    assert max(rec.in_flight) <= 8 or (not step_level and max(rec.in_flight) == 12)  # a larger request runs alone
    starts = [int(x.split(":")[0]) for x in rec.starts]
    assert starts == sorted(starts)  # first come, first served
    if step_level:  # images join as others leave: the engine is kept full
        assert rec.in_flight[:4] == [8, 8, 8, 8]
    else:  # whole requests, together only when the engine is idle: 5+2, then 3, then 12 alone
        assert rec.in_flight == [7] * 3 + [3] * 3 + [12] * 3


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
    public = et.publish(merged)  # the schema: figures keyed by system, for 256 px
    assert public["max_images_per_s"] == {"a": 30.0, "c": 5.0, "d": 12.0}
    assert public["max_images_per_s_by_workload"]["mixed"] == {"a": 20.0, "c": 10.0}

    rerun = _part(["a", "c", "d"], "256", [("a", 5, 5.0, 250, 0)], {"a/256": 31.0}, padded=(0, 100))
    again = et.merge([p256, mixed, rerun])  # a rerun of the same part replaces it whole
    assert again["max_images_per_s"]["a/256"] == 31.0 and again["padding_fraction"] == pytest.approx(30 / 200)
    assert [r["p99_ms"] for r in again["rows"] if r["system"] == "a" and r["workload"] == "256"] == [250]

    with pytest.raises(SystemExit, match="different machines"):
        et.merge([p256, {**mixed, "gpu": "other"}])


def test_the_harness_runs_end_to_end(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "engine_throughput.py"), "--smoke",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "engine_throughput_smoke.json").read_text())
    assert {r["system"] for r in result["rows"]} == {"a", "b", "c", "d", "e", "f"}  # ours and diffusers' DiTPipeline
    assert all(r["unfinished"] == 0 and r["images_per_s"] > 0 for r in result["rows"])
    assert result["real_rows"] > 0 and 0.0 <= result["padding_fraction"] < 1.0
    assert set(result["max_images_per_s"]) == {"a", "b", "c", "d", "e", "f"}
    assert result["max_images_per_s_by_workload"]["single"] == result["max_images_per_s"]
    assert set(result["single_image_ms"]) == {"a", "c", "e", "f"} and result["targets"]
    assert {"single 256 px image (e) <= 150 ms", "single 256 px image (f) <= 150 ms"} <= {
        t["target"] for t in result["targets"]}
