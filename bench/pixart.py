"""PixArt-Σ benchmarks: one denoising step, one image end to end, and a mixed-size prompt workload, our
engine against diffusers' PixArtSigmaPipeline.

Models: the built-ins ``pixart-sigma-512`` and ``pixart-sigma-1024`` (PixArt-Σ-XL/2 0.6B, a T5-XXL-sized
encoder 4.7B, the SDXL VAE; random weights made on the GPU, bf16). Prompts: 200 generated ones of ~15-30
tokens, encoded to ``max_sequence_length`` = the card's ``max_tokens`` (300) as the pipeline does; the
negative prompt is "" (the unconditional one). Sections (``--sections``):

  step   latency (median ms, synchronised) of ONE CFG denoising step of B images (2B transformer rows):
           diffusers   the loop body of PixArtSigmaPipeline: latents doubled, transformer, CFG, learned-sigma
                       split, DPMSolverMultistepScheduler.step; eager
           eager       our GraphRunner over the family's step (workers.families.pixart.make_step), no capture
           full        one CUDA graph per power-of-two bucket
           breakable   graph segments around eager breaks (varlen's attention kernels; with padded
                       cross-attention there are none: PixArt's self-attention is not broken)
         each of ours with cross-attention ``padded`` (all 300 keys, masked) and ``varlen`` (each prompt's
         real tokens, an eager break); plus capture time and graph pool size per backend.
  e2e    one image, prompt to pixels: 20 steps DPM++ 2M, CFG 4.5, text encoding and VAE decode included:
           ours        Engine(breakable graphs, max batch 8, warmed), padded and varlen cross-attention;
                       the encoding cache is cleared before each run; T5 replays from graphs (the graph
                       backends' rule) and so does the VAE decode (compiled too with --compile)
           diffusers   PixArtSigmaPipeline with DPMSolverMultistepScheduler, resolution binning as default
  mixed  throughput at 512: requests of 1 image (70%), 2-8 (25%) or 16-32 (5%), each 512x512, 512x768 or
         768x512 (width x height, 1:1:1 by request; both systems generate at the nearest aspect-ratio bin and
         resize back), one of the 200 prompts, seeded Poisson arrivals, one single-threaded clock (latency
         runs from a request's arrival to its last image decoded):
           a           our engine, breakable graphs, step-level batching (images join at any step), at most
                       32 images in flight, admitted as the service leases (the queue's head, then the
                       shapes in flight: workers/admission.py), warmed at the three sizes before the clock
                       starts; with --compile its VAE decode is captured and compiled too (--decode-graphs)
           d           PixArtSigmaPipeline with static batching: the first queued request and the queued
                       requests of its size (first come first served across sizes), up to 32 images per
                       call, waiting at most 0.1 s for more; one prompt per image in the call's list
         images/s and p50/p99 latency at each offered load, the maximum sustained images/s (a backlog
         queued at t=0 run to completion), and the graph pool of the three shapes.
Targets: e2e ours <= 0.3x diffusers at 512 and <= 0.9x at 1024; mixed max sustained a >= 2x d.

    python bench/pixart.py                                      # on a GPU: everything (~5 min)
    python bench/pixart.py --resolutions 1024 --sections step e2e
                                                                # a part: merged into the report in --out
    python bench/pixart.py --smoke --out /tmp/pixart            # seconds, on a CPU: every section, tiny PixArt

Mixed options: --loads (offered images/s, default 2 4 6), --window (seconds of arrivals per load, 10),
--cross-attention (system a's; default the engine's). --fresh starts a new report instead of merging.

Writes pixart.json and pixart.md (pixart_smoke.* with --smoke) under --out after every section, so a run
cut short keeps what it measured; a report there from the same GPU and versions keeps the sections this
run does not redo.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workers import admission
from workers.families.pixart import DEFAULT_CROSS_ATTENTION

# engine_throughput's summaries (images/s, censored latency percentiles, "sustained"), shared
_spec = importlib.util.spec_from_file_location("engine_throughput", Path(__file__).parent / "engine_throughput.py")
et = sys.modules.setdefault("engine_throughput", importlib.util.module_from_spec(_spec))
if not hasattr(et, "summarise"):
    _spec.loader.exec_module(et)

SECTIONS = ("step", "e2e", "mixed")
BACKENDS = ("eager", "full", "breakable")
CROSS_ATTENTION = ("padded", "varlen")
E2E_TARGETS = {512: 0.3, 1024: 0.9}  # ours / diffusers, one image end to end
MIXED_TARGET = 2.0                    # max sustained a / d


@dataclass(frozen=True)
class Setup:
    """What a run measures and for how long: the GPU run's settings, or ``smoke()``'s."""

    steps: int = 20
    guidance: float = 4.5
    batches: dict = field(default_factory=lambda: {512: (1, 2, 4, 8, 16, 32), 1024: (1, 2, 4, 8)})
    iters: tuple[int, int] = (20, 8)  # timed steps at small and at large batches
    e2e_reps: int = 5
    e2e_max_batch: int = 8
    binning: bool = True              # diffusers' use_resolution_binning (the tiny model has no bins)
    mixed_res: int = 512
    mixed_sizes: tuple = ((512, 512), (512, 768), (768, 512))  # (width, height) asked
    max_batch: int = 32               # mixed: images in flight (a), images per pipeline call (d)
    wait_s: float = 0.1
    window_s: float = 10.0
    drain_s: float = 5.0
    loads: tuple = (2.0, 4.0, 6.0)    # offered images/s
    backlog_stop_s: float = 150.0
    cross_attention: str = DEFAULT_CROSS_ATTENTION  # mixed: system a's cross-attention (the engine's default)
    compile: str = "off"              # our engines' steps: "inductor" compiles them inside the graphs
    precision: str = "bf16"           # "fp8": the model's block linears as FP8 products (workers/fp8.py)
    decode_graphs: str = "auto"       # mixed: system a's VAE decode captured: "on" | "off" | "auto" (with compile)
    overlap_finish: bool = False      # mixed: system a's finished images handed out a step later, their decode
                                      # and copies overlapping that step (EngineConfig.overlap_finish)


COMPILE_CHOICES = ("off", "inductor", "inductor-blocks")  # --compile: -blocks compiles the transformer's blocks


def compile_kwargs(mode: str) -> dict:
    """EngineConfig's compile settings for a --compile choice."""
    return {"compile": "off" if mode == "off" else "inductor",
            "compile_scope": "blocks" if mode.endswith("-blocks") else "step"}


def mixed_decode_graphs(s) -> bool:
    """Whether a mixed run's engine captures its VAE decode (``s.decode_graphs``): "auto" when its step is
    compiled, and then the decode is compiled too (on an H200 8 FLUX.1 decodes at 512 px took 60.8 ms
    compiled and captured against 110.6 plain, where captured alone took 120.8; docs/design.md, "The VAE
    decode in graphs"); its cold compile adds about a minute per size to the warm-up."""
    return s.decode_graphs == "on" or (s.decode_graphs == "auto" and s.compile != "off")


def tuned_suffix(compile_mode: str, precision: str) -> str:
    """The report's name suffix for a tuned run ("_inductor", "_fp8", "_inductor_fp8"; "" for the default),
    so tuned and default figures never merge into one report."""
    return "".join(f"_{x}" for x in (compile_mode, precision) if x not in ("off", "bf16"))


def smoke() -> Setup:
    """Every section in seconds on a CPU, on workers.models.tiny_pixart (16x16 native)."""
    return Setup(batches={16: (1, 2, 4)}, iters=(3, 3), e2e_reps=2, binning=False, mixed_res=16,
                 mixed_sizes=((16, 16), (32, 16), (16, 32)), max_batch=8, wait_s=0.02, window_s=1.0, drain_s=4.0,
                 loads=(20.0,), backlog_stop_s=60.0)


# -- prompts and workload --------------------------------------------------------------------------
STYLES = ("watercolor painting", "photograph", "oil painting", "pencil sketch", "3d render", "studio photo",
          "ink illustration", "pixel art", "film still", "poster")
SUBJECTS = ("a red fox", "an old lighthouse", "a bowl of ramen", "a vintage bicycle", "a snow leopard", "a tiny robot",
            "a glass teapot", "a medieval castle", "a koi pond", "a hot air balloon", "a sleeping cat",
            "a wooden sailboat", "an astronaut", "a field of sunflowers", "a steam locomotive", "a paper lantern",
            "a mountain village", "a jazz trio", "a stack of books", "a crystal cave")
PLACES = ("on a misty hill", "in a busy market", "under a starry sky", "by a frozen lake", "in a sunlit kitchen",
          "at the edge of a forest", "on a rainy street", "inside an old library", "above the clouds",
          "in a desert at dusk")
LIGHTS = ("golden hour light", "soft morning light", "dramatic shadows", "neon glow", "overcast", "candlelight",
          "high contrast", "pastel colors", "cinematic lighting", "vivid colors")


def make_prompts(n: int = 200, seed: int = 0) -> list[str]:
    """``n`` distinct prompts, seeded: style, subject, place, and a light half the time (15-32 T5 tokens
    with the built-in tokenizer, </s> included)."""
    rng, out = random.Random(seed), {}
    while len(out) < n:
        p = f"{rng.choice(STYLES)} of {rng.choice(SUBJECTS)} {rng.choice(PLACES)}"
        out.setdefault(p + (f", {rng.choice(LIGHTS)}" if rng.random() < 0.5 else ""), None)
    return list(out)


@dataclass
class Job:
    """A request: ``n`` images of one prompt (index into the prompt list) at one asked size."""

    id: int
    arrival: float
    n: int
    size: tuple[int, int]  # (width, height) asked
    prompt: int
    done_images: int = 0
    finished: float | None = None


MEAN_SIZE = 3.15  # mean request size of the mix: 0.7 * 1 + 0.25 * 5 + 0.05 * 24


def make_jobs(load: float, seed: int, sizes: tuple, prompts: int, window_s: float) -> list[Job]:
    """As engine_throughput.make_jobs (the Poisson count the load implies, arrivals uniform in the window,
    request sizes in blocks of 20 that hold the mix exactly: 14 of 1, 5 of 2-8, one of 16-32), with image
    sizes in shuffled blocks of the three (1:1:1 by request) and a prompt index each."""
    rng = random.Random(seed)
    count = max(1, round(load * window_s / MEAN_SIZE))
    ns: list[int] = []
    while len(ns) < count:
        block = [1] * 14 + [rng.randint(2, 8) for _ in range(5)] + [rng.randint(16, 32)]
        rng.shuffle(block)
        ns += block
    shapes: list = []
    while len(shapes) < count:
        shapes += rng.sample(list(sizes), len(sizes))
    times = sorted(rng.uniform(0.0, window_s) for _ in range(count))
    return [Job(i, t, n, tuple(shapes[i]), rng.randrange(prompts)) for i, (t, n) in enumerate(zip(times, ns))]


def backlog(sizes: tuple, prompts: int, seed: int = 99) -> list[Job]:
    """60 requests queued at t=0: the mix exactly (14 of 1, then 2, 4, 5, 6, 8 and 24, the mean of 16-32)
    three times, each time at the next size, so every size gets every request size once: 189 images,
    63 per size."""
    rng = random.Random(seed)
    ns = [1] * 14 + [2, 4, 5, 6, 8, 24]
    rng.shuffle(ns)
    return [Job(r * len(ns) + k, 0.0, n, tuple(sizes[(k + r) % len(sizes)]), rng.randrange(prompts))
            for r in range(len(sizes)) for k, n in enumerate(ns)]


def static_batch(pending: list[Job], now: float, max_images: int) -> list[Job]:
    """System d's next pipeline call: the first queued request, then the queued requests of its size in
    arrival order that still fit within ``max_images`` (a larger first request runs alone)."""
    if not pending or pending[0].arrival > now:
        return []
    batch, total = [pending[0]], pending[0].n
    for j in pending[1:]:
        if j.arrival <= now and j.size == batch[0].size and total + j.n <= max_images:
            batch.append(j)
            total += j.n
    return batch


# -- helpers -----------------------------------------------------------------------------------------
def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median wall time of fn() in ms, synchronised, as step_latency.cuda_ms (a CPU run too)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def repeat_ms(fn, reps: int) -> list[float]:
    """fn(0) once untimed (a warm-up), then fn(1..reps) timed: ms each, synchronised."""
    out = []
    for i in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        fn(i)
        sync()
        if i:
            out.append(round((time.perf_counter() - t0) * 1e3, 2))
    return out


def baseline(model, load_plain):
    """What diffusers' side runs, as a zero-argument loader: None (``model`` itself) when ours is plain;
    when ours runs FP8 linears (they replace the transformer's modules in place), a function returning the
    same model with a plain bf16 transformer from ``load_plain()`` (the same seeded weights), so the
    baseline is diffusers as users run it. Each section loads it when diffusers' turn comes and drops it
    after, so neither our runs nor the memory section share the GPU with a second transformer."""
    import copy

    if getattr(model, "precision", "bf16") == "bf16":
        return None

    def load():
        ref = copy.copy(model)  # the family's extra modules (SD3's and FLUX's further encoders) come along
        ref.transformer, ref.precision, ref.fp8_linears = load_plain().transformer, "bf16", 0
        return ref

    return load


def pipeline(model):
    """diffusers' PixArtSigmaPipeline over the loaded model's modules, with PixArt-Σ's scheduler."""
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline

    pipe = PixArtSigmaPipeline(tokenizer=model.tokenizer, text_encoder=model.text_encoder, vae=model.vae,
                               transformer=model.transformer,
                               scheduler=DPMSolverMultistepScheduler.from_config(model.card.scheduler))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_pipeline(pipe, model, prompts: list[str], size: tuple[int, int], s: Setup, seed: int):
    """One pipeline call: one image per prompt at ``size`` (width, height), pixels out as numpy."""
    w, h = size
    return pipe(prompts, negative_prompt="", num_inference_steps=s.steps, guidance_scale=s.guidance, height=h,
                width=w, max_sequence_length=model.card.max_tokens, clean_caption=False,
                use_resolution_binning=s.binning, output_type="np",
                generator=torch.Generator().manual_seed(seed)).images


# -- section 1: one denoising step --------------------------------------------------------------------
def live_inputs(model, batch: int, prompts: list[str], s: Setup) -> dict[str, torch.Tensor]:
    """Our step's inputs for ``batch`` images at step 10 of a DPM++ 2M plan (a second-order update), with
    the family's encodings of ``batch`` prompts."""
    from samplers import gather_rows, make_plan
    from workers.families import family_of
    from workers.spec import ItemSpec

    dev = model.device
    plan = make_plan("dpmpp_2m", s.steps, model.schedule)
    t, coeffs = gather_rows([plan] * batch, [min(10, s.steps - 1)] * batch)
    specs = [ItemSpec(id=str(i), seed=i, sampler="dpmpp_2m", steps=s.steps, guidance=s.guidance,
                      prompt=prompts[i % len(prompts)]) for i in range(batch)]
    conds = family_of(model).encode(model, specs)
    x = torch.randn(batch, *model.latent_shape, device=dev)
    return dict(x=x, t=t.to(dev), coeffs=coeffs.to(dev), guidance=torch.full((batch,), s.guidance, device=dev),
                hist=torch.zeros_like(x), noise=torch.zeros_like(x),
                **{k: torch.stack([c[k] for c in conds]) for k in conds[0]})


def diffusers_step(model, inp: dict, s: Setup):
    """One iteration of PixArtSigmaPipeline.__call__'s denoising loop, as diffusers writes it, at the same
    step. The scheduler counts its steps itself (``_step_index``), so each call sets the count back."""
    from diffusers import DPMSolverMultistepScheduler

    sched = DPMSolverMultistepScheduler.from_config(model.card.scheduler)
    sched.set_timesteps(s.steps, device=model.device)
    index = min(10, s.steps - 1)
    t, c = sched.timesteps[index], model.latent_shape[0]
    latents = inp["x"].to(model.dtype)  # the pipeline's latents are in the text encoder's dtype
    embeds = torch.cat([inp["neg_embeds"], inp["prompt_embeds"]])  # (2B, L, D): negative first, as the pipeline
    mask = torch.cat([inp["neg_mask"], inp["prompt_mask"]])        # (2B, L)
    added_cond_kwargs = {"resolution": None, "aspect_ratio": None}

    def step():
        sched._step_index = index
        latent_model_input = sched.scale_model_input(torch.cat([latents] * 2), t)
        current_timestep = t[None].to(latent_model_input.device).expand(latent_model_input.shape[0])
        noise_pred = model.transformer(latent_model_input, encoder_hidden_states=embeds, encoder_attention_mask=mask,
                                       timestep=current_timestep, added_cond_kwargs=added_cond_kwargs,
                                       return_dict=False)[0]
        noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
        noise_pred = noise_pred_uncond + s.guidance * (noise_pred_text - noise_pred_uncond)
        if model.transformer.config.out_channels // 2 == c:  # learned sigma
            noise_pred = noise_pred.chunk(2, dim=1)[0]
        return sched.step(noise_pred, t, latents, return_dict=False)[0]

    return step


def build_runner(model, backend: str, max_batch: int):
    """As step_latency.build_runner, for PixArt at its native latent shape."""
    from graphs import GraphRunner
    from workers.engine import step_specs
    from workers.families import family_of

    shape = tuple(model.latent_shape)
    inputs, outputs = step_specs(model, shape)
    return GraphRunner(family_of(model).make_step(model, shape), inputs, outputs, max_batch=max_batch,
                       backend=backend, device=model.device)


def iters_for(s: Setup, batch: int, res: int) -> int:
    return s.iters[0] if batch * max(1, res // 512) ** 2 <= 4 else s.iters[1]


def bench_step(model, res: int, s: Setup, prompts: list[str], ref=None) -> dict:
    """Section 1. The runners' max batch is the largest batch measured; the cross-attention mode is set
    before a runner is built (its captures hold the processors) and "padded" restored after it. ``ref``:
    the model diffusers runs (``baseline``), when it is not ``model``."""
    from workers.families import pixart

    batches = s.batches[res]
    block = {"model": model.name, "batches": list(batches), "rows": [], "capture_s": {}, "pool_mb": {},
             "totals": {}, "prompt_tokens": _token_counts(model, prompts[:max(batches)])}
    inputs = {b: live_inputs(model, b, prompts, s) for b in batches}
    pixart.set_cross_attention(model, "padded")
    base = ref() if ref else model
    with torch.no_grad():
        for b in batches:
            ms = timed_ms(diffusers_step(base, inputs[b], s), iters_for(s, b, res))
            block["rows"].append(dict(batch=b, backend="diffusers", cross_attention="padded", ms=round(ms, 3)))
    del base
    free()
    with torch.no_grad():
        for mode in CROSS_ATTENTION:
            for backend in BACKENDS:
                try:
                    pixart.set_cross_attention(model, mode)
                    _time_runner(model, backend, mode, inputs, block, s, res)
                finally:
                    pixart.set_cross_attention(model, "padded")
                    free()
    return block


def _time_runner(model, backend: str, mode: str, inputs: dict, block: dict, s: Setup, res: int) -> None:
    key = f"{backend}/{mode}"
    runner = build_runner(model, backend, max(inputs))
    t0 = time.perf_counter()
    runner.warmup(example=inputs[max(inputs)])  # real prompts' masks in the static inputs, not zeros
    sync()
    block["capture_s"][key] = round(time.perf_counter() - t0, 3)
    block["pool_mb"][key] = round(runner.stats()["pool_reserved_bytes"] / 2**20, 1)
    for b, inp in inputs.items():
        ms = timed_ms(lambda: runner.run(**inp), iters_for(s, b, res))
        block["rows"].append(dict(batch=b, backend=backend, cross_attention=mode, ms=round(ms, 3)))
    block["totals"][key] = {"backend": runner.backend, **runner.stats()["totals"]}  # graphs: no eager_fallbacks


def _token_counts(model, prompts: list[str]) -> dict:
    n = [sum(model.tokenizer(p.lower().strip()).attention_mask) for p in prompts]
    return {"min": min(n), "median": statistics.median(n), "max": max(n), "padded_to": model.card.max_tokens}


# -- section 2: one image end to end -----------------------------------------------------------------
def host_loop_s(n: int = 3_000_000) -> float:
    """Seconds of a plain Python loop on this host: diffusers' pipelines launch their kernels from Python,
    so at small images their time follows the host's CPU (the H200 hosts measured so far differ 1.8x)."""
    t0, acc = time.perf_counter(), 0
    for i in range(n):
        acc += i * i % 7
    return round(time.perf_counter() - t0, 3)


def host_line(block: dict) -> str:
    return f"host Python loop (3M iterations) {block['host_loop_s']} s" if "host_loop_s" in block else ""


def bench_e2e(model, s: Setup, prompts: list[str], ref=None) -> dict:
    """Section 2: a prompt never seen before in every run (and the encoding cache cleared), so both
    systems encode the prompt and "" each time; ours warmed (graphs captured) before the first run."""
    from workers.families import pixart

    fresh = iter(prompts)
    block = {"model": model.name, "size": list(model.card.native_size), "steps": s.steps, "guidance": s.guidance,
             "runs_ms": {}, "host_loop_s": host_loop_s()}
    for mode in CROSS_ATTENTION:
        try:
            block["runs_ms"][f"ours/{mode}"], block.setdefault("compiles", {})[mode] = _ours_e2e(model, mode, s, fresh)
        finally:
            pixart.set_cross_attention(model, "padded")  # before any diffusers call
            free()
    pipe = pipeline(ref() if ref else model)
    size = model.card.native_size
    block["runs_ms"]["diffusers"] = repeat_ms(lambda i: call_pipeline(pipe, model, [next(fresh)], size, s, i),
                                              s.e2e_reps)
    block["ms"] = {k: round(statistics.median(v), 1) for k, v in block["runs_ms"].items()}
    block["ratio"] = {m: round(block["ms"][f"ours/{m}"] / block["ms"]["diffusers"], 3) for m in CROSS_ATTENTION}
    return block


def _ours_e2e(model, mode: str, s: Setup, fresh) -> tuple[list[float], dict]:
    """ms per image, and what was compiled and captured: the step's and the decode's compile counters, the
    text encoder's captured lengths."""
    from workers.engine import Engine, EngineConfig
    from workers.spec import ItemSpec

    engine = Engine(model, EngineConfig(backend="breakable", max_batch=s.e2e_max_batch, cross_attention=mode,
                                        decode_graphs=True, **compile_kwargs(s.compile)))
    engine.warmup()

    def one(i):
        model.cache.clear()
        engine.generate([ItemSpec(id=str(i), seed=i, sampler="dpmpp_2m", steps=s.steps, guidance=s.guidance,
                                  prompt=next(fresh))])

    runs = repeat_ms(one, s.e2e_reps)
    (group,) = engine.stats()["groups"].values()
    compiled = {k: {n: group[k][n] for n in ("graphs", "one_row_graphs", "compile_s", "fallback_reason")}
                for k in ("compile", "decode_compile") if k in group}
    graphs = model.text_graphs
    compiled["text_encoder_lengths"] = sorted(graphs.runners) if graphs is not None else []
    return runs, compiled


# -- section 3: mixed-size workload ------------------------------------------------------------------
def item_specs(model, job: Job, prompts: list[str], s: Setup) -> list:
    """A request's images for our engine: generated at the aspect-ratio bin the card snaps the asked size to
    (as the pipeline's resolution binning does), resized back to the asked size after decoding."""
    from workers.spec import ItemSpec

    w, h = job.size
    gw, gh = model.card.size_for(w, h)
    ow, oh = (w, h) if (gw, gh) != (w, h) else (0, 0)
    return [ItemSpec(id=f"{job.id}:{k}", seed=job.id * 1000 + k, sampler="dpmpp_2m", steps=s.steps,
                     guidance=s.guidance, prompt=prompts[job.prompt], width=gw, height=gh, out_width=ow,
                     out_height=oh) for k in range(job.n)]


class Timeline:
    """Where a run of system a spends the GPU's clock, without slowing it: a CUDA event (and the host's
    clock) at each boundary between the loop's phases, read after the run. The GPU time between two marks
    is the work the host queued in the first phase plus any time the GPU sat waiting for it, so the phases
    add up to the run's wall time: "loop" (the benchmark's own bookkeeping), "admit" (``add_many``: plans,
    prompt encoding, uploads), "step" (the replays), and the finished images' "decode" (the VAE, its captured
    replays when the decode is in graphs) and "convert" (``workers.engine.decode_start``'s resizing, conversion
    to bytes and copy to the host, and the host's waits for them). Also counts the replays per bucket."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, object, float]] = []
        self.replays: dict[int, int] = {}
        self.steps = 0

    def mark(self, phase: str) -> None:
        ev = None
        if torch.cuda.is_available():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        self.marks.append((phase, ev, time.perf_counter()))

    def watch(self, engine) -> None:
        """Mark "decode" and "convert" in the engine's finishing of images (back to "step" after): the
        engine's ``_finish`` runs the VAE, then hands its pixels to the module's ``decode_start`` to convert
        (with ``overlap_finish`` the copies are waited for in the next step, and counted there)."""
        from workers import engine as eng

        plain, convert = engine._finish, eng.decode_start
        self._unwatch = (engine, convert)

        def finish(group, done):
            self.mark("decode")
            try:
                return plain(group, done)
            finally:
                self.mark("step")

        def converting(*args, **kwargs):
            self.mark("convert")
            return convert(*args, **kwargs)

        engine._finish = finish
        eng.decode_start = converting  # the engine's _finish (and decode) look it up when they run

    def unwatch(self) -> None:
        """The engine's own ``_finish`` and the module's own ``decode_start`` again (after ``watch``)."""
        from workers import engine as eng

        engine, eng.decode_start = self._unwatch
        del engine._finish

    def count(self, engine) -> None:
        """The replays the engine's next step runs (each group's plan for its rows)."""
        self.steps += 1
        for g in engine.groups.values():
            for b in g.runner.plan(len(g.active)) if g.active else ():
                self.replays[b] = self.replays.get(b, 0) + 1

    def summary(self) -> dict:
        sync()
        gpu: dict[str, float] = {}
        host: dict[str, float] = {}
        for (phase, a, ta), (_, b, tb) in zip(self.marks, self.marks[1:]):
            host[phase] = host.get(phase, 0.0) + (tb - ta) * 1000
            if a is not None:
                gpu[phase] = gpu.get(phase, 0.0) + a.elapsed_time(b)
        r = lambda d: {k: round(v, 1) for k, v in d.items()}
        return {"gpu_ms": r(gpu), "host_ms": r(host), "steps": self.steps,
                "replays": {str(k): v for k, v in sorted(self.replays.items())}}


def run_engine(engine, model, jobs: list[Job], prompts: list[str], s: Setup, stop_s: float,
               timeline: Timeline | None = None) -> None:
    """System a, as engine_throughput.run_engine at step level: arrived images join at any step boundary,
    the queue's head first, then images of the shapes in flight (``workers.admission``, as the
    service's lease), while fewer than ``max_batch`` are in flight (encoded together on admission).
    ``timeline``: marks the phases (``Timeline``)."""
    pending, start, by_id = list(jobs), time.perf_counter(), {j.id: j for j in jobs}
    queue: list = []  # arrived images not yet in the engine
    mark = timeline.mark if timeline is not None else (lambda phase: None)
    mark("loop")
    while pending or queue or engine.num_active or engine.num_finishing:
        now = time.perf_counter() - start
        if now > stop_s:
            for rid in list(engine.progress()):  # leave the engine empty for the next point
                engine.cancel(rid)
            return
        while pending and pending[0].arrival <= now:
            queue += item_specs(model, pending.pop(0), prompts, s)
        admit = max(0, s.max_batch - engine.num_active)
        if admit and queue:  # as the service leases: shape-aware (workers.admission)
            mark("admit")
            started = admission.take(queue, admit, engine.in_flight_shapes(), capacity=s.max_batch)
            if started:  # none while a small group is held back (rule 4)
                engine.add_many(started)
            mark("loop")
        if engine.num_active == 0 and not engine.num_finishing:
            time.sleep(max(0.0, min(0.005, pending[0].arrival - now)) if pending else 0.0)
            continue
        if timeline is not None:
            timeline.count(engine)
        mark("step")
        results = engine.step()
        mark("loop")
        for r in results:
            j = by_id[int(r.request.id.split(":")[0])]
            j.done_images += 1
            if j.done_images == j.n:
                if not s.overlap_finish:  # as measured before; overlapped, the GPU is running the next step
                    sync()                # and the images are on the host already: no wait
                j.finished = time.perf_counter() - start


def run_static(pipe, model, jobs: list[Job], prompts: list[str], s: Setup, stop_s: float) -> None:
    """System d: ``static_batch`` once the first queued request has waited ``wait_s`` or the call is full;
    one pipeline call per batch, one prompt per image."""
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
            batch = static_batch(pending, now, s.max_batch)
            if sum(j.n for j in batch) >= s.max_batch or now >= batch[0].arrival + s.wait_s:
                break
            time.sleep(0.002)
        for j in batch:
            pending.remove(j)
        call_pipeline(pipe, model, [prompts[j.prompt] for j in batch for _ in range(j.n)], batch[0].size, s,
                      seed=batch[0].id)
        sync()
        for j in batch:
            j.finished = time.perf_counter() - start


def bench_mixed(model, s: Setup, prompts: list[str], save, ref=None) -> dict:
    """Section 3: system a's backlog and load points, then d's (the engine is dropped and "padded" restored
    before any diffusers call); ``save(block)`` after each figure. The encoding cache is cleared before
    every run of a, so each run pays for the prompts it meets first."""
    from workers.engine import Engine, EngineConfig
    from workers.families import pixart

    made = [model.card.size_for(w, h) for w, h in s.mixed_sizes]
    block = {"model": model.name, "sizes": [list(x) for x in s.mixed_sizes], "made_sizes": [list(x) for x in made],
             "steps": s.steps, "guidance": s.guidance, "max_batch": s.max_batch, "wait_s": s.wait_s,
             "window_s": s.window_s, "drain_s": s.drain_s, "cross_attention": s.cross_attention,
             "backlog_images": sum(j.n for j in backlog(s.mixed_sizes, len(prompts))),
             "rows": [], "max_images_per_s": {}, "decode_graphs": mixed_decode_graphs(s), "decode": decode_kind(s),
             "overlap_finish": s.overlap_finish}
    engine = Engine(model, EngineConfig(backend="breakable", max_batch=s.max_batch, cross_attention=s.cross_attention,
                                        decode_graphs=block["decode_graphs"], overlap_finish=s.overlap_finish,
                                        **compile_kwargs(s.compile)))
    try:
        t0 = time.perf_counter()
        engine.warmup(sizes=made)
        sync()
        block["warmup_s"] = round(time.perf_counter() - t0, 2)
        pool = sum(g.runner.stats()["pool_reserved_bytes"] for g in engine.groups.values())  # one pool, shared
        block["pool_mb"] = round(pool / 2**20, 1)
        block["groups"] = len(engine.groups)
        # each shape's measured ms per replay by bucket: what the splitter weighs padding against more replays by
        block["replay_ms"] = {"x".join(map(str, g.shape)): {str(b): round(ms, 3) for b, ms in g.runner.replay_ms.items()}
                              for g in engine.groups.values()}
        for load, jobs, stop in _runs(s, len(prompts)):
            model.cache.clear()
            timeline = Timeline() if load == float("inf") else None
            if timeline is not None:
                timeline.watch(engine)
            try:
                run_engine(engine, model, jobs, prompts, s, stop, timeline)
            finally:
                if timeline is not None:
                    timeline.unwatch()
            if timeline is not None:
                block["backlog_a_phases"] = timeline.summary()
            _record(block, "a", load, jobs, stop, s, save)
        block["padding_fraction"] = round(engine.padded_rows / max(1, engine.padded_rows + engine.real_rows), 4)
    finally:
        del engine
        pixart.set_cross_attention(model, "padded")
        free()
    pipe = pipeline(ref() if ref else model)
    for load, jobs, stop in _runs(s, len(prompts)):
        run_static(pipe, model, jobs, prompts, s, stop)
        _record(block, "d", load, jobs, stop, s, save)
    return block


def _runs(s: Setup, prompts: int):
    """The backlog (load inf), then each load point, with the same seeded arrivals for both systems."""
    yield float("inf"), backlog(s.mixed_sizes, prompts), s.backlog_stop_s
    for load in s.loads:
        yield load, make_jobs(load, int(load * 1000) + 7, s.mixed_sizes, prompts, s.window_s), s.window_s + s.drain_s


def _record(block: dict, system: str, load: float, jobs: list[Job], stop: float, s: Setup, save) -> None:
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


# -- the report --------------------------------------------------------------------------------------
def targets(result: dict) -> list[dict]:
    """The targets, checked on whatever sections the result holds."""
    out = []
    for res, block in sorted(result.get("e2e", {}).items(), key=lambda kv: int(kv[0])):
        limit = E2E_TARGETS.get(int(res))
        for mode, ratio in sorted(block.get("ratio", {}).items()):
            if limit is not None:
                out.append({"target": f"e2e {res}: ours ({mode}) <= {limit}x diffusers", "value": ratio,
                            "met": ratio <= limit})
    ratio = result.get("mixed", {}).get("ratio_max")
    if ratio is not None:
        out.append({"target": f"mixed: max sustained a >= {MIXED_TARGET}x d", "value": ratio,
                    "met": ratio >= MIXED_TARGET})
    return out


def markdown(result: dict) -> str:
    lines = [f"# PixArt-Σ on {result['gpu']} (torch {result['torch']}, diffusers {result['diffusers']})", "",
             "`python bench/pixart.py " + " ".join(result["argv"]) + "` (latest run)", ""]
    cols = ["diffusers"] + [f"{b}/{m}" for m in CROSS_ATTENTION for b in BACKENDS]
    for res, block in sorted(result.get("step", {}).items(), key=lambda kv: int(kv[0])):
        lines += [f"## One CFG step, {block['model']} (ms, median; batch = images)", "",
                  "| batch | " + " | ".join(cols) + " | diffusers / best |", "|---|" + "---|" * (len(cols) + 1)]
        for b in block["batches"]:
            ms = {("diffusers" if r["backend"] == "diffusers" else f"{r['backend']}/{r['cross_attention']}"): r["ms"]
                  for r in block["rows"] if r["batch"] == b}
            best = min((v for k, v in ms.items() if k != "diffusers"), default=None)
            ratio = f"{ms['diffusers'] / best:.2f}x" if best and "diffusers" in ms else ""
            lines.append(f"| {b} | " + " | ".join(f"{ms[c]:.2f}" if c in ms else "" for c in cols) + f" | {ratio} |")
        lines += ["", "Capture s: " + ", ".join(f"{k} {v}" for k, v in block["capture_s"].items()),
                  "", "Graph pool MiB: " + ", ".join(f"{k} {v}" for k, v in block["pool_mb"].items()),
                  "", f"Prompt tokens: {block['prompt_tokens']}", ""]
    if result.get("e2e"):
        lines += ["## One image end to end (ms, median)", "", "| model | ours padded | ours varlen | diffusers | "
                  "padded / diffusers | varlen / diffusers |", "|---|---|---|---|---|---|"]
        for res, b in sorted(result["e2e"].items(), key=lambda kv: int(kv[0])):
            ms, r = b["ms"], b["ratio"]
            lines.append(f"| {b['model']} | {ms['ours/padded']} | {ms['ours/varlen']} | {ms['diffusers']} | "
                         f"{r['padded']}x | {r['varlen']}x |")
        hosts = [f"{b['model']}: {host_line(b)}" for b in result["e2e"].values() if host_line(b)]
        lines += ["", "; ".join(hosts)] if hosts else []
        lines.append("")
    if result.get("mixed"):
        lines += _mixed_markdown(result["mixed"])
    lines += ["## Targets", "", "| target | value | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['value']} | {'yes' if t['met'] else 'no'} |" for t in targets(result)]
    return "\n".join(lines) + "\n"


def _mixed_markdown(m: dict) -> list[str]:
    return mixed_markdown(m, f"Sizes asked {m['sizes']}, generated at {m['made_sizes']}; a: our engine "
                             f"({m['cross_attention']} cross-attention, at most {m['max_batch']} in flight"
                             f"{decode_note(m)}); d: "
                             f"PixArtSigmaPipeline, static batches of one size up to {m['max_batch']} images.")


def decode_kind(s) -> str:
    """How a mixed run's engine decodes: "compiled and captured", "captured" or "eager"."""
    if not mixed_decode_graphs(s):
        return "eager"
    return "compiled and captured" if s.compile != "off" else "captured"


def decode_note(m: dict) -> str:
    """", decode <how>" when a mixed run's engine captured its decode ("" for an eager one, or a report from
    before the field)."""
    return f", decode {m['decode']}" if m.get("decode", "eager") != "eager" else ""


def mixed_markdown(m: dict, systems: str) -> list[str]:
    """The mixed section's report: ``systems`` says what a and d are (bench/mmdit.py uses it too)."""
    lines = [f"## Mixed sizes, {m['model']}", "",
             f"{systems} {m['window_s']} s of arrivals per load, {m['drain_s']} s to drain.",
             "", "| system | offered img/s | arrived img/s | done img/s | p50 ms | p99 ms | unfinished | sustained |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['system']} | {r['offered_images_per_s']:g} | {r.get('arrived_images_per_s', '')} | "
              f"{r['images_per_s']} | {r['p50_ms']} | {r['p99_ms']} | {r['unfinished']}/{r['requests']} | "
              f"{'yes' if et.sustained(r) else 'no'} |" for r in m["rows"]]
    lines += ["", f"Max sustained img/s ({m['backlog_images']} images queued at t=0): "
              + ", ".join(f"{k} {v}" for k, v in m["max_images_per_s"].items())
              + (f"; a / d {m['ratio_max']}x" if "ratio_max" in m else ""),
              "", f"Graph pool of the {m.get('groups', '?')} shapes: {m.get('pool_mb', '?')} MiB; warm-up "
              f"{m.get('warmup_s', '?')} s; padding fraction (a) {m.get('padding_fraction', '?')}", ""]
    if "backlog_a_phases" in m:
        lines += phases_markdown(m["backlog_a_phases"])
    return lines


def phases_markdown(ph: dict) -> list[str]:
    """System a's backlog run by phase (``Timeline``)."""
    clock = ph["gpu_ms"] or ph["host_ms"]
    total = sum(clock.values()) or 1.0
    lines = [f"Where system a's backlog run went ({'GPU clock between the phases' if ph['gpu_ms'] else 'host clock'}; "
             f"{ph['steps']} steps; replays per bucket "
             + ", ".join(f"{b}: {n}" for b, n in ph["replays"].items()) + "):", "",
             "| phase | GPU ms | host ms | share |", "|---|---|---|---|"]
    lines += [f"| {k} | {ph['gpu_ms'].get(k, '-')} | {ph['host_ms'].get(k, '-')} | {v / total:.1%} |"
              for k, v in sorted(clock.items(), key=lambda kv: -kv[1])]
    if "decode" in clock:  # earlier reports had the two as one phase, "finish"
        both = lambda d: round(d.get("decode", 0.0) + d.get("convert", 0.0), 1) if d else "-"  # noqa: E731
        lines.append(f"| finish (decode + convert) | {both(ph['gpu_ms'])} | {both(ph['host_ms'])} | "
                     f"{(clock.get('decode', 0.0) + clock.get('convert', 0.0)) / total:.1%} |")
    return lines + [""]


def previous(path: Path, head: dict, fresh: bool) -> dict:
    """The report at ``path`` from earlier runs on the same GPU and versions (parts run separately make one
    report; each section's block records the command that measured it), or a new one."""
    if fresh or not path.exists():
        return dict(head)
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError:
        return dict(head)
    if any(old.get(k) != head[k] for k in ("gpu", "torch", "diffusers")):
        print(f"{path} is from another machine or versions: starting a new report", flush=True)
        return dict(head)
    return {**old, **head}


def write(result: dict, out: Path, name: str) -> None:
    result["targets"] = targets(result)
    text = json.dumps(result, indent=1, default=str) + "\n"
    (out / f"{name}.json").write_text(text)
    (out / f"{name}.md").write_text(markdown(result))


def plan_models(sections: list[str], resolutions: list[int], mixed_res: int) -> list[tuple[int, list[str]]]:
    """(resolution, sections) per model load, in order: step and e2e at every resolution asked, mixed at
    ``mixed_res`` (loaded for it alone when not among them); one model in memory at a time."""
    out = [(r, [x for x in SECTIONS if x in sections and (x != "mixed" or r == mixed_res)])
           for r in sorted(set(resolutions))]
    if "mixed" in sections and mixed_res not in resolutions:
        out.append((mixed_res, ["mixed"]))
    return [(r, xs) for r, xs in out if xs]


def main(argv: list[str] | None = None) -> None:
    import diffusers

    from workers.loading import load_model

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    p.add_argument("--resolutions", type=int, nargs="+", default=[512, 1024], choices=[512, 1024])
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    p.add_argument("--smoke", action="store_true", help="every section in seconds on a tiny random PixArt (CPU)")
    p.add_argument("--loads", type=float, nargs="+", help="mixed: offered loads in images/s (default 2 4 6)")
    p.add_argument("--window", type=float, help="mixed: seconds of arrivals per load (default 10)")
    p.add_argument("--cross-attention", choices=CROSS_ATTENTION, default=Setup.cross_attention,
                   help="mixed: system a's (default: the engine's)")
    p.add_argument("--fresh", action="store_true", help="start a new report instead of merging into the one in --out")
    p.add_argument("--compile", choices=COMPILE_CHOICES, default="off", help="our engines' steps compiled "
                   "(inductor-blocks: the transformer's blocks, one graph per block class)")
    p.add_argument("--precision", choices=["bf16", "fp8"], default="bf16", help="our model's block linears")
    p.add_argument("--decode-graphs", choices=["auto", "on", "off"], default="auto", help="mixed: system a's VAE "
                   "decode captured (auto: with --compile, compiled too; each size's cold compile takes about a minute)")
    p.add_argument("--overlap-finish", action="store_true", help="mixed: system a hands finished images out a step "
                   "later, their decode and copies overlapping it (EngineConfig.overlap_finish); the report's name "
                   "gets _overlap")
    p.add_argument("--fp8-promoted-accum", action="store_true", help="with --precision fp8: the products without "
                   "cuBLASLt's fast accumulation (workers.fp8.FAST_ACCUM off); the report's name gets _promoted")
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        p.error("the benchmark needs a CUDA GPU (or --smoke, which runs on a CPU)")
    if args.fp8_promoted_accum:
        if args.precision != "fp8":
            p.error("--fp8-promoted-accum needs --precision fp8")
        from workers import fp8

        fp8.FAST_ACCUM = False
    s = smoke() if args.smoke else Setup()
    over = {"loads": tuple(args.loads) if args.loads else None, "window_s": args.window,
            "cross_attention": args.cross_attention, "compile": args.compile, "precision": args.precision,
            "decode_graphs": args.decode_graphs, "overlap_finish": args.overlap_finish or None}
    s = Setup(**{**s.__dict__, **{k: v for k, v in over.items() if v is not None}})
    if args.smoke:
        import tempfile

        from workers.models.tiny_pixart import make_tiny_pixart

        tiny = make_tiny_pixart(Path(tempfile.mkdtemp()) / "tiny-pixart")
        load, resolutions = (lambda res, precision=s.precision: load_model(tiny, precision=precision)), [s.mixed_res]
    else:
        load = lambda res, precision=s.precision: load_model(f"pixart-sigma-{res}", device="cuda",
                                                             dtype=torch.bfloat16, precision=precision)
        resolutions = args.resolutions
    name = ("pixart_smoke" if args.smoke else "pixart") + tuned_suffix(s.compile, s.precision) \
        + ("_promoted" if args.fp8_promoted_accum else "") + ("_overlap" if args.overlap_finish else "")
    head = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "diffusers": diffusers.__version__, "argv": argv}
    args.out.mkdir(parents=True, exist_ok=True)
    result = previous(args.out / f"{name}.json", head, args.fresh)
    prompts = make_prompts()
    t0 = time.perf_counter()
    for res, sections in plan_models(args.sections, resolutions, s.mixed_res):
        model = load(res)
        ref = baseline(model, lambda res=res: load(res, "bf16"))  # diffusers never runs our FP8 modules
        for section in sections:
            def save(block, section=section, res=res):
                block["argv"] = argv
                if section == "mixed":
                    result["mixed"] = block
                else:
                    result.setdefault(section, {})[str(res)] = block
                write(result, args.out, name)

            print(f"{section} {model.name} ...", flush=True)
            if section == "step":
                save(bench_step(model, res, s, prompts, ref))
            elif section == "e2e":
                save(bench_e2e(model, s, prompts, ref))
            else:
                save(bench_mixed(model, s, prompts, save, ref))
        del model, ref
        free()
    print(markdown(result))
    print(f"benchmark took {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
