"""The chaos benchmark's pure parts: the process tree read from /proc, the fuzz accounting on a made-up
HAR, the checks and the report's table on made-up results, and that its command line starts. The
benchmarks themselves start services and take minutes; they are not run here."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("chaos", ROOT / "bench" / "chaos.py")
chaos = sys.modules["chaos"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chaos)

SLEEPER = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
          "time.sleep(60)"


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_the_process_tree_holds_a_child_and_its_child_until_they_are_killed():
    child = subprocess.Popen([sys.executable, "-c", SLEEPER])
    try:
        _wait_for(lambda: len(chaos.descendants(child.pid)) == 1)  # the grandchild has started
        tree = chaos.descendants(os.getpid())
        mine = {p.pid: p for p in tree}
        assert child.pid in mine and mine[child.pid].ppid == os.getpid()
        grandchild = chaos.descendants(child.pid)[0]
        assert grandchild.ppid == child.pid and grandchild.pid in mine
        assert "time.sleep(60)" in grandchild.cmdline
        assert chaos.tree_rss(child.pid) > chaos.rss_bytes([child.pid]) > 0
        chaos.kill_all([mine[child.pid], grandchild])
        child.wait(10)
        _wait_for(lambda: not chaos.still_alive([grandchild]))  # reaped by init once its parent is gone
    finally:
        if child.poll() is None:
            child.kill()


def test_a_process_name_with_spaces_and_parentheses_is_parsed(tmp_path):
    odd = tmp_path / "a (b) c"  # the name in /proc/<pid>/stat is "(a (b) c)": split at the last ")"
    odd.symlink_to(sys.executable)
    proc = subprocess.Popen([str(odd), "-I", "-S", "-c", "import time; time.sleep(30)"])
    try:
        _wait_for(lambda: proc.pid in chaos.processes())
        p = chaos.processes()[proc.pid]
        assert p.ppid == os.getpid() and p.title == str(odd).split(" ")[0] and p.start > 0
    finally:
        proc.kill()
        proc.wait()


def test_a_reused_pid_is_not_the_same_process():
    me = chaos.processes()[os.getpid()]
    assert chaos.still_alive([me]) == [me]
    assert chaos.still_alive([chaos.Proc(me.pid, me.ppid, me.start + 1, me.cmdline)]) == []


def _entry(method, url, status, headers=(), query=()):
    return {"request": {"method": method, "url": url, "queryString": [{"name": k, "value": v} for k, v in query]},
            "response": {"status": status, "headers": [{"name": k, "value": v} for k, v in headers]}}


def test_fuzz_accounting_counts_stored_and_purged_jobs_and_every_5xx():
    base = "http://127.0.0.1:1234"
    entries = [_entry("POST", f"{base}/v1/jobs", 202),                                           # +1
               _entry("POST", f"{base}/v1/jobs", 202, [("idempotent-replayed", "true")]),        # a replay
               _entry("POST", f"{base}/v1/jobs", 400), _entry("POST", f"{base}/v1/jobs", 401),
               _entry("POST", f"{base}/v1/images/generations", 200),                              # +1
               _entry("DELETE", f"{base}/v1/jobs/x?purge=True", 200, query=[("purge", "True")]),  # -1
               _entry("DELETE", f"{base}/v1/jobs/y", 200),                                        # a cancel
               _entry("GET", f"{base}/v1/jobs?offset=99", 500)]
    rounds = [{"cases": 8, "failures": {"ST101 Server error": 1}, "version": "9.9"}]
    stopped = {"exit_code": 0, "left_running": []}
    r = chaos.fuzz_result(rounds, entries, before=3, after=4, target=8, stopped=stopped)  # 3 + 2 - 1 = 4
    assert (r["summary"]["accepted"], r["summary"]["purged"], r["summary"]["5xx"]) == (2, 1, 1)
    assert r["checks"] == {"0 5xx": False, "cases >= 8": True, "stored == accepted - purged": True,
                           "SIGTERM exits 0, nothing left": True}
    assert r["details"]["server_errors"] == [f"GET {base}/v1/jobs?offset=99 -> 500"]
    assert not chaos.fuzz_result(rounds, entries, 3, 5, 9, stopped)["checks"]["stored == accepted - purged"]


def test_per_item_fields_show_every_integer_counter():
    items = [{"index": i, "label": i % 10, "seed": i, "step": 20, "total_steps": 20, "state": "done",
              "attempts": 1 + (i < 2), "requeues": 0, "error": None} for i in range(5)]
    assert chaos.per_item_fields(items) == {"attempts (max; histogram)": "2; {1: 3, 2: 2}",
                                            "requeues (max; histogram)": "0; {0: 5}"}


def test_overload_checks_need_a_bound_and_retry_after_on_every_429():
    from collections import Counter

    args = type("A", (), {"max_queued": 100})()
    load = {"status": Counter({"202": 30, "429": 4}), "retry_after": Counter({True: 3, False: 1}),
            "images_offered": 150, "images_accepted": 120, "seconds": 10.0, "behind": 0}
    samples = [{"t_s": 0.0, "queue_depth": 0, "running": 0}, {"t_s": 2.0, "queue_depth": 36, "running": 64},
               {"t_s": 4.0, "queue_depth": 90, "running": None}]  # 36 + 64 = 100: at the bound
    stopped = {"exit_code": 0, "left_running": ["ray::DashboardAgent"]}
    r = chaos.overload_result(args, 10.0, 20.0, load, samples, 2**30, 2**30 + 2**20, True, stopped)
    assert r["checks"] == {"0 5xx": True, "every 429 has Retry-After": False, "queued + running within the bound": True,
                           "no transport errors": True, "SIGTERM exits 0, nothing left": False}  # 4 s: no trend
    assert "not judged" in r["summary"]["rss trend MiB/min, second half"]
    flat = "memory flat (RSS trend over the second half <= 0.5 MiB/min)"
    long = [{"t_s": t, "queue_depth": 1, "running": 1} for t in (0.0, 150.0, 200.0, 250.0, 300.0)]
    assert chaos.overload_result(args, 10.0, 20.0, load, long, 0, 0, True, stopped)["checks"][flat] is False  # no RSS
    for x, mb in zip(long, (100, 100, 101, 102, 103)):
        x["rss_mb"] = mb
    assert chaos.overload_result(args, 10.0, 20.0, load, long, 0, 0, True, stopped)["checks"][flat] is False  # 1.2/min
    for x in long:
        x["rss_mb"] = 100
    assert chaos.overload_result(args, 10.0, 20.0, load, long, 0, 0, True, stopped)["checks"][flat] is True
    assert r["summary"]["429 with Retry-After"] == "3/4" and r["summary"]["sent images/s"] == 15.0
    assert (r["summary"]["queue depth max"], r["summary"]["queued + running max"]) == (90, 100)
    args.max_queued = 99
    assert not chaos.overload_result(args, 10.0, 20.0, load, samples, 0, 0, True, stopped)["checks"][
        "queued + running within the bound"]
    assert not chaos.overload_result(args, 10.0, 20.0, load, samples, 0, 0, False, stopped)["checks"][
        "queued + running within the bound"]  # a service without a bound cannot pass


def test_the_report_is_written_and_tabled(tmp_path):
    result = {"summary": {"kills": "2/2", "done": 20, "attempts (max; histogram)": "3; {3: 20}"},
              "checks": {"0 lost": True, "0 failed": False}, "details": {"kills": [{"t_s": 1.5}]}}
    extra = {"hardware": {"cpu": "test"}, "command": "python bench/chaos.py worker-kill --smoke"}
    path = chaos.write_report("worker-kill", result, tmp_path / "out", smoke=True, extra=extra)
    assert path == tmp_path / "out" / "chaos_worker_kill_smoke.json"
    report = json.loads(path.read_text())
    assert report["ok"] is False and report["smoke"] is True and report["hardware"] == {"cpu": "test"}
    lines = chaos.format_table(report).splitlines()
    assert lines[0] == "worker-kill (smoke): FAILED"
    assert [ln.split() for ln in lines[1:]] == [["kills", "2/2"], ["done", "20"],
                                               ["attempts", "(max;", "histogram)", "3;", "{3:", "20}"],
                                               ["check:", "0", "lost", "ok"], ["check:", "0", "failed", "FAILED"]]
    assert chaos.write_report("fuzz", result, tmp_path, smoke=False, extra={}).name == "chaos_fuzz.json"


def test_the_command_line_starts():
    out = subprocess.run([sys.executable, "bench/chaos.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    for name in ("worker-kill", "serve-kill", "fuzz", "overload", "--smoke"):
        assert name in out.stdout


def test_memory_growth_is_measured_over_the_second_half_per_process():
    samples = [{"t_s": float(t), "rss_mb": 100.0 + t, "rss_mb_by_process": {"serve": 50.0 + t, "raylet": 30.0}}
               for t in range(0, 101, 10)]
    samples[-1]["rss_mb_by_process"]["gcs_server"] = 2.0  # a process that appeared late counts from 0
    g = chaos.memory_growth(samples)
    assert g["total"] == 50.0 and g["by_process"] == {"gcs_server": 2.0, "raylet": 0.0, "serve": 50.0}
    assert chaos.memory_growth([]) == {"total": None, "by_process": {}}


def test_memory_is_flat_only_when_the_second_half_trend_is():
    flat = [{"t_s": float(t), "rss_mb": 1000.0 + min(t, 300) * 0.1 + (t % 20) * 0.05} for t in range(0, 1201, 10)]
    assert chaos.memory_slope(flat) <= chaos.FLAT_MIB_PER_MIN  # warm-up growth in the first half only
    creeping = [{"t_s": float(t), "rss_mb": 1000.0 + t * 0.05} for t in range(0, 601, 10)]  # 3 MiB/min
    assert abs(chaos.memory_slope(creeping) - 3.0) < 1e-6


def test_autoscale_runs_the_kill_benches_from_no_worker(tmp_path):
    """--autoscale: the serve's config turns [autoscale] on from no worker (CPU workers without CUDA), beside what
    the bench writes itself; the benches it does not apply to refuse it."""
    import pytest
    import torch

    from dit_serve.server.config import load_config

    args = chaos.build_parser().parse_args(["serve-kill", "--autoscale", "--autoscale-workers", "3",
                                            "--idle-timeout", "4"])
    cfg = load_config(chaos.write_config(tmp_path / "a.toml", args, "[store]\nlease_seconds = 10\n"))
    a = cfg.autoscale
    assert (a.enabled, a.min_workers, a.max_workers, a.idle_timeout_s) == (True, 0, 3, 4.0)
    assert cfg.store.lease_seconds == 10
    if not torch.cuda.is_available():
        assert (cfg.workers.resource, cfg.workers.cpu_workers) == ("CPU", 3)
    assert chaos.write_config(tmp_path / "b.toml", chaos.build_parser().parse_args(["worker-kill"])) is None
    for bench in ("fuzz", "overload"):
        with pytest.raises(SystemExit) as e:
            chaos.main([bench, "--autoscale"])
        assert e.value.code == 2
