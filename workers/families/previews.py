"""Previews while denoising: the current denoised estimate as a small RGB image, without a VAE decode.

A sampler's step already returns ``denoised`` (the engine keeps it as ``hist``). For a latent model a
fixed linear map from its C latent channels to RGB (plus a bias) approximates what the VAE would decode,
at the latent resolution; a pixel-space model's estimate is its own image. Each family names its maps
by latent channels (``Family.previews``: the card's family, latent channels and pixel space choose,
never the model's name; ``workers.families.preview_map_of``). The numbers come from
ComfyUI's ``comfy/latent_formats.py`` (``latent_rgb_factors`` and ``latent_rgb_factors_bias``; rows are
latent channels, columns R, G, B), fitted there on latents in the sampler's space, which is the space
the engine samples in (``decode`` undoes ``vae_scale`` and ``vae_shift`` only at the end). Their output,
like a VAE's, is in [-1, 1].

Importing this module is cheap (no torch): the API reads the maps to say which models have previews.
``to_rgb`` imports torch when called (on the worker).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

MAX_SIDE = 64  # pixels on the long side of a preview; latents larger than this are area-downscaled


@dataclass(frozen=True)
class PreviewMap:
    """``weight`` (C rows of (R, G, B)) and ``bias`` (R, G, B); ``identity``: the estimate is the image."""

    weight: tuple[tuple[float, float, float], ...] = ()
    bias: tuple[float, float, float] = (0.0, 0.0, 0.0)
    identity: bool = False


# ComfyUI latent_formats.SD15: the SD VAE (sd-vae-ft-ema/mse) that DiT and PixArt decode with (the families
# name their own VAEs' maps: workers.families.<name>)
SD_VAE = PreviewMap(weight=((0.3512, 0.2297, 0.3227),
                            (0.3250, 0.4974, 0.2350),
                            (-0.2829, 0.1762, 0.2721),
                            (-0.2120, -0.2616, -0.7177)))

# ComfyUI latent_formats.Flux: the 16-channel FLUX.1 VAE, which Z-Image uses too
FLUX_VAE = PreviewMap(weight=((-0.0346, 0.0244, 0.0681), (0.0034, 0.0210, 0.0687), (0.0275, -0.0668, -0.0433),
                              (-0.0174, 0.0160, 0.0617), (0.0859, 0.0721, 0.0329), (0.0004, 0.0383, 0.0115),
                              (0.0405, 0.0861, 0.0915), (-0.0236, -0.0185, -0.0259), (-0.0245, 0.0250, 0.1180),
                              (0.1008, 0.0755, -0.0421), (-0.0515, 0.0201, 0.0011), (0.0428, -0.0012, -0.0036),
                              (0.0817, 0.0765, 0.0749), (-0.1264, -0.0522, -0.1103), (-0.0280, -0.0881, -0.0499),
                              (-0.1262, -0.0982, -0.0778)),
                      bias=(-0.0329, -0.0718, -0.0851))
IDENTITY = PreviewMap(identity=True)


def preview_size(height: int, width: int, max_side: int = MAX_SIDE) -> tuple[int, int]:
    """(h, w) of a preview of an (height, width) estimate: its own size, or scaled so the long side is
    ``max_side`` (at least 1 pixel a side)."""
    scale = min(1.0, max_side / max(height, width))
    return max(1, round(height * scale)), max(1, round(width * scale))


def to_rgb(denoised, pmap: PreviewMap, max_side: int = MAX_SIDE):
    """(B, C, H, W) denoised estimates -> (B, h, w, c) uint8 on the same device: c = 3, or 1 for a
    one-channel pixel model. A handful of kernels for the whole batch, whatever its size: the resize first
    (area averaging commutes with the linear map, and there are fewer channels before it than after it,
    for SD-style latents as many), one copy to float32 pixel-major rows, one matrix product with the map's
    factors scaled to uint8 levels (``(v + 1) * 127.5`` folded in), clamp, round, cast. On a GPU a preview
    at every step costs the host these few launches: it runs while the GPU is still stepping."""
    import torch
    import torch.nn.functional as F

    x = denoised
    size = preview_size(*x.shape[-2:], max_side=max_side)
    if size != tuple(x.shape[-2:]):
        x = F.interpolate(x.float(), size=size, mode="area")                  # (B, C, h, w)
    b, c, h, w = x.shape
    rows = torch.empty((b, h, w, c), dtype=torch.float32, device=x.device).copy_(x.permute(0, 2, 3, 1)).view(-1, c)
    if pmap.identity:
        levels = rows.mul(127.5).add_(127.5)                                  # (B*h*w, c)
    else:
        weight, bias = _factors(pmap, x.device)                               # (C, 3), (3,) in uint8 levels
        levels = torch.addmm(bias, rows, weight)                              # (B*h*w, 3)
    return levels.clamp_(0, 255).round_().to(torch.uint8).view(b, h, w, -1)  # (B, h, w, c)


@functools.cache
def _factors(pmap: PreviewMap, device):
    """``pmap``'s weight and bias as float32 tensors on ``device``, scaled from [-1, 1] to uint8 levels
    (``(v + 1) * 127.5``), made once: building them per call copied from pageable host memory, which on a
    GPU waits for every step queued before it (the host could no longer run ahead of the GPU: +25-33% step
    time with a preview at every step on an H200)."""
    import torch

    weight = torch.tensor(pmap.weight, dtype=torch.float64) * 127.5
    bias = (torch.tensor(pmap.bias, dtype=torch.float64) + 1) * 127.5
    return weight.to(device, torch.float32), bias.to(device, torch.float32)
