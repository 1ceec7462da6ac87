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


# -- the rule, for families without an img2img or inpaint pipeline -------------------------------------------
# Their reference is the family's own text-to-image pipeline driven as the img2img and inpaint pipelines drive
# theirs: the schedule cut by get_timesteps (``cut_timesteps``, or the cut sigmas where the pipeline takes them),
# the latents given as the clean latents noised by the scheduler's own add_noise / scale_noise (``noised``), and
# the inpainting blend in the step-end callback (``blend_callback``).
def start_of(steps: int, strength: float) -> int:
    """get_timesteps' first step, written out again: int(max(N - min(N * strength, N), 0))."""
    return int(max(steps - min(steps * strength, steps), 0))


def noised(scheduler, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The scheduler's own noising of x0 to timestep t: scale_noise for flow matching, add_noise otherwise."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    t = torch.as_tensor(t).reshape(1)
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return scheduler.scale_noise(x0, t, noise)
    return scheduler.add_noise(x0, noise, t)


def cut_timesteps(retrieve, strength: float):
    """A pipeline module's ``retrieve_timesteps`` followed by the img2img pipelines' ``get_timesteps``: the
    timesteps from the start strength selects, the scheduler's begin index set there."""

    def retrieve_timesteps(scheduler, *args, **kwargs):
        timesteps, n = retrieve(scheduler, *args, **kwargs)
        start = start_of(n, strength)
        if hasattr(scheduler, "set_begin_index"):  # DDPM and DDIM index by timestep
            scheduler.set_begin_index(start)
        scheduler.edit_timesteps = timesteps[start:]  # what the blend reads (blend_callback)
        return timesteps[start:], n - start

    return retrieve_timesteps


def blend_callback(x0: torch.Tensor, noise: torch.Tensor, mask: torch.Tensor):
    """The inpaint pipelines' blend after each step, as a step-end callback: outside the mask, x0 noised to the
    next step's level (the last step: x0 itself)."""

    def callback(pipe, i, t, kwargs):
        scheduler = pipe.scheduler
        timesteps = getattr(scheduler, "edit_timesteps", scheduler.timesteps)  # cut sigmas: its own timesteps
        proper = noised(scheduler, x0, noise, timesteps[i + 1]) if i + 1 < len(timesteps) else x0
        return {"latents": (1 - mask) * proper + mask * kwargs["latents"]}

    return callback


def pipeline_mask(spec, width: int, height: int) -> torch.Tensor:
    """The inpaint pipelines' mask_processor output for ``spec``'s mask: (1, 1, height, width), binarised."""
    from diffusers.image_processor import VaeImageProcessor

    processor = VaeImageProcessor(do_normalize=False, do_binarize=True, do_convert_grayscale=True)
    return processor.preprocess(decode_mask(spec.mask), height=height, width=width)


def pipeline_image(spec, width: int, height: int) -> torch.Tensor:
    """The img2img pipelines' image_processor output for ``spec``'s image: (1, 3, height, width) in [-1, 1]."""
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor().preprocess(decode_image(spec.image), height=height, width=width)
