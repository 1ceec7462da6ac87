"""FLUX.1 Kontext (an instruction edit: the image is a reference the prompt edits) through the HTTP API, in an
API-only service over a tiny Kontext directory (a test leases and commits as a worker would): its card says it
takes an image and neither mask nor strength (``edit`` "reference"), POST /v1/jobs with an image is accepted and
its items carry the image and no strength, a mask or a strength is a 400 naming the field with nothing stored, and
POST /v1/images/edits takes its one image as the reference. The images themselves equal FluxKontextPipeline's in
tests/workers/families/test_kontext.py."""

from __future__ import annotations

import base64
import io
import threading
from contextlib import contextmanager

import httpx
import pytest
from PIL import Image

from dit_serve.server.service import Service

from .conftest import service_config

NAME = "kontext-tiny"


def png(size=(40, 28), color=(90, 120, 200)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


@contextmanager
def fake_worker(svc, name: str, models: list[str], out=(64, 64)):
    """A worker ``name`` in a thread while the block runs: it leases ``models``' items, keeps their specs (the list
    yielded) and commits a PNG of size ``out`` for each."""
    specs, stop = [], threading.Event()

    def work():
        while not stop.wait(0.02):
            for lease in svc.store.lease(name, models, 16, 60.0):
                specs.append(lease.spec)
                svc.store.commit_result(lease, png(out))

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        yield specs
    finally:
        stop.set()
        thread.join(5)


def transparent_left(size=(40, 28)) -> bytes:
    im = Image.new("RGBA", size, (0, 0, 0, 255))
    im.paste((0, 0, 0, 0), (0, 0, size[0] // 2, size[1]))
    out = io.BytesIO()
    im.save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    from workers.models.tiny_flux import make_tiny_flux

    root = tmp_path_factory.mktemp("kontext")
    model = make_tiny_flux(root / NAME, kontext=True)
    cfg = service_config(root / "svc", "digits", workers={"models": (str(model),)})
    with Service(cfg, roles=("api",)) as service:
        yield service


@pytest.fixture(scope="module")
def http(svc):
    with httpx.Client(base_url=svc.url, timeout=30) as h:
        yield h


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_the_card_takes_a_reference_image_without_mask_or_strength(http):
    m = http.get(f"/v1/models/{NAME}").json()
    assert (m["takes_image"], m["takes_mask"], m["edit"], m["warnings"]) == (True, False, "reference", [])


def test_a_job_with_an_image_is_accepted_and_its_items_carry_it_without_strength(svc, http):
    source = png()
    r = http.post("/v1/jobs", json={"model": NAME, "prompts": ["make the sky purple"], "num_per_prompt": 2,
                                    "image_b64": base64.b64encode(source).decode(), "seed": 3, "steps": 2})
    assert r.status_code < 300, r.text
    params = r.json()["params"]
    assert params["strength"] is None and params["mask"] is None and params["image"]["width"] == 40
    assert (params["width"], params["height"]) == (96, 64)  # the listed size nearest the image's ratio
    leases = svc.store.lease("test-kontext", [NAME], 16, 60.0)
    assert len(leases) == 2
    for lease in leases:
        spec = lease.spec
        assert (spec.image, spec.mask, spec.strength, spec.prompt) == (source, b"", 1.0, "make the sky purple")
        svc.store.commit_result(lease, png((96, 64)))


@pytest.mark.parametrize("extra, param", [({"mask_b64": base64.b64encode(png()).decode()}, "mask"),
                                          ({"strength": 0.5}, "strength")])
def test_a_mask_or_a_strength_is_a_400_naming_it_and_stores_nothing(svc, http, extra, param):
    before = http.get("/v1/jobs").json()["total"]
    err = _error(http.post("/v1/jobs", json={"model": NAME, "prompts": ["x"], **extra,
                                             "image_b64": base64.b64encode(png()).decode()}), 400)
    assert err["param"] == param and "reference image" in err["message"] and f"no {param}" in err["message"]
    assert http.get("/v1/jobs").json()["total"] == before


def test_images_edits_takes_its_one_image_as_the_reference(svc, http):
    with fake_worker(svc, "test-openai", [NAME]) as specs:
        source = png((30, 30))
        r = http.post("/v1/images/edits", files={"image": ("in.png", source, "image/png")},
                      data={"model": NAME, "prompt": "add a hat", "n": "1", "response_format": "b64_json"})
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 1
        (spec,) = specs
        assert (spec.image, spec.mask, spec.strength, spec.prompt) == (source, b"", 1.0, "add a hat")
        assert (spec.width, spec.height) == (64, 64)
    err = _error(http.post("/v1/images/edits", files={"image": ("in.png", png(), "image/png"),
                                                       "mask": ("m.png", transparent_left(), "image/png")},
                           data={"model": NAME, "prompt": "x"}), 400)
    assert err["param"] == "mask"
    err = _error(http.post("/v1/images/edits", files={"image": ("in.png", png(), "image/png")},
                           data={"model": NAME, "prompt": "x", "strength": "0.4"}), 400)
    assert err["param"] == "strength"
