"""Qwen-Image-Edit (an instruction edit that needs its image) through the HTTP API, in an API-only service over a
tiny Qwen-Image-Edit directory (a test leases and commits as a worker would, running the leased items through an
engine over the same directory): its card says it takes an image and neither mask nor strength (``edit``
"reference") and that a job must send one (``needs_image``); POST /v1/jobs with an image is accepted and its
items carry the image and no strength, and run in the engine at the size the job chose; a job without an image,
a mask or a strength is a 400 naming the field with nothing stored; POST /v1/images/edits takes its one image as
the reference, and /v1/images/generations is refused. The images themselves equal QwenImageEditPipeline's in
tests/workers/families/test_qwenimage_edit.py.

Qwen-Image-Edit-Plus (a tiny Qwen-Image-Edit-2509 directory beside it: its card's ``max_images`` 3) takes several
reference images: a job's ``image`` (or ``image_b64``) as a list, stored once per job as image, image2, ...,
recorded in its params and manifest (``extra_images``: each one's upload id and SHA-256), carried to the worker as
``ItemSpec.extra_images`` and run in the engine; the same through OpenAI's edits (several ``image[]`` files), the SDK
(``image=[...]``), the CLI (repeated ``--image``) and the local generate command. More images than a card takes is a
400 naming ``image`` (a usage error naming ``--image``), with nothing stored."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image

from dit_serve.server.service import Service

from .conftest import service_config
from .test_kontext_api import _error, fake_worker, png
from .test_web_page import _find, _js, _js_errors, _wait, browser  # noqa: F401 (browser: the page's fixture)

NAME = "qwen-edit-tiny"
PLUS = "qwen-edit-plus-tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from workers.models.tiny_qwenimage_edit import make_tiny_qwenimage_edit

    return make_tiny_qwenimage_edit(tmp_path_factory.mktemp("qwen-edit") / NAME)


@pytest.fixture(scope="module")
def plus_dir(tmp_path_factory):
    from workers.models.tiny_qwenimage_edit import make_tiny_qwenimage_edit

    return make_tiny_qwenimage_edit(tmp_path_factory.mktemp("qwen-edit-plus") / PLUS, seed=1, plus=True)


@pytest.fixture(scope="module")
def svc(model_dir, plus_dir, tmp_path_factory):
    cfg = service_config(tmp_path_factory.mktemp("svc"), "digits",
                         workers={"models": (str(model_dir), str(plus_dir))})
    with Service(cfg, roles=("api",)) as service:
        yield service


@pytest.fixture(scope="module")
def http(svc):
    with httpx.Client(base_url=svc.url, timeout=30) as h:
        yield h


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
    with fake_worker(svc, "test-openai", [NAME]) as specs:
        source = png((30, 30))
        r = http.post("/v1/images/edits", files={"image": ("in.png", source, "image/png")},
                      data={"model": NAME, "prompt": "add a hat", "n": "1", "response_format": "b64_json"})
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 1
        (spec,) = specs
        assert (spec.image, spec.mask, spec.strength, spec.prompt) == (source, b"", 1.0, "add a hat")
        assert (spec.width, spec.height) == (64, 64)
    err = _error(http.post("/v1/images/generations", json={"model": NAME, "prompt": "a cat"}), 400)
    assert err["param"] == "model" and "/v1/images/edits" in err["message"]


def test_the_local_generate_command_needs_an_image_too(model_dir):
    from dit_serve.errors import UsageError
    from dit_serve.server.generate import GenerateArgs, _edit
    from workers.request.cards import read_card

    with pytest.raises(UsageError, match="--image: model .* edits an input image"):
        _edit(read_card(model_dir), GenerateArgs(model=str(model_dir), prompts=("a cat",)))


# -- Qwen-Image-Edit-Plus: several reference images ------------------------------------------------------------------
def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_the_plus_card_takes_up_to_three_images(http):
    assert http.get(f"/v1/models/{PLUS}").json()["max_images"] == 3
    assert http.get(f"/v1/models/{NAME}").json()["max_images"] == 1


def test_a_two_image_job_is_stored_once_recorded_and_run_in_the_engine(svc, http, plus_dir):
    """Image 1 an upload, image 2 inline: both stored with the job, each one's id and SHA-256 in its params and its
    manifest; the items carry both to the worker, and run there (the output's size: the listed size nearest the
    last image's ratio, as the Plus pipeline sizes its output)."""
    import hashlib
    import json
    import zipfile

    import numpy as np

    from workers.config import WorkerConfig
    from workers.engine import Engine
    from workers.loading import load_model

    first, second = png((40, 28), (200, 40, 40)), png((28, 40), (40, 200, 40))
    up = http.post("/v1/uploads", files={"file": ("person.png", first, "image/png")}).json()
    r = http.post("/v1/jobs", json={"model": PLUS, "prompts": ["1 sits in 2"], "num_per_prompt": 2, "seed": 4,
                                    "steps": 2, "negative_prompt": "blurry", "image": [up["id"], _data_url(second)]})
    assert r.status_code == 202, r.text
    job = r.json()
    p = job["params"]
    assert p["image"] == {"id": up["id"], "sha256": hashlib.sha256(first).hexdigest(), "width": 40, "height": 28}
    assert p["extra_images"] == [{"id": None, "sha256": hashlib.sha256(second).hexdigest(), "width": 28,
                                  "height": 40}]
    assert (p["width"], p["height"]) == (64, 96)  # the last image's ratio (2:3 wide), not the first's
    folder = svc.config.store.data_dir / "inputs" / job["id"]
    assert sorted(f.name for f in folder.iterdir()) == ["image", "image2"]
    assert http.get(f"/v1/jobs/{job['id']}/inputs/image2").content == second
    assert http.get(f"/v1/jobs/{job['id']}/inputs/image3").status_code == 404
    leases = sorted(svc.store.lease("test-plus", [PLUS], 16, 60.0), key=lambda ls: ls.index)
    specs = [lease.spec for lease in leases]
    assert [(s.image, s.extra_images, s.references) for s in specs] == [(first, (second,), (first, second))] * 2
    model = load_model(plus_dir)
    results = Engine(model, WorkerConfig(backend="eager", max_batch=2)).generate(specs)
    for lease, result in zip(leases, results):
        assert result.image.shape == (96, 64, 3) and np.isfinite(result.latents.numpy()).all()
        out = io.BytesIO()
        Image.fromarray(result.image).save(out, format="PNG")
        svc.store.commit_result(lease, out.getvalue())
    assert http.get(f"/v1/jobs/{job['id']}").json()["state"] == "done"
    with zipfile.ZipFile(io.BytesIO(http.get(f"/v1/jobs/{job['id']}/archive").content)) as z:
        manifest = json.loads(z.read("manifest.json"))
    assert manifest["params"]["image"]["id"] == up["id"]
    assert [i["sha256"] for i in [manifest["params"]["image"], *manifest["params"]["extra_images"]]] == \
        [hashlib.sha256(first).hexdigest(), hashlib.sha256(second).hexdigest()]


@pytest.mark.parametrize("model, field, n, words", [(PLUS, "image", 4, "at most 3 input images"),
                                                    (PLUS, "image_b64", 4, "at most 3 input images"),
                                                    (NAME, "image", 2, "one input image")])
def test_more_images_than_the_card_takes_is_a_400_naming_image(http, model, field, n, words):
    before = http.get("/v1/jobs").json()["total"]
    images = [png((20 + i, 20)) for i in range(n)]
    sent = [_data_url(d) for d in images] if field == "image" else [base64.b64encode(d).decode() for d in images]
    err = _error(http.post("/v1/jobs", json={"model": model, "prompts": ["x"], field: sent}), 400)
    assert err["param"] == "image" and words in err["message"] and f"{n} were sent" in err["message"]
    assert http.get("/v1/jobs").json()["total"] == before


def test_the_bodies_that_carry_images_have_room_for_every_reference(svc):
    """An image and a mask, or a served model's max_images references (3 here), inline or as files."""
    from dit_serve.server.api import edit_body_limits

    limits = svc.config.limits
    one, three = edit_body_limits(1 << 20, limits), edit_body_limits(1 << 20, limits, max_images=3)
    assert three["/v1/images/edits"] - one["/v1/images/edits"] == limits.max_image_bytes
    assert three["/v1/jobs"] - one["/v1/jobs"] >= limits.max_inline_image_bytes * 4 // 3


def test_a_bad_image_of_a_list_is_a_400_naming_it(http):
    err = _error(http.post("/v1/jobs", json={"model": PLUS, "prompts": ["x"],
                                             "image_b64": [base64.b64encode(png()).decode(), "bm90IGFuIGltYWdl"]}), 400)
    assert err["param"] == "image_b64[1]"


def test_the_openai_client_edits_with_several_images_as_the_plus_references(svc, http):
    with fake_worker(svc, "test-openai-plus", [PLUS]) as specs:
        import openai

        client = openai.OpenAI(base_url=f"{svc.url}/v1", api_key="none", max_retries=0)
        a, b = png((30, 30), (1, 2, 3)), png((30, 20), (4, 5, 6))
        r = client.images.edit(model=PLUS, image=[("a.png", a, "image/png"), ("b.png", b, "image/png")],
                               prompt="1 in 2", response_format="b64_json")  # the SDK sends them as image[]
        assert len(r.data) == 1
        (spec,) = specs
        assert (spec.image, spec.extra_images) == (a, (b,))
    two = [("image", ("a.png", a, "image/png")), ("image", ("b.png", b, "image/png"))]
    err = _error(http.post("/v1/images/edits", files=two, data={"model": NAME, "prompt": "x"}), 400)
    assert err["param"] == "image" and "one input image" in err["message"]


def test_the_sdk_and_the_cli_send_several_images(svc, tmp_path, monkeypatch):
    import hashlib

    from dit_serve import client as sdk

    from .test_cli_usage import cli

    a, b = png((30, 30), (7, 8, 9)), png((30, 20), (9, 8, 7))
    (tmp_path / "a.png").write_bytes(a)
    (tmp_path / "b.png").write_bytes(b)
    with sdk.Client(svc.url) as c:
        job = c.submit(prompts=["1 in 2"], model=PLUS, image=[tmp_path / "a.png", Image.open(io.BytesIO(b))])
        assert job.params.image.sha256 == hashlib.sha256(a).hexdigest() and len(job.params.extra_images) == 1
        monkeypatch.setattr(sdk, "INLINE_MAX_BYTES", 10)  # anything larger goes as an upload first
        job = c.submit(prompts=["1 in 2"], model=PLUS, image=[a, b])
        assert job.params.image.id.startswith("upl_") and job.params.extra_images[0].id.startswith("upl_")
        assert job.params.extra_images[0].sha256 == hashlib.sha256(b).hexdigest()
    done = cli("submit", "--model", PLUS, "--prompt", "1 in 2", "--image", str(tmp_path / "a.png"),
               "--image", str(tmp_path / "b.png"), env={"DIT_SERVE_URL": svc.url})
    assert done.returncode == 0, done.stderr
    with httpx.Client(base_url=svc.url) as h:
        params = h.get(f"/v1/jobs/{done.stdout.strip()}").json()["params"]
    assert [params["image"]["sha256"], params["extra_images"][0]["sha256"]] == \
        [hashlib.sha256(a).hexdigest(), hashlib.sha256(b).hexdigest()]


def test_the_local_generate_command_refuses_more_images_than_the_card_takes(model_dir, plus_dir, tmp_path):
    from dit_serve.errors import UsageError
    from dit_serve.server.generate import GenerateArgs, _edit
    from workers.request.cards import read_card

    for i in range(4):
        (tmp_path / f"{i}.png").write_bytes(png((20 + i, 20)))
    paths = [tmp_path / f"{i}.png" for i in range(4)]
    with pytest.raises(UsageError, match="--image: model .* takes one input image; 2 were given"):
        _edit(read_card(model_dir), GenerateArgs(model=str(model_dir), prompts=("x",), image=paths[0],
                                                 extra_images=(paths[1],)))
    with pytest.raises(UsageError, match="takes at most 3 input images; 4 were given"):
        _edit(read_card(plus_dir), GenerateArgs(model=str(plus_dir), prompts=("x",), image=paths[0],
                                                extra_images=tuple(paths[1:])))
    spec, refs, size = _edit(read_card(plus_dir), GenerateArgs(model=str(plus_dir), prompts=("x",), image=paths[0],
                                                               extra_images=(paths[1],)))
    assert spec["extra_images"] == (paths[1].read_bytes(),) and len(refs["extra_images"]) == 1 and size == (21, 20)


def test_the_web_page_sends_every_picked_image_to_a_plus_model(svc, http, browser, tmp_path):
    """On a model that takes several images the page's file input takes several: the first is the one shown (and
    masked, where the model inpaints), all of them go to the job as its reference images, in the order picked."""
    drv = browser
    paths = []
    for i, color in enumerate(((200, 40, 40), (40, 200, 40))):
        paths.append(tmp_path / f"ref{i}.png")
        paths[-1].write_bytes(png((40 + 8 * i, 28), color))
    drv.get(f"{svc.url}/")
    _wait(drv, lambda d: _js(d, "return document.querySelectorAll('#f-model option').length") > 0, what="models")
    _js(drv, "const s = document.querySelector('#f-model'); s.value = arguments[0];"
             "s.dispatchEvent(new Event('change'))", PLUS)
    _wait(drv, lambda d: _js(d, "return document.querySelector('#f-image').multiple"), what="a multiple file input")
    assert "up to 3" in _js(drv, "return document.querySelector('#image-note').textContent")
    _find(drv, "#f-image").send_keys("\n".join(str(p) for p in paths))
    _wait(drv, lambda d: not _js(d, "return document.querySelector('#mask-editor').hidden"), what="the preview")
    _js(drv, "document.querySelector('#f-prompts').value = 'picture 1 beside picture 2'")
    _find(drv, "#submit").click()
    _wait(drv, lambda d: "#/jobs/" in d.current_url, what="the job page")
    job = http.get(f"/v1/jobs/{drv.current_url.split('#/jobs/', 1)[1]}").json()
    assert job["params"]["image"]["width"] == 40 and [e["width"] for e in job["params"]["extra_images"]] == [48]
    assert _js_errors(drv) == []
