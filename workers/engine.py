"""The batch engine: image requests in, denoising steps as graph replays, images out.

Each request owns its state: latents ``x`` from its own seeded generator, the sampler's history
``hist``, its step index, its sampler plan (per-step model timesteps and coefficients) and its
conditioning tensors, which its model's family (``workers.families``: class labels, prompt encodings)
makes once at admission. The engine knows no family: it stacks whatever conditioning tensors the
family declares. Requests are grouped by graph key (model, latent shape, dtype, backend); once per ``step()`` every group's
active requests advance exactly one denoising step through that group's ``GraphRunner``, which
splits them into power-of-two replays. Because every per-sample quantity is a tensor row, a
batch mixes samplers, step counts, steps and guidance scales, and requests join or leave at any
step boundary (step-level batching). Finished latents are decoded (VAE for latent models) into
uint8 images.

Determinism: the starting noise of a request comes from ``torch.Generator("cpu").manual_seed(seed)``
(CPU noise, so a seed means the same image on any device), and an ancestral sampler's per-step
noise from the same generator, so an image does not depend on its batch or bucket.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch

from graphs import GraphKey, GraphRunner, TensorSpec
from samplers import Plan, make_plan
from workers.families import family_of
from workers.loading import LoadedModel
from workers.patches import break_attention
from workers.spec import ItemSpec

log = logging.getLogger(__name__)

ProgressFn = Callable[[str, int, int], None]  # (request id, steps done, total steps)


@dataclass
class ImageResult:
    request: ItemSpec
    image: np.ndarray  # (H, W, 3) or (H, W) uint8
    latents: torch.Tensor  # final x on the CPU, float32 (C, H, W): for equality checks


@dataclass(frozen=True)
class EngineConfig:
    backend: str = "eager"        # eager | full | breakable
    max_batch: int = 64           # largest graph bucket (a power of two)
    attention_break: bool = True  # under `breakable`, each layer's attention is an eager break


@dataclass
class _Active:
    req: ItemSpec
    plan: Plan
    x: torch.Tensor              # (C, H, W) float32, on the device
    hist: torch.Tensor           # (C, H, W) previous denoised estimate
    gen: torch.Generator         # CPU generator: initial and per-step noise
    rows: torch.Tensor           # (S, 1 + 9) the plan's timestep and coefficients per step, on the device
    guidance: torch.Tensor       # () float32, on the device
    cond: dict[str, torch.Tensor]  # the family's conditioning (labels; prompt encodings), on the device
    step: int = 0


@dataclass
class _Group:
    model: LoadedModel
    runner: GraphRunner
    active: list[_Active] = field(default_factory=list)


BASE_INPUTS = ("x", "t", "guidance", "coeffs", "hist", "noise")


def step_specs(model: LoadedModel) -> tuple[dict[str, TensorSpec], dict[str, TensorSpec]]:
    """The step's static inputs (the sampler's, then the family's conditioning) and outputs, per sample."""
    lat, f32 = tuple(model.latent_shape), torch.float32
    inputs = {"x": TensorSpec(lat, f32), "t": TensorSpec((), f32), "guidance": TensorSpec((), f32),
              "coeffs": TensorSpec((9,), f32), "hist": TensorSpec(lat, f32), "noise": TensorSpec(lat, f32),
              **family_of(model).cond_specs(model)}
    return inputs, {"x_next": TensorSpec(lat, f32), "hist_next": TensorSpec(lat, f32)}


class Engine:
    """Runs image requests for one or more loaded models with step-level batching."""

    def __init__(self, models: LoadedModel | Iterable[LoadedModel], config: EngineConfig = EngineConfig()):
        models = [models] if isinstance(models, LoadedModel) else list(models)
        self.config = config
        self.models = {m.name: m for m in models}
        self.groups: dict[GraphKey, _Group] = {}
        self._keys: dict[str, GraphKey] = {}
        for m in models:
            family = family_of(m)
            if config.backend == "breakable" and config.attention_break and family.BREAK_ATTENTION:
                break_attention(m.transformer)
            inputs, outputs = step_specs(m)
            runner = GraphRunner(family.make_step(m), inputs, outputs, max_batch=config.max_batch,
                                 backend=config.backend, device=m.device)
            key = GraphKey(m.name, tuple(m.latent_shape), str(m.dtype).removeprefix("torch."), runner.backend)
            self.groups[key] = _Group(m, runner)
            self._keys[m.name] = key
        self.steps_run = 0
        self.real_rows = 0    # sample-steps served
        self.padded_rows = 0  # bucket rows replayed without a sample in them (padding waste)

    def warmup(self) -> None:
        """Capture every bucket of every group (start-up only; serving never captures)."""
        for group in self.groups.values():
            group.runner.warmup()

    # -- admission and cancellation -------------------------------------------------------------
    def add(self, req: ItemSpec) -> None:
        """Admit a request; it joins its group's batch at the next step."""
        self.add_many([req])

    def add_many(self, reqs: list[ItemSpec]) -> None:
        """Admit requests (their conditioning encoded together, per model); they join at the next step.
        Nothing is admitted if any of them is invalid (KeyError, ValueError)."""
        by_group: dict[GraphKey, list[ItemSpec]] = {}
        for req in reqs:
            by_group.setdefault(self._key(req), []).append(req)
        admitted = []
        for key, group_reqs in by_group.items():
            group = self.groups[key]
            plans = [make_plan(r.sampler, r.steps, group.model.schedule, eta=r.eta) for r in group_reqs]
            conds = family_of(group.model).encode(group.model, group_reqs)
            admitted += [(group, r, p, c) for r, p, c in zip(group_reqs, plans, conds)]
        for group, req, plan, cond in admitted:
            group.active.append(self._admit(group.model, req, plan, cond))

    @staticmethod
    def _admit(model: LoadedModel, req: ItemSpec, plan: Plan, cond: dict[str, torch.Tensor]) -> _Active:
        gen = torch.Generator("cpu").manual_seed(req.seed)
        x = torch.randn(model.latent_shape, generator=gen) * plan.init_sigma  # (C, H, W)
        device = model.device
        # everything a step needs from this request goes to the device once, here, without waiting for
        # the GPU: the step loop then makes no host-to-device copy at all
        rows = torch.cat([plan.timesteps[:, None], plan.coeffs], dim=1)  # (S, 10)
        guidance = torch.tensor(req.guidance, dtype=torch.float32)
        return _Active(req, plan, _upload(x, device), torch.zeros(x.shape, device=device), gen,
                       _upload(rows, device), _upload(guidance, device),
                       {k: _upload(v, device) for k, v in cond.items()})

    def cancel(self, request_id: str) -> bool:
        """Drop a request at this step boundary; True if it was active."""
        for group in self.groups.values():
            for i, a in enumerate(group.active):
                if a.req.id == request_id:
                    del group.active[i]
                    return True
        return False

    @property
    def num_active(self) -> int:
        return sum(len(g.active) for g in self.groups.values())

    def progress(self) -> dict[str, tuple[int, int]]:
        return {a.req.id: (a.step, a.plan.num_steps) for g in self.groups.values() for a in g.active}

    # -- the step loop ---------------------------------------------------------------------------
    def step(self, on_progress: ProgressFn | None = None) -> list[ImageResult]:
        """Advance every active request one denoising step; return the ones that finished."""
        finished: list[ImageResult] = []
        for group in self.groups.values():
            if group.active:
                finished += self._step_group(group, on_progress)
        self.steps_run += 1
        return finished

    def _step_group(self, group: _Group, on_progress: ProgressFn | None) -> list[ImageResult]:
        active = group.active
        self.real_rows += len(active)
        self.padded_rows += sum(group.runner.plan(len(active))) - len(active)
        rows = torch.stack([a.rows[a.step] for a in active])  # (B, 10): timestep, then the 9 coefficients
        cond = {k: torch.stack([a.cond[k] for a in active]) for k in active[0].cond}
        out = group.runner.run(
            x=torch.stack([a.x for a in active]), t=rows[:, 0], coeffs=rows[:, 1:],
            guidance=torch.stack([a.guidance for a in active]), hist=torch.stack([a.hist for a in active]),
            noise=self._noise(active, group.model), **cond)
        done: list[_Active] = []
        for i, a in enumerate(active):
            a.x, a.hist, a.step = out["x_next"][i], out["hist_next"][i], a.step + 1
            if on_progress is not None:
                on_progress(a.req.id, a.step, a.plan.num_steps)
            if a.step == a.plan.num_steps:
                done.append(a)
        if not done:
            return []
        group.active = [a for a in active if a.step < a.plan.num_steps]
        return self._finish(group.model, done)

    @staticmethod
    def _noise(active: list[_Active], model: LoadedModel) -> torch.Tensor:
        """Fresh per-step noise for ancestral rows (each from its own CPU generator), zeros elsewhere."""
        if not any(a.plan.stochastic for a in active):  # no host noise to ship: zeros made on the device
            return torch.zeros((len(active), *model.latent_shape), device=model.device)
        rows = torch.stack([torch.randn(model.latent_shape, generator=a.gen) if a.plan.stochastic
                            else torch.zeros(model.latent_shape) for a in active])  # (B, C, H, W)
        return _upload(rows, model.device)

    def _finish(self, model: LoadedModel, done: list[_Active]) -> list[ImageResult]:
        latents = torch.stack([a.x for a in done])  # (B, C, H, W)
        images = decode(model, latents)
        cpu = latents.float().cpu()
        return [ImageResult(a.req, images[i], cpu[i]) for i, a in enumerate(done)]

    def _key(self, req: ItemSpec) -> GraphKey:
        name = req.model or next(iter(self.models))
        if name not in self._keys:
            raise KeyError(f"model {name!r} is not loaded here (loaded: {', '.join(self._keys)})")
        return self._keys[name]

    # -- convenience -----------------------------------------------------------------------------
    def generate(self, requests: list[ItemSpec], on_progress: ProgressFn | None = None,
                 max_active: int | None = None) -> list[ImageResult]:
        """Run requests to completion (admitting at most ``max_active`` at a time, new ones joining
        as others finish); results come back in request order."""
        pending, results = list(requests), {}
        limit = max_active or len(requests) or 1
        while pending or self.num_active:
            while pending and self.num_active < limit:
                self.add(pending.pop(0))
            for r in self.step(on_progress):
                results[r.request.id] = r
        return [results[r.id] for r in requests]

    def stats(self) -> dict:
        return {"steps": self.steps_run, "real_rows": self.real_rows, "padded_rows": self.padded_rows,
                "groups": {f"{k.model}:{'x'.join(map(str, k.latent_shape))}:{k.dtype}:{k.backend}":
                           g.runner.stats() for k, g in self.groups.items()}}


def _upload(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor to ``device`` without waiting: on CUDA, a pinned copy, asynchronous, so the host
    goes on while the GPU finishes earlier replays (PyTorch's caching host allocator keeps the pinned
    block until the copy is done). A pageable copy would wait for the stream to drain."""
    if torch.device(device).type != "cuda" or t.is_cuda:  # on the CPU, or made on the GPU already
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@torch.no_grad()
def decode(model: LoadedModel, latents: torch.Tensor) -> list[np.ndarray]:
    """Latents (B, C, h, w) -> uint8 images; pixel-space models are their own image."""
    if model.vae is None:
        pixels = latents.float()
    else:
        pixels = model.vae.decode(latents.to(model.vae.dtype) / model.vae_scale).sample.float()
    u8 = ((pixels.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()  # (B, c, H, W)
    u8 = u8.permute(0, 2, 3, 1).numpy()                                     # (B, H, W, c)
    return [img[..., 0] if img.shape[-1] == 1 else img for img in u8]
