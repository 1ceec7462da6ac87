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

from dit_serve.schemas import ImageGenerationRequest, JobParams, JobRequest, ModelCard, clip
from dit_serve.server.config import LimitsConfig
from samplers.rules import RULES, Grid, SettingError, check_plan
from workers.families import preview_map_of
from workers.families.base import DIT_SCHEDULER
from workers.request import cards
from workers.request.sizes import parse_size


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

    def resolve_job(self, req: JobRequest, idempotency_key: str | None = None) -> NewJob:
        """Check a job against the model and the limits; fill in the model's defaults (and a seed, drawn
        from ``idempotency_key`` when there is one: a retried submission is the same request)."""
        info = self.model(req.model)
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
        params = self.params(info, req.sampler, req.steps, req.guidance, req.eta, req.negative_prompt,
                             size=_size(info, req.width, req.height, req.exact_size))
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
        return NewJob(info.name, params, labels, seeds, req.priority, req.webhook_url, prompts)

    def params(self, info: cards.ModelCard, sampler: str | None, steps: int | None, guidance: float | None,
               eta: float, negative_prompt: str = "", size: dict | None = None) -> JobParams:
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
                           **(size or _size(info, None, None, False)))
        params.warnings[:0] = info.warnings  # how the model is served comes first
        return params

    def resolve_images(self, req: ImageGenerationRequest) -> NewJob:
        """An OpenAI images request as a job: the prompt names one class, ``n`` images of it."""
        info = self.model(req.model)
        if req.n > self.limits.max_images_per_request:
            raise RequestError(f"n must be at most {self.limits.max_images_per_request}, got {req.n}", "n")
        width = height = None
        if req.size not in (None, "auto"):
            try:
                width, height = parse_size(req.size)
            except ValueError as e:
                raise RequestError(str(e), "size") from None
        try:  # OpenAI's size is the image's size: snapped to a bin when needed, then resized to it
            size = _size(info, width, height, exact=True)
        except RequestError:  # its message speaks of width and height, which this endpoint does not have
            lo, hi = info.size_range
            free = f", or sides that are multiples of {info.size_multiple} px from {lo} to {hi}" if hi else ""
            raise RequestError(f"model {info.name!r} does not make {req.size} images; size must be one of "
                               f"{', '.join(f'{w}x{h}' for w, h in info.made_sizes())}{free}, or 'auto' (its own size)",
                               "size") from None
        params = self.params(info, None, req.steps, req.guidance, 0.0, size=size)
        seed = random_seed() if req.seed is None else req.seed
        seeds = [seed + i for i in range(req.n)]
        if info.conditioning == "text":
            params.warnings.extend(_truncation_warnings(info, [req.prompt], "prompt"))
            return NewJob(info.name, params, [0] * req.n, seeds, req.priority, prompts=[req.prompt] * req.n)
        try:
            label = info.label_id(req.prompt)
        except ValueError as e:
            raise RequestError(f"the prompt must name one class of model {info.name!r}: {e}", "prompt") from None
        return NewJob(info.name, params, [label] * req.n, seeds, req.priority)


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
