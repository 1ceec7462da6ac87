"""Autoscaling with Ray's real autoscaler, on one machine: a head node started with an autoscaling config whose
node provider is Ray's fake multi-node provider (``ray.autoscaler._private.fake_multi_node``: each "node" it
launches is a raylet and its processes on this machine). Worker nodes bring a ``dit_worker`` resource, which
stands in for a GPU; the service runs with [autoscale] on and min_workers 0.

Three details of Ray 2.60 shape the head's start: the wheel lacks the provider's defaults file
(``fake_multi_node/example.yaml``), so the provider is named as an external one (its class path), which Ray
fills with minimal defaults; ``ray start`` writes the cluster's address into its temp dir
(``ray_current_cluster``, which a bare ``ray.init()`` of another test would join), so the head gets a temp dir
of its own; and the head authenticates as this process does (token authentication, which a local
``ray.init()`` earlier in the same process turns on). Every process of this cluster (head, monitor, fake nodes, their workers) is a descendant of the
``ray start`` this test runs, and is stopped by its process ids at the end."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import ray
import yaml

from dit_serve.client import Client
from dit_serve.server import reaper
from dit_serve.server.service import Service

from .conftest import patient, service_config

pytestmark = pytest.mark.slow
RESOURCE = "dit_worker"
PROVIDER = "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster_config(gcs_address: str, max_nodes: int = 2) -> dict:
    return {
        "cluster_name": "dit-serve-fake", "max_workers": max_nodes, "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.1,  # a node without work goes after 6 s
        "provider": {"type": "external", "module": PROVIDER, "gcs_address": gcs_address, "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True,
                     "launch_multiple": True},  # the nodes of one launch together (else one an update)
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
            "ray.worker.dit": {"resources": {"CPU": 1, RESOURCE: 1}, "node_config": {}, "min_workers": 0,
                               "max_workers": max_nodes}},
        "head_node_type": "ray.head.default", "auth": {}, "docker": {}, "file_mounts": {},
        "cluster_synced_files": [], "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
        "head_start_ray_commands": [], "worker_start_ray_commands": []}


@dataclass
class FakeCluster:
    address: str
    config: Path  # the autoscaler's config: it reads the file again at every update

    def set_max_nodes(self, n: int) -> None:
        """Let the autoscaler keep at most ``n`` worker nodes: beyond them, it terminates nodes through its
        provider at its next update, busy or not (``max_workers_per_type``)."""
        self.config.write_text(yaml.safe_dump(_cluster_config(self.address, n)))


@pytest.fixture
def fake_cluster():
    """The head node with the autoscaler (an update a second), joined by this process."""
    tmp = Path(tempfile.mkdtemp(prefix="dsf-", dir="/tmp"))  # short: Ray's socket paths live under it
    port = _free_port()
    host = "127.0.0.1"
    config = tmp / "cluster.yaml"
    config.write_text(yaml.safe_dump(_cluster_config(f"{host}:{port}")))
    # the cluster authenticates as this process does: a local ray.init() earlier in the process turned token
    # authentication on for it (RAY_AUTH_MODE=token, the token in ~/.ray/auth_token), and then the GCS must send
    # the token to reach this process (else every actor it owns is taken for orphaned at once); else neither does
    auth = os.environ.get("RAY_AUTH_MODE", "disabled")
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_AUTH_MODE": auth,
           "RAY_TMPDIR": str(tmp)}
    log = open(tmp / "head.log", "w")
    head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", f"--port={port}",
                             f"--node-ip-address={host}", "--num-cpus=1", f"--autoscaling-config={config}",
                             f"--temp-dir={tmp / 'ray'}", "--include-dashboard=false", "--disable-usage-stats",
                             "--block"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    root = {(head.pid, reaper.start_time(head.pid))}
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                ray.init(address=f"{host}:{port}", log_to_driver=False)
                break
            except Exception:
                assert head.poll() is None and time.monotonic() < deadline, (tmp / "head.log").read_text()[-3000:]
                time.sleep(1.0)
        yield FakeCluster(f"{host}:{port}", config)
    finally:
        ray.shutdown()
        reaper.kill(reaper.with_descendants(root))  # by process id: this cluster's processes only
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + patient(timeout)
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def _worker_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(RESOURCE)}


def test_the_real_autoscaler_launches_nodes_for_the_backlog_and_terminates_them_when_idle(fake_cluster, digits_model,
                                                                                          tmp_path):
    """min_workers 0: no worker node until a job comes; the scheduler's request makes the autoscaler launch
    nodes and workers start on them. Mid-job the autoscaler is allowed one node only, and terminates one of the
    two, busy, through its provider: the items its worker held go back to the queue uncharged (a requeue, no
    crash) and finish on the other. Every item finishes once (one PNG each, one commit each), the request goes
    to 0, the idle workers stop and the autoscaler terminates their nodes; a second job scales from zero
    again."""
    cfg = service_config(tmp_path, digits_model,
                         workers={"resource": RESOURCE, "max_inflight": 8},
                         autoscale={"enabled": True, "min_workers": 0, "max_workers": 2, "idle_timeout_s": 2.0,
                                    "target_drain_s": 1.0, "default_rate": 100.0})
    with Service(cfg) as svc, Client(svc.url) as client:
        time.sleep(2.0)
        assert _worker_nodes() == set() and svc.scheduler.workers == {}
        done = 0
        # round 0: 64 items of 200 steps, up to 8 held by each of two workers at a time, the queue not drained for
        # seconds of stepping: the node goes while its worker holds items, however fast a loaded machine steps
        for round_, (labels, per_label, steps, want_nodes) in enumerate([(list(range(8)), 8, 200, 2),
                                                                          ([3], 4, 50, 1)]):
            job = client.submit(labels=labels, num_per_label=per_label, steps=steps, seed=round_)
            _wait_for(lambda: len(_worker_nodes()) >= want_nodes, 120, f"{want_nodes} worker node(s) launched")
            _wait_for(lambda: any(w.ready for w in svc.scheduler.workers.values()), 120, "a worker ready")
            # ready workers run on the launched nodes; a node whose worker was slow to take it (a loaded machine)
            # may have gone idle first and been replaced, its worker with it: so not every worker, nor the first nodes
            assert {w.plan.node_id for w in list(svc.scheduler.workers.values()) if w.ready} <= _worker_nodes()
            if round_ == 0:
                _wait_for(lambda: sum(bool(w.leases) for w in list(svc.scheduler.workers.values())) == 2, 120,
                          "both workers holding items")
                fake_cluster.set_max_nodes(1)  # the autoscaler terminates one busy node
                _wait_for(lambda: len(_worker_nodes()) == 1, 60, "one node terminated")
            job = client.wait(job, progress=False, timeout=patient(180))
            assert job.state == "done" and all(it.state == "done" and it.crashes == 0 for it in job.items)
            assert all(it.attempts == 1 + it.requeues for it in job.items)
            if round_ == 0:  # the terminated node's worker held items: they ran again, once
                assert 1 <= sum(it.requeues for it in job.items) <= 8
                assert svc.metrics.requeued.labels("infra")._value.get() == sum(it.requeues for it in job.items)
            else:
                assert all(it.attempts == 1 for it in job.items)
            pngs = sorted(p.name for p in (tmp_path / "images" / job.id).iterdir())
            assert pngs == [f"{i:05d}.png" for i in range(job.num_items)]
            done += job.num_items
            assert svc.metrics.items.labels("done")._value.get() == done  # each committed once
            _wait_for(lambda: svc.scheduler.asked == 0, 30, "the request lowered to nothing")
            _wait_for(lambda: svc.scheduler.workers == {}, 60, "the idle workers to stop")
            _wait_for(lambda: not _worker_nodes(), 90, "the autoscaler to terminate the idle nodes")
        metrics = httpx.get(f"{svc.url}/metrics").text
        assert "dit_serve_scale_from_zero_seconds_count 2.0" in metrics
        assert svc.metrics.worker_crashes._value.get() == 0
