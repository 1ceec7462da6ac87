"""Image-to-image and inpainting in the engine: a request with an image starts from the image's latents noised
to the step its strength selects, and an inpainting request's rows blend the image back outside the mask after
every step, inside the captured step. The reference is diffusers' img2img and inpaint pipelines
(``StableDiffusion3Img2ImgPipeline`` / ``InpaintPipeline``, ``FluxImg2ImgPipeline`` / ``FluxInpaintPipeline``,
``QwenImage*``, ``ZImage*``); families without one follow the same rule (``docs/design.md``, "Edits").

At admission (``starts``, once per admission batch, model and latent shape, whatever the rows' step variants):

1. The image (``workers.request.images``: decoded, upright, RGB) is resized to the generation size as the
   pipelines' image processor does (Lanczos, stretched) and scaled to [-1, 1] (``pixels_of``); a mask
   likewise, in grayscale, then binarised at 0.5 (``mask_of``), then brought to the latent grid by the family
   (``Family.mask_latents``: nearest, as the pipelines' ``interpolate``; FLUX.2 bilinear).
2. The images of the batch are encoded together by the family (``Family.encode_image``: (B, 3, H, W) in
   [-1, 1] -> (B, C, h, w) in the engine's latent layout), each row's posterior sample drawn from its request's
   own generator (``posterior``), as a pipeline given a list of generators draws it.
3. The plan is cut where strength starts it (``samplers.edit_start`` / ``start_at``: the pipelines'
   ``get_timesteps``), and the request joins its group at that step: the same graphs, nothing else.
4. The starting latents: ``a x0 + b noise`` at the first kept step (``Plan.levels``: ``scale_noise`` for flow
   schedulers, ``add_noise`` for DDPM/DDIM/Euler/DPM-Solver), noise drawn from the generator after the
   posterior (the pipelines' order). An inpainting request at strength 1 starts from ``noise * init_sigma``
   (the inpaint pipelines' ``is_strength_max``; the same values for flow schedulers, whose first sigma is 1).

Generator rule: a request's CPU generator, seeded with its seed, draws (1) the VAE posterior's sample where the
family's pipelines sample it (SD3, FLUX.1, Qwen-Image, Z-Image, PixArt and DiT with an AutoencoderKL), nothing
where they take the mode (FLUX.2's pipelines: ``sample_mode="argmax"``) or the encoder is deterministic (Sana's
DC-AE, pixel-space models), (2) the starting noise, (3) an ancestral sampler's per-step noise. The inpaint
pipelines also encode the masked image with the same generator after the noise (for 9- and 33-channel
inpainting models only): that draw is not made, so an ancestral sampler's per-step noise follows the noise.

Inpainting in the step (``inpainting``): an engine-level variant of the family's step (``INPAINT``: its
groups are their own graphs, so text-to-image rows do not pay for it), with four more static inputs per row:
the mask (1, h, w), the image's latents and the noise (C, h, w), and the step's blend row (a, b): after the
family's update, ``x = (1 - mask) (a x0 + b noise) + mask x``, with (a, b) the next step's level (the last step:
(1, 0), the clean latents), as the pipelines' ``init_latents_proper`` blend. The multistep history (``hist``) is
not blended, as the pipelines' scheduler state is not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from graphs import TensorSpec
from samplers import Plan, edit_start, start_at
from workers.request.images import check_mask_size, check_strength, decode_image, decode_mask, resize

INPAINT = "inpaint"  # the engine's step variant of inpainting rows, beside a family's own (Family.step_variants)
EDIT_INPUTS = ("mask", "image_latents", "image_noise", "blend")


def inpaint_variant(variant: str) -> str:
    """The engine's variant of inpainting rows whose family step is ``variant`` ("" or e.g. NO_CFG)."""
    return f"{variant}+{INPAINT}" if variant else INPAINT


def family_variant(variant: str) -> tuple[str, bool]:
    """(the family's variant, whether the rows inpaint) of an engine variant."""
    if variant == INPAINT:
        return "", True
    if variant.endswith("+" + INPAINT):
        return variant[: -len(INPAINT) - 1], True
    return variant, False


def edit_specs(shape: tuple[int, int, int]) -> dict[str, TensorSpec]:
    """The inpainting step's static inputs per row, beside the family's."""
    c, h, w = shape
    f32 = torch.float32
    return {"mask": TensorSpec((1, h, w), f32), "image_latents": TensorSpec((c, h, w), f32),
            "image_noise": TensorSpec((c, h, w), f32), "blend": TensorSpec((2,), f32)}


def inpainting(step):
    """``step`` (a family's whole step) followed by the inpainting blend, elementwise per row: the latents outside
    the mask replaced by the image's latents noised to the next step's level, ``(1 - m) (a x0 + b n) + m x``,
    as the inpaint pipelines' ``(1 - init_mask) * init_latents_proper + init_mask * latents``."""

    def inpaint_step(x, t, guidance, coeffs, hist, noise, mask, image_latents, image_noise, blend, **cond):
        out = step(x, t, guidance, coeffs, hist, noise, **cond)
        a, b = blend[:, 0].view(-1, 1, 1, 1), blend[:, 1].view(-1, 1, 1, 1)
        proper = a * image_latents + b * image_noise                       # (B, C, h, w)
        return {"x_next": (1 - mask) * proper + mask * out["x_next"], "hist_next": out["hist_next"]}

    return inpaint_step


# -- admission ---------------------------------------------------------------------------------------------------
def check_edit(family, model, spec) -> None:
    """ValueError when ``spec``'s edit fields do not fit: a mask without an image, a strength outside (0, 1], an
    image or a mask for a model whose family does not take one, more reference images than the card's
    ``max_images``."""
    if spec.extra_images:
        if not spec.image:
            raise ValueError("image: further reference images need a first one (image is empty)")
        most = getattr(getattr(model, "card", None), "max_images", 1)
        if len(spec.references) > most:
            raise ValueError(f"image: model {model.name!r} takes at most {most} input image"
                             f"{'s' if most > 1 else ''}, got {len(spec.references)}")
    if not spec.image:
        if spec.mask:
            raise ValueError("mask: a mask needs an image to inpaint (image is empty)")
        if takes_reference(model) and model.card.needs_image:  # Qwen-Image-Edit: its pipelines need one
            raise ValueError(f"image: model {model.name!r} edits an input image by its prompt: send one")
        return
    if takes_reference(model):  # an instruction edit (FLUX.1 Kontext): the image is a reference, strength unused
        if spec.mask:
            raise ValueError(f"mask: model {model.name!r} edits a reference image by its prompt and takes no mask")
        return
    check_strength(spec.strength)
    if not family.takes_image:
        raise ValueError(f"image: model {model.name!r} ({family.name}) does not take an input image")
    if spec.mask and not family.takes_mask:
        raise ValueError(f"mask: model {model.name!r} ({family.name}) does not inpaint")


def takes_reference(model) -> bool:
    """Whether ``model``'s input image is a reference its family's step reads (its card's ``edit`` "reference":
    FLUX.1 Kontext), not a starting point: such a request starts as text-to-image, its image the family's."""
    card = getattr(model, "card", None)
    return card is not None and card.edit == "reference"


def pixels_of(image, width: int, height: int) -> torch.Tensor:
    """A PIL RGB image as the pipelines' ``VaeImageProcessor.preprocess`` makes it: resized to width x height
    (Lanczos), float32 / 255, 2x - 1: (3, height, width) in [-1, 1]."""
    arr = np.array(resize(image, width, height)).astype(np.float32) / 255.0   # (H, W, 3)
    return torch.from_numpy(arr).permute(2, 0, 1) * 2.0 - 1.0


def mask_of(mask, width: int, height: int) -> torch.Tensor:
    """A PIL "L" mask as the pipelines' mask processor makes it: resized (Lanczos), / 255, binarised (< 0.5: 0,
    else 1): (1, height, width), 1 = repaint."""
    arr = np.array(resize(mask, width, height)).astype(np.float32) / 255.0   # (H, W)
    m = torch.from_numpy(arr)[None]
    return (m >= 0.5).to(torch.float32)


def posterior(dist, generators: list[torch.Generator] | None) -> torch.Tensor:
    """A diagonal-Gaussian posterior's latents: its mode (``generators`` None), else a sample per row, each row's
    standard normal drawn on the CPU from its own generator in the posterior's dtype, as diffusers'
    ``DiagonalGaussianDistribution.sample`` draws it (``randn_tensor`` with a list of generators)."""
    if generators is None:
        return dist.mode()
    mean = dist.mean
    eps = torch.cat([torch.randn((1, *mean.shape[1:]), generator=g, device="cpu", dtype=mean.dtype)
                     for g in generators])
    if mean.is_cuda:  # pinned and asynchronous: a pageable copy would wait for the GPU
        eps = eps.pin_memory()
    return mean + dist.std * eps.to(mean.device, non_blocking=True)


def vae_encode(model, pixels: torch.Tensor, generators: list[torch.Generator] | None = None) -> torch.Tensor:
    """The families' default ``encode_image``: pixels (B, 3, H, W) in [-1, 1] -> latents (B, C, h, w) float32.
    An AutoencoderKL's posterior (sampled with ``generators``, else its mode), then ``(z - shift) * scale``, the
    inverse of the engine's decode (``workers.decode``), as the pipelines' ``_encode_vae_image``. A pixel-space
    model's latents are the pixels: RGB as they are, one channel as Pillow's luma (ITU-R 601-2, its "L")."""
    vae = model.vae
    if vae is None:
        c = model.latent_shape[0]
        if c == 3:
            return pixels.float()
        if c == 1:
            rgb = pixels.float()
            return rgb[:, 0:1] * 0.299 + rgb[:, 1:2] * 0.587 + rgb[:, 2:3] * 0.114
        raise ValueError(f"model {model.name!r} works on {c} pixel channels: no image maps to them")
    z = posterior(vae.encode(pixels.to(model.device, vae.dtype)).latent_dist, generators)
    return ((z - model.vae_shift) * model.vae_scale).float()


def nearest_mask(mask: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """The families' default ``mask_latents``: (B, 1, H, W) -> (B, 1, h, w) by ``interpolate`` (nearest), as the
    pipelines' ``prepare_mask_latents``."""
    return torch.nn.functional.interpolate(mask, size=tuple(shape[1:]))


@dataclass
class Start:
    """Where a request starts: its latents, its generator (what is left of it: per-step noise), its plan (cut for
    an edit), and an inpainting request's static inputs (``EDIT_INPUTS`` but ``blend``: (S, 2), a row per step)."""

    x: torch.Tensor
    gen: torch.Generator
    plan: Plan
    edit: dict[str, torch.Tensor] = field(default_factory=dict)


def _to(t: torch.Tensor, device) -> torch.Tensor:
    return t.to(device)


@torch.no_grad()
def starts(model, family, shape: tuple[int, int, int], specs, plans: list[Plan], upload=_to) -> list[Start]:
    """Each request's ``Start`` (the module docstring's steps 1-4); the images of all of them encoded in one batch.
    Text-to-image requests: seeded noise times the plan's init_sigma, on the host, as before. ValueError (an
    ImageError naming the field) for an image or mask that cannot be used. ``upload(tensor, device)``: how host
    tensors go to the model's device (the engine's pinned, asynchronous copy); an edit's tensors are made there."""
    gens = [torch.Generator("cpu").manual_seed(s.seed) for s in specs]
    out: list[Start | None] = [None] * len(specs)
    edits = [i for i, s in enumerate(specs) if s.image and not takes_reference(model)]
    for i, s in enumerate(specs):
        if i not in edits:  # text-to-image, and a reference edit (its image is a step input: the family's encode)
            out[i] = Start(torch.randn(shape, generator=gens[i]) * plans[i].init_sigma, gens[i], plans[i])
    if not edits:
        return out
    c, h, w = shape
    factor = model.image_size // model.latent_shape[1]   # the VAE's downsampling (1: pixel space)
    width, height = w * factor, h * factor
    pixels, masks = [], {}
    for i in edits:
        image = decode_image(specs[i].image)
        pixels.append(pixels_of(image, width, height))
        if specs[i].mask:
            mask = decode_mask(specs[i].mask)
            check_mask_size(image, mask)
            masks[i] = mask_of(mask, width, height)
    cut = [start_at(plans[i], edit_start(plans[i].num_steps, specs[i].strength)) for i in edits]
    device = model.device
    latents = family.encode_image(model, upload(torch.stack(pixels), device), [gens[i] for i in edits])
    grid = {}
    if masks:  # the masks of the batch brought to the latent grid together
        order = list(masks)
        grid = dict(zip(order, family.mask_latents(model, upload(torch.stack([masks[i] for i in order]), device),
                                                   shape).float()))
    for j, i in enumerate(edits):
        plan, x0 = cut[j], latents[j].float()
        noise = upload(torch.randn(shape, generator=gens[i]), device)
        if i in masks and specs[i].strength == 1.0:  # the inpaint pipelines' is_strength_max: pure noise
            x = noise * plan.init_sigma
        else:  # float32 scalars: the scheduler's arithmetic
            x = float(plan.levels[0, 0]) * x0 + float(plan.levels[0, 1]) * noise
        edit = {} if i not in masks else {"mask": grid[i], "image_latents": x0, "image_noise": noise,
                                          "blend": plan.levels[1:]}
        out[i] = Start(x, gens[i], plan, edit)
    return out
