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
uint8 images (``workers.decode``).

Compiled steps (``SpeedConfig.compile = "inductor"``, ``workers.speed``): each group's step is compiled by Inductor once,
with a dynamic batch, at warm-up, and captured into the same graphs (``graphs.compiled``); the attention
breaks stay breaks. Compile time, graphs compiled and cache hits are in ``stats()`` per group.

Previews (``ItemSpec.preview_every``): after a group's step, the requests that asked for one at this
step (every N-th, not the last) get their denoised estimate (``hist_next``, a graph output) mapped to
small RGB by ``workers.families.previews``, outside the graph: one batched matmul and resize per group, a uint8
copy to the host that does not wait for the GPU (pinned, non-blocking, with an event: ``workers.decode``),
collected by ``take_previews()``. Previews read the step's outputs and write nothing back: images are bit-equal
with and without them.

Determinism: the starting noise of a request comes from ``torch.Generator("cpu").manual_seed(seed)``
(CPU noise, so a seed means the same image on any device), and an ancestral sampler's per-step
noise from the same generator, so an image does not depend on its batch or bucket.

Edits (``workers.edits``; ``ItemSpec.image``, ``mask``, ``strength``): an image-to-image request is admitted with
its image encoded (one VAE batch per admission, model and latent shape) and noised to the step its strength
selects, and joins its group at that step with a cut plan: the same graphs as text-to-image. An instruction edit
(a card whose ``edit`` is "reference": FLUX.1 Kontext) starts as text-to-image; its image is a per-request input of
its family's step variant (``Family.variant_specs``), grouped by the reference's size. An inpainting request's rows run the
engine's ``INPAINT`` variant of the family's step (its own groups and graphs), which blends the image back outside
the mask after every step, inside the captured step.

LoRA (``WorkerConfig.lora_slots`` > 0; ``workers.lora``): each model gets, after the speed layer, a fixed-shape
adapter bank (``LoraBank``) over the linears its sped-up step reaches (``workers.lora.reached``, measured on one
forward of the warm-up example): those it calls (SD3's and FLUX.1's hoisted modulation linears among them: each
returns its slice of the one product, and its wrapper adds to it), and those a speed rewrite computes itself and
adds their per-row terms to (q, k and v fused into one product, FP8 or not; DiT's hoisted modulation;
``workers.speed.terms``). A fast path that multiplies a linear's weights itself (the GELU epilogue, FP8 products
of codes made elsewhere) calls the linear instead where it is wrapped. What no step reaches is left out of the
bank, so an adapter targeting it is refused at registration (naming it) rather than applied in part. What
admission computes with the model counts as reached: SD3's and FLUX.1's ``time_text_embed``, computed once per
request for its modulation table under the graph backends, runs with the request's adapters (``step_tables``). Its
linears are wrapped (``apply_lora``), and every group's step is
``with_lora(step)`` with two more per-row inputs (``lora_specs``: the rows' slots and scales), made at admission from
the request's ``ItemSpec.loras`` (``LoraBank.row``). A request whose adapters are registered but not resident waits in
the engine's queue (``num_active`` counts it, ``progress`` shows it at step 0) until ``step`` loads them between
steps into free or least recently used idle slots (in place: no recapture, no recompile), then joins its group.
With ``lora_slots`` 0 none of this exists: no bank, no wrap, no extra inputs.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np
import torch

from graphs import GraphKey, GraphRunner, TensorSpec
from graphs.compiled import CompiledStep
from samplers import Plan, make_plan
from workers.config import WorkerConfig
from workers.decode import (Preview, _PendingPreviews, _upload, decode, decode_runner, previews_on_host,
                            previews_to_host)
from workers.edits import EDIT_INPUTS, Start, check_edit, edit_specs, family_variant, inpaint_variant, inpainting, starts
from workers.families.encoders import EncoderGraphs, padded_length
from workers.families import compile_regions, family_of, preview_map_of
from workers.kernels import lora as lora_kernel
from workers.kernels.attention import CHOOSER
from workers.lora import apply_lora, lora_rows, lora_specs, reached, with_lora
from workers.lora.serving import Loras
from workers.loading import LoadedModel
from workers.families.previews import to_rgb
from workers.request.admission import spec_shape
from workers.request.spec import ItemSpec
from workers.speed import SpeedConfig
from workers.speed.apply import apply as apply_speed

log = logging.getLogger(__name__)

ProgressFn = Callable[[str, int, int], None]  # (request id, steps done, total steps)


@dataclass
class ImageResult:
    request: ItemSpec
    image: np.ndarray  # (H, W, 3) or (H, W) uint8
    latents: torch.Tensor  # final x on the CPU, float32 (C, H, W): for equality checks




def auto_backend(device: str) -> str:
    """The backend "auto" means for a worker or ``dit-serve generate`` on ``device``: "graphs" on CUDA
    (whole-step graphs per model, breakable ones where its step has eager breaks), "eager" elsewhere."""
    return "graphs" if str(device).startswith("cuda") else "eager"


def backend_for(backend: str, model) -> str:
    """The graph backend of ``model``'s groups under the config's ``backend``: "auto" as ``auto_backend`` says
    for the model's device, and "graphs" picking whole-step graphs (one replay per step, no host work between
    kernels) for a step without eager breaks and breakable graphs for one whose family breaks it (PixArt's
    varlen cross-attention). DiT's self-attention patch is a break only under breakable: under full the same
    kernel is captured in the graph."""
    backend = auto_backend(model.device) if backend == "auto" else backend
    if backend != "graphs":
        return backend
    return "breakable" if family_of(model).needs_breaks(model) else "full"


def _speed_of(model, config: WorkerConfig, speed: SpeedConfig | Mapping[str, SpeedConfig] | None) -> SpeedConfig:
    """``model``'s speed-layer config: ``speed``'s (for all models, or its entry), else its speed in
    ``config`` (``WorkerConfig.speed_for``)."""
    if isinstance(speed, SpeedConfig):
        return speed
    if speed is not None and model.name in speed:
        return speed[model.name]
    return config.speed_for(model.name, family_of(model))


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
    tables: dict[str, torch.Tensor] = field(default_factory=dict)  # the family's per-step inputs, (S, ...) each
    step: int = 0
    edit: dict[str, torch.Tensor] = field(default_factory=dict)  # an inpainting row's (workers.edits.EDIT_INPUTS):
    # mask, image_latents, image_noise on the device, and blend (S, 2), a row per step
    slots: tuple[int, ...] = ()  # the bank slots its adapters are in (a host copy of cond["lora_slots"])


@dataclass
class _Group:
    model: LoadedModel
    runner: GraphRunner
    shape: tuple[int, int, int]  # the latents' (C, H, W)
    active: list[_Active] = field(default_factory=list)
    last_used: int = 0           # the engine's step count when it last ran or admitted
    compiled: CompiledStep | None = None  # the runner's step, when the model's speed compiles it
    decoder: GraphRunner | None = None    # the VAE decode at this shape, when the model's speed captures it
    variant: str = ""                     # the family's step it runs (Family.step_variants)


BASE_INPUTS = ("x", "t", "guidance", "coeffs", "hist", "noise")

# What warm-up runs every bucket on before it captures and times it: a typical request, not zeros. The
# timings are what the splitter weighs padding against more replays by, and zeros time another step than
# a prompt's: an all-zero prompt mask makes PixArt's varlen cross-attention score every one of its 300 keys
# (a real prompt keeps about 20), and zero rows quantize to zero codes. A prompt of a usual length.
WARMUP_PROMPT = "a photograph of a red fox standing in fresh snow at the edge of a pine forest, morning light"


def step_specs(model: LoadedModel, shape: tuple[int, int, int] | None = None, variant: str = ""
               ) -> tuple[dict[str, TensorSpec], dict[str, TensorSpec]]:
    """The step's static inputs (the sampler's, then the family's conditioning, then an inpainting variant's,
    ``workers.edits.edit_specs``) and outputs, per sample, for latents of ``shape`` (C, H, W; the model's native
    shape by default) in the engine's step ``variant``."""
    lat, f32 = tuple(shape or model.latent_shape), torch.float32
    family = family_of(model)
    inputs = {"x": TensorSpec(lat, f32), "t": TensorSpec((), f32), "guidance": TensorSpec((), f32),
              "coeffs": TensorSpec((9,), f32), "hist": TensorSpec(lat, f32), "noise": TensorSpec(lat, f32),
              **family.cond_specs(model), **family.variant_specs(model, lat, family_variant(variant)[0]),
              **table_specs(model),
              **(edit_specs(lat) if family_variant(variant)[1] else {})}
    return inputs, {"x_next": TensorSpec(lat, f32), "hist_next": TensorSpec(lat, f32)}


def table_specs(model: LoadedModel) -> dict[str, TensorSpec]:
    """The family's per-step inputs known at admission (``step_tables``; e.g. SD3's and FLUX.1's modulation,
    ``workers.speed.modulation``), per sample; none for most families."""
    return family_of(model).table_specs(model)


def step_tables(model: LoadedModel, plans: list[Plan], reqs: list[ItemSpec],
                conds: list[dict[str, torch.Tensor]], bank=None) -> list[dict[str, torch.Tensor]]:
    """Each request's ``table_specs`` inputs at every step of its plan ((S, ...) each, on the model's device).
    With the model's adapter ``bank`` and the requests' ``lora_slots`` / ``lora_scales`` in ``conds``, every step's
    row is computed with its request's adapters (``lora_rows``): an adapter on a linear the table's computation
    calls (SD3's and FLUX.1's ``time_text_embed``) reaches the table, as it would the step's embedding."""
    if not table_specs(model):
        return [{} for _ in reqs]
    family = family_of(model)
    if bank is None:
        return family.step_tables(model, plans, reqs, conds)
    rows = lambda key: torch.cat([c[key][None].expand(p.num_steps, -1) for c, p in zip(conds, plans)])
    with lora_rows(bank, rows("lora_slots").to(model.device), rows("lora_scales").to(model.device)):
        return family.step_tables(model, plans, reqs, conds)


def table_inputs(model: LoadedModel, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``inputs`` (a step's rows) with their ``table_specs`` inputs added where the step takes some and they
    are missing: what a caller that makes a step's inputs itself (a benchmark) passes to the engine's runners."""
    specs = table_specs(model)
    if not specs or specs.keys() <= inputs.keys():
        return inputs
    return {**inputs, **family_of(model).table_inputs(model, inputs)}


class Engine:
    """Runs image requests for one or more loaded models with step-level batching.

    ``config`` is the worker's (``workers.config.WorkerConfig``: backend, buckets, sizes kept, each model's
    speed). ``speed``: what the speed layer does to the models, given outright (one ``SpeedConfig`` for all, or
    one per model name) instead of from ``config``'s speeds: what tests and benchmarks compare. Each model
    goes through the speed layer (``workers.speed.apply``) once, here; the engine then runs what it got."""

    def __init__(self, models: LoadedModel | Iterable[LoadedModel], config: WorkerConfig = WorkerConfig(),
                 speed: SpeedConfig | Mapping[str, SpeedConfig] | None = None):
        models = [models] if isinstance(models, LoadedModel) else list(models)
        self.config = config
        self.models: dict[str, LoadedModel] = {}
        self.speed: dict[str, SpeedConfig] = {}
        self.groups: dict[GraphKey, _Group] = {}
        self._keys: dict[tuple[str, tuple[int, int, int]], GraphKey] = {}
        self._pools: dict[torch.device, tuple] = {}  # one graph pool and stream per device, for every shape
        self._warm = False
        self.steps_run = 0
        self.attention: dict[str, str] = {}  # model -> the attention kernel its steps run, where a family says
        self.lora = Loras(config.lora_slots, config.lora_max_rank, config.lora_per_request, config.lora_max_bytes,
                          config.lora_kernel) \
            if config.lora_slots else None
        self._waiting: list[ItemSpec] = []  # admitted requests whose adapters are not resident yet (FIFO)
        for m in models:  # encoder graphs an earlier engine made are not this one's
            m.text_graphs = None
        for m in models:
            self._add_model(m, _speed_of(m, config, speed))
        self.real_rows = 0    # sample-steps served
        self.padded_rows = 0  # bucket rows replayed without a sample in them (padding waste)
        self.previews_made = 0
        self._previews: list[_PendingPreviews] = []

    def add_model(self, model: LoadedModel, speed: SpeedConfig | None = None,
                  sizes: Iterable[tuple[int, int]] = ()) -> None:
        """Serve ``model`` from now on, beside the engine's others (a worker's later models, loaded while its
        first one serves): through the speed layer (``speed``, else its speed in the config), its native
        shape's group and those of ``sizes`` it makes, warmed now when the engine is warm already. Call it
        where steps run (the engine's one thread)."""
        if model.name in self.models:
            raise ValueError(f"the engine serves a model named {model.name!r} already")
        model.text_graphs = None
        self._add_model(model, speed or _speed_of(model, self.config, None))
        if self._warm:
            self._warm_models([model], sizes)

    def remove_model(self, name: str) -> LoadedModel:
        """Stop serving ``name``: its groups (their graphs and arenas) go, and the model is handed back (the caller
        drops it, and its memory goes with the last reference). Its requests must have left first (ValueError
        otherwise: cancel them). The graph pool stays for the other models' captures. Call it where steps run."""
        if name not in self.models:
            raise KeyError(f"model {name!r} is not loaded here (loaded: {', '.join(self.models) or 'none'})")
        mine = [key for key, group in self.groups.items() if group.model.name == name]
        if active := sum(len(self.groups[key].active) for key in mine):
            raise ValueError(f"model {name!r} still runs {active} request(s): cancel them before removing it")
        for key in mine:
            del self.groups[key]
        self._keys = {k: v for k, v in self._keys.items() if k[0] != name}
        if any(self._model_of(r) == name for r in self._waiting):
            raise ValueError(f"model {name!r} still has requests waiting for adapters: cancel them before removing it")
        model = self.models.pop(name)
        if self.lora is not None:
            self.lora.remove_model(name)
        self.speed.pop(name, None)
        self.attention.pop(name, None)
        model.text_graphs = None
        return model

    def _add_model(self, m: LoadedModel, speed: SpeedConfig) -> None:
        self.models[m.name], self.speed[m.name] = m, speed
        family, graphs = family_of(m), self.backend_for(m) != "eager"
        applied = apply_speed(m, family, speed, graphs=graphs)
        if applied.attention is not None:
            self.attention[m.name] = applied.attention
            log.info("%s: %s", m.name, applied.attention)
        if self.lora is not None:
            self._add_bank(m)
        for variant in family.step_variants(m):  # warmed by warmup or add_model, with its sizes
            self._group(m, tuple(m.latent_shape), variant, capture=False)
        if graphs and family.encoder_graphs:
            self._graph_encoder(m)

    def _add_bank(self, m: LoadedModel) -> None:
        """``m``'s adapter bank over the linears its sped-up step calls (module docstring), its linears wrapped."""
        shape = tuple(m.latent_shape)
        step = family_of(m).make_step(m, shape)
        with torch.no_grad():  # the example made as admission makes a row (its modulation tables too), then stepped
            targets = reached(m.transformer, lambda: step(**(self.warmup_example(m, shape)
                                                             or _zeros(step_specs(m, shape)[0], m.device))))
        if patterns := self.config.lora_targets:
            named = [t for t in targets if any(re.search(p, t) for p in patterns)]
            if not named:
                raise ValueError(f"{m.name}: [workers] lora_targets {list(patterns)} match none of the linears its "
                                 f"step reaches (e.g. {', '.join(targets[:3])})")
            outside = {t: "[workers] lora_targets leaves it out" for t in targets if t not in named}
            targets = named
        else:
            outside = {}
        bank = self.lora.add_model(m.name, m.transformer, targets, outside)
        apply_lora(m.transformer, bank)
        if bank.kernel == "triton" and m.device.type == "cuda" and not lora_kernel.runs_on(m.device, m.dtype):
            log.warning("%s: lora_kernel 'triton' needs Triton; its adapters' terms run as 'bmm'", m.name)
        log.info("%s: adapter bank of %d slots, rank %d, over %d of its linears (%.1f MB)", m.name, bank.slots,
                 bank.max_rank, len(bank.targets), bank.nbytes / 1e6)

    def backend_for(self, model: LoadedModel) -> str:
        """The graph backend of ``model``'s groups (``backend_for``)."""
        return backend_for(self.config.backend, model)

    def _group(self, model: LoadedModel, shape: tuple[int, int, int], variant: str = "",
               capture: bool = True) -> GraphKey:
        """The group of ``model`` at latent ``shape`` running its step ``variant`` (``Family.step_variants``, or the
        engine's inpainting variant of one, ``workers.edits.inpaint_variant``), made on first use. Groups of every
        shape capture into their device's one graph pool: their replays never overlap (one engine thread), so the
        pool holds the largest shape's working memory once, not one copy per shape. A group new once the engine
        is warm is captured at once unless ``capture`` is False (its caller warms it)."""
        if (model.name, shape, variant) in self._keys:
            key = self._keys[model.name, shape, variant]
            self.groups[key].last_used = self.steps_run
            return key
        self._evict(model, variant)
        device = model.device
        if device.type == "cuda" and device not in self._pools:
            self._pools[device] = (torch.cuda.graph_pool_handle(), torch.cuda.Stream(device))
        pool, stream = self._pools.get(device, (None, None))
        inputs, outputs = step_specs(model, shape, variant)
        base, inpaints = family_variant(variant)
        step = family_of(model).make_step(model, shape, **({"variant": base} if base else {}))
        if inpaints:  # the family's step, then the blend (workers.edits.inpainting)
            step = inpainting(step)
        if self.lora is not None and model.name in self.lora.banks:  # the rows' adapters (module docstring)
            step = with_lora(step, self.lora.banks[model.name])
            inputs = {**inputs, **lora_specs(self.config.lora_per_request)}
        speed, compiled = self.speed[model.name], None
        if speed.compile != "off":
            declined = family_of(model).uncompiled_on.get(device.type)
            regions = compile_regions(model) if speed.compile_scope == "blocks" and not declined else []
            compiled = CompiledStep(step, f"{model.name} at {'x'.join(map(str, shape))}{' ' + variant if variant else ''}",
                                    regions=regions, dynamic=device.type not in family_of(model).static_batch_on)
            if declined:
                compiled.decline(declined)
        runner = GraphRunner(compiled or step, inputs, outputs,
                             max_batch=self.config.max_batch, backend=self.backend_for(model), device=device,
                             pool=pool, stream=stream)
        key = GraphKey(model.name, shape, str(model.dtype).removeprefix("torch."), runner.backend, variant)
        decoder = decode_runner(model, shape, pool, stream, compiled=speed.compile != "off") \
            if speed.decode_graphs and model.vae is not None else None
        self.groups[key] = _Group(model, runner, shape, last_used=self.steps_run, compiled=compiled, decoder=decoder,
                                  variant=variant)
        self._keys[model.name, shape, variant] = key
        if self._warm and capture:  # a size first asked for while serving: captured now, once (logged)
            log.info("capturing %s at latent shape %s%s on first use", model.name, "x".join(map(str, shape)),
                     f" ({variant})" if variant else "")
            runner.warmup(example=self.warmup_example(model, shape, variant))
            if decoder is not None:
                decoder.warmup()
        return key

    def _graph_encoder(self, model: LoadedModel) -> None:
        """Under the graph backends, a family's masked text encoder replays from CUDA graphs too
        (``workers.families.encoders.EncoderGraphs``): one set per encoder module, shared by the models that share
        it, in the graph pool of its device when the steps run there."""
        encoder = model.text_encoder
        device = next(encoder.parameters()).device
        if device.type != "cuda":
            return
        for other in self.models.values():
            if other.text_encoder is encoder and other.text_graphs is not None:
                model.text_graphs = other.text_graphs
                return
        pool, stream = self._pools.get(device, (None, None))
        model.text_graphs = EncoderGraphs(encoder, model.card.max_tokens, pool=pool, stream=stream)

    def _evict(self, model: LoadedModel, variant: str = "") -> None:
        """Before a new shape of ``model``: at ``max_shapes`` of them, drop the least recently used idle one
        (never the native shape). Its arena (the static inputs, e.g. 315 MB for PixArt-Σ at 64 rows) and its
        graphs go; the pool keeps its blocks for the next capture. Every bin a user may ask for (33 for
        PixArt) would otherwise stay captured for good."""
        mine = [(k, g) for k, g in self.groups.items() if k.model == model.name and k.variant == variant]
        if len(mine) < self.config.max_shapes:
            return
        idle = [(g.last_used, k) for k, g in mine if not g.active and g.shape != tuple(model.latent_shape)]
        if idle:
            _, key = min(idle)
            del self.groups[key], self._keys[model.name, key.latent_shape, variant]
            log.info("dropped %s at latent shape %s (least recently used of %d shapes)", model.name,
                     "x".join(map(str, key.latent_shape)), len(mine))

    def warmup(self, sizes: Iterable[tuple[int, int]] = ()) -> None:
        """Capture every bucket of every group, and of each model's groups at ``sizes`` (width, height) it
        makes (start-up; a size first asked for later is captured when it first arrives)."""
        self._warm_models(list(self.models.values()), sizes)
        self._warm = True

    def _warm_models(self, models: list[LoadedModel], sizes: Iterable[tuple[int, int]]) -> None:
        for m in models:  # the groups of ``sizes`` are made here, then warmed below
            for w, h in sizes:
                if m.card is not None and m.card.makes(w, h):
                    for variant in family_of(m).step_variants(m):
                        self._group(m, m.card.latent_shape(w, h), variant, capture=False)
        names = {m.name for m in models}
        for group in [g for g in self.groups.values() if g.model.name in names]:
            known = len(CHOOSER.choices)
            if not group.runner.warmed:
                group.runner.warmup(example=self.warmup_example(group.model, group.shape, group.variant))
            if group.decoder is not None and not group.decoder.warmed:
                group.decoder.warmup()
            for line in CHOOSER.summary()[known:]:  # the attention shapes this group's warm-up measured
                log.info("%s at %s: attention %s", group.model.name, "x".join(map(str, group.shape)), line)
        for m in models:
            if m.text_graphs is not None:  # the shortest padded length, which most prompts use
                m.text_graphs.runner(padded_length(1, m.text_graphs.limit))

    def warmup_example(self, model: LoadedModel, shape: tuple[int, int, int], variant: str = ""
                       ) -> dict[str, torch.Tensor] | None:
        """One row of the step's inputs as a request makes them (``WARMUP_PROMPT`` or class 0, the model's
        default sampler at its middle step, seeded noise; an inpainting variant's: the left half masked, seeded
        image latents), on the model's device; None for a model without a card, or where making it failed
        (logged): warm-up then runs on zeros, which only its timings mind. Warm-up tiles it over every bucket's
        rows."""
        if model.card is None:
            return None
        try:
            example = self._example(model, shape, variant)
            if self.lora is not None and model.name in self.lora.banks:  # no adapter: slot 0 at scale 0
                p = self.config.lora_per_request
                example.update(lora_slots=torch.zeros((1, p), dtype=torch.int64, device=model.device),
                               lora_scales=torch.zeros((1, p), device=model.device))
            return example
        except Exception as e:  # the timings lose realism; serving must not fail on it
            log.warning("%s: warm-up runs on zeros (its example failed: %s: %s)", model.name, type(e).__name__, e)
            return None

    @staticmethod
    def _example(model: LoadedModel, shape: tuple[int, int, int], variant: str = "") -> dict[str, torch.Tensor]:
        card = model.card
        family = family_of(model)
        probe = ItemSpec(id="warmup", model=model.name, seed=0, prompt=WARMUP_PROMPT if card.conditioning == "text"
                         else "", sampler=card.defaults["sampler"], steps=int(card.defaults["steps"]),
                         guidance=float(card.defaults["guidance"]))
        extra = family.plan_kwargs(model, shape)
        plan = make_plan(probe.sampler, probe.steps, model.schedule, **extra)
        cond = family.encode(model, [probe])[0]
        gen = torch.Generator("cpu").manual_seed(0)
        i = plan.num_steps // 2
        tables = step_tables(model, [plan], [probe], [cond])[0]
        row = {"x": torch.randn(shape, generator=gen), "t": plan.timesteps[i], "coeffs": plan.coeffs[i],
               "guidance": torch.tensor(probe.guidance), "hist": torch.randn(shape, generator=gen),
               "noise": torch.randn(shape, generator=gen), **cond, **{k: v[i] for k, v in tables.items()}}
        for name, spec in step_specs(model, shape, variant)[0].items():  # a variant's own inputs (Kontext's
            if name not in row and name not in EDIT_INPUTS:             # reference tokens): seeded noise
                row[name] = torch.randn(spec.shape_per_sample, generator=gen).to(spec.dtype)
        if family_variant(variant)[1]:
            mask = torch.zeros((1, *shape[1:]))
            mask[..., : shape[2] // 2] = 1.0
            row.update(mask=mask, image_latents=torch.randn(shape, generator=gen),
                       image_noise=torch.randn(shape, generator=gen), blend=plan.levels[i + 1])
        return {k: v.to(model.device)[None] for k, v in row.items()}

    # -- admission and cancellation -------------------------------------------------------------
    def add(self, req: ItemSpec) -> None:
        """Admit a request; it joins its group's batch at the next step."""
        self.add_many([req])

    def add_many(self, reqs: list[ItemSpec]) -> None:
        """Admit requests (their conditioning encoded together, per model); they join at the next step, or,
        naming adapters not resident, wait in the engine's queue until ``step`` loads them. Nothing is admitted
        if any of them is invalid (KeyError, ValueError: an unknown adapter too)."""
        for req in reqs:
            self._key(req)
            self._check_loras(req)
        if self.lora is not None:
            waiting = [r for r in reqs if r.loras and self.lora.missing(r.loras, self._model_of(r))]
            self._waiting += waiting
            reqs = [r for r in reqs if all(r is not w for w in waiting)]
        if reqs:
            self._admit_many(reqs)

    def _admit_many(self, reqs: list[ItemSpec]) -> None:
        by_group: dict[GraphKey, list[ItemSpec]] = {}
        for req in reqs:
            by_group.setdefault(self._key(req), []).append(req)
        plans: dict[GraphKey, list[Plan]] = {}
        same_shape: dict[tuple[str, tuple[int, int, int]], list[tuple[GraphKey, int]]] = {}
        for key, group_reqs in by_group.items():
            group = self.groups[key]
            extra = family_of(group.model).plan_kwargs(group.model, group.shape)
            plans[key] = [make_plan(r.sampler, r.steps, group.model.schedule, eta=r.eta, **extra) for r in group_reqs]
            same_shape.setdefault((group.model.name, group.shape), []).extend((key, i) for i in range(len(group_reqs)))
        # each request's starting latents and generator: an edit's image encoded (one batch per model and shape,
        # whatever the rows' step variants) and its plan cut where its strength starts it (workers.edits)
        begun: dict[GraphKey, list[Start]] = {key: [None] * len(reqs) for key, reqs in by_group.items()}
        for members in same_shape.values():
            group = self.groups[members[0][0]]
            made = starts(group.model, family_of(group.model), group.shape, [by_group[k][i] for k, i in members],
                          [plans[k][i] for k, i in members], upload=_upload)
            for (k, i), start in zip(members, made):
                begun[k][i] = start
        admitted = []
        for key, group_reqs in by_group.items():
            group = self.groups[key]
            family = family_of(group.model)
            conds = family.encode(group.model, group_reqs)
            bank = self.lora.banks.get(group.model.name) if self.lora is not None else None
            if bank is not None:  # the rows' slots and scales
                conds = [{**c, **self.lora.row(r.loras, group.model.name)} for r, c in zip(group_reqs, conds)]
            tables = step_tables(group.model, [b.plan for b in begun[key]], group_reqs, conds, bank)
            admitted += [(group, r, b, c, tb) for r, b, c, tb in zip(group_reqs, begun[key], conds, tables)]
        for group, req, start, cond, tables in admitted:
            group.active.append(self._admit(group, req, start, cond, tables))

    @staticmethod
    def _admit(group: _Group, req: ItemSpec, begun: Start, cond: dict[str, torch.Tensor],
               tables: dict[str, torch.Tensor]) -> _Active:
        model, plan = group.model, begun.plan
        device = model.device
        # everything a step needs from this request goes to the device once, here, without waiting for
        # the GPU: the step loop then makes no host-to-device copy at all
        rows = torch.cat([plan.timesteps[:, None], plan.coeffs], dim=1)  # (S, 10)
        guidance = torch.tensor(req.guidance, dtype=torch.float32)
        return _Active(req, plan, _upload(begun.x, device), torch.zeros(begun.x.shape, device=device), begun.gen,
                       _upload(rows, device), _upload(guidance, device),
                       {k: _upload(v, device) for k, v in cond.items()}, tables,
                       edit={k: _upload(v, device) for k, v in begun.edit.items()},
                       slots=tuple(int(s) for s in cond["lora_slots"] if s) if "lora_slots" in cond else ())

    def cancel(self, request_id: str) -> bool:
        """Drop a request at this step boundary; True if it was active (or finished and not yet handed out)."""
        for i, r in enumerate(self._waiting):
            if r.id == request_id:
                del self._waiting[i]
                return True
        for group in self.groups.values():
            for i, a in enumerate(group.active):
                if a.req.id == request_id:
                    del group.active[i]
                    return True
        return False

    @property
    def num_active(self) -> int:
        """Requests admitted and not finished: in their groups, or waiting for their adapters."""
        return sum(len(g.active) for g in self.groups.values()) + len(self._waiting)

    def in_flight_shapes(self) -> set[tuple[str, int, int]]:
        """The shapes of the active requests (``workers.request.admission.spec_shape``)."""
        return {spec_shape(a.req) for g in self.groups.values() for a in g.active}

    def progress(self) -> dict[str, tuple[int, int]]:
        """Steps done and planned per active request."""
        waiting = {r.id: (0, r.steps) for r in self._waiting}
        return {**waiting, **{a.req.id: (a.step, a.plan.num_steps) for g in self.groups.values() for a in g.active}}

    # -- the step loop ---------------------------------------------------------------------------
    def step(self, on_progress: ProgressFn | None = None) -> list[ImageResult]:
        """Advance every active request one denoising step; return the ones that finished. Waiting requests whose
        adapters can be loaded now are loaded and join first."""
        if self.lora is not None:
            self._admit_waiting()
        finished: list[ImageResult] = []
        for group in self.groups.values():
            if group.active:
                finished += self._step_group(group, on_progress)
        self.steps_run += 1
        if self.lora is not None:
            self._collect_loras()
        return finished

    def _step_group(self, group: _Group, on_progress: ProgressFn | None) -> list[ImageResult]:
        active = group.active
        group.last_used = self.steps_run
        self.real_rows += len(active)
        self.padded_rows += sum(group.runner.plan(len(active))) - len(active)
        rows = torch.stack([a.rows[a.step] for a in active])  # (B, 10): timestep, then the 9 coefficients
        cond = {k: torch.stack([a.cond[k] for a in active]) for k in active[0].cond}
        cond.update({k: torch.stack([a.tables[k][a.step] for a in active]) for k in active[0].tables})
        if family_variant(group.variant)[1]:  # inpainting rows: their mask, image, noise and this step's blend
            cond.update({k: torch.stack([a.edit[k] for a in active]) for k in EDIT_INPUTS if k != "blend"})
            cond["blend"] = torch.stack([a.edit["blend"][a.step] for a in active])
        out = group.runner.run(
            x=torch.stack([a.x for a in active]), t=rows[:, 0], coeffs=rows[:, 1:],
            guidance=torch.stack([a.guidance for a in active]), hist=torch.stack([a.hist for a in active]),
            noise=self._noise(active, group), **cond)
        done: list[_Active] = []
        for i, a in enumerate(active):
            a.x, a.hist, a.step = out["x_next"][i], out["hist_next"][i], a.step + 1
            if on_progress is not None:
                on_progress(a.req.id, a.step, a.plan.num_steps)
            if a.step == a.plan.num_steps:
                done.append(a)
        self._preview(group, active, out["hist_next"])
        if not done:
            return []
        group.active = [a for a in active if a.step < a.plan.num_steps]
        return self._finish(group, done)

    # -- adapters -------------------------------------------------------------------------------------------
    def add_lora(self, name: str, data: bytes | Path, model: str | None = None) -> dict:
        """Register an adapter (safetensors bytes or file) as ``name`` for ``model`` (None: the model its metadata
        names, else every served model it fits), in host memory; it is loaded into a slot when a request needs it.
        ValueError naming the mismatch (``workers.lora.serving``); its ``loras()`` entry."""
        if self.lora is None:
            raise ValueError("this engine serves no adapters (lora_slots is 0)")
        return self.lora.register(name, data, model)

    def remove_lora(self, name: str) -> None:
        """Unregister ``name``: new requests cannot name it; it leaves its slot once no request uses it. KeyError
        if it is not registered."""
        if self.lora is None:
            raise KeyError(f"adapter {name!r} is not registered here (lora_slots is 0)")
        self.lora.remove(name)
        self._collect_loras()

    def loras(self) -> dict[str, dict]:
        """{name: {"model", "models", "resident", "slot"}} of the registered adapters."""
        return {} if self.lora is None else self.lora.describe()

    def _check_loras(self, req: ItemSpec) -> None:
        if not req.loras:
            return
        if self.lora is None:
            raise ValueError(f"loras: this worker serves no adapters (asked for {', '.join(n for n, _ in req.loras)})")
        self.lora.check(req.loras, self._model_of(req))

    def _admit_waiting(self) -> None:
        """Between steps: load what the waiting requests need into slots no running row uses, in their order (a
        request that cannot get a slot keeps later ones of its model from taking one), and admit those ready."""
        in_use: dict[str, set[int]] = {}
        for g in self.groups.values():
            in_use.setdefault(g.model.name, set()).update(s for a in g.active for s in a.slots)
        ready, blocked = [], set()
        for req in self._waiting:
            model = self._model_of(req)
            if model not in blocked and self.lora.make_resident(req.loras, model, in_use.setdefault(model, set())):
                ready.append(req)
            else:
                blocked.add(model)
        if ready:
            self._waiting = [r for r in self._waiting if all(r is not q for q in ready)]
            self._admit_many(ready)

    def _collect_loras(self) -> None:
        if self.lora.removing:
            named = {n for r in self._waiting for n, _ in r.loras}
            named |= {n for g in self.groups.values() for a in g.active for n, _ in a.req.loras}
            self.lora.collect(named)

    def _model_of(self, req: ItemSpec) -> str:
        return req.model or next(iter(self.models))

    def _preview(self, group: _Group, active: list[_Active], denoised: torch.Tensor) -> None:
        """Start the previews due at this step (rows of ``denoised``, (B, C, H, W)) on their way to the host."""
        rows = [i for i, a in enumerate(active) if a.req.preview_every and a.step < a.plan.num_steps
                and a.step % a.req.preview_every == 0]
        pmap = preview_map_of(group.model.card) if rows and group.model.card is not None else None
        if pmap is None:
            return
        with torch.no_grad():  # nothing here may wait for the GPU: no pageable copy, no sync
            due = denoised if len(rows) == len(active) else \
                denoised.index_select(0, _upload(torch.tensor(rows), denoised.device))
            rgb = to_rgb(due, pmap)  # (b, h, w, c) uint8 on the device
        ids = [(active[i].req.id, active[i].step) for i in rows]
        self._previews.append(previews_to_host(ids, rgb))

    def take_previews(self, wait: bool = False) -> list[Preview]:
        """The previews whose copies have reached the host (all of them with ``wait``), oldest first."""
        out, self._previews = previews_on_host(self._previews, wait)
        self.previews_made += len(out)
        return out

    @staticmethod
    def _noise(active: list[_Active], group: _Group) -> torch.Tensor:
        """Fresh per-step noise for ancestral rows (each from its own CPU generator), zeros elsewhere."""
        shape, device = group.shape, group.model.device
        if not any(a.plan.stochastic for a in active):  # no host noise to ship: zeros made on the device
            return torch.zeros((len(active), *shape), device=device)
        rows = torch.stack([torch.randn(shape, generator=a.gen) if a.plan.stochastic
                            else torch.zeros(shape) for a in active])  # (B, C, H, W)
        return _upload(rows, device)

    def _finish(self, group: _Group, done: list[_Active]) -> list[ImageResult]:
        latents = torch.stack([a.x for a in done])  # (B, C, H, W)
        pixels = None if group.decoder is None else group.decoder.run(latents=latents)["pixels"]
        sizes = [(a.req.out_width, a.req.out_height) for a in done]
        images = decode(group.model, latents, sizes, pixels)
        cpu = latents.float().cpu()
        return [ImageResult(a.req, images[i], cpu[i]) for i, a in enumerate(done)]

    def _key(self, req: ItemSpec) -> GraphKey:
        name = req.model or next(iter(self.models))
        if name not in self.models:
            raise KeyError(f"model {name!r} is not loaded here (loaded: {', '.join(self.models)})")
        model = self.models[name]
        family = family_of(model)
        check_edit(family, model, req)
        variant = family.variant_of(model, req)
        if req.mask:  # inpainting rows run the engine's variant of the family's step, in groups of their own
            variant = inpaint_variant(variant)
        if not (req.width or req.height):
            return self._group(model, tuple(model.latent_shape), variant)
        card = model.card
        size = (req.width or card.image_size, req.height or card.image_size)
        if not card.makes(*size):
            raise ValueError(f"model {name!r} does not make {size[0]}x{size[1]} images "
                             f"(sizes: {', '.join(f'{w}x{h}' for w, h in card.made_sizes())})")
        return self._group(model, card.latent_shape(*size), variant)

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
                "previews": self.previews_made, "attention": self.attention,
                **({"lora": self.lora.stats(len(self._waiting))} if self.lora is not None else {}),
                "groups": {f"{k.model}:{'x'.join(map(str, k.latent_shape))}:{k.dtype}:{k.backend}"
                           f"{':' + k.variant if k.variant else ''}":
                           _group_stats(g) for k, g in self.groups.items()}}


def _zeros(specs: Mapping[str, TensorSpec], device) -> dict[str, torch.Tensor]:
    """One row of zeros of every input of ``specs``."""
    return {k: torch.zeros((1, *spec.shape_per_sample), dtype=spec.dtype, device=device) for k, spec in specs.items()}


def _group_stats(group: _Group) -> dict:
    """The runner's counters, and the compiler's (graphs, seconds, cache hits) when the step is compiled
    (and when the decode is, ``decode_compile``)."""
    stats = group.runner.stats()
    if group.compiled is not None:
        stats["compile"] = group.compiled.stats()
    if group.decoder is not None and isinstance(group.decoder.step, CompiledStep):
        stats["decode_compile"] = group.decoder.step.stats()
    return stats
