"""Autoscaling in the whole service, on a local Ray with CPU workers (the [workers] resource "CPU": its
``cpu_workers`` are the slots): no worker until a job comes, idle workers stop, a job waits for a worker while
none serves its model. Ray's autoscaler itself is in test_autoscaler_fake_cluster.py."""

from __future__ import annotations

import time

import httpx
import pytest
import ray

from dit_serve.client import Client
from dit_serve.server.service import Service

from .conftest import patient, service_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # never a stray cluster
    try:
        yield
    finally:
        ray.shutdown()


def _wait_for(cond, timeout: float = 90.0, what: str = "condition"):
    deadline = time.monotonic() + patient(timeout)
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def _pngs(svc: Service, job_id: str) -> list[str]:
    return sorted(p.name for p in (svc.config.store.data_dir / "images" / job_id).iterdir())


def test_scale_from_zero_to_zero_and_back(local_ray, digits_model, tmp_path):
    """min_workers 0: no worker at start; a job starts one (its GET says it waits for a worker meanwhile), the
    worker stops once idle for idle_timeout_s (a clean stop: no crash, nothing requeued), and a second job
    starts one again. Every item ends done, with one PNG."""
    cfg = service_config(tmp_path, digits_model, workers={"resource": "CPU", "max_inflight": 8},
                         autoscale={"enabled": True, "min_workers": 0, "max_workers": 1, "idle_timeout_s": 1.0})
    with Service(cfg) as svc, Client(svc.url) as client:
        time.sleep(1.0)
        assert svc.scheduler.workers == {}
        for round_ in range(2):
            job = client.submit(labels=list(range(10)), steps=10, seed=round_)
            assert client.get(job, items=False).waiting.startswith("waiting for a worker: ")
            workers = _wait_for(lambda: httpx.get(f"{svc.url}/v1/workers").json()["data"], what="a worker listed")
            assert [(w["name"], w["resource"]) for w in workers] == [("worker-cpu-0", "CPU")]
            assert "digits" in workers[0]["models"] + workers[0]["loading"]
            job = client.wait(job, progress=False, timeout=patient(120))
            assert job.state == "done" and job.waiting is None
            assert _pngs(svc, job.id) == [f"{i:05d}.png" for i in range(10)]
            assert all(it.attempts == 1 and it.requeues == 0 for it in job.items)
            _wait_for(lambda: svc.scheduler.workers == {}, what="the idle worker to stop")
            _wait_for(lambda: svc.store.list_workers() == [], what="the store to say so")  # the same reconcile's end
            assert svc.scheduler.asked == 0
        assert svc.metrics.worker_crashes._value.get() == 0
        assert svc.store.list_workers() == [] and httpx.get(f"{svc.url}/v1/workers").json() == {"data": []}
        for line in ("dit_serve_scale_from_zero_seconds_count 2.0", "dit_serve_autoscale_requested_workers 0.0",
                     'dit_serve_autoscale_desired_workers{model="digits"} 0.0',
                     'dit_serve_autoscale_backlog_gpu_seconds{model="digits"} 0.0',
                     'dit_serve_workers_serving{model="digits"} 0.0'):  # gauges: set at each reconcile
            _wait_for(lambda: line in httpx.get(f"{svc.url}/metrics").text, 60, line)


def test_a_worker_switches_model_once_for_a_backlog_of_the_other_model(local_ray, digits_model, tmp_path):
    """Two models, two worker slots, one model per worker: a digits backlog starts two digits workers; then a
    digits-text job finds both idle (they stay: a long idle timeout) and one of them switches, once. No item
    fails, none runs twice, and each has one PNG."""
    cfg = service_config(tmp_path, digits_model,
                         workers={"models": ("digits", "digits-text"), "resource": "CPU", "cpu_workers": 2,
                                  "max_inflight": 8},
                         autoscale={"enabled": True, "max_workers": 2, "idle_timeout_s": 600, "target_drain_s": 1,
                                    "default_rate": 100})
    with Service(cfg) as svc, Client(svc.url) as client:
        a = client.submit(labels=list(range(8)), num_per_label=2, steps=50, seed=1)  # 16 items: two workers' worth
        _wait_for(lambda: len(svc.scheduler.workers) == 2, what="two workers")
        a = client.wait(a, progress=False, timeout=patient(120))
        assert a.state == "done"
        assert {tuple(w.models) for w in svc.scheduler.workers.values()} == {("digits",)}
        b = client.submit(prompts=["a handwritten seven", "a three"], num_per_prompt=3, steps=10, seed=2,
                          model="digits-text")
        b = client.wait(b, progress=False, timeout=patient(120))
        assert b.state == "done"
        assert svc.scheduler.switches == {"digits-text": 1}
        assert sorted(tuple(w.models) for w in svc.scheduler.workers.values()) == [("digits",), ("digits-text",)]
        for job in (a, b):
            assert all(it.state == "done" and it.attempts == 1 for it in job.items)
            assert _pngs(svc, job.id) == [f"{i:05d}.png" for i in range(job.num_items)]
        assert svc.metrics.worker_crashes._value.get() == 0 and "digits-text" in svc.scheduler.switch_s
        for line in ('dit_serve_model_switches_total{model="digits-text"} 1.0', "dit_serve_model_switch_seconds_count 1.0",
                     'dit_serve_workers_serving{model="digits"} 1.0', 'dit_serve_workers_serving{model="digits-text"} 1.0'):
            _wait_for(lambda: line in httpx.get(f"{svc.url}/metrics").text, 60, line)  # gauges: at each reconcile
        _wait_for(lambda: sorted(tuple(w["models"]) for w in httpx.get(f"{svc.url}/v1/workers").json()["data"])
                  == [("digits",), ("digits-text",)], 15, "the workers listed with their models")
