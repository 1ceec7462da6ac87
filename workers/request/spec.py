"""The one description of an image to make, from the store to the engine.

An ``ItemSpec`` is built once, when the store leases an item, from the job's resolved parameters (the
model's defaults already filled in by the API), and travels unchanged: scheduler -> worker actor ->
engine. Plain data, no torch: the API and the store import it; the engine turns it into tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ItemSpec:
    """One image: ``id`` is the store's item key (``job/index``); ``model`` empty means the engine's only
    model. Class-conditional models read ``label``; text models ``prompt`` and ``negative_prompt`` (""
    is the unconditional prompt, as in the reference pipelines). ``width`` x ``height`` is the size the
    model generates at (0: its native size); ``out_width`` x ``out_height``, when set, the size the image
    is resized (and centre-cropped) to afterwards. ``preview_every`` N > 0: a preview of the denoised
    estimate after every N-th step (not the last; ``workers.families.previews``); 0: none.

    Edits. ``image``: an encoded image file as uploaded (PNG, JPEG or WebP bytes; ``workers.request.images``
    checks and decodes it); empty: text-to-image. With an image the request is image-to-image: the image,
    resized to the generation size, is encoded by the model's VAE and noised to the step ``strength`` in (0, 1]
    selects (1: the whole schedule, from pure noise; 0.3: its last 30%). ``mask``: an encoded image of the image's
    size, white = repaint, black = keep (diffusers' ``mask_image``): inpainting. ``strength`` without an image
    means nothing. ``extra_images``: an instruction edit's further reference images (images 2, 3, ... of
    QwenImageEditPlusPipeline's list; ``image`` is image 1), at most the card's ``max_images`` in all
    (``references``). The bytes stay out of the repr (logs).

    ``loras``: the adapters (registered names) and their scales the image is made with, at most the worker's
    ``lora_per_request``; empty: none (``workers.lora``)."""

    id: str
    seed: int
    sampler: str
    steps: int
    guidance: float
    eta: float = 0.0
    label: int = 0
    model: str = ""
    prompt: str = ""
    negative_prompt: str = ""
    width: int = 0
    height: int = 0
    out_width: int = 0
    out_height: int = 0
    preview_every: int = 0
    image: bytes = field(default=b"", repr=False)
    mask: bytes = field(default=b"", repr=False)
    strength: float = 1.0
    extra_images: tuple[bytes, ...] = field(default=(), repr=False)
    loras: tuple[tuple[str, float], ...] = ()

    @property
    def references(self) -> tuple[bytes, ...]:
        """Every input image in order (``image``, then ``extra_images``); empty without an image."""
        return (self.image, *self.extra_images) if self.image else ()
