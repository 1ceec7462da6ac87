"""Kill `dit-serve serve` (API, scheduler, its local Ray and worker) with SIGKILL mid-job, start it
again on the same store: the job completes, every item with exactly one PNG. Then SIGTERM drains:
no new work is leased, the running items finish, and it exits cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dit_serve.client import Client

from .conftest import oracle, patient

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(config: Path, log: Path) -> subprocess.Popen:
    # its own session, so the kill below reaches the Ray processes it started and nothing else
    return subprocess.Popen([sys.executable, "-m", "dit_serve.cli", "serve", "--config", str(config)], cwd=ROOT,
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + patient(timeout)
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/healthz", timeout=2).json().get("workers"):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"service not ready: {log.read_text()[-3000:]}")


def _started(tmp_path: Path, model: str, drain_seconds: int, store: str = "") -> tuple:
    """`dit-serve serve` on a free port with its data under tmp_path: (proc, url, data dir, log, config),
    once its worker is ready."""
    port, data, log = _free_port(), tmp_path / "data", tmp_path / "serve.log"
    config = tmp_path / "dit-serve.toml"
    config.write_text(f'[server]\nport = {port}\n[store]\ndata_dir = "{data}"\n{store}'
                      f'[ray]\nnum_cpus = 2\n[workers]\nmodels = ["{model}"]\nmax_batch = 16\n'
                      f'[scheduler]\ndrain_seconds = {drain_seconds}\n')
    url = f"http://127.0.0.1:{port}"
    proc = _serve(config, log)
    try:
        _wait_ready(url, proc, log)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc, url, data, log, config


def test_restart_mid_job_loses_nothing(digits_model, tmp_path):
    proc, url, data, log, config = _started(tmp_path, digits_model, 60, store="lease_seconds = 4\n")
    try:
        client = Client(url)
        job = client.submit(labels=list(range(10)), num_per_label=2, steps=250, seed=21)
        deadline = time.monotonic() + 60
        while client.get(job, items=False).steps_done == 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)  # no goodbye: leases are left to expire
        proc.wait(30)
        proc = _serve(config, log)
        _wait_ready(url, proc, log)
        job = client.wait(job, progress=False, timeout=patient(180))
        assert job.state == "done", job
        assert sorted(p.name for p in (data / "images" / job.id).iterdir()) == [f"{i:05d}.png" for i in range(20)]
        assert max(it.attempts for it in job.items) == 2
        assert oracle(client.images(job), [it.label for it in job.items]) >= 0.8
        running = client.submit(labels=[1, 2], steps=200, seed=3)
        while client.get(running, items=False).steps_done == 0:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert "stopping (draining" in log.read_text()
        from dit_serve.server.store import Store

        store = Store(f"sqlite:///{data / 'jobs.db'}", data)
        try:
            assert store.get_job(running.id).counts == {"done": 2}  # the drain let them finish
        finally:
            store.close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_sigterm_ends_event_streams_at_once_and_a_second_one_skips_the_drain(digits_model, tmp_path):
    """uvicorn handles the signals: the first SIGTERM closes the listener and ends open event streams
    (their clients resume elsewhere) at once, then the drain starts; a second SIGTERM ends the drain
    early, the process exits 0 and the unfinished items are back in the queue, not lost."""
    import threading

    proc, url, data, log, _ = _started(tmp_path, digits_model, 120)
    try:
        client = Client(url)
        job = client.submit(labels=list(range(8)), steps=1000, seed=1)
        while client.get(job, items=False).steps_done == 0:
            time.sleep(0.05)
        ended = threading.Event()

        def follow():
            for _ in Client(url).events(job):
                pass

        def run():
            try:
                follow()
            except Exception:  # the stream ends with the server, one way or another
                pass
            ended.set()

        threading.Thread(target=run, daemon=True).start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert ended.wait(30), "an open event stream held the shutdown"
        deadline = time.monotonic() + 30
        while "stopping (draining" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        assert proc.poll() is None, "the drain should still be running"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        from dit_serve.server.store import Store

        store = Store(f"sqlite:///{data / 'jobs.db'}", data)
        try:
            counts = store.get_job(job.id).counts
        finally:
            store.close()
        assert set(counts) <= {"queued", "done"} and counts.get("queued", 0) > 0, counts
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
