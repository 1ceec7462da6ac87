"""The families added beside DiT, PixArt, SD3 and FLUX.1 (FLUX.2 [klein], Qwen-Image, Z-Image, Sana, Sana Sprint)
through the whole service, as users run it: real local Ray, one worker actor serving all five tiny random pipeline
directories (``workers/models/tiny_*.py``) at once, SQLite, uvicorn. A job per family through the SDK with the card's
sampler and a small step count finishes with a PNG of the card's native size per item and a manifest that records
them; an OpenAI images request comes back as a PNG; ``dit-serve submit --out`` writes its PNGs and manifest; and the
service's images are those of an engine run here on the same directory (to one uint8 level in a few pixels). One
service, about 20 s on 2 cores. The images themselves equal the diffusers pipelines' in
tests/workers/families/test_<family>.py."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import zipfile

import httpx
import numpy as np
import pytest
import ray
from PIL import Image

from dit_serve.client import Client
from dit_serve.server.service import Service
from workers.models.tiny_flux2 import make_tiny_flux2
from workers.models.tiny_qwenimage import make_tiny_qwenimage
from workers.models.tiny_sana import make_tiny_sana, make_tiny_sana_sprint
from workers.models.tiny_zimage import make_tiny_zimage
from workers.request.cards import read_card

from .conftest import patient, service_config

pytestmark = pytest.mark.slow

STEPS = 2  # every card's default is more (Sana Sprint's is 2): the override is what the jobs record
PROMPTS = ["a red cat", "a blue house"]
SEED = 7  # item i: SEED + i
# each tiny directory's builder, by the directory's name (the model's)
BUILDERS = {"klein-tiny": make_tiny_flux2, "qwen-tiny": make_tiny_qwenimage, "zimage-tiny": make_tiny_zimage,
            "sana-tiny": make_tiny_sana, "sana-sprint-tiny": make_tiny_sana_sprint}
NAMES = list(BUILDERS)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: make(root / name) for name, make in BUILDERS.items()}


@pytest.fixture(scope="module")
def svc(dirs, tmp_path_factory):
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # never a stray cluster
    try:
        models = tuple(str(d) for d in dirs.values())
        cfg = service_config(tmp_path_factory.mktemp("data"), models[0], workers={"models": models, "max_batch": 4})
        with Service(cfg) as service:
            assert service.wait_ready(patient(120)), "the worker did not start"
            yield service
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def client(svc):
    with Client(svc.url) as c:
        yield c


@pytest.fixture(scope="module")
def jobs(client):
    """One finished job per family, all submitted at once (the worker runs the five models side by side)."""
    queued = {name: client.submit(prompts=PROMPTS, model=name, steps=STEPS, seed=SEED) for name in NAMES}
    return {name: client.wait(job, progress=False, timeout=patient(90)) for name, job in queued.items()}


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(io.BytesIO(data)) as im:
        assert im.format == "PNG" and im.mode == "RGB"
        return im.size


@pytest.mark.parametrize("name", NAMES)
def test_a_job_per_family_through_the_sdk(client, jobs, dirs, name, tmp_path):
    """The card's sampler and guidance, STEPS steps: a PNG of the card's native size per item, and a manifest (the
    job's archive) that records the model, sampler, steps and each image's seed and prompt."""
    card, job = read_card(dirs[name]), jobs[name]
    assert job.state == "done", [it.error for it in job.items]
    assert (job.model, job.params.sampler, job.params.steps, job.params.guidance) == (
        name, card.defaults["sampler"], STEPS, card.defaults["guidance"])
    assert [it.seed for it in job.items] == [SEED, SEED + 1] and [it.prompt for it in job.items] == PROMPTS
    assert [_png_size(client.image_bytes(job, it.index)) for it in job.items] == [card.native_size] * 2
    with zipfile.ZipFile(client.archive(job, tmp_path / "job.zip")) as z:
        manifest = json.loads(z.read("manifest.json"))
        assert [_png_size(z.read(e["file"])) for e in manifest["images"]] == [card.native_size] * 2
    params = manifest["params"]
    assert (manifest["model"], manifest["state"], params["sampler"], params["steps"]) == (
        name, "done", card.defaults["sampler"], STEPS)
    assert [(e["seed"], e["prompt"]) for e in manifest["images"]] == [(SEED, PROMPTS[0]), (SEED + 1, PROMPTS[1])]


def test_an_openai_images_request_returns_a_png(svc):
    r = httpx.post(f"{svc.url}/v1/images/generations", timeout=patient(60),
                   json={"model": "zimage-tiny", "prompt": "a dog", "size": "96x64", "steps": STEPS,
                         "response_format": "b64_json"})
    assert r.status_code == 200, r.text
    (image,) = r.json()["data"]
    assert _png_size(base64.b64decode(image["b64_json"])) == (96, 64)


def test_the_cli_submits_waits_and_writes_pngs_and_a_manifest(svc, dirs, tmp_path):
    card, out = read_card(dirs["sana-tiny"]), tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "dit_serve.cli", "submit", "--url", svc.url, "--model", card.name,
                        "--prompt", "a red cat", "--num-per-prompt", "2", "--steps", str(STEPS), "--seed", "3",
                        "--out", str(out)], capture_output=True, text=True, timeout=patient(90))
    assert r.returncode == 0, r.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["job"], manifest["model"], manifest["state"]) == (r.stdout.split()[0], card.name, "done")
    assert (manifest["params"]["sampler"], manifest["params"]["steps"]) == (card.defaults["sampler"], STEPS)
    assert [(e["seed"], e["prompt"]) for e in manifest["images"]] == [(3, "a red cat"), (4, "a red cat")]
    assert [_png_size((out / e["file"]).read_bytes()) for e in manifest["images"]] == [card.native_size] * 2
    assert (out / manifest["grid"]).exists()


@pytest.mark.parametrize("name", NAMES)
def test_the_services_images_are_the_engines(client, jobs, dirs, name):
    """The job's items run here, in an engine over the same directory (eager, float32): the same PNG pixels, to one
    uint8 level in at most 0.1% of them. The budget is the batch's: the worker's batches and threads need not be this
    engine's, and a row's float32 arithmetic may change in its last bits with them (measured: Qwen-Image's first item
    one level off in one value of 12288, the other families' images equal). The two items (seeds SEED and SEED + 1,
    two prompts) differ."""
    from workers.config import WorkerConfig
    from workers.engine import Engine
    from workers.loading import load_model
    from workers.request.spec import ItemSpec

    job = jobs[name]
    p = job.params
    specs = [ItemSpec(id=str(it.index), seed=it.seed, sampler=p.sampler, steps=p.steps, guidance=p.guidance,
                      prompt=it.prompt, negative_prompt=p.negative_prompt, width=p.width, height=p.height)
             for it in job.items]
    results = Engine(load_model(dirs[name]), WorkerConfig(backend="eager", max_batch=4)).generate(specs)
    served = [np.asarray(Image.open(io.BytesIO(client.image_bytes(job, it.index)))) for it in job.items]
    for got, want in zip(served, results):
        assert got.shape == want.image.shape and got.dtype == want.image.dtype == np.uint8
        diff = np.abs(got.astype(np.int16) - want.image.astype(np.int16))
        assert diff.max() <= 1 and (diff > 0).mean() <= 1e-3, (diff.max(), (diff > 0).sum())
    assert not np.array_equal(served[0], served[1])
