"""The one description of an image to make, from the store to the engine.

An ``ItemSpec`` is built once, when the store leases an item, from the job's resolved parameters (the
model's defaults already filled in by the API), and travels unchanged: scheduler -> worker actor ->
engine. Plain data, no torch: the API and the store import it; the engine turns it into tensors.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ItemSpec:
    """One image: ``id`` is the store's item key (``job/index``); ``model`` empty means the engine's only
    model. Class-conditional models read ``label``; text models ``prompt`` and ``negative_prompt`` (""
    is the unconditional prompt, as in the reference pipelines). ``width`` x ``height`` is the size the
    model generates at (0: its native size); ``out_width`` x ``out_height``, when set, the size the image
    is resized (and centre-cropped) to afterwards. ``preview_every`` N > 0: a preview of the denoised
    estimate after every N-th step (not the last; ``workers.previews``); 0: none."""

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
