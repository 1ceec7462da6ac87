"""What the API knows about the configured models, and the one place user requests are checked
against models and limits.

The API process may run without a worker, a GPU or torch (several API processes in front of one
PostgreSQL store), so it reads each model's card (``workers.request.cards``: the model directory's JSON files,
the same reader the worker's loader uses) and checks sampler settings with the rules in
``samplers.rules`` (plain data). A request that passes ``resolve_job`` is one the workers can run; its
defaults are filled in here, once.
"""

from __future__ import annotations

import functools
import hashlib
import secrets
from dataclasses import dataclass
from typing import Callable

from dit_serve.schemas import (ImageEditRequest, ImageGenerationRequest, JobParams, JobRequest, ModelCard, clip,
                               input_name)
from dit_serve.server.config import LimitsConfig
from samplers.rules import RULES, Grid, SettingError, check_plan
from workers.families import preview_map_of
from workers.families.base import DIT_SCHEDULER
from workers.request import cards
from workers.request.images import ImageError, check_mask_size, check_strength
from workers.request.sizes import nearest_bin, parse_size


class RequestError(ValueError):
    """A request the service cannot run; ``param`` names the offending field, ``status`` the HTTP code."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, retry_after: int | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.retry_after = message, param, status, retry_after


def model_entry(card: cards.ModelCard, speed: str = "default") -> ModelCard:
    """A card as GET /v1/models shows it, with the speed the workers run it at."""
    return ModelCard(id=card.name, conditioning=card.conditioning, family=card.family, speed=speed,
                     num_classes=card.num_classes,
                     max_tokens=card.max_tokens, image_size=card.image_size, guidance=card.guidance_mode,
                     sizes=[f"{w}x{h}" for w, h in card.made_sizes()], size_multiple=card.size_multiple,
                     size_range=list(card.size_range) if card.size_range[1] else [], class_names=card.class_names(),
                     takes_image=card.takes_image, takes_mask=card.takes_mask, edit=card.edit,
                     needs_image=card.needs_image, max_images=card.max_images,
                     defaults=card.defaults, warnings=list(card.warnings),
                     samplers=[n for n, rule in RULES.items() if card.prediction_type in rule.predictions])


def random_seed(idempotency_key: str | None = None) -> int:
    """The seed of a request that names none: repeated requests differ, as in the reference UIs; each item
    records its seed. Below 2**31, so seed + i stays a number a user retypes. A submission with an
    Idempotency-Key takes its seed from the key, so that its retry is the same request, not a conflict."""
    if idempotency_key is None:
        return secrets.randbelow(2**31)
    return int.from_bytes(hashlib.sha256(idempotency_key.encode()).digest()[:4], "big") % 2**31


def grid_of(card: cards.ModelCard) -> Grid:
    """What the samplers' rules read of a model's schedule (its worker builds NoiseSchedule from the same)."""
    return Grid.of(card.scheduler or DIT_SCHEDULER)


@dataclass(frozen=True)
class NewJob:
    model: str
    params: JobParams
    labels: list[int]  # per item (0 for text models)
    seeds: list[int]
    priority: int = 0
    webhook_url: str | None = None
    prompts: list[str] | None = None  # per item, text models
    inputs: dict[str, bytes] | None = None  # edits: {"image": ..., "image2": ..., "mask": ...} as stored, once for
                                            # the job (dit_serve.server.store.uploads.input_name)


# an edit's strength when the request gives none: the img2img pipelines' (FluxImg2ImgPipeline,
# StableDiffusion3Img2ImgPipeline) for image-to-image; the whole schedule inside a mask, as OpenAI's edits repaint it
DEFAULT_STRENGTH = {"image": 0.6, "mask": 1.0}
# reads and checks an input image: dit_serve.server.inputs (which imports this module) makes them, as Input
Reader = Callable[[], "Input"]


class Catalog:
    """The served models' cards by name, and the limits."""

    def __init__(self, models: list[cards.ModelCard], limits: LimitsConfig, speeds: dict[str, str] | None = None):
        self.models = {m.name: m for m in models}
        self.limits = limits
        self.speeds = speeds or {}  # model name -> the speed the workers run it at

    @classmethod
    def of(cls, specs: list[str], limits: LimitsConfig, speeds: list[str] | None = None) -> "Catalog":
        """The catalog of the configured models (names or directories; ``speeds`` in their order); ValueError
        if one cannot be served."""
        models = [cards.read_card(s) for s in specs]
        return cls(models, limits, {m.name: sp for m, sp in zip(models, speeds or [])})

    def entry(self, name: str) -> ModelCard:
        """A served model as GET /v1/models shows it."""
        return model_entry(self.models[name], self.speeds.get(name, "default"))

    def model(self, name: str | None) -> cards.ModelCard:
        if name is None:
            return next(iter(self.models.values()))
        if name not in self.models:
            raise RequestError(f"unknown model {name!r}; this service serves: {', '.join(self.models)}", "model")
        return self.models[name]

    def resolve_job(self, req: JobRequest, idempotency_key: str | None = None, inputs: "JobInputs | None" = None
                    ) -> NewJob:
        """Check a job against the model and the limits; fill in the model's defaults (and a seed, drawn
        from ``idempotency_key`` when there is one: a retried submission is the same request). ``inputs``: the
        request's images and mask, read once the card allows them (an edit; without it a request that sends
        them is refused)."""
        info = self.model(req.model)
        if inputs is None and any(getattr(req, f) is not None for f in ("image", "image_b64", "mask", "mask_b64")):
            raise RequestError("this endpoint takes no input image", "image")
        edit, stored, image = self.edit(info, inputs.readers("image") if inputs else [],
                                        inputs and inputs.reader("mask"), req.strength)
        text = info.conditioning == "text"
        if text and req.prompts is None:
            raise RequestError(f"model {info.name!r} draws from text: send prompts, not labels", "labels")
        if not text and req.prompts is not None:
            raise RequestError(f"model {info.name!r} is class-conditional: send labels (class numbers or names), "
                               "not prompts", "prompts")
        if req.num_items > self.limits.max_items_per_job:
            per = "len(prompts) * num_per_prompt" if text else "len(labels) * num_per_label"
            raise RequestError(f"the job has {req.num_items} items ({per}); the limit is "
                               f"{self.limits.max_items_per_job}", "prompts" if text else "labels")
        width, height = req.width, req.height
        if image is not None and width is None and height is None:  # the listed size nearest the (last) image's ratio
            width, height = nearest_bin(image.width, image.height, info.made_sizes())
        params = self.params(info, req.sampler, req.steps, req.guidance, req.eta, req.negative_prompt,
                             size=_size(info, width, height, req.exact_size), **edit)
        if req.preview_every:
            if preview_map_of(info) is None:
                raise RequestError(f"model {info.name!r} has no preview (its {info.latent_channels}-channel latents "
                                   "have no RGB map); send preview_every 0", "preview_every")
            params.preview_every = req.preview_every
        if text:
            params.warnings.extend(_truncation_warnings(info, req.prompts))
            prompts = [p for p in req.prompts for _ in range(req.num_per_prompt)]
            labels = [0] * len(prompts)
        else:
            prompts = None
            labels = [lb for lb in (_label(info, lb) for lb in req.labels) for _ in range(req.num_per_label)]
        seed = random_seed(idempotency_key) if req.seed is None else req.seed
        seeds = req.seeds if req.seeds is not None else [seed + i for i in range(len(labels))]
        return NewJob(info.name, params, labels, seeds, req.priority, req.webhook_url, prompts, stored or None)

    def edit(self, info: cards.ModelCard, images: list[Reader], mask: Reader | None, strength: float | None
             ) -> tuple[dict, dict[str, bytes], "Input | None"]:
        """An edit's images, mask and strength checked against the model's card: (JobParams' fields, the bytes to
        store, the image whose aspect ratio sizes the output by default: the last one, as QwenImageEditPlusPipeline
        sizes its output by its list's last image). The readers are called (files read, decoded, checked) only once
        the card allows what they read. Without an image: nothing, and a mask or a strength is refused. More images
        than the card's ``max_images``: refused. An instruction edit's (a card whose ``edit`` is "reference"): the
        images only, a mask or a strength refused."""
        if not images:
            if info.needs_image:
                raise RequestError(f"model {info.name!r} edits an input image by its prompt (GET /v1/models: its "
                                   "needs_image is true): send image (or image_b64)", "image")
            if mask is not None:
                raise RequestError("a mask needs an input image to inpaint: send image (or image_b64) too", "mask")
            if strength is not None:
                raise RequestError("strength applies to edits (an input image): send image too, or no strength",
                                   "strength")
            return {}, {}, None
        if not info.takes_image:
            raise RequestError(f"model {info.name!r} does not take an input image (GET /v1/models: its takes_image "
                               "is false)", "image")
        if len(images) > info.max_images:
            most = "one input image" if info.max_images == 1 else f"at most {info.max_images} input images"
            raise RequestError(f"model {info.name!r} takes {most} (GET /v1/models: its max_images is "
                               f"{info.max_images}); {len(images)} were sent", "image")
        if info.edit == "reference":  # an instruction edit (FLUX.1 Kontext): the images are the prompt's references
            for name, sent in (("mask", mask is not None), ("strength", strength is not None)):
                if sent:
                    raise RequestError(f"model {info.name!r} edits a reference image by its prompt (an instruction "
                                       f"edit, GET /v1/models: its edit is \"reference\"): it takes no {name}", name)
            sources = [read() for read in images]
            fields = {"image": sources[0].ref(), "extra_images": [s.ref() for s in sources[1:]], "mask": None,
                      "strength": None}
            return fields, {input_name(i): s.data for i, s in enumerate(sources)}, sources[-1]
        image = images[0]
        if mask is not None and not info.takes_mask:
            raise RequestError(f"model {info.name!r} does not inpaint (GET /v1/models: its takes_mask is false): "
                               "send no mask for image-to-image", "mask")
        if strength is not None:
            try:
                check_strength(strength)
            except ValueError as e:
                raise RequestError(str(e), "strength") from None
        source = image()
        painted = mask() if mask is not None else None
        if painted is not None:
            try:
                check_mask_size(source, painted)
            except ImageError as e:
                raise RequestError(str(e), "mask") from None
        if strength is None:
            strength = DEFAULT_STRENGTH["mask" if painted is not None else "image"]
        fields = {"image": source.ref(), "mask": painted and painted.ref(), "strength": strength}
        stored = {"image": source.data, **({"mask": painted.data} if painted is not None else {})}
        return fields, stored, source

    def resolve_edit(self, req: ImageEditRequest, images: list[Reader], mask: Reader | None) -> NewJob:
        """An OpenAI edit as a job of ``n`` images made from ``images`` (one, or a model's several references): the
        prompt as for generations; ``size`` the images' size ('auto': the model's listed size nearest the (last)
        input's aspect ratio)."""
        info = self.model(req.model)
        if req.n > self.limits.max_images_per_request:
            raise RequestError(f"n must be at most {self.limits.max_images_per_request}, got {req.n}", "n")
        width = height = None
        if req.size not in (None, "auto"):
            try:
                width, height = parse_size(req.size)
            except ValueError as e:
                raise RequestError(str(e), "size") from None
        if info.conditioning != "text":
            self._class_label(info, req.prompt)  # before the files are read
        edit, stored, source = self.edit(info, images, mask, req.strength)
        if width is None:
            width, height = nearest_bin(source.width, source.height, info.made_sizes())
        params = self.params(info, None, req.steps, req.guidance, 0.0, size=self._openai_size(info, width, height,
                                                                                              req.size), **edit)
        seed = random_seed() if req.seed is None else req.seed
        seeds = [seed + i for i in range(req.n)]
        if info.conditioning == "text":
            params.warnings.extend(_truncation_warnings(info, [req.prompt], "prompt"))
            return NewJob(info.name, params, [0] * req.n, seeds, req.priority, prompts=[req.prompt] * req.n,
                          inputs=stored)
        return NewJob(info.name, params, [self._class_label(info, req.prompt)] * req.n, seeds, req.priority,
                      inputs=stored)

    def params(self, info: cards.ModelCard, sampler: str | None, steps: int | None, guidance: float | None,
               eta: float, negative_prompt: str = "", size: dict | None = None, **edit) -> JobParams:
        sampler = sampler or info.defaults["sampler"]
        steps = steps or info.defaults["steps"]
        if steps > self.limits.max_steps:
            raise RequestError(f"steps must be at most {self.limits.max_steps}, got {steps}", "steps")
        try:  # the rule make_plan applies in the worker: an accepted job can run
            check_plan(sampler, steps, eta, grid_of(info))
        except SettingError as e:
            raise RequestError(f"model {info.name!r}: {e}", e.param) from None
        guidance = info.defaults["guidance"] if guidance is None else guidance
        if negative_prompt and info.conditioning != "text":
            raise RequestError(f"model {info.name!r} is class-conditional: negative_prompt applies to text models",
                               "negative_prompt")
        if negative_prompt and info.guidance_mode != "cfg":
            meaning = "a network input (guidance-distilled)" if info.guidance_mode == "embedded" else "ignored"
            raise RequestError(f"model {info.name!r} has no classifier-free guidance (its guidance is {meaning}): "
                               "negative_prompt does not apply", "negative_prompt")
        params = JobParams(sampler=sampler, steps=steps, guidance=guidance, eta=eta, negative_prompt=negative_prompt,
                           **(size or _size(info, None, None, False)), **edit)
        params.warnings[:0] = info.warnings  # how the model is served comes first
        return params

    def resolve_images(self, req: ImageGenerationRequest) -> NewJob:
        """An OpenAI images request as a job: the prompt names one class, ``n`` images of it."""
        info = self.model(req.model)
        if info.needs_image:
            raise RequestError(f"model {info.name!r} edits an input image by its prompt: use POST /v1/images/edits",
                               "model")
        if req.n > self.limits.max_images_per_request:
            raise RequestError(f"n must be at most {self.limits.max_images_per_request}, got {req.n}", "n")
        width = height = None
        if req.size not in (None, "auto"):
            try:
                width, height = parse_size(req.size)
            except ValueError as e:
                raise RequestError(str(e), "size") from None
        size = self._openai_size(info, width, height, req.size)
        params = self.params(info, None, req.steps, req.guidance, 0.0, size=size)
        seed = random_seed() if req.seed is None else req.seed
        seeds = [seed + i for i in range(req.n)]
        if info.conditioning == "text":
            params.warnings.extend(_truncation_warnings(info, [req.prompt], "prompt"))
            return NewJob(info.name, params, [0] * req.n, seeds, req.priority, prompts=[req.prompt] * req.n)
        return NewJob(info.name, params, [self._class_label(info, req.prompt)] * req.n, seeds, req.priority)

    @staticmethod
    def _class_label(info: cards.ModelCard, prompt: str) -> int:
        try:
            return info.label_id(prompt)
        except ValueError as e:
            raise RequestError(f"the prompt must name one class of model {info.name!r}: {e}", "prompt") from None

    @staticmethod
    def _openai_size(info: cards.ModelCard, width: int | None, height: int | None, asked: str | None) -> dict:
        try:  # OpenAI's size is the image's size: snapped to a bin when needed, then resized to it
            return _size(info, width, height, exact=True)
        except RequestError:  # its message speaks of width and height, which these endpoints do not have
            lo, hi = info.size_range
            free = f", or sides that are multiples of {info.size_multiple} px from {lo} to {hi}" if hi else ""
            raise RequestError(f"model {info.name!r} does not make {asked} images; size must be one of "
                               f"{', '.join(f'{w}x{h}' for w, h in info.made_sizes())}{free}, or 'auto' (its own size)",
                               "size") from None


@functools.lru_cache(maxsize=16)
def _tokenizer(path: str):
    """The model's tokenizer.json, to count a prompt's tokens: without the truncation and padding a file may
    carry (digits-text's cuts at 32 and pads to 32), which would make every prompt as long as the limit."""
    from tokenizers import Tokenizer  # the Rust tokenizer alone: no torch, no transformers

    tok = Tokenizer.from_file(path)
    tok.no_truncation()
    tok.no_padding()
    return tok


def _truncation_warnings(info: cards.ModelCard, prompts: list[str], field: str = "prompts",
                         limit: int = 10) -> list[str]:
    """Prompts longer than the model's token limit are cut there, as the reference pipelines do; the job
    says which, naming each such prompt and its token count (counted with the model's own tokenizer.json;
    a directory without one is not counted)."""
    if not info.tokenizer_file or not info.max_tokens:
        return []
    try:
        tok = _tokenizer(info.tokenizer_file)
    except Exception:  # an unreadable tokenizer fails the worker's load with its message, not the API
        return []
    out = []
    for i, p in enumerate(prompts):
        n = len(tok.encode(p.lower().strip() if info.lowercase_prompts else p).ids)
        if n > info.max_tokens and len(out) < limit:
            where = field if len(prompts) == 1 and field != "prompts" else f"{field}[{i}]"
            out.append(f"{where} {clip(p, 60)!r} has {n} tokens; model {info.name!r} reads the first "
                       f"{info.max_tokens} (the rest is cut, as the reference pipelines do)")
    return out


def _size(info: cards.ModelCard, width: int | None, height: int | None, exact: bool) -> dict:
    """JobParams' size fields: what the model generates at, the exact size to resize to (if any), and a
    warning when it generates at another size than the one asked (as its reference pipeline would)."""
    try:
        (w, h), note = info.resolve_size(width, height)
    except ValueError as e:
        raise RequestError(str(e), "width" if width not in (None, info.image_size) else "height") from None
    asked = (width or info.image_size, height or info.image_size)
    out = asked if exact and asked != (w, h) else (0, 0)
    if note and exact:
        note += f", then resized to {asked[0]}x{asked[1]}"
    return {"width": w, "height": h, "output_width": out[0], "output_height": out[1],
            "warnings": [note] if note else []}


def _label(info: cards.ModelCard, label: int | str) -> int:
    try:
        return info.label_id(label)
    except ValueError as e:
        raise RequestError(str(e), "labels") from None
