"""Shared fixtures for the service tests: the shipped digits model, service configs, free data dirs."""

from __future__ import annotations

import os
import re
import select
import subprocess
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from dit_serve.server.config import Config

DIGITS_DIR = Path(__file__).resolve().parents[2] / "workers" / "models" / "digits"
# How many times its stated bound a test waits on what Ray workers do (start, run a job) before calling it hung: a
# busy machine (a runner shared with other jobs starts a worker in minutes, not seconds) is slow, not failing; a
# passing test never waits the bound out. DIT_SERVE_TEST_SLACK=1 gives the bare bounds.
SLACK = float(os.environ.get("DIT_SERVE_TEST_SLACK", "4"))


def patient(seconds: float) -> float:
    """``seconds`` of waiting on the service's workers, stretched by ``SLACK``."""
    return seconds * SLACK


@pytest.fixture(scope="session")
def digits_model() -> str:
    if not (DIGITS_DIR / "model_index.json").exists():
        pytest.skip("the shipped digits model (workers/models/digits) is missing")
    return "digits"


def service_config(data_dir: Path, model: str = "digits", **sections) -> Config:
    """A config for tests: free port, data under ``data_dir``, short leases, small buckets."""
    base = dict(server={"port": 0}, store={"data_dir": str(data_dir), "lease_seconds": 5.0},
                workers={"models": (model,), "max_batch": 32, "torch_threads": 1},
                scheduler={"reconcile_seconds": 0.5})
    for name, fields in sections.items():
        base.setdefault(name, {}).update(fields)
    return Config().with_overrides(**base)


def oracle(images, labels) -> float:
    """The digit classifier's accuracy on PIL images (8x8 grayscale) for the labels asked for."""
    from workers.models.digits import oracle_accuracy

    x = np.stack([np.asarray(im.convert("L"), dtype=np.float32) for im in images]) / 127.5 - 1.0  # (N, 8, 8)
    return oracle_accuracy(x, np.asarray(labels))


@pytest.fixture(scope="session")
def postgres_schema() -> str:
    """The URL of a schema of this test process's own in the PostgreSQL database that .ci/run starts (it sets
    DIT_SERVE_TEST_POSTGRES_URL): its connections put the schema first on their search path, so test processes
    sharing the server (pytest-xdist's workers, another checkout's run) never drop or read each other's tables.
    Dropped with everything in it at the end of the session."""
    url = os.environ.get("DIT_SERVE_TEST_POSTGRES_URL", "")
    if not url:
        pytest.skip("no PostgreSQL server: set DIT_SERVE_TEST_POSTGRES_URL (.ci/run starts one)")
    from sqlalchemy import create_engine, text

    from dit_serve.server.store import _driver_url

    schema = f"dit_serve_test_{os.getpid()}"
    engine = create_engine(_driver_url(url))
    with engine.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA IF NOT EXISTS {schema}"))
    try:
        yield f"{url}{'&' if '?' in url else '?'}options=-csearch_path%3D{schema}"
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        engine.dispose()


@pytest.fixture
def postgres_url(postgres_schema) -> str:
    """This process's PostgreSQL schema (``postgres_schema``), emptied for the test."""
    from sqlalchemy import create_engine

    from dit_serve.server.store import _driver_url, meta

    engine = create_engine(_driver_url(postgres_schema))
    meta.drop_all(engine)
    engine.dispose()
    return postgres_schema


@contextmanager
def running_service(data_dir: Path, model: str):
    """A Service with the digits worker ready, on a Ray of its own (2 CPUs) that ends with it."""
    import ray

    from dit_serve.server.service import Service

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # never a stray cluster
    try:
        with Service(service_config(data_dir, model)) as service:
            assert service.wait_ready(patient(120)), "the worker did not start"
            yield service
    finally:
        ray.shutdown()


def serving_url(proc: subprocess.Popen, log: Path, timeout: float = 120) -> str:
    """The URL in the line `dit-serve serve` prints on stdout once it listens."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    m = re.search(r"at (http://127\.0\.0\.1:\d+);", line)
    assert m, f"no serving line ({line!r}): {log.read_text()[-3000:]}"
    return m.group(1)
