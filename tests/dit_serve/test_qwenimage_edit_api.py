"""Qwen-Image-Edit (an instruction edit that needs its image) through the HTTP API, in an API-only service over a
tiny Qwen-Image-Edit directory (a test leases and commits as a worker would, running the leased items through an
engine over the same directory): its card says it takes an image and neither mask nor strength (``edit``
"reference") and that a job must send one (``needs_image``); POST /v1/jobs with an image is accepted and its
items carry the image and no strength, and run in the engine at the size the job chose; a job without an image,
a mask or a strength is a 400 naming the field with nothing stored; POST /v1/images/edits takes its one image as
the reference, and /v1/images/generations is refused. The images themselves equal QwenImageEditPipeline's in
tests/workers/families/test_qwenimage_edit.py."""

from __future__ import annotations

import base64
import io
import threading

import httpx
import pytest
from PIL import Image

from dit_serve.server.service import Service

from .conftest import service_config

NAME = "qwen-edit-tiny"


def png(size=(40, 28), color=(90, 120, 200)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from workers.models.tiny_qwenimage_edit import make_tiny_qwenimage_edit

    return make_tiny_qwenimage_edit(tmp_path_factory.mktemp("qwen-edit") / NAME)


@pytest.fixture(scope="module")
def svc(model_dir, tmp_path_factory):
    cfg = service_config(tmp_path_factory.mktemp("svc"), "digits", workers={"models": (str(model_dir),)})
    with Service(cfg, roles=("api",)) as service:
        yield service


@pytest.fixture(scope="module")
def http(svc):
    with httpx.Client(base_url=svc.url, timeout=30) as h:
        yield h


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_the_card_takes_a_reference_image_and_needs_one(http):
    m = http.get(f"/v1/models/{NAME}").json()
    assert (m["takes_image"], m["takes_mask"], m["edit"], m["needs_image"], m["warnings"]) == \
        (True, False, "reference", True, [])
    assert m["sizes"] == ["64x64", "96x64", "64x96"] and m["guidance"] == "cfg"


def test_a_job_with_an_image_is_accepted_and_its_items_run_in_the_engine(svc, http, model_dir):
    import numpy as np

    from workers.config import WorkerConfig
    from workers.engine import Engine
    from workers.loading import load_model

    source = png()
    r = http.post("/v1/jobs", json={"model": NAME, "prompts": ["make the sky purple"], "num_per_prompt": 2,
                                    "negative_prompt": "blurry", "image_b64": base64.b64encode(source).decode(),
                                    "seed": 3, "steps": 2})
    assert r.status_code < 300, r.text
    params = r.json()["params"]
    assert params["strength"] is None and params["mask"] is None and params["image"]["width"] == 40
    assert (params["width"], params["height"]) == (96, 64)  # the listed size nearest the image's ratio
    leases = svc.store.lease("test-qwen-edit", [NAME], 16, 60.0)
    assert len(leases) == 2
    specs = [lease.spec for lease in leases]
    for spec in specs:
        assert (spec.image, spec.mask, spec.strength, spec.prompt, spec.negative_prompt) == \
            (source, b"", 1.0, "make the sky purple", "blurry")
    results = Engine(load_model(model_dir), WorkerConfig(backend="eager", max_batch=2)).generate(specs)
    for lease, result in zip(leases, results):
        assert result.image.shape == (64, 96, 3) and np.isfinite(result.latents.numpy()).all()
        out = io.BytesIO()
        Image.fromarray(result.image).save(out, format="PNG")
        svc.store.commit_result(lease, out.getvalue())
    assert http.get(f"/v1/jobs/{r.json()['id']}").json()["state"] == "done"


@pytest.mark.parametrize("extra, param", [({}, "image"),
                                          ({"mask_b64": base64.b64encode(png()).decode(), "image": True}, "mask"),
                                          ({"strength": 0.5, "image": True}, "strength")])
def test_no_image_a_mask_or_a_strength_is_a_400_naming_it_and_stores_nothing(http, extra, param):
    before = http.get("/v1/jobs").json()["total"]
    body = {"model": NAME, "prompts": ["x"], **extra}
    if body.pop("image", False):
        body["image_b64"] = base64.b64encode(png()).decode()
    err = _error(http.post("/v1/jobs", json=body), 400)
    assert err["param"] == param and ("needs_image" in err["message"] if param == "image" else
                                      f"no {param}" in err["message"])
    assert http.get("/v1/jobs").json()["total"] == before


def test_images_edits_takes_its_one_image_as_the_reference_and_generations_are_refused(svc, http):
    specs, stop = [], threading.Event()

    def work():
        while not stop.wait(0.02):
            for lease in svc.store.lease("test-openai", [NAME], 16, 60.0):
                specs.append(lease.spec)
                svc.store.commit_result(lease, png((64, 64)))

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        source = png((30, 30))
        r = http.post("/v1/images/edits", files={"image": ("in.png", source, "image/png")},
                      data={"model": NAME, "prompt": "add a hat", "n": "1", "response_format": "b64_json"})
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 1
        (spec,) = specs
        assert (spec.image, spec.mask, spec.strength, spec.prompt) == (source, b"", 1.0, "add a hat")
        assert (spec.width, spec.height) == (64, 64)
    finally:
        stop.set()
        thread.join(5)
    err = _error(http.post("/v1/images/generations", json={"model": NAME, "prompt": "a cat"}), 400)
    assert err["param"] == "model" and "/v1/images/edits" in err["message"]


def test_the_local_generate_command_needs_an_image_too(model_dir):
    from dit_serve.errors import UsageError
    from dit_serve.server.generate import GenerateArgs, _edit
    from workers.request.cards import read_card

    with pytest.raises(UsageError, match="--image: model .* edits an input image"):
        _edit(read_card(model_dir), GenerateArgs(model=str(model_dir), prompts=("a cat",)))
