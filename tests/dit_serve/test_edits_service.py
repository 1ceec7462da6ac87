"""Edits through the whole service (real local Ray, a worker actor with the engine and digits-text, the SDK and
OpenAI's endpoint over HTTP): image-to-image keeps a held-out 3 at a low strength and inpainting its left half from
"an eight" draws an 8, with the kept half the source's pixels exactly. One service, about 25 s on 2 cores."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from dit_serve.client import Client

from .conftest import patient, running_service

pytestmark = pytest.mark.slow


def _png(x: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.round((np.clip(x, -1, 1) + 1) * 127.5).astype(np.uint8), "L").save(out, "PNG")
    return out.getvalue()


def _read(images) -> np.ndarray:
    from workers.models.digits import classify

    return classify(np.stack([np.asarray(im.convert("L"), dtype=np.float32) / 127.5 - 1.0 for im in images]))


def test_image_to_image_and_inpainting_through_a_worker(tmp_path):
    from workers.models.digits import load_split

    _, _, x_test, y_test = load_split()
    three = x_test[y_test == 3][0]
    source = _png(three)
    mask = np.full((8, 8), -1.0)
    mask[:, :4] = 1.0  # the left half repainted
    with running_service(tmp_path / "data", "digits-text") as svc, Client(svc.url) as c:
        kept = c.submit(prompts=["an eight"], num_per_prompt=4, image=source, strength=0.05, seed=10)
        painted = c.submit(prompts=["an eight"], num_per_prompt=4, image=source, mask=_png(mask), seed=20)
        kept, painted = (c.wait(j, progress=False, timeout=patient(120)) for j in (kept, painted))
        assert kept.state == painted.state == "done"
        assert (painted.params.strength, kept.params.strength) == (1.0, 0.05)
        assert (_read(c.images(kept)) == 3).mean() >= 0.75  # close to the source: still a 3
        repainted = c.images(painted)
        assert (_read(repainted) == 8).mean() >= 0.75
        src = np.asarray(Image.open(io.BytesIO(source)))
        for im in repainted:  # outside the mask, the source's pixels exactly
            assert np.array_equal(np.asarray(im.convert("L"))[:, 4:], src[:, 4:])

        r = httpx.post(f"{svc.url}/v1/images/edits", timeout=120,
                       files={"image": ("three.png", source, "image/png")},
                       data={"prompt": "a seven", "n": "2", "response_format": "b64_json", "strength": "1"})
        assert r.status_code == 200, r.text
        sevens = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in r.json()["data"]]
        assert (_read(sevens) == 7).mean() >= 0.5
