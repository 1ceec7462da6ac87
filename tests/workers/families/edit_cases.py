"""What the families' edit tests share: an input image and masks as a user uploads them (PNG bytes), the same
images decoded as the worker decodes them (what the reference pipelines are given), and the tolerance.

Tolerance: max |ours - reference| <= 1e-4 * max(1, max |reference|) over the final latents, as the families'
text-to-image tests: both sides run the same float32 modules; what differs is the batch (a different matmul
blocking) and the sampler arithmetic (float64-built coefficients rounded to float32)."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from workers.request.images import decode_image, decode_mask

STRENGTHS = (0.3, 0.6, 1.0)
TOL = 1e-4


def png(im: Image.Image) -> bytes:
    out = io.BytesIO()
    im.save(out, "PNG")
    return out.getvalue()


def image_bytes(width: int = 40, height: int = 28, seed: int = 0) -> bytes:
    """A smooth colour field with some texture, PNG, at a size other than the models' (the pipelines resize it)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    rgb = np.stack([np.sin(6 * x + seed), np.cos(5 * y - seed), np.sin(4 * (x + y))], axis=-1)
    rgb = (rgb + 1) * 110 + rng.uniform(0, 35, (height, width, 3))
    return png(Image.fromarray(rgb.clip(0, 255).astype(np.uint8), "RGB"))


def mask_bytes(width: int = 40, height: int = 28, box: tuple[float, float, float, float] = (0.5, 0, 1, 1)) -> bytes:
    """A white (repaint) box on black, as fractions (left, top, right, bottom) of the size: the right half by
    default."""
    im = Image.new("L", (width, height), 0)
    l, t, r, b = box
    im.paste(255, (round(l * width), round(t * height), round(r * width), round(b * height)))
    return png(im)


def decoded(spec) -> dict:
    """The reference pipelines' ``image`` (and ``mask_image``) arguments for ``spec``: its bytes decoded as the
    worker decodes them."""
    out = {"image": decode_image(spec.image)}
    if spec.mask:
        out["mask_image"] = decode_mask(spec.mask)
    return out


def generator(spec) -> torch.Generator:
    """The reference's generator: seeded as the engine seeds the request's."""
    return torch.Generator("cpu").manual_seed(spec.seed)


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str = "") -> float:
    assert ours.shape == ref.shape, (what, tuple(ours.shape), tuple(ref.shape))
    err = (ours - ref).abs().max().item()
    assert err <= TOL * max(1.0, ref.abs().max().item()), (what, err)
    return err
