"""The service on a GPU: the scheduler starts one worker per GPU (``num_gpus=1``), the worker captures
its graphs once, and a job's steps are graph replays (no eager fallbacks), with correct digits."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from dit_serve.client import Client
from dit_serve.server.service import Service

from .conftest import oracle, patient, service_config

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _metric(text: str, name: str) -> list[float]:
    return [float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)]


def test_a_gpu_worker_serves_a_job_through_graphs(digits_model, tmp_path):
    import ray
    import torch

    cfg = service_config(tmp_path, digits_model, workers={"max_batch": 64})
    with Service(cfg) as svc, Client(svc.url) as client:
        deadline = time.monotonic() + 300
        while not [w for w in svc.scheduler.workers.values() if w.models]:
            assert time.monotonic() < deadline, "no worker became ready"
            time.sleep(0.2)
        workers = list(svc.scheduler.workers.values())
        assert len(workers) == torch.cuda.device_count() and {w.plan.resource for w in workers} == {"GPU"}
        info = ray.get(workers[0].handle.info.remote())
        assert info["device"].startswith("cuda") and info["backend"] == "graphs"
        assert set(info["backends"].values()) == {"full"}  # class-conditional DiTs: whole-step graphs

        job = client.submit(list(range(10)), num_per_label=10, seed=5, steps=50)
        job = client.wait(job, progress=False, timeout=patient(300))
        assert job.state == "done" and job.num_items == 100
        assert oracle(client.images(job), [it.label for it in job.items]) >= 0.9

        time.sleep(2 * cfg.scheduler.heartbeat_seconds)  # the last poll's counters reach the metrics
        text = httpx.get(f"{svc.url}/metrics").text
        assert sum(_metric(text, "dit_serve_graph_replays")) > 0
        assert sum(_metric(text, "dit_serve_graph_eager_fallbacks")) == 0
