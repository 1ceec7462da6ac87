"""The engine's decode and host hand-off: finished latents to uint8 images on the host, previews to the
host, and a request's tensors to the device, none of it waiting for the GPU where it need not.

Decode: latent models' latents go through the VAE (``_vae_pixels``; captured per group in a GraphRunner of
its own, ``decode_runner``, when ``SpeedConfig.decode_graphs`` is on), pixel-space models' latents are
their own image; ``decode`` resizes and centre-crops to the size asked (``resize_and_crop``, as the
reference pipelines do) and converts to uint8, the images of one output size together, copied to the host
in chunks of ``DECODE_CONVERT``.

Previews (``workers.families.previews`` maps a step's denoised estimate to small RGB on the device):
``previews_to_host`` starts a batch's uint8 copy to the host (pinned, non-blocking, with an event),
``previews_on_host`` collects the batches that have arrived.

Uploads (``_upload``): a host tensor to the device as a pinned, asynchronous copy, so the host goes on
queueing steps while the GPU finishes earlier replays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from graphs import GraphRunner, TensorSpec
from graphs.compiled import CompiledStep
from workers.loading import LoadedModel


@dataclass
class Preview:
    request_id: str
    step: int          # steps done when it was taken
    image: np.ndarray  # (h, w, 3) or (h, w) uint8, at most ``workers.families.previews.MAX_SIDE`` a side


@dataclass
class _PendingPreviews:
    """A batch of previews on its way to the host: ``host`` (B, h, w, c) uint8, valid once ``ready``."""

    ids: list[tuple[str, int]]  # (request id, step) per row
    host: torch.Tensor
    ready: object = None        # a torch.cuda.Event recorded after the copy; None: already copied


def previews_to_host(ids: list[tuple[str, int]], rgb: torch.Tensor) -> _PendingPreviews:
    """A batch of previews, ``rgb`` (b, h, w, c) uint8 on the device, on its way to the host (``ids``: the
    request id and step of each row). On CUDA nothing here waits for the GPU: a pinned, non-blocking copy
    with an event recorded after it."""
    if rgb.device.type != "cuda":
        return _PendingPreviews(ids, rgb.cpu())
    host = torch.empty(rgb.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(rgb, non_blocking=True)  # no wait: the host goes on queueing steps
    ready = torch.cuda.Event()
    ready.record()
    return _PendingPreviews(ids, host, ready)


def previews_on_host(pending: list[_PendingPreviews], wait: bool = False
                     ) -> tuple[list[Preview], list[_PendingPreviews]]:
    """The previews of ``pending`` whose copies have reached the host (all of them with ``wait``), oldest
    first, and the batches still on their way."""
    out, left = [], []
    for p in pending:
        if p.ready is not None and not wait and not p.ready.query():
            left.append(p)
            continue
        if p.ready is not None:
            p.ready.synchronize()
        imgs = p.host.numpy()
        out += [Preview(rid, step, img[..., 0] if img.shape[-1] == 1 else img)
                for (rid, step), img in zip(p.ids, imgs)]
    return out, left


def _upload(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor to ``device`` without waiting: on CUDA, a pinned copy, asynchronous, so the host
    goes on while the GPU finishes earlier replays (PyTorch's caching host allocator keeps the pinned
    block until the copy is done). A pageable copy would wait for the stream to drain."""
    if torch.device(device).type != "cuda" or t.is_cuda:  # on the CPU, or made on the GPU already
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


DECODE_PIXELS = 1 << 20  # a captured decode's largest batch makes at most this many output pixels (16 images
                         # at 256 px, 4 at 512, 1 at 1024): a VAE's activations at full size are large


def _vae_pixels(model: LoadedModel, latents: torch.Tensor) -> torch.Tensor:
    """The VAE's decode of latents (B, C, h, w) as float32 pixels (B, c, H, W) in [-1, 1] (not clamped)."""
    return model.vae.decode(latents.to(model.vae.dtype) / model.vae_scale + model.vae_shift).sample.float()


def decode_runner(model: LoadedModel, shape: tuple[int, int, int], pool=None, stream=None,
                  compiled: bool = False) -> GraphRunner:
    """``model``'s VAE decode at latent ``shape`` as a GraphRunner: backend "full" (a VAE needs no eager
    breaks) on CUDA, eager elsewhere, in the step's pool; batches up to DECODE_PIXELS of output, larger
    ones in chunks of that. ``compiled``: the decode compiled by Inductor first (``CompiledStep``: one
    compile for every batch), as the model's step is (on an H200, PixArt-Σ's 512 px decode took 7.2 ms
    as a compiled graph against 20.6 as a plain one), with the VAE's weights in channels-last on CUDA (the
    compiled graph's convolutions then run cuDNN's NHWC kernels: PixArt-Σ 512's decode at the 4-image bucket
    5.34 ms an image against 8.44; cuDNN's autotuning adds nothing to either, ``bench/decode_layouts.py`` (in git history))."""
    c, h, w = shape
    if compiled and model.device.type == "cuda":  # NHWC weights: cuDNN's NHWC convolutions (see the docstring)
        model.vae.to(memory_format=torch.channels_last)
    factor = model.image_size // model.latent_shape[1]  # the VAE's upsampling
    out = (model.vae.config.out_channels, h * factor, w * factor)
    largest = max(1, min(64, DECODE_PIXELS // (out[1] * out[2])))
    fn = lambda latents: {"pixels": _vae_pixels(model, latents)}  # noqa: E731
    if compiled:
        fn = CompiledStep(fn, f"{model.name} decode at {'x'.join(map(str, shape))}")
    return GraphRunner(fn, {"latents": TensorSpec(tuple(shape), torch.float32)},
                       {"pixels": TensorSpec(out, torch.float32)}, max_batch=1 << (largest.bit_length() - 1),
                       backend="full", device=model.device, pool=pool, stream=stream)


DECODE_CONVERT = 8  # images converted to uint8 and copied to the host at once


def decode(model: LoadedModel, latents: torch.Tensor, out_sizes: list[tuple[int, int]] | None = None,
           pixels: torch.Tensor | None = None) -> list[np.ndarray]:
    """Latents (B, C, h, w) -> uint8 images; pixel-space models are their own image. ``out_sizes`` (width,
    height per image; (0, 0) keeps the size) resizes and centre-crops, as the reference pipelines do.
    ``pixels``: the VAE's decode of ``latents`` made already (a captured decode), else it is made here."""
    return decode_start(model, latents, out_sizes, pixels).get()


class _Images:
    """Converted images on the host (``decode_start``): ``get()`` returns them in order."""

    def __init__(self, n: int) -> None:
        self.parts: list[tuple[list[int], torch.Tensor]] = []  # (image indices, (b, H, W, c) uint8 on the host)
        self.n = n

    def get(self) -> list[np.ndarray]:
        images: list[np.ndarray] = [None] * self.n  # type: ignore[list-item]
        for rows, host in self.parts:
            host = host.numpy()
            for j, i in enumerate(rows):
                images[i] = host[j, ..., 0] if host.shape[-1] == 1 else host[j]
        return images


@torch.no_grad()
def decode_start(model: LoadedModel, latents: torch.Tensor, out_sizes: list[tuple[int, int]] | None = None,
                 pixels: torch.Tensor | None = None) -> _Images:
    """``decode``'s conversions, each chunk copied to the host at once; ``_Images.get()`` returns the images."""
    if pixels is None:
        pixels = latents.float() if model.vae is None else _vae_pixels(model, latents)
    by_size: dict[tuple[int, int], list[int]] = {}  # the images of one output size convert and cross together:
    for i, size in enumerate(out_sizes or [(0, 0)] * len(pixels)):  # one copy to the host, not one per image
        by_size.setdefault(tuple(size), []).append(i)
    out = _Images(len(pixels))
    for (w, h), same in by_size.items():
        for at in range(0, len(same), DECODE_CONVERT):  # chunks bound the float copies on the device
            rows = same[at:at + DECODE_CONVERT]
            img = pixels if len(rows) == len(pixels) else pixels[rows]              # (b, c, H, W)
            img = (resize_and_crop(img, w, h) if w else img).clamp(-1, 1)  # a copy: the decode's output stays
            img = img.add_(1).mul_(127.5).round_().to(torch.uint8).permute(0, 2, 3, 1)  # (b, H, W, c)
            out.parts.append((rows, img.cpu()))
    return out


def resize_and_crop(pixels: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """(B, c, H, W) -> (B, c, height, width): scaled (bilinear) until it covers the target, then cropped
    about the centre, as diffusers' ``resize_and_crop_tensor`` (PixArt's resolution binning)."""
    h0, w0 = pixels.shape[-2:]
    if (h0, w0) == (height, width):
        return pixels
    ratio = max(height / h0, width / w0)
    rh, rw = int(h0 * ratio), int(w0 * ratio)
    pixels = torch.nn.functional.interpolate(pixels, size=(rh, rw), mode="bilinear", align_corners=False)
    top, left = (rh - height) // 2, (rw - width) // 2
    return pixels[..., top:top + height, left:left + width]
