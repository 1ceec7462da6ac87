"""Edits through the HTTP API, in an API-only service (no workers: a test leases and commits as a worker would):
uploads (quota, tenants, retention), image/mask/strength on POST /v1/jobs (an upload's id, a data URL, base64),
what reaches the worker (``ItemSpec`` built at lease time from the inputs stored once per job), bad input (a 4xx
naming the field, nothing stored), the manifest's record of the inputs, OpenAI's /v1/images/edits through the
real ``openai`` client, the SDK, the CLI, and the multipart parser. Generation itself: test_edits_service.py."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import threading
import time
import zipfile
from dataclasses import replace

import httpx
import pytest
from PIL import Image

from dit_serve.server.service import Service

from .conftest import service_config

KEY = "edits-admin-key-0123"


def png(size=(8, 8), mode="L", color=128, fmt="PNG", **save) -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, color).save(out, format=fmt, **save)
    return out.getvalue()


def left_half(size=(8, 8)) -> bytes:
    """A mask (white = repaint) of the left half."""
    im = Image.new("L", size, 0)
    im.paste(255, (0, 0, size[0] // 2, size[1]))
    out = io.BytesIO()
    im.save(out, format="PNG")
    return out.getvalue()


def transparent_left(size=(8, 8)) -> bytes:
    """OpenAI's mask: the left half transparent (edited), the rest opaque."""
    im = Image.new("RGBA", size, (0, 0, 0, 255))
    im.paste((0, 0, 0, 0), (0, 0, size[0] // 2, size[1]))
    out = io.BytesIO()
    im.save(out, format="PNG")
    return out.getvalue()


def animated() -> bytes:
    out = io.BytesIO()
    frames = [Image.new("L", (8, 8), v) for v in (0, 255)]
    frames[0].save(out, format="PNG", save_all=True, append_images=frames[1:])
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def svc(digits_model, tmp_path_factory):
    cfg = service_config(tmp_path_factory.mktemp("edits"), digits_model,
                         workers={"models": ("digits", "digits-text")}, server={"api_keys": [KEY]},
                         limits={"max_inline_image_bytes": 4096, "max_image_bytes": 8192,
                                 "tenant_max_upload_bytes": 20_000})
    with Service(cfg, roles=("api",)) as service:
        yield service


@pytest.fixture(scope="module")
def http(svc):
    with httpx.Client(base_url=svc.url, timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as h:
        yield h


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def _stored(svc) -> tuple[int, list[str]]:
    """Jobs in the store, and the job folders under inputs/."""
    data = svc.config.store.data_dir
    with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {KEY}"}) as h:
        total = h.get("/v1/jobs").json()["total"]
    folder = data / "inputs"
    return total, sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _lease_all(svc, job_id: str, n: int):
    leases = sorted((ls for ls in svc.store.lease("test-edits", ["digits", "digits-text"], 64, 60.0)
                     if ls.job_id == job_id), key=lambda ls: ls.index)
    assert len(leases) == n
    return leases


def test_models_say_which_edits_they_take(http):
    models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert all(models[name]["takes_image"] and models[name]["takes_mask"] for name in ("digits", "digits-text"))


def test_an_upload_is_checked_stored_counted_and_deleted(svc, http):
    data = png()
    r = http.post("/v1/uploads", files={"file": ("three.png", data, "image/png")})
    assert r.status_code == 201, r.text
    up = r.json()
    assert up["id"].startswith("upl_") and r.headers["Location"] == f"/v1/uploads/{up['id']}"
    assert (up["sha256"], up["bytes"], up["format"], up["width"], up["height"], up["filename"]) == \
        (hashlib.sha256(data).hexdigest(), len(data), "PNG", 8, 8, "three.png")
    assert up["expires_at"] == pytest.approx(up["created_at"] + 24 * 3600)
    assert (svc.config.store.data_dir / "uploads" / up["id"]).read_bytes() == data
    assert http.get(f"/v1/uploads/{up['id']}").json() == up
    assert svc.store.upload_bytes("default") >= len(data)
    assert http.delete(f"/v1/uploads/{up['id']}").json()["id"] == up["id"]
    assert not (svc.config.store.data_dir / "uploads" / up["id"]).exists()
    _error(http.get(f"/v1/uploads/{up['id']}"), 404)
    _error(http.delete(f"/v1/uploads/{up['id']}"), 404)


@pytest.mark.parametrize("files, status, param, words", [
    ({"file": ("x.png", b"not an image")}, 400, "file", "not a PNG, JPEG or WebP image"),
    ({"file": ("x.png", b"")}, 400, "file", "empty"),
    ({"file": ("x.png", animated())}, 400, "file", "animated"),
    ({"file": ("x.gif", png(fmt="GIF"))}, 400, "file", "not a PNG, JPEG or WebP"),
    ({"file": ("x.png", png((64, 64), "RGB", (1, 2, 3), compress_level=0))}, 413, "file", "at most 8,192"),
    ({"image": ("x.png", png())}, 400, "image", "unknown file field 'image'"),
    ({"purpose": (None, "edits")}, 400, "file", "file is required"),
    ({"file": ("x.png", png()), "purpose": (None, "edits")}, 400, "purpose", "unknown field 'purpose'"),
])
def test_a_bad_upload_is_a_4xx_naming_the_field_and_stores_nothing(svc, http, files, status, param, words):
    before = svc.store.upload_bytes("default")
    err = _error(http.post("/v1/uploads", files=files), status)
    assert err["param"] == param and words in err["message"], err
    assert svc.store.upload_bytes("default") == before
    assert not list((svc.config.store.data_dir / "uploads").glob(".*.tmp"))


def test_uploads_must_be_multipart_and_well_formed(http):
    assert "multipart/form-data" in _error(http.post("/v1/uploads", json={"file": "x"}), 415)["message"]
    r = http.post("/v1/uploads", content=b"--b\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nxx",
                  headers={"content-type": "multipart/form-data; boundary=b"})
    assert "closing boundary" in _error(r, 400)["message"]


def test_a_tenants_uploads_are_its_own_and_bounded_by_its_quota(svc, http):
    from dit_serve.server.keys import create_key

    _, key = create_key(svc.store, "edits-tenant")
    with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {key}"}) as mine:
        big = png((40, 40), "RGB", (9, 9, 9), compress_level=0)  # ~4.9 kB each; the quota is 20,000 bytes
        ids = []
        while len(ids) < 10:
            r = mine.post("/v1/uploads", files={"file": ("a.png", big)})
            if r.status_code != 201:
                break
            ids.append(r.json()["id"])
        err = _error(r, 403)
        assert err["param"] == "file" and "at most 20,000" in err["message"] and len(ids) == 20_000 // len(big)
        assert mine.delete(f"/v1/uploads/{ids[0]}").status_code == 200  # room again
        assert mine.post("/v1/uploads", files={"file": ("a.png", big)}).status_code == 201
        theirs = http.post("/v1/uploads", files={"file": ("t.png", png())}).json()["id"]  # the admin's tenant
        _error(mine.get(f"/v1/uploads/{theirs}"), 404)
        err = _error(mine.post("/v1/jobs", json={"labels": [1], "image": theirs}), 400)
        assert err["param"] == "image" and "no upload" in err["message"]
        assert http.get(f"/v1/uploads/{ids[1]}").status_code == 200  # an admin sees every tenant's


def test_retention_deletes_uploads_past_their_expiry_and_jobs_keep_their_copy(svc, http):
    data = png(color=77)
    up = http.post("/v1/uploads", files={"file": ("a.png", data)}).json()
    job = http.post("/v1/jobs", json={"labels": [2], "image": up["id"]}).json()
    from sqlalchemy import update

    from dit_serve.server.store import uploads
    with svc.store._tx() as conn:
        conn.execute(update(uploads).where(uploads.c.id == up["id"]).values(expires_at=time.time() - 1))
    _error(http.get(f"/v1/uploads/{up['id']}"), 404)  # expired: gone at once, whether or not purged yet
    assert up["id"] in svc.store.purge_uploads()
    assert not (svc.config.store.data_dir / "uploads" / up["id"]).exists()
    assert http.get(f"/v1/jobs/{job['id']}/inputs/image").content == data
    (lease,) = _lease_all(svc, job["id"], 1)
    assert lease.spec.image == data
    http.delete(f"/v1/jobs/{job['id']}")
    assert svc.store.delete_job(job["id"])  # purged with its inputs
    assert not (svc.config.store.data_dir / "inputs" / job["id"]).exists()


def test_a_job_stores_its_inputs_once_and_each_item_gets_them(svc, http):
    image, mask = png(color=50), left_half()
    up = http.post("/v1/uploads", files={"file": ("src.png", image)}).json()
    r = http.post("/v1/jobs", json={"prompts": ["an eight", "a two"], "num_per_prompt": 2, "model": "digits-text",
                                    "image": up["id"], "mask": "data:image/png;base64," + b64(mask),
                                    "strength": 0.75, "seed": 3})
    assert r.status_code == 202, r.text
    job = r.json()
    p = job["params"]
    assert p["image"] == {"id": up["id"], "sha256": hashlib.sha256(image).hexdigest(), "width": 8, "height": 8}
    assert p["mask"] == {"id": None, "sha256": hashlib.sha256(mask).hexdigest(), "width": 8, "height": 8}
    assert p["strength"] == 0.75
    folder = svc.config.store.data_dir / "inputs" / job["id"]
    assert sorted(f.name for f in folder.iterdir()) == ["image", "mask"]  # once per job, not per item
    assert (folder / "image").read_bytes() == image and (folder / "mask").read_bytes() == mask
    got = http.get(f"/v1/jobs/{job['id']}/inputs/mask")
    assert got.content == mask and got.headers["content-type"] == "image/png"
    assert got.headers["x-content-type-options"] == "nosniff"
    _error(http.get(f"/v1/jobs/{job['id']}/inputs/other"), 400)

    leases = _lease_all(svc, job["id"], 4)
    specs = [ls.spec for ls in leases]
    assert all((s.image, s.mask, s.strength) == (image, mask, 0.75) for s in specs)
    assert len({id(s.image) for s in specs}) == 1  # one bytes object: pickled once to the worker
    assert [s.prompt for s in specs] == ["an eight", "an eight", "a two", "a two"]
    assert "PNG" not in repr(leases[0]) and "PNG" not in repr(specs[0])  # the bytes stay out of logs
    for ls in leases:
        assert svc.store.commit_result(ls, png(color=200))
    with zipfile.ZipFile(io.BytesIO(http.get(f"/v1/jobs/{job['id']}/archive").content)) as z:
        manifest = json.loads(z.read("manifest.json"))
    assert manifest["params"]["image"]["id"] == up["id"]
    assert manifest["params"]["image"]["sha256"] == hashlib.sha256(image).hexdigest()
    assert manifest["params"]["mask"]["sha256"] == hashlib.sha256(mask).hexdigest()


def test_defaults_base64_and_an_idempotent_repeat(svc, http):
    body = {"labels": [3], "image_b64": b64(png())}
    job = http.post("/v1/jobs", json=body).json()
    assert job["params"]["strength"] == 0.6 and job["params"]["mask"] is None and job["params"]["image"]["id"] is None
    job = http.post("/v1/jobs", json={**body, "mask_b64": b64(left_half())}).json()
    assert job["params"]["strength"] == 1.0  # inpainting: the whole schedule inside the mask
    before = _stored(svc)
    headers = {"Idempotency-Key": "edit-once"}
    first = http.post("/v1/jobs", json=body, headers=headers)
    again = http.post("/v1/jobs", json=body, headers=headers)
    assert again.headers.get("Idempotent-Replayed") == "true" and again.json()["id"] == first.json()["id"]
    assert _stored(svc) == (before[0] + 1, sorted([*before[1], first.json()["id"]]))
    wrapped = base64.encodebytes(png(color=9)).decode()  # line-wrapped base64 is read too
    assert http.post("/v1/jobs", json={"labels": [3], "image_b64": wrapped}).status_code == 202


@pytest.mark.parametrize("body, status, param, words", [
    ({"labels": [1], "image_b64": b64(png()), "strength": 0}, 400, "strength", "must be more than 0"),
    ({"labels": [1], "image_b64": b64(png()), "strength": 1.5}, 400, "strength", "must be at most 1"),
    ({"labels": [1], "strength": 0.5}, 400, "strength", "applies to edits"),
    ({"labels": [1], "mask_b64": b64(left_half())}, 400, "mask", "needs an input image"),
    ({"labels": [1], "image_b64": b64(png()), "mask_b64": b64(left_half((9, 8)))}, 400, "mask",
     "9x8 differs from the image's 8x8"),
    ({"labels": [1], "image_b64": b64(b"GIF89a not really")}, 400, "image_b64", "not a PNG, JPEG or WebP"),
    ({"labels": [1], "image_b64": "%%%not base64"}, 400, "image_b64", "not valid base64"),
    ({"labels": [1], "image": "https://example.com/a.png"}, 400, "image", "upload's id"),
    ({"labels": [1], "image": "upl_" + "0" * 24}, 400, "image", "no upload"),
    ({"labels": [1], "image_b64": b64(animated())}, 400, "image_b64", "animated"),
    ({"labels": [1], "image_b64": b64(png((64, 64), "RGB", (5, 6, 7), compress_level=0))}, 413, "image_b64",
     "at most 4,096"),
    ({"labels": [1], "image": "data:image/png;base64," + b64(png()), "image_b64": b64(png())}, 400, "image_b64",
     "not both"),
])
def test_bad_edits_are_4xx_naming_the_field_and_store_nothing(svc, http, body, status, param, words):
    before = _stored(svc)
    err = _error(http.post("/v1/jobs", json=body), status)
    assert err["param"] == param and words in err["message"], err
    assert _stored(svc) == before
    assert not list((svc.config.store.data_dir / "inputs").glob(".staging-*"))


def test_a_pixel_bomb_is_refused_from_its_header(svc, http):
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 30000, 30000, 8, 0, 0, 0, 0)  # 900 MP declared in 60 bytes
    bomb = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b"")
    err = _error(http.post("/v1/jobs", json={"labels": [1], "image_b64": b64(bomb)}), 400)
    assert err["param"] == "image_b64" and "25,000,000 pixels" in err["message"]


def test_a_model_that_does_not_inpaint_or_take_images_refuses_them(tmp_path):
    """Every shipped family edits; a card that says otherwise is what the API goes by."""
    from fastapi.testclient import TestClient

    from dit_serve.server.api import create_app
    from dit_serve.server.catalog import Catalog
    from dit_serve.server.config import LimitsConfig
    from dit_serve.server.metrics import Metrics
    from dit_serve.server.service import open_store
    from workers.request.cards import read_card

    digits = read_card("digits")
    catalog = Catalog([replace(digits, name="no-mask", takes_mask=False),
                       replace(digits, name="no-edits", takes_image=False, takes_mask=False)], LimitsConfig())
    cfg = service_config(tmp_path / "data")
    http = TestClient(create_app(open_store(cfg), catalog, cfg.server, Metrics()))
    cards = {m["id"]: (m["takes_image"], m["takes_mask"]) for m in http.get("/v1/models").json()["data"]}
    assert cards == {"no-mask": (True, False), "no-edits": (False, False)}
    err = _error(http.post("/v1/jobs", json={"model": "no-mask", "labels": [1], "image_b64": b64(png()),
                                             "mask_b64": b64(left_half())}), 400)
    assert err["param"] == "mask" and "does not inpaint" in err["message"]
    assert http.post("/v1/jobs", json={"model": "no-mask", "labels": [1], "image_b64": b64(png())}).status_code == 202
    err = _error(http.post("/v1/jobs", json={"model": "no-edits", "labels": [1], "image_b64": b64(png())}), 400)
    assert err["param"] == "image" and "does not take an input image" in err["message"]
    files = {"image": ("a.png", png()), "mask": ("m.png", transparent_left())}
    err = _error(http.post("/v1/images/edits", files=files, data={"model": "no-mask", "prompt": "3"}), 400)
    assert err["param"] == "mask"
    assert http.get("/v1/jobs").json()["total"] == 1
    assert len(list((tmp_path / "data" / "inputs").iterdir())) == 1


# -- OpenAI's /v1/images/edits -----------------------------------------------------------------------------
class Worker:
    """Leases what is queued and commits a PNG for each item, as a worker would, while a test waits on the images
    endpoint; records the specs it got."""

    def __init__(self, svc):
        self.svc, self.specs, self.stop = svc, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.wait(0.02):
            for lease in self.svc.store.lease("test-openai", ["digits", "digits-text"], 16, 60.0):
                self.specs.append(lease.spec)
                self.svc.store.commit_result(lease, png(color=220))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(5)


def test_the_openai_client_edits_an_image_with_a_transparent_mask(svc):
    import openai

    client = openai.OpenAI(base_url=f"{svc.url}/v1", api_key=KEY, max_retries=0)
    source = png(color=60)
    with Worker(svc) as worker:
        r = client.images.edit(model="digits-text", image=("three.png", source, "image/png"),
                               mask=("mask.png", transparent_left(), "image/png"), prompt="an eight", n=2,
                               response_format="b64_json", extra_body={"seed": 5, "steps": 4})
        assert len(r.data) == 2 and Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json))).size == (8, 8)
        mine = [s for s in worker.specs if s.steps == 4]  # (it also ran what earlier tests left queued)
        assert len(mine) == 2
        spec = mine[0]
        assert (spec.prompt, spec.seed, spec.steps, spec.strength, spec.image) == ("an eight", 5, 4, 1.0, source)
        mask = Image.open(io.BytesIO(spec.mask))  # OpenAI's rule: the transparent half is the one repainted
        assert mask.mode == "L" and mask.getpixel((0, 0)) == 255 and mask.getpixel((7, 0)) == 0
        r = client.images.edit(model="digits", image=("three.png", source, "image/png"), prompt="seven",
                               size="8x8", extra_body={"strength": 0.3})
        assert r.data[0].url.startswith(svc.url) and worker.specs[-1].label == 7
        assert (worker.specs[-1].strength, worker.specs[-1].mask) == (0.3, b"")

    def refused(**kwargs):
        with pytest.raises(openai.BadRequestError) as e:
            client.images.edit(model="digits", prompt="three", **{"image": ("a.png", source, "image/png"), **kwargs})
        return e.value.body

    assert refused(image=[("a.png", source), ("b.png", source)])["param"] == "image"  # one image, said why
    assert "no transparency" in refused(mask=("m.png", png(), "image/png"))["message"]  # an opaque mask
    assert refused(mask=("m.png", transparent_left((9, 8)), "image/png"))["param"] == "mask"
    assert refused(image=("a.png", b"junk", "image/png"))["param"] == "image"
    assert refused(n=0)["param"] == "n"
    assert refused(extra_body={"strength": 2})["param"] == "strength"
    assert "unknown field 'colour'" in refused(extra_body={"colour": "red"})["message"]


# -- the SDK and the CLI -----------------------------------------------------------------------------------
def test_the_sdk_inlines_small_images_and_uploads_large_ones(svc, tmp_path, monkeypatch):
    from dit_serve import client as sdk

    (tmp_path / "mask.png").write_bytes(left_half())
    with sdk.Client(svc.url, api_key=KEY) as c:
        job = c.submit(labels=[3], image=Image.new("L", (8, 8), 30), mask=tmp_path / "mask.png", strength=0.5)
        assert (job.params.strength, job.params.image.id, job.params.mask.id) == (0.5, None, None)
        assert job.params.mask.sha256 == hashlib.sha256(left_half()).hexdigest()
        monkeypatch.setattr(sdk, "INLINE_MAX_BYTES", 10)  # anything larger goes as an upload first
        job = c.submit(labels=[3], image=png(color=31))
        assert job.params.image.id.startswith("upl_")
        assert c.get(job).params.image.sha256 == hashlib.sha256(png(color=31)).hexdigest()
        up = c.upload(tmp_path / "mask.png")
        assert c.submit(labels=[3], image=up.id).params.image.id == up.id
        assert c.delete_upload(up.id).id == up.id
        with pytest.raises(sdk.InvalidRequest, match="image: cannot read"):
            c.submit(labels=[3], image=tmp_path / "missing.png")
        with pytest.raises(sdk.ApiError) as e:
            c.submit(labels=[3], image=png(), strength=0.0)
        assert e.value.param == "strength" and e.value.status == 400


def test_the_async_sdk_sends_edits_too(svc, monkeypatch):
    import asyncio

    from dit_serve import client as sdk

    async def run():
        async with sdk.AsyncClient(svc.url, api_key=KEY) as c:
            inline = await c.submit(prompts=["a one"], model="digits-text", image=png(color=12), strength=0.4)
            monkeypatch.setattr(sdk, "INLINE_MAX_BYTES", 10)
            uploaded = await c.submit(prompts=["a one"], model="digits-text", image=png(color=13),
                                      mask=left_half())
            return inline, uploaded

    inline, uploaded = asyncio.run(run())
    assert (inline.params.image.id, inline.params.strength) == (None, 0.4)
    assert uploaded.params.image.id.startswith("upl_") and uploaded.params.mask.id.startswith("upl_")


def test_the_cli_submits_edits_and_bad_ones_are_one_line_exit_2(svc, tmp_path):
    from .test_cli_usage import cli, one_line

    env = {"DIT_SERVE_URL": svc.url, "DIT_SERVE_API_KEY": KEY}
    (tmp_path / "in.png").write_bytes(png(color=40))
    (tmp_path / "mask.png").write_bytes(left_half())
    (tmp_path / "wide.png").write_bytes(left_half((16, 8)))
    done = cli("submit", "--model", "digits-text", "--prompt", "an eight", "--image", str(tmp_path / "in.png"),
               "--mask", str(tmp_path / "mask.png"), "--strength", "0.9", env=env)
    assert done.returncode == 0, done.stderr
    with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {KEY}"}) as h:
        params = h.get(f"/v1/jobs/{done.stdout.strip()}").json()["params"]
    assert params["strength"] == 0.9 and params["mask"]["sha256"] == hashlib.sha256(left_half()).hexdigest()
    assert "cannot read" in one_line(cli("submit", "--labels", "1", "--image", str(tmp_path / "nope.png"), env=env))
    assert "differs from the image's" in one_line(cli("submit", "--labels", "1", "--image", str(tmp_path / "in.png"),
                                                      "--mask", str(tmp_path / "wide.png"), env=env))
    assert "strength" in one_line(cli("submit", "--labels", "1", "--image", str(tmp_path / "in.png"),
                                      "--strength", "1.5", env=env))


# -- the multipart parser ------------------------------------------------------------------------------------
def test_multipart_bodies_are_split_exactly():
    from dit_serve.server import multipart

    payload = b"\x89PNG\r\n--not-the-boundary\r\n\r\n\x00"
    req = httpx.Request("POST", "http://x/", files={"image": ("a.png", payload)}, data={"prompt": "h\u00e9"})
    parts = multipart.parse(req.headers["content-type"], req.read())
    assert [(p.name, p.filename, p.data) for p in parts] == [("prompt", None, "hé".encode()),
                                                            ("image", "a.png", payload)]
    kind = "multipart/form-data; boundary=b"
    for body, words in ((b"--b\r\nContent-Disposition: form-data\r\n\r\nx\r\n--b--", "name="),
                        (b"no boundary here", "no part"),
                        (b"--b\r\nContent-Disposition: form-data; name=a\r\n\r\n" + b"x" * 70000 + b"\r\n--b--",
                         "at most"),
                        (b"".join(b"--b\r\nContent-Disposition: form-data; name=a\r\n\r\nx\r\n" for _ in range(70))
                         + b"--b--", "more than 64 parts")):
        with pytest.raises(multipart.FormError, match=words):
            multipart.parse(kind, body)
    with pytest.raises(multipart.FormError) as e:
        multipart.parse("application/x-www-form-urlencoded", b"a=1")
    assert e.value.status == 415


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_the_store_keeps_uploads_and_job_inputs_on_either_database(kind, tmp_path, request):
    from dit_serve.schemas import InputImage, JobParams
    from dit_serve.server.store import Store, UploadQuotaFull

    url = request.getfixturevalue("postgres_url") if kind == "postgresql" else f"sqlite:///{tmp_path / 'jobs.db'}"
    store = Store(url, tmp_path / "data")
    try:
        first = store.put_upload("t", b"12345", "PNG", 1, 1, max_tenant_bytes=8, ttl_s=60)
        with pytest.raises(UploadQuotaFull):
            store.put_upload("t", b"6789", "PNG", 1, 1, max_tenant_bytes=8)
        assert store.upload_bytes("t") == 5 and store.get_upload(first.id, tenant="other") is None
        assert store.get_upload(first.id, data=True)[1] == b"12345" and store.purge_uploads() == []
        image = png()
        ref = InputImage(sha256=hashlib.sha256(image).hexdigest(), width=8, height=8)
        params = JobParams(sampler="ddim", steps=4, guidance=1.0, image=ref, strength=0.5)
        job_id = store.create_job("digits", params, [1, 2], [0, 1], inputs={"image": image})
        leases = store.lease("w", ["digits"], 2, 30)
        assert [(ls.spec.image, ls.spec.strength) for ls in leases] == [(image, 0.5)] * 2
        (tmp_path / "data" / "inputs" / job_id / "image").write_bytes(png(color=1))  # changed behind its back
        store.release(leases, "stop")
        from dit_serve.server.store.uploads import _read_input

        _read_input.cache_clear()  # (a new scheduler process: nothing read yet)
        assert store.lease("w", ["digits"], 2, 30) == []
        assert "changed since it was submitted" in store.get_job(job_id).items[0].error
    finally:
        store.close()
