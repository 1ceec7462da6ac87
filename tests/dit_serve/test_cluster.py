"""Scaling with the cluster, on one machine with ``ray.cluster_utils.Cluster``: workers start on nodes
that bring the worker resource, and when a node leaves mid-job its items finish on another node,
each with exactly one PNG. (A custom resource stands in for GPUs, which this machine lacks.)"""

from __future__ import annotations

import time

import pytest
import ray
from ray.cluster_utils import Cluster

from dit_serve.client import Client
from dit_serve.server.service import Service

from .conftest import oracle, patient, service_config

pytestmark = pytest.mark.slow
RESOURCE = "dit_worker"


def _wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + patient(timeout)
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def _ready_nodes(svc: Service) -> set[str]:
    return {w.plan.node_id for w in list(svc.scheduler.workers.values()) if w.ready}


def test_workers_follow_nodes(digits_model, tmp_path):
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})  # the head has no worker resource
    ray.init(address=cluster.address, log_to_driver=False)
    cfg = service_config(tmp_path, digits_model, workers={"resource": RESOURCE, "max_inflight": 8})
    try:
        with Service(cfg) as svc, Client(svc.url) as client:
            # 80 items of 200 steps: more than one worker finishes before the second node's worker is up
            job = client.submit(labels=list(range(10)), num_per_label=8, steps=200, seed=70)
            time.sleep(1.0)
            assert svc.scheduler.workers == {} and client.get(job, items=False).state == "queued"

            first = cluster.add_node(num_cpus=1, resources={RESOURCE: 1})
            _wait_for(lambda: _ready_nodes(svc) == {first.node_id}, 120, "a worker on the first node")
            second = cluster.add_node(num_cpus=1, resources={RESOURCE: 1})
            _wait_for(lambda: _ready_nodes(svc) == {first.node_id, second.node_id}, 120, "a worker on each node")
            _wait_for(lambda: all(w.leases for w in svc.scheduler.workers.values()), 60, "both workers busy")

            cluster.remove_node(first)  # mid-job: its leased items must return to the queue
            _wait_for(lambda: _ready_nodes(svc) == {second.node_id}, 60, "the first node's worker to go")
            job = client.wait(job, progress=False, timeout=patient(300))
            assert job.state == "done"
            assert max(it.attempts for it in job.items) == 2  # some items ran again on the second node
            pngs = sorted(p.name for p in (tmp_path / "images" / job.id).iterdir())
            assert pngs == [f"{i:05d}.png" for i in range(80)]
            assert oracle(client.images(job), [it.label for it in job.items]) >= 0.8
    finally:
        ray.shutdown()
        cluster.shutdown()
