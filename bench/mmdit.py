"""SD3.5 and FLUX.1-dev benchmarks (the MMDiT families): one denoising step, one image end to end, a
mixed-size FLUX workload and memory, our engine against diffusers' StableDiffusion3Pipeline / FluxPipeline.

Models (``--models``): the built-ins ``sd35-medium-1024`` (SD3.5-medium 2.5B, CLIP-L, CLIP-bigG, T5-XXL,
the 16-channel VAE) and ``flux-dev-512`` / ``flux-dev-1024`` (FLUX.1-dev 12B, CLIP-L, T5-XXL, VAE), random
weights made on the GPU, bf16. Prompts: bench/pixart.py's 200 generated ones, encoded to the card's
``max_tokens`` as the pipelines do (SD3: a CFG pair against ""; FLUX-dev: guidance embedded, one row per
image). Sections (``--sections``), in this order per model:

  step    latency (median ms, synchronised) of ONE denoising step of B images at the native size:
            diffusers   the pipeline's loop body: transformer (SD3: latents doubled, CFG combine; FLUX: packed
                        latents, as FluxPipeline packs them once before its loop), FlowMatchEulerDiscreteScheduler.step
            eager       our GraphRunner over the family's step (family.make_step(model, shape)), no capture
            full        one CUDA graph per power-of-two bucket
            breakable   graph segments around eager breaks (none in these families: one segment)
          SD3.5 at 1024: B = 1, 2, 4 (2B rows); FLUX-dev at 512: 1, 2, 4, 8 and at 1024: 1, 2, 4 (B rows);
          plus capture time and graph pool size per backend.
  memory  weights (GiB of parameters per component), the peak memory of a warmed worker engine
          (torch.cuda.max_memory_allocated over Engine(breakable, max batch 4) warm-up and one batch of 4
          images, decode included) and its graph pool. The engine is then reused by e2e.
  e2e     one image, prompt to pixels, 28 steps (SD3.5 CFG 4.5; FLUX-dev guidance 3.5), text encoding and
          VAE decode included, a prompt never seen before in every run (our encoding cache cleared):
            ours        Engine(breakable graphs, max batch 4, warmed), generate([one ItemSpec])
            diffusers   the pipeline over the same modules, output_type "np"
          median of 3 runs after one warm-up.
  mixed   FLUX-dev at 512: requests of 1 image (70%), 2-4 (25%) or 8 (5%), each 512x512, 512x768 or 768x512
          asked (1:1:1 by request), made at the size the card makes for it (``card.size_for``) by both
          systems, seeded Poisson arrivals, one single-threaded clock (as bench/pixart.py):
            a           our engine, breakable graphs, step-level batching, at most 8 images in flight,
                        admitted as the service leases (the queue's head, then the shapes in flight:
                        workers/admission.py), warmed at the three sizes before the clock starts (one
                        shared graph pool); with --compile its VAE decode is captured and compiled too
                        (--decode-graphs)
            d           FluxPipeline with static batching: the first queued request and the queued ones of
                        its size, up to 8 images per call, waiting at most 0.1 s for more
          max sustained images/s (24 images queued at t=0, 8 per size) and images/s, p50/p99 at each load.
Targets: e2e ours <= 0.6x diffusers for flux-dev-512 and <= 1.0x for flux-dev-1024; mixed max sustained
a >= 1.3x d.

On one H200 (estimates from FLOP counts, not yet measured; each model's load, random weights made on the
GPU, comes on top; one model is in memory at a time):

    python bench/mmdit.py --models sd35-medium-1024     # step, memory, e2e: ~60 s
    python bench/mmdit.py --models flux-dev-512         # step, memory, e2e, mixed: ~230 s
    python bench/mmdit.py --models flux-dev-1024        # step, memory, e2e: ~130 s
    python bench/mmdit.py                               # all three in one process: ~7 min + three loads
    python bench/mmdit.py --models flux-dev-512 --sections mixed   # one section (~160 s): merged into the report
    python bench/mmdit.py --smoke --out /tmp/mmdit          # ~20 s on a CPU: every section, tiny models

Per section (SD3.5 / FLUX 512 / FLUX 1024): step ~30 / 45 / 65 s (capture of two graph backends
included); memory ~10 / 6 / 16 s; e2e ~22 / 17 / 50 s; mixed (FLUX 512) ~160 s. Parts run separately
merge into one report. Mixed options: --loads (offered images/s, default 0.3 0.6), --window (seconds
of arrivals per load, 10). --fresh starts a new report instead of merging.

Writes mmdit.json and mmdit.md (mmdit_smoke.* with --smoke) under --out after every section (and every
mixed figure), so a run cut short keeps what it measured; a report there from the same GPU and versions
keeps the sections and models this run does not redo.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workers import admission

# bench/pixart.py's prompts, jobs, static batches, timing and report merging, shared
_spec = importlib.util.spec_from_file_location("pixart_bench", Path(__file__).parent / "pixart.py")
pb = sys.modules.setdefault("pixart_bench", importlib.util.module_from_spec(_spec))
if not hasattr(pb, "make_prompts"):
    _spec.loader.exec_module(pb)
et = pb.et  # engine_throughput's summaries

SECTIONS = ("step", "memory", "e2e", "mixed")  # the order they run in, per model
BACKENDS = ("eager", "full", "breakable")
MODELS = ("sd35-medium-1024", "flux-dev-512", "flux-dev-1024")
MIXED_MODEL = "flux-dev-512"
E2E_TARGETS = {"flux-dev-512": 0.6, "flux-dev-1024": 1.0}  # ours / diffusers, one image end to end
MIXED_TARGET = 1.3                                          # max sustained a / d
SAMPLER = "flow_euler"


@dataclass(frozen=True)
class Setup:
    """What a run measures and for how long: the GPU run's settings, or ``smoke()``'s."""

    steps: int = 28
    guidance: dict = field(default_factory=lambda: {"sd3": 4.5, "flux": 3.5})  # by the card's family
    batches: dict = field(default_factory=lambda: {"sd35-medium-1024": (1, 2, 4), "flux-dev-512": (1, 2, 4, 8),
                                                   "flux-dev-1024": (1, 2, 4)})
    iters: tuple[int, int] = (8, 5)  # timed steps at small and at large work (rows x latent tokens)
    e2e_reps: int = 3
    engine_batch: int = 4            # memory and e2e: the warmed engine's largest bucket
    memory_steps: int = 2            # memory: steps of its one batch
    mixed_sizes: tuple = ((512, 512), (512, 768), (768, 512))  # (width, height) asked
    max_batch: int = 8               # mixed: images in flight (a), images per pipeline call (d)
    wait_s: float = 0.1
    window_s: float = 10.0
    drain_s: float = 4.0
    loads: tuple = (0.3, 0.6)        # offered images/s: ~2 and ~3 requests in the window; ~0.6 saturates a (est.)
    backlog_stop_s: float = 120.0
    compile: str = "off"             # our engines' steps: "inductor" compiles them inside the graphs
    precision: str = "bf16"          # "fp8": the models' block linears as FP8 products (workers/fp8.py); "fp8+attention": and attention
    decode_graphs: str = "auto"      # mixed: system a's VAE decode captured: "on" | "off" | "auto" (with compile)


def smoke() -> Setup:
    """Every section in seconds on a CPU, on workers.models.tiny_sd3 (16x16) and tiny_flux (64x64)."""
    return Setup(steps=4, batches={m: (1, 2, 4) for m in MODELS}, iters=(3, 3), e2e_reps=2,
                 mixed_sizes=((64, 64), (64, 96), (96, 64)), wait_s=0.02, window_s=1.0, drain_s=4.0,
                 loads=(20.0,), backlog_stop_s=60.0)


# -- workload -----------------------------------------------------------------------------------------
MEAN_SIZE = 1.85  # mean request size of the mix: 0.7 * 1 + 0.25 * 3 + 0.05 * 8


def make_jobs(load: float, seed: int, sizes: tuple, prompts: int, window_s: float) -> list:
    """As bench/pixart.py's make_jobs (the Poisson count the load implies, arrivals uniform in the window,
    sizes in shuffled blocks of the three), with requests no larger than system a's 8 in flight: blocks of
    20 hold 14 of 1 image, 5 of 2-4 and one of 8."""
    rng = random.Random(seed)
    count = max(1, round(load * window_s / MEAN_SIZE))
    ns: list[int] = []
    while len(ns) < count:
        block = [1] * 14 + [rng.randint(2, 4) for _ in range(5)] + [8]
        rng.shuffle(block)
        ns += block
    shapes: list = []
    while len(shapes) < count:
        shapes += rng.sample(list(sizes), len(sizes))
    times = sorted(rng.uniform(0.0, window_s) for _ in range(count))
    return [pb.Job(i, t, n, tuple(shapes[i]), rng.randrange(prompts)) for i, (t, n) in enumerate(zip(times, ns))]


def backlog(sizes: tuple, prompts: int, seed: int = 99) -> list:
    """15 requests queued at t=0: 1, 1, 1, 2 and 3 images (shuffled) at each size in turn: 24 images, 8 per
    size, so one full pipeline call per size for d."""
    rng = random.Random(seed)
    ns = [1, 1, 1, 2, 3]
    rng.shuffle(ns)
    return [pb.Job(r * len(ns) + k, 0.0, n, tuple(sizes[(k + r) % len(sizes)]), rng.randrange(prompts))
            for r in range(len(sizes)) for k, n in enumerate(ns)]


# -- helpers ------------------------------------------------------------------------------------------
def guidance_of(model, s: Setup) -> float:
    return s.guidance[model.card.family]


def rows_per_image(model) -> int:
    """Transformer rows per image: 2 under classifier-free guidance (SD3), 1 when embedded (FLUX-dev)."""
    return 2 if model.card.guidance_mode == "cfg" else 1


def scheduler_config(model) -> dict:
    """The card's scheduler config without ``flow_grid`` (ours, not diffusers': the pipeline passes FLUX's
    sigma grid itself)."""
    return {k: v for k, v in model.card.scheduler.items() if k != "flow_grid"}


def pipeline(model):
    """StableDiffusion3Pipeline or FluxPipeline over the loaded model's modules."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, StableDiffusion3Pipeline

    sched = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config(model))
    text = dict(text_encoder=model.text_encoder, tokenizer=model.tokenizer, text_encoder_2=model.text_encoder_2,
                tokenizer_2=model.tokenizer_2)
    if model.card.family == "sd3":
        pipe = StableDiffusion3Pipeline(transformer=model.transformer, vae=model.vae, scheduler=sched, **text,
                                        text_encoder_3=model.text_encoder_3, tokenizer_3=model.tokenizer_3)
    else:
        pipe = FluxPipeline(transformer=model.transformer, vae=model.vae, scheduler=sched, **text)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_pipeline(pipe, model, prompts: list[str], size: tuple[int, int], s: Setup, seed: int):
    """One pipeline call: one image per prompt at ``size`` (width, height), pixels out as numpy."""
    w, h = size
    negative = {"negative_prompt": ""} if rows_per_image(model) == 2 else {}
    return pipe(prompts, height=h, width=w, num_inference_steps=s.steps, guidance_scale=guidance_of(model, s),
                max_sequence_length=model.card.max_tokens, output_type="np",
                generator=torch.Generator().manual_seed(seed), **negative).images


def item_spec(model, s: Setup, rid: str, seed: int, prompt: str, size: tuple[int, int] = (0, 0),
              steps: int | None = None):
    """One image for our engine: the benchmark's sampler, steps and guidance; ``size`` (width, height) one
    the card makes ((0, 0): the native size)."""
    from workers.spec import ItemSpec

    return ItemSpec(id=rid, seed=seed, sampler=SAMPLER, steps=steps or s.steps, guidance=guidance_of(model, s),
                    prompt=prompt, width=size[0], height=size[1])


def weights_gib(model) -> dict[str, float]:
    """GiB of parameters per component, and their total."""
    names = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "vae")
    parts = {n: getattr(model, n, None) for n in names}
    out = {n: sum(p.numel() * p.element_size() for p in m.parameters()) / 2**30 for n, m in parts.items()
           if m is not None}
    return {**{k: round(v, 4) for k, v in out.items()}, "total": round(sum(out.values()), 4)}


# -- section 1: one denoising step --------------------------------------------------------------------
STEP_INDEX = 10  # of 28: any step (the Euler update is first order); the smoke's last one when it has fewer


def live_inputs(model, batch: int, prompts: list[str], s: Setup) -> dict[str, torch.Tensor]:
    """Our step's inputs for ``batch`` images at the native shape, at step STEP_INDEX of the flow plan,
    with the family's encodings of ``batch`` prompts (on the host in its cache: uploaded here)."""
    from samplers import gather_rows, make_plan
    from workers.families import family_of

    dev, family, shape = model.device, family_of(model), tuple(model.latent_shape)
    extra = family.plan_kwargs(model, shape) if hasattr(family, "plan_kwargs") else {}
    plan = make_plan(SAMPLER, s.steps, model.schedule, **extra)
    t, coeffs = gather_rows([plan] * batch, [min(STEP_INDEX, s.steps - 1)] * batch)
    conds = family.encode(model, [item_spec(model, s, str(i), i, prompts[i % len(prompts)]) for i in range(batch)])
    x = torch.randn(batch, *shape, device=dev)
    return dict(x=x, t=t.to(dev), coeffs=coeffs.to(dev), guidance=torch.full((batch,), guidance_of(model, s),
                device=dev), hist=torch.zeros_like(x), noise=torch.zeros_like(x),
                **{k: torch.stack([c[k] for c in conds]).to(dev) for k in conds[0]})


def _scheduler_at(model, s: Setup, sigmas=None):
    """The pipeline's scheduler after its set_timesteps at the native size (mu only with dynamic shifting)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    sched = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config(model))
    cfg, (_, h, w) = sched.config, model.latent_shape
    mu = calculate_shift((h // 2) * (w // 2), cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                         cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
    extra = {"mu": mu} if cfg.get("use_dynamic_shifting") else {}
    sched.set_timesteps(None if sigmas is not None else s.steps, device=model.device, sigmas=sigmas, **extra)
    return sched


def sd3_step(model, inp: dict, s: Setup):
    """One iteration of StableDiffusion3Pipeline.__call__'s denoising loop, as diffusers writes it. The
    scheduler counts its steps itself (``_step_index``), so each call sets the count back."""
    index = min(STEP_INDEX, s.steps - 1)
    sched, g = _scheduler_at(model, s), guidance_of(model, s)
    t = sched.timesteps[index]
    latents = inp["x"].to(model.dtype)                                   # the pipeline's latents: the encoders' dtype
    embeds = torch.cat([inp["neg_embeds"], inp["prompt_embeds"]])       # (2B, 77 + L, 4096): negative first
    pooled = torch.cat([inp["neg_pooled"], inp["pooled"]])              # (2B, 2048)

    def step():
        sched._step_index = index
        latent_model_input = torch.cat([latents] * 2)
        timestep = t.expand(latent_model_input.shape[0])
        noise_pred = model.transformer(hidden_states=latent_model_input, timestep=timestep,
                                       encoder_hidden_states=embeds, pooled_projections=pooled,
                                       joint_attention_kwargs=None, return_dict=False)[0]
        noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
        noise_pred = noise_pred_uncond + g * (noise_pred_text - noise_pred_uncond)
        return sched.step(noise_pred, t, latents, return_dict=False)[0]

    return step


def flux_step(model, inp: dict, s: Setup):
    """One iteration of FluxPipeline.__call__'s denoising loop on latents packed as the pipeline packs them
    (once, before its loop), with its sigma grid, mu, ids and guidance tensor."""
    import numpy as np
    from diffusers import FluxPipeline

    from workers.families.flux import pack

    index, dev, dtype = min(STEP_INDEX, s.steps - 1), model.device, model.dtype
    sched = _scheduler_at(model, s, sigmas=np.linspace(1.0, 1 / s.steps, s.steps))
    t = sched.timesteps[index]
    _, h, w = model.latent_shape
    latents = pack(inp["x"].to(dtype))                                               # (B, N, 64)
    img_ids = FluxPipeline._prepare_latent_image_ids(len(latents), h // 2, w // 2, dev, dtype)  # (N, 3)
    txt_ids = torch.zeros(inp["prompt_embeds"].shape[1], 3, device=dev, dtype=dtype)  # (L, 3)
    guidance = None
    if model.transformer.config.guidance_embeds:
        guidance = torch.full([1], guidance_of(model, s), device=dev, dtype=torch.float32).expand(len(latents))

    def step():
        sched._step_index = index
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        with model.transformer.cache_context("cond"):
            noise_pred = model.transformer(hidden_states=latents, timestep=timestep / 1000, guidance=guidance,
                                           pooled_projections=inp["pooled"], encoder_hidden_states=inp["prompt_embeds"],
                                           txt_ids=txt_ids, img_ids=img_ids, joint_attention_kwargs={},
                                           return_dict=False)[0]
        return sched.step(noise_pred, t, latents, return_dict=False)[0]

    return step


DIFFUSERS_STEP = {"sd3": sd3_step, "flux": flux_step}


def build_runner(model, backend: str, max_batch: int):
    """As bench/pixart.py's build_runner: the family's step at the native latent shape."""
    from graphs import GraphRunner
    from workers.engine import step_specs
    from workers.families import family_of

    shape = tuple(model.latent_shape)
    inputs, outputs = step_specs(model, shape)
    return GraphRunner(family_of(model).make_step(model, shape), inputs, outputs, max_batch=max_batch,
                       backend=backend, device=model.device)


def iters_for(model, s: Setup, batch: int) -> int:
    """More timed steps while the work is small: one transformer row at 1024 (four at 512)."""
    _, h, w = model.latent_shape
    return s.iters[0] if batch * rows_per_image(model) * h * w <= 128 * 128 else s.iters[1]


def bench_step(model, s: Setup, batches: tuple, prompts: list[str], ref=None) -> dict:
    """Section 1. The runners' max batch is the largest batch measured; diffusers runs ``ref``
    (``pb.baseline``) when given."""
    block = {"model": model.name, "size": list(model.card.native_size), "batches": list(batches),
             "rows_per_image": rows_per_image(model), "steps": s.steps, "rows": [], "capture_s": {}, "pool_mb": {},
             "totals": {}}
    inputs = {b: live_inputs(model, b, prompts, s) for b in batches}
    base = ref() if ref else model
    with torch.no_grad():
        for b in batches:
            ms = pb.timed_ms(DIFFUSERS_STEP[model.card.family](base, inputs[b], s), iters_for(model, s, b), warmup=2)
            block["rows"].append(dict(batch=b, backend="diffusers", ms=round(ms, 3)))
    del base
    pb.free()
    for backend in BACKENDS:
        try:
            _time_runner(model, backend, inputs, block, s)
        finally:
            pb.free()
    return block


def _time_runner(model, backend: str, inputs: dict, block: dict, s: Setup) -> None:
    from workers.engine import table_inputs

    runner = build_runner(model, backend, max(inputs))
    inputs = {b: table_inputs(model, inp) for b, inp in inputs.items()}  # where the step reads modulation tables
    t0 = time.perf_counter()
    runner.warmup(example=inputs[max(inputs)])  # real prompts' encodings in the static inputs, not zeros
    pb.sync()
    block["capture_s"][backend] = round(time.perf_counter() - t0, 3)
    block["pool_mb"][backend] = round(runner.stats()["pool_reserved_bytes"] / 2**20, 1)
    for b, inp in inputs.items():
        ms = pb.timed_ms(lambda: runner.run(**inp), iters_for(model, s, b), warmup=2)
        block["rows"].append(dict(batch=b, backend=backend, ms=round(ms, 3)))
    block["totals"][backend] = {"backend": runner.backend, **runner.stats()["totals"]}


# -- sections 2 and 3: a warmed engine's memory, one image end to end ---------------------------------
def warm_engine(model, s: Setup, prompts: list[str]) -> tuple[object, dict]:
    """Engine(breakable, max batch ``engine_batch``) warmed, then one batch of that many images run to
    completion (decoded together); the peak allocated memory from before its construction (the model's
    weights included: what a worker holds). On a CPU (smoke) the process's peak RSS stands in."""
    from workers.engine import Engine, EngineConfig

    pb.free()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine = Engine(model, EngineConfig(backend="breakable", max_batch=s.engine_batch,
                                        **pb.compile_kwargs(s.compile)))
    engine.warmup()
    pb.sync()
    warmup_s = time.perf_counter() - t0
    engine.generate([item_spec(model, s, f"mem{i}", i, prompts[-1 - i], steps=s.memory_steps)
                     for i in range(s.engine_batch)])
    if torch.cuda.is_available():
        peak, source = torch.cuda.max_memory_allocated(), "cuda max_memory_allocated"
    else:
        peak, source = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu peak rss (smoke)"
    pool = sum(g.runner.stats()["pool_reserved_bytes"] for g in engine.groups.values())
    runner = next(iter(engine.groups.values())).runner
    return engine, {"backend": runner.backend, "max_batch": s.engine_batch, "warmup_s": round(warmup_s, 2),
                    "peak_gib": round(peak / 2**30, 3), "peak_source": source, "pool_mib": round(pool / 2**20, 1)}


def bench_memory(model, s: Setup, prompts: list[str], state: dict) -> dict:
    """Section 2; leaves the warmed engine in ``state`` for e2e."""
    state["engine"], info = warm_engine(model, s, prompts)
    return {"model": model.name, "weights_gib": weights_gib(model), **info}


def bench_e2e(model, s: Setup, prompts: list[str], state: dict, ref=None) -> dict:
    """Section 3: ours (memory's engine, or one warmed here), then diffusers, each run on a prompt never
    seen before."""
    fresh = iter(prompts[len(prompts) // 2:])  # neither step's nor memory's
    block = {"model": model.name, "size": list(model.card.native_size), "steps": s.steps,
             "guidance": guidance_of(model, s), "engine_max_batch": s.engine_batch, "runs_ms": {},
             "host_loop_s": pb.host_loop_s()}
    engine = state.pop("engine", None) or warm_engine(model, s, prompts)[0]
    block["runs_ms"]["ours"] = _ours_e2e(engine, model, s, fresh)
    del engine  # its graphs, before the pipeline runs
    pb.free()
    pipe = pipeline(ref() if ref else model)
    size = model.card.native_size
    block["runs_ms"]["diffusers"] = pb.repeat_ms(lambda i: call_pipeline(pipe, model, [next(fresh)], size, s, i),
                                                 s.e2e_reps)
    block["ms"] = {k: round(statistics.median(v), 1) for k, v in block["runs_ms"].items()}
    block["ratio"] = round(block["ms"]["ours"] / block["ms"]["diffusers"], 3)
    return block


def _ours_e2e(engine, model, s: Setup, fresh) -> list[float]:
    def one(i):
        model.cache.clear()
        engine.generate([item_spec(model, s, f"e2e{i}", i, next(fresh))])

    return pb.repeat_ms(one, s.e2e_reps)


# -- section 4: mixed-size workload (FLUX-dev 512) ----------------------------------------------------
def run_engine(engine, model, jobs: list, prompts: list[str], s: Setup, stop_s: float) -> None:
    """System a, as bench/pixart.py's run_engine: arrived images join at any step boundary, the queue's
    head first, then images of the shapes in flight (``workers.admission``, as the service's lease), while
    fewer than ``max_batch`` are in flight (encoded together on admission)."""
    pending, start, by_id = list(jobs), time.perf_counter(), {j.id: j for j in jobs}
    queue: list = []  # arrived images not yet in the engine
    while pending or queue or engine.num_active:
        now = time.perf_counter() - start
        if now > stop_s:
            for rid in list(engine.progress()):  # leave the engine empty for the next point
                engine.cancel(rid)
            return
        while pending and pending[0].arrival <= now:
            job = pending.pop(0)
            queue += [item_spec(model, s, f"{job.id}:{k}", job.id * 1000 + k, prompts[job.prompt], job.size)
                      for k in range(job.n)]
        admit = max(0, s.max_batch - engine.num_active)
        if admit and queue:  # as the service leases: shape-aware (workers.admission)
            started = admission.take(queue, admit, engine.in_flight_shapes(), capacity=s.max_batch)
            if started:  # none while a small group is held back (rule 4)
                engine.add_many(started)
        if engine.num_active == 0:
            time.sleep(max(0.0, min(0.005, pending[0].arrival - now)) if pending else 0.0)
            continue
        for r in engine.step():
            j = by_id[int(r.request.id.split(":")[0])]
            j.done_images += 1
            if j.done_images == j.n:
                pb.sync()
                j.finished = time.perf_counter() - start


def run_static(pipe, model, jobs: list, prompts: list[str], s: Setup, stop_s: float) -> None:
    """System d, as bench/pixart.py's run_static: ``static_batch`` once the first queued request has waited
    ``wait_s`` or the call is full; one pipeline call per batch, one prompt per image."""
    pending, start = list(jobs), time.perf_counter()
    while pending:
        now = time.perf_counter() - start
        if now > stop_s:
            return
        if pending[0].arrival > now:
            time.sleep(min(0.005, pending[0].arrival - now))
            continue
        while True:
            now = time.perf_counter() - start
            batch = pb.static_batch(pending, now, s.max_batch)
            if sum(j.n for j in batch) >= s.max_batch or now >= batch[0].arrival + s.wait_s:
                break
            time.sleep(0.002)
        for j in batch:
            pending.remove(j)
        call_pipeline(pipe, model, [prompts[j.prompt] for j in batch for _ in range(j.n)], batch[0].size, s,
                      seed=batch[0].id)
        pb.sync()
        for j in batch:
            j.finished = time.perf_counter() - start


def bench_mixed(model, s: Setup, prompts: list[str], save, ref=None) -> dict:
    """Section 4: system a's backlog and load points, then d's (the engine dropped first); ``save(block)``
    after each figure. The encoding cache is cleared before every run of a."""
    from workers.engine import Engine, EngineConfig

    made = tuple(model.card.size_for(w, h) for w, h in s.mixed_sizes)
    block = {"model": model.name, "sizes": [list(x) for x in s.mixed_sizes], "made_sizes": [list(x) for x in made],
             "steps": s.steps, "guidance": guidance_of(model, s), "max_batch": s.max_batch, "wait_s": s.wait_s,
             "window_s": s.window_s, "drain_s": s.drain_s, "backlog_images": sum(j.n for j in backlog(made, 1)),
             "rows": [], "max_images_per_s": {}, "decode_graphs": pb.mixed_decode_graphs(s),
             "decode": pb.decode_kind(s)}
    engine = Engine(model, EngineConfig(backend="breakable", max_batch=s.max_batch,
                                        decode_graphs=block["decode_graphs"], **pb.compile_kwargs(s.compile)))
    try:
        t0 = time.perf_counter()
        engine.warmup(sizes=made)
        pb.sync()
        block["warmup_s"] = round(time.perf_counter() - t0, 2)
        pool = sum(g.runner.stats()["pool_reserved_bytes"] for g in engine.groups.values())  # one pool, shared
        block["pool_mb"], block["groups"] = round(pool / 2**20, 1), len(engine.groups)
        for load, jobs, stop in _runs(s, made, len(prompts)):
            model.cache.clear()
            run_engine(engine, model, jobs, prompts, s, stop)
            _record(block, "a", load, jobs, stop, s, save)
        block["padding_fraction"] = round(engine.padded_rows / max(1, engine.padded_rows + engine.real_rows), 4)
    finally:
        del engine
        pb.free()
    pipe = pipeline(ref() if ref else model)
    for load, jobs, stop in _runs(s, made, len(prompts)):
        run_static(pipe, model, jobs, prompts, s, stop)
        _record(block, "d", load, jobs, stop, s, save)
    return block


def _runs(s: Setup, sizes: tuple, prompts: int):
    """The backlog (load inf), then each load point, with the same seeded arrivals for both systems."""
    yield float("inf"), backlog(sizes, prompts), s.backlog_stop_s
    for load in s.loads:
        yield load, make_jobs(load, int(load * 1000) + 7, sizes, prompts, s.window_s), s.window_s + s.drain_s


def _record(block: dict, system: str, load: float, jobs: list, stop: float, s: Setup, save) -> None:
    # as bench/pixart.py's _record
    if load == float("inf"):
        row = {**et.summarise(system, "mixed", load, jobs, stop), "offered_images_per_s": None}  # JSON has no inf
        block["max_images_per_s"][system] = row["images_per_s"]
        block[f"backlog_{system}"] = row
    else:
        row = et.summarise(system, "mixed", load, jobs, stop, window_s=s.window_s)
        block["rows"].append(row)
    mx = block["max_images_per_s"]
    if "a" in mx and mx.get("d"):
        block["ratio_max"] = round(mx["a"] / mx["d"], 3)
    print(system, row, flush=True)
    save(block)


# -- the report ---------------------------------------------------------------------------------------
def targets(result: dict) -> list[dict]:
    """The targets, checked on whatever sections the result holds."""
    out = []
    for name, limit in E2E_TARGETS.items():
        ratio = result.get("e2e", {}).get(name, {}).get("ratio")
        if ratio is not None:
            out.append({"target": f"e2e {name}: ours <= {limit}x diffusers", "value": ratio, "met": ratio <= limit})
    ratio = result.get("mixed", {}).get("ratio_max")
    if ratio is not None:
        out.append({"target": f"mixed: max sustained a >= {MIXED_TARGET}x d", "value": ratio,
                    "met": ratio >= MIXED_TARGET})
    return out


def _ordered(blocks: dict) -> list[tuple[str, dict]]:
    return sorted(blocks.items(), key=lambda kv: MODELS.index(kv[0]) if kv[0] in MODELS else len(MODELS))


def markdown(result: dict) -> str:
    lines = [f"# SD3.5 and FLUX.1-dev on {result['gpu']} (torch {result['torch']}, diffusers {result['diffusers']}, "
             f"transformers {result.get('transformers', '?')})", "",
             "`python bench/mmdit.py " + " ".join(result["argv"]) + "` (latest run)", ""]
    cols = ["diffusers", *BACKENDS]
    for name, block in _ordered(result.get("step", {})):
        rows = "2 rows (CFG)" if block["rows_per_image"] == 2 else "1 row (guidance embedded)"
        lines += [f"## One step, {name} (ms, median; batch = images, {rows} each)", "",
                  "| batch | " + " | ".join(cols) + " | diffusers / best |", "|---|" + "---|" * (len(cols) + 1)]
        for b in block["batches"]:
            ms = {r["backend"]: r["ms"] for r in block["rows"] if r["batch"] == b}
            best = min((v for k, v in ms.items() if k != "diffusers"), default=None)
            ratio = f"{ms['diffusers'] / best:.2f}x" if best and "diffusers" in ms else ""
            lines.append(f"| {b} | " + " | ".join(f"{ms[c]:.2f}" if c in ms else "" for c in cols) + f" | {ratio} |")
        lines += ["", "Capture s: " + ", ".join(f"{k} {v}" for k, v in block["capture_s"].items()),
                  "", "Graph pool MiB: " + ", ".join(f"{k} {v}" for k, v in block["pool_mb"].items()), ""]
    if result.get("e2e"):
        lines += ["## One image end to end (ms, median)", "", "| model | size | steps | ours | diffusers | ours / diffusers |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {name} | {b['size'][0]}x{b['size'][1]} | {b['steps']} | {b['ms']['ours']} | "
                  f"{b['ms']['diffusers']} | {b['ratio']}x |" for name, b in _ordered(result["e2e"])]
        hosts = [f"{name}: {pb.host_line(b)}" for name, b in _ordered(result["e2e"]) if pb.host_line(b)]
        lines += ["", "; ".join(hosts)] if hosts else []
        lines.append("")
    if result.get("memory"):
        lines += ["## Memory", "", "| model | weights GiB | engine peak GiB | graph pool MiB | max batch |",
                  "|---|---|---|---|---|"]
        for name, b in _ordered(result["memory"]):
            parts = ", ".join(f"{k} {v}" for k, v in b["weights_gib"].items() if k != "total")
            lines.append(f"| {name} | {b['weights_gib']['total']} ({parts}) | {b['peak_gib']} | {b['pool_mib']} | "
                         f"{b['max_batch']} |")
        lines.append("")
    if result.get("mixed"):
        lines += _mixed_markdown(result["mixed"])
    lines += ["## Targets", "", "| target | value | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['value']} | {'yes' if t['met'] else 'no'} |" for t in targets(result)]
    return "\n".join(lines) + "\n"


def _mixed_markdown(m: dict) -> list[str]:
    return pb.mixed_markdown(m, f"Sizes asked {m['sizes']}, made at {m['made_sizes']} by both systems; a: our "
                                f"engine (at most {m['max_batch']} in flight{pb.decode_note(m)}); d: FluxPipeline, "
                                f"static batches of "
                                f"one size up to {m['max_batch']} images.")


def write(result: dict, out: Path, name: str) -> None:
    import json

    result["targets"] = targets(result)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / f"{name}.md").write_text(markdown(result))


def plan_models(sections: list[str], models: list[str]) -> list[tuple[str, list[str]]]:
    """(model, sections in run order) per model load, in the order asked: mixed only with MIXED_MODEL
    (loaded for it alone when not asked); one model in memory at a time."""
    models = list(dict.fromkeys(models))
    out = [(m, [x for x in SECTIONS if x in sections and (x != "mixed" or m == MIXED_MODEL)]) for m in models]
    if "mixed" in sections and MIXED_MODEL not in models:
        out.append((MIXED_MODEL, ["mixed"]))
    return [(m, xs) for m, xs in out if xs]


def loaders(smoke: bool, precision: str = "bf16"):
    """name -> a function loading it: the built-ins on the GPU in bf16, or (smoke) tiny directories made
    offline in a temporary folder, float32 on the CPU (tiny SD3 for sd35-*, tiny FLUX-dev for flux-dev-*);
    ``precision="fp8"``: their block linears as FP8 products."""
    from workers.loading import load_model

    if not smoke:
        return lambda name, precision=precision: load_model(name, device="cuda", dtype=torch.bfloat16,
                                                            precision=precision)
    import tempfile

    from workers.models.tiny_flux import make_tiny_flux
    from workers.models.tiny_sd3 import make_tiny_sd3

    tmp, made = Path(tempfile.mkdtemp()), {}

    def load(name, precision=precision):
        kind = "sd3" if name.startswith("sd35") else "flux"
        if kind not in made:
            made[kind] = (make_tiny_sd3 if kind == "sd3" else make_tiny_flux)(tmp / f"tiny-{kind}")
        return load_model(made[kind], precision=precision)

    return load


def main(argv: list[str] | None = None) -> None:
    import diffusers
    import transformers

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    p.add_argument("--smoke", action="store_true", help="every section in seconds on tiny random models (CPU)")
    p.add_argument("--loads", type=float, nargs="+", help="mixed: offered loads in images/s (default 0.3 0.6)")
    p.add_argument("--window", type=float, help="mixed: seconds of arrivals per load (default 10)")
    p.add_argument("--engine-batch", type=int, help="memory and e2e: the warmed engine's largest bucket (default 4; "
                   "1 compiles one graph instead of two with --compile inductor)")
    p.add_argument("--fresh", action="store_true", help="start a new report instead of merging into the one in --out")
    p.add_argument("--compile", choices=pb.COMPILE_CHOICES, default="off", help="our engines' steps compiled "
                   "(inductor-blocks: the transformer's blocks, one graph per block class)")
    p.add_argument("--precision", choices=["bf16", "fp8", "fp8+attention"], default="bf16",
                   help="our models' block linears (fp8), and their joint attention (fp8+attention)")
    p.add_argument("--decode-graphs", choices=["auto", "on", "off"], default="auto", help="mixed: system a's VAE "
                   "decode captured (auto: with --compile, compiled too; each size's cold compile takes 1-2 minutes)")
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        p.error("the benchmark needs a CUDA GPU (or --smoke, which runs on a CPU)")
    if (args.loads and min(args.loads) <= 0) or (args.window is not None and args.window <= 0):
        p.error("--loads and --window must be positive")
    s = smoke() if args.smoke else Setup()
    if args.smoke:  # one thread: on a shared CPU torch's threads wait on each other and tiny steps swing 100x
        torch.set_num_threads(1)
    over = {"loads": tuple(args.loads) if args.loads else None, "window_s": args.window, "compile": args.compile,
            "precision": args.precision, "engine_batch": args.engine_batch, "decode_graphs": args.decode_graphs}
    s = Setup(**{**s.__dict__, **{k: v for k, v in over.items() if v is not None}})
    name = ("mmdit_smoke" if args.smoke else "mmdit") + pb.tuned_suffix(s.compile, s.precision)
    head = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
            "cuda": torch.version.cuda, "diffusers": diffusers.__version__, "transformers": transformers.__version__,
            "argv": argv}
    args.out.mkdir(parents=True, exist_ok=True)
    result = pb.previous(args.out / f"{name}.json", head, args.fresh)
    prompts, load = pb.make_prompts(), loaders(args.smoke, s.precision)
    t0 = time.perf_counter()
    for slot, sections in plan_models(args.sections, args.models):
        t1 = time.perf_counter()
        model = load(slot)
        pb.sync()
        result.setdefault("load_s", {})[slot] = round(time.perf_counter() - t1, 1)
        ref = pb.baseline(model, lambda slot=slot: load(slot, "bf16"))  # diffusers never runs our FP8 modules
        state: dict = {}
        for section in sections:
            def save(block, section=section, slot=slot):
                block["argv"] = argv
                if section == "mixed":
                    result["mixed"] = block
                else:
                    result.setdefault(section, {})[slot] = block
                write(result, args.out, name)

            print(f"{section} {slot} ({model.name}) ...", flush=True)
            t1 = time.perf_counter()
            if section == "step":
                block = bench_step(model, s, s.batches[slot], prompts, ref)
            elif section == "memory":
                block = bench_memory(model, s, prompts, state)
            elif section == "e2e":
                block = bench_e2e(model, s, prompts, state, ref)
            else:
                block = bench_mixed(model, s, prompts, save, ref)
            block["section_s"] = round(time.perf_counter() - t1, 1)
            save(block)
        state.clear()
        del model, ref
        pb.free()
    print(markdown(result))
    print(f"benchmark took {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
