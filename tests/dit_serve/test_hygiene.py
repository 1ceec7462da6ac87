"""Nothing `dit-serve serve` started outlives a SIGKILL of it: its local Ray (GCS, raylet, agents,
workers) and the watchdog that stops them. And a pid file left by a dead dit-serve makes the next
start stop what it names, only where the start time still matches."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dit_serve.server import reaper

from .conftest import patient, serving_url

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _proc(pid: int) -> tuple[int, int, int, str] | None:
    """(ppid, session, start time, name) of a live process; None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, session, ... start time at [19]
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    return None if fields[0] in "ZX" else (int(fields[1]), int(fields[3]), int(fields[19]), name)


def _family(root: int) -> dict[tuple[int, int], str]:
    """Every live descendant of ``root`` and every other process of its session (whose id is
    ``root``), as (pid, start time) -> name."""
    table = {int(e.name): info for e in os.scandir("/proc") if e.name.isdigit() and (info := _proc(int(e.name)))}
    found = {(pid, start): name for pid, (_, sid, start, name) in table.items() if sid == root and pid != root}
    stack = [root]
    while stack:
        parent = stack.pop()
        for pid, (ppid, _, start, name) in table.items():
            if ppid == parent:
                found[(pid, start)] = name
                stack.append(pid)
    return found


def _alive(procs: dict[tuple[int, int], str]) -> dict[tuple[int, int], str]:
    """Those of ``procs`` still running: same pid, same start time, not a zombie."""
    return {(pid, start): name for (pid, start), name in procs.items() if (info := _proc(pid)) and info[2] == start}


def _wait_for_worker(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + patient(timeout)
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/healthz", timeout=2).json().get("workers") == 1:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"no worker ready: {log.read_text()[-3000:]}")


def _without_ray_auth_mode() -> dict:
    """The environment as a user's shell has it: Ray's auth mode unset (Ray then warns unless told)."""
    return {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}


@pytest.mark.slow
def test_sigkill_of_serve_leaves_no_process_behind(digits_model, tmp_path):
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "dit_serve.cli", "serve", "--port", "0",
                             "--data-dir", str(tmp_path / "data"), "--model", digits_model],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=log.open("wb"), text=True,
                            start_new_session=True, env={**_without_ray_auth_mode(), "RAY_ADDRESS": "local"})
    # "local": a Ray of its own; without an address ray.init() joins the cluster another test may have started
    started = {}
    try:
        _wait_for_worker(serving_url(proc, log), proc, log)
        assert "Token authentication" not in log.read_text()  # Ray's warning on every start, quieted
        started = _family(proc.pid)
        names = set(started.values())
        # the snapshot holds Ray's processes (an actor's title names the method it runs: ray::Worker.poll)
        assert {"gcs_server", "raylet"} <= names and any(n.startswith("ray::Worker") for n in names), names
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 30  # the watchdog acts at once; a loaded machine may be slow to run it
        while _alive(started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(started), f"still running 30 s after the SIGKILL: {_alive(started)}"
        assert "stopped its" in log.read_text()  # the watchdog says what it did
        assert not (tmp_path / "data" / reaper.PID_FILE).exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid, _ in _alive(started):  # leave nothing behind on a failure either
            os.kill(pid, signal.SIGKILL)


def _sleeper() -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(["sleep", "60"])
    return proc, reaper.start_time(proc.pid)


def _pid_file(tmp_path: Path, owner: tuple[int, int], processes: list[tuple[int, int]]) -> Path:
    path = tmp_path / reaper.PID_FILE
    path.write_text(json.dumps({"boot_id": reaper.boot_id(), "owner": owner, "processes": processes}))
    return path


def test_leftovers_of_a_dead_dit_serve_are_stopped_when_their_start_time_matches(tmp_path, caplog):
    owner, owner_start = _sleeper()
    owner.kill()
    owner.wait()
    (left, left_start), (other, other_start) = _sleeper(), _sleeper()
    try:
        # `other` has the pid of a recorded process but not its start time: a reused pid, not ours
        path = _pid_file(tmp_path, (owner.pid, owner_start), [(left.pid, left_start), (other.pid, other_start + 1)])
        with caplog.at_level(logging.WARNING, logger="dit_serve.server.reaper"):
            assert reaper.clean_leftovers(path) == 1
        assert left.wait(30) == -signal.SIGTERM
        assert other.poll() is None
        assert not path.exists()
        assert "cleaned up 1 processes left by a previous dit-serve that did not stop cleanly" in caplog.text
    finally:
        left.kill(), other.kill()
        left.wait(), other.wait()


def test_leftovers_of_a_running_dit_serve_are_not_touched(tmp_path):
    proc, start = _sleeper()
    try:
        path = _pid_file(tmp_path, (os.getpid(), reaper.start_time(os.getpid())), [(proc.pid, start)])
        assert reaper.clean_leftovers(path) == 0  # its owner runs: another dit-serve's Ray
        assert proc.poll() is None and path.exists()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_the_local_ray_keeps_no_idle_worker_processes(digits_model, tmp_path):
    """The service's local Ray runs its worker actors and nothing else: no pool of prestarted idle
    Python workers (Ray starts up to one per core by default). An answer the size of a worker's poll with
    one 256 px PNG (300 KB) comes back inline, not through the object store (no node holds it), and the
    service's interpreter switches threads every SWITCH_INTERVAL_S."""
    import sys

    import ray

    from dit_serve.server.service import SWITCH_INTERVAL_S, Service

    from .conftest import service_config

    @ray.remote(num_cpus=0)
    class Answer:
        def png_sized(self) -> bytes:
            return b"\x89" * 300_000

    with Service(service_config(tmp_path, digits_model, ray={"num_cpus": 8})) as svc:
        assert svc.wait_ready(patient(120))
        assert sys.getswitchinterval() == SWITCH_INTERVAL_S
        ref = Answer.remote().png_sized.remote()
        assert len(ray.get(ref)) == 300_000
        assert ray.experimental.get_object_locations([ref])[ref]["node_ids"] == []
        time.sleep(5.0)  # Ray prestarts its pool within a second or two of the driver's start
        idle = [pid for (pid, _), name in _family(os.getpid()).items() if name.startswith("ray::IDLE")]
    assert idle == [], f"{len(idle)} idle Ray workers"

