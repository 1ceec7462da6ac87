"""What the API knows about the configured models, read from their JSON files (no weights, no
torch), and the one place user requests are checked against models and limits.

The API process may run without a worker or a GPU (several API processes in front of one
PostgreSQL store), so it cannot ask a loaded model for its classes; ``describe`` reads the same
files ``workers.loading.load_model`` reads and names models the same way (a test keeps the two in
step). A request that passes ``resolve_job`` is one the workers can run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from dit_serve.config import LimitsConfig
from dit_serve.schemas import ImageGenerationRequest, JobParams, JobRequest, ModelCard
from workers.labels import resolve_label

BUILTIN_RESOLUTIONS = {"dit-xl-2-256": 256, "dit-xl-2-512": 512}  # as workers.loading
FALLBACK_DEFAULTS = {"guidance": 4.0, "sampler": "ddim", "steps": 50}
DIGITS_DIR = Path(__file__).resolve().parent.parent / "workers" / "models" / "digits"


class RequestError(ValueError):
    """A request the service cannot run; ``param`` names the offending field, ``status`` the HTTP code."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, retry_after: int | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.retry_after = message, param, status, retry_after


@dataclass(frozen=True)
class ModelInfo:
    name: str
    num_classes: int
    image_size: int
    id2label: dict[int, str] = field(default_factory=dict)
    defaults: dict = field(default_factory=lambda: dict(FALLBACK_DEFAULTS))
    scheduler: str = ""  # JSON of scheduler/scheduler_config.json; empty: DiT's (as workers.loading)

    def label_id(self, label: int | str) -> int:
        """As ``LoadedModel.label_id``: a class number, or a name among id2label's comma-separated names."""
        try:
            return resolve_label(label, self.num_classes, self.id2label, self.name)
        except ValueError as e:
            raise RequestError(str(e), "labels") from None

    def card(self) -> ModelCard:
        names = [self.id2label.get(i, "") for i in range(self.num_classes)] if self.id2label else []
        return ModelCard(id=self.name, num_classes=self.num_classes, image_size=self.image_size,
                         class_names=names, defaults=self.defaults)


def describe(spec: str) -> ModelInfo:
    """Model metadata from a built-in name or a diffusers-format directory; ValueError if unreadable."""
    if spec in BUILTIN_RESOLUTIONS:
        return ModelInfo(spec, 1000, BUILTIN_RESOLUTIONS[spec])
    path = DIGITS_DIR if spec == "digits" else Path(spec).expanduser()
    name = "digits" if spec == "digits" else path.name
    if (path / "model_index.json").is_file():
        index = _read_json(path / "model_index.json")
        cfg = _read_json(path / "transformer" / "config.json")
        vae = path / "vae" / "config.json"
        factor = 2 ** (len(_read_json(vae)["block_out_channels"]) - 1) if vae.is_file() else 1
        sched = path / "scheduler" / "scheduler_config.json"
        return ModelInfo(name, int(cfg["num_embeds_ada_norm"]), int(cfg["sample_size"]) * factor,
                         {int(k): v for k, v in (index.get("id2label") or {}).items()},
                         {**FALLBACK_DEFAULTS, **index.get("dit_serve", {}).get("defaults", {})},
                         json.dumps(_read_json(sched)) if sched.is_file() else "")
    if (path / "config.json").is_file():
        cfg = _read_json(path / "config.json")
        return ModelInfo(name, int(cfg["num_embeds_ada_norm"]), int(cfg["sample_size"]))
    raise ValueError(f"model {spec!r}: no model_index.json or config.json at {path}")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None


@dataclass(frozen=True)
class NewJob:
    model: str
    params: JobParams
    labels: list[int]
    seeds: list[int]
    priority: int = 0
    webhook_url: str | None = None


class Catalog:
    """The served models by name and the limits."""

    def __init__(self, models: list[ModelInfo], limits: LimitsConfig):
        self.models = {m.name: m for m in models}
        self.limits = limits

    def model(self, name: str | None) -> ModelInfo:
        if name is None:
            return next(iter(self.models.values()))
        if name not in self.models:
            raise RequestError(f"unknown model {name!r}; this service serves: {', '.join(self.models)}", "model")
        return self.models[name]

    def resolve_job(self, req: JobRequest) -> NewJob:
        """Check a job against the model and the limits; fill in the model's defaults."""
        info = self.model(req.model)
        if req.num_items > self.limits.max_items_per_job:
            raise RequestError(f"the job has {req.num_items} items (len(labels) * num_per_label); the limit "
                               f"is {self.limits.max_items_per_job}", "labels")
        ids = [info.label_id(lb) for lb in req.labels]
        params = self.params(info, req.sampler, req.steps, req.guidance, req.eta)
        labels = [lb for lb in ids for _ in range(req.num_per_label)]
        seeds = req.seeds if req.seeds is not None else [req.seed + i for i in range(len(labels))]
        return NewJob(info.name, params, labels, seeds, req.priority, req.webhook_url)

    def params(self, info: ModelInfo, sampler: str | None, steps: int | None, guidance: float | None,
               eta: float) -> JobParams:
        sampler = sampler or info.defaults["sampler"]
        steps = steps or info.defaults["steps"]
        if steps > self.limits.max_steps:
            raise RequestError(f"steps must be at most {self.limits.max_steps}, got {steps}", "steps")
        try:
            _check_plan(info.scheduler, sampler, steps, eta)
        except ValueError as e:
            msg = str(e)
            raise RequestError(msg, "steps" if "num_steps" in msg else "eta" if "eta" in msg else "sampler") from None
        guidance = info.defaults["guidance"] if guidance is None else guidance
        return JobParams(sampler=sampler, steps=steps, guidance=guidance, eta=eta)

    def resolve_images(self, req: ImageGenerationRequest) -> NewJob:
        """An OpenAI images request as a job: the prompt names one class, ``n`` images of it."""
        info = self.model(req.model)
        if req.n > self.limits.max_images_per_request:
            raise RequestError(f"n must be at most {self.limits.max_images_per_request}, got {req.n}", "n")
        if req.size not in (None, "auto", f"{info.image_size}x{info.image_size}"):
            raise RequestError(f"size {req.size!r} is not supported by model {info.name!r}: it makes "
                               f"{info.image_size}x{info.image_size} images (or pass 'auto')", "size")
        try:
            label = info.label_id(req.prompt)
        except RequestError as e:
            raise RequestError(f"the prompt must name one class of model {info.name!r}: {e.message}", "prompt") from None
        params = self.params(info, None, req.steps, req.guidance, 0.0)
        seed = 0 if req.seed is None else req.seed
        return NewJob(info.name, params, [label] * req.n, [seed + i for i in range(req.n)], req.priority)


@lru_cache(maxsize=256)
def _check_plan(scheduler_json: str, sampler: str, steps: int, eta: float) -> None:
    """Build the sampler's plan as a worker will (``samplers.make_plan``): the same ValueError, at the edge."""
    from samplers import make_plan

    make_plan(sampler, steps, _schedule(scheduler_json), eta=eta)


@lru_cache(maxsize=32)
def _schedule(scheduler_json: str):
    from samplers import NoiseSchedule
    from workers.loading import DIT_SCHEDULER

    return NoiseSchedule.from_config(json.loads(scheduler_json) if scheduler_json else DIT_SCHEDULER)
