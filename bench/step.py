"""One denoising step per system: its latency at each image count, and (``--profile``) where its GPU time goes.

For a model (a built-in with random weights made on the GPU, or a model directory; any family) and image
counts, each system (bench/harness.py's ``SYSTEMS``) runs one step of B images at the model's native size:

  diffusers      the loop body of the family's diffusers pipeline, as diffusers writes it (DiTPipeline,
                 PixArtSigmaPipeline, StableDiffusion3Pipeline, FluxPipeline): the transformer (CFG rows
                 doubled where the family doubles them), guidance, the scheduler's step; for the other
                 families (FLUX.2, Qwen-Image, Z-Image, Sana) the pipeline itself (``Family.reference_pipeline``)
                 at the card's defaults, each step timed between its step-end callbacks (``pipeline_step_ms``)
  torch.compile  the same loop body with the transformer wrapped in ``torch.compile``
  default, fast, fastest   our engine's runner, built and warmed as a worker builds it from the preset
                 (``harness.engine_config``), replaying its captured step

Inputs are what a request makes (the engine's warm-up example: a prompt or class 0, the card's sampler at its
middle step), tiled over B rows with seeded noise; the prompt encoded where --text-encoder-device says (the host,
for a model whose encoder and transformer do not fit one GPU together). Reported per system: median ms of a step
at each B (synchronised, its host work included) and its p10/p90, the warm-up (capture and compile) seconds, the
graph pool, and the largest difference of x_next from ``default``'s on the same inputs (relative to its norm: what
compile and FP8 change). Each B's work is counted once (``step_flops``: the floating-point operations of the
step's matrix products, convolutions and attention, by ``torch.utils.flop_counter`` over one eager step, CFG's
rows included), so each system's step also reads as TFLOP/s, against the peak of the device's bf16 matrix products
measured in the same run (``measured_peak``: an 8192-square product). ``--profile`` adds the step's kernels by
group (matrix products, attention, normalisation, fused/elementwise, copies) and the heaviest ten, from
torch.profiler (operators on a CPU).
Writes docs/benchmarks/step_<model>.{json,md}.

    python bench/step.py --model dit-xl-2-256 --images 1 64
    python bench/step.py --model flux-dev-1024 --images 1 --systems diffusers fast fastest --profile
    python bench/step.py --model flux2-dev-1024 --images 1 4 --systems diffusers default --text-encoder-device cpu
    python bench/step.py --smoke [--family pixart]     # a tiny random model of the family on a CPU, seconds
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

# kernel name -> group, first match wins (CUDA kernel names, and aten operator names on a CPU)
GROUPS = [
    # Inductor's own kernels (pointwise, reduction, persistent reduction) are never matrix products, whatever
    # their names list: "triton_red_fused__scaled_mm_..." is an FP8 quantization fused after a product
    ("normalisation", re.compile(r"^triton_(?:poi|red|per)_\w*norm")),
    ("fused / elementwise", re.compile(r"^triton_(?:poi|red|per)_")),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn.*(?:mha|sdpa)", re.I)),
    ("matrix products", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|^triton_tem_|scaled_mm|\bmm\b|addmm|matmul|bmm|linear", re.I)),
    ("normalisation", re.compile(r"norm", re.I)),
    ("copies", re.compile(r"copy|memcpy|memset|\bcat\b|catarray|clone|contiguous", re.I)),
    ("fused / elementwise", re.compile(r"triton|elementwise|vectorized|reduce|unrolled|gelu|silu|mul|add|div", re.I)),
]


# -- inputs ------------------------------------------------------------------------------------------
def step_inputs(engine, model, images: int) -> dict[str, torch.Tensor]:
    """B rows of the step's inputs: the engine's warm-up example (one request's conditioning, the card's
    sampler at its middle step) tiled, with seeded latents, noise and history per row."""
    shape = tuple(model.latent_shape)
    row = engine.warmup_example(model, shape)
    gen = torch.Generator().manual_seed(images)
    out = {k: v.expand(images, *v.shape[1:]).contiguous() for k, v in row.items()}
    for k in ("x", "noise", "hist"):
        out[k] = torch.randn(images, *shape, generator=gen).to(model.device)
    return out


# -- diffusers' loop bodies ----------------------------------------------------------------------------
def _scheduler(model, steps: int):
    """The family's diffusers scheduler, set to ``steps`` (FLUX.1's sigma grid and mu as FluxPipeline sets them)."""
    import numpy as np
    from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    family, config = model.card.family, dict(model.card.scheduler or {})
    if family == "dit":
        sched = DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear", clip_sample=False)
    elif family == "pixart":
        sched = DPMSolverMultistepScheduler.from_config(config)
    else:
        sched = FlowMatchEulerDiscreteScheduler.from_config({k: v for k, v in config.items() if k != "flow_grid"})
    extra = {}
    if family in ("sd3", "flux"):
        cfg, (_, h, w) = sched.config, model.latent_shape
        mu = calculate_shift((h // 2) * (w // 2), cfg.get("base_image_seq_len", 256),
                             cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        extra = {"mu": mu} if cfg.get("use_dynamic_shifting") else {}
    if family == "flux":
        sched.set_timesteps(device=model.device, sigmas=np.linspace(1.0, 1 / steps, steps), **extra)
    else:
        sched.set_timesteps(steps, device=model.device, **extra)
    return sched


LOOP_BODIES = ("dit", "pixart", "sd3", "flux")  # families whose diffusers loop body is written out below


def loop_body(model, inp: dict):
    """One iteration of the family's diffusers pipeline loop at the middle step of the card's default count,
    as diffusers writes it. Schedulers count their steps themselves (``_step_index``): each call resets it."""
    family, steps = model.card.family, int(model.card.defaults["steps"])
    g, index, dev = float(inp["guidance"][0]), steps // 2, model.device
    sched = _scheduler(model, steps)
    t = sched.timesteps[index]
    latents = inp["x"].to(model.dtype)  # (B, C, H, W)
    tf = model.transformer

    def cfg(pred):
        uncond, cond = pred.chunk(2)
        return uncond + g * (cond - uncond)

    if family == "dit":
        c = model.latent_shape[0]
        labels = torch.cat([inp["labels"], torch.full_like(inp["labels"], model.null_class)])  # (2B,)

        def model_out():
            x2 = torch.cat([latents, latents])
            pred = tf(x2, timestep=t[None].to(dev).expand(len(x2)), class_labels=labels).sample
            return cfg(pred[:, :c])
    elif family == "pixart":
        c = model.latent_shape[0]
        embeds = torch.cat([inp["neg_embeds"], inp["prompt_embeds"]])  # (2B, L, D): negative first
        mask = torch.cat([inp["neg_mask"], inp["prompt_mask"]])        # (2B, L)

        def model_out():
            x2 = sched.scale_model_input(torch.cat([latents, latents]), t)
            pred = tf(x2, encoder_hidden_states=embeds, encoder_attention_mask=mask, timestep=t[None].expand(len(x2)),
                      added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)[0]
            pred = cfg(pred)
            return pred.chunk(2, dim=1)[0] if tf.config.out_channels // 2 == c else pred  # learned sigma
    elif family == "sd3":
        embeds = torch.cat([inp["neg_embeds"], inp["prompt_embeds"]])  # (2B, 77 + L, 4096)
        pooled = torch.cat([inp["neg_pooled"], inp["pooled"]])         # (2B, 2048)

        def model_out():
            x2 = torch.cat([latents, latents])
            return cfg(tf(hidden_states=x2, timestep=t.expand(len(x2)), encoder_hidden_states=embeds,
                          pooled_projections=pooled, return_dict=False)[0])
    elif family == "flux":
        from diffusers import FluxPipeline

        from workers.families.flux.runtime import pack

        _, h, w = model.latent_shape
        latents = pack(latents)                                                         # (B, N, 64)
        img_ids = FluxPipeline._prepare_latent_image_ids(len(latents), h // 2, w // 2, dev, model.dtype)
        txt_ids = torch.zeros(inp["prompt_embeds"].shape[1], 3, device=dev, dtype=model.dtype)
        guidance = torch.full((len(latents),), g, device=dev) if tf.config.guidance_embeds else None

        def model_out():
            return tf(hidden_states=latents, timestep=t.expand(len(latents)).to(latents.dtype) / 1000,
                      guidance=guidance, pooled_projections=inp["pooled"], encoder_hidden_states=inp["prompt_embeds"],
                      txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
    else:
        raise ValueError(f"no diffusers loop body for family {family!r}")

    def step():
        sched._step_index = index
        return sched.step(model_out(), t, latents, return_dict=False)[0]

    return step


def pipeline_step_ms(model, images: int, reps: int = 2) -> list[float]:
    """Each denoising step's wall time (ms) inside the family's diffusers pipeline (``Family.reference_pipeline``)
    making ``images`` images of one prompt at the card's defaults: the pipeline's own loop body, timed between its
    ``callback_on_step_end`` calls (the device synchronised at each), its first two steps of every call left out.
    The baseline of a family without a loop body written here."""
    from workers.families import family_of
    from workers.request.spec import ItemSpec

    family, d = family_of(model), model.card.defaults
    specs = [ItemSpec(id=str(i), seed=i, sampler=d["sampler"], steps=int(d["steps"]), guidance=float(d["guidance"]),
                      prompt="a photograph of a red fox in fresh snow") for i in range(images)]
    pipe = family.reference_pipeline(model)
    harness.feed_encoders(model)  # text encoders on the host: their inputs moved there
    out: list[float] = []
    for rep in range(reps):
        marks: list[float] = []

        def mark(pipeline, i, t, kwargs):
            harness.sync()
            marks.append(time.perf_counter())
            return kwargs

        harness.sync()
        marks.append(time.perf_counter())
        pipe(**family.reference_call(model, specs), output_type="latent", callback_on_step_end=mark,
             generator=torch.Generator().manual_seed(rep))
        out += [1000 * (b - a) for a, b in zip(marks[2:], marks[3:])] or [1000 * (marks[-1] - marks[0])]
    return out


def step_flops(model, counts: list[int]) -> dict[int, int]:
    """Floating-point operations of one step of each of ``counts`` images (the card's default request's step, run
    eagerly once per count under ``torch.utils.flop_counter.FlopCounterMode``): the work every system does."""
    from torch.utils.flop_counter import FlopCounterMode

    from workers.config import WorkerConfig
    from workers.engine import Engine
    from workers.families import family_of

    family, shape = family_of(model), tuple(model.latent_shape)
    engine = Engine(model, WorkerConfig(backend="eager", max_batch=max(counts)))  # its warm-up example only
    variant = family.variant_of(model, SimpleNamespace(guidance=float(model.card.defaults["guidance"])))
    step = family.make_step(model, shape, **({"variant": variant} if variant else {}))  # as the engine asks for it
    out = {}
    for n in counts:
        inputs = step_inputs(engine, model, n)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            step(**inputs)
        out[n] = int(counter.get_total_flops())
    del engine
    return out


def measured_peak(smoke: bool) -> dict:
    """TFLOP/s of the device's dense matrix products: the median of 20 8192-square bf16 products (on a CPU, for a
    smoke run, 512-square float32 ones)."""
    n, dtype = (512, torch.float32) if smoke or not torch.cuda.is_available() else (8192, torch.bfloat16)
    device = harness.device_and_dtype(smoke)[0]
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    ms = harness.percentile(harness.cuda_ms(lambda: a @ b, 20), 50)
    return {"tflops": float(f"{2 * n ** 3 / (ms * 1e-3) / 1e12:.4g}"), "size": n, "dtype": str(dtype).split(".")[-1]}


def compiled(model):
    """The model with its transformer wrapped in ``torch.compile`` (a shallow copy: ``model`` is unchanged)."""
    out = copy.copy(model)
    out.transformer = torch.compile(model.transformer)
    return out


# -- profiling ---------------------------------------------------------------------------------------
def group_of(name: str) -> str:
    return next((g for g, pattern in GROUPS if pattern.search(name)), "other")


def summarise(kernels: dict[str, float], steps: int, top_n: int = 10) -> dict:
    """Per-step ms by group (descending) and the ``top_n`` heaviest kernels, from total ms per kernel name."""
    groups: dict[str, float] = {}
    for name, ms in kernels.items():
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + ms / steps
    total = sum(groups.values()) or 1.0
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:top_n]
    return {"total_ms": round(total, 3),
            "groups": {g: {"ms": round(ms, 3), "share": round(ms / total, 4)}
                       for g, ms in sorted(groups.items(), key=lambda kv: -kv[1])},
            "top": [{"kernel": name[:160], "group": group_of(name), "ms": round(ms / steps, 3)} for name, ms in top]}


def profile(fn, iters: int) -> dict:
    """``summarise`` of ``iters`` calls of ``fn``: device time per kernel on CUDA, self CPU time per operator
    elsewhere."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = torch.cuda.is_available()
    fn()
    with torch_profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            fn()
        harness.sync()
    kernels: dict[str, float] = {}
    for ev in prof.key_averages():
        ms = (ev.device_time_total if cuda else ev.self_cpu_time_total) / 1e3
        if ms > 0 and (cuda or not ev.key.startswith(("ProfilerStep", "cuda"))):
            kernels[ev.key] = kernels.get(ev.key, 0.0) + ms
    return summarise(kernels, iters)


# -- the run -----------------------------------------------------------------------------------------
def measure(fn, block: dict, images: int, args) -> torch.Tensor:
    """Time ``fn`` (one step of ``images`` images) into ``block``; profile it with --profile; its output."""
    iters = 3 if args.smoke else (30 if images <= 8 else 12)
    block.setdefault("ms", {})[images] = harness.stats(harness.wall_ms(fn, iters))
    if args.profile:
        block.setdefault("profile", {})[images] = profile(fn, 3 if args.smoke else 5)
    return fn()


def compare(block: dict, images: int, x: torch.Tensor, reference: dict) -> None:
    """x_next's largest difference from ``default``'s, and its norm relative to the reference's."""
    if images in reference and x.shape == reference[images].shape:
        d = x.float() - reference[images]
        block.setdefault("max_abs_diff", {})[images] = d.abs().max().item()
        block.setdefault("rel_diff", {})[images] = (d.norm() / reference[images].norm()).item()


def run_preset(name: str, args, models: dict, result: dict, reference: dict) -> None:
    family = models["bf16"].card.family
    config, precision = harness.engine_config(name, family, max_batch=max(args.images),
                                              compile_cache=str(args.cache), text_encoder_device=args.encoders)
    if (why := harness.unavailable(precision, harness.device_and_dtype(args.smoke)[0])) is not None:
        result["systems"][name] = {"skipped": why}
        return
    if precision not in models:  # the same seeded weights, loaded again with the precision's linears
        models[precision] = harness.load(args.model, precision, args.smoke, args.encoders)
    model = models[precision]
    from workers.families import family_of

    engine, warm_s = harness.build_engine(model, config)
    probe = SimpleNamespace(guidance=float(model.card.defaults["guidance"]))  # the card's default request's step
    variant = family_of(model).variant_of(model, probe)
    runner = next(g.runner for k, g in engine.groups.items() if k.variant == variant)
    block = result["systems"][name] = {"config": harness.describe(config), "precision": precision, "warmup_s": round(warm_s, 2),
                                       "pool_mib": round(runner.stats()["pool_reserved_bytes"] / 2**20, 1),
                                       "backend": runner.backend}
    with torch.no_grad():
        for n in args.images:
            inp = step_inputs(engine, model, n)
            x = measure(lambda r=runner, i=inp: r.run(**i), block, n, args)["x_next"]
            if name == "default":
                reference[n] = x.float().clone()
            compare(block, n, x, reference)
    del engine, runner
    harness.free()


def run_baseline(name: str, args, models: dict, result: dict) -> None:
    """diffusers' loop body (``torch.compile``: its transformer compiled) on the plain model, before any
    engine patches it."""
    from workers.config import WorkerConfig
    from workers.engine import Engine

    model = models["bf16"]
    example = Engine(model, WorkerConfig(backend="eager", max_batch=1))  # only its warm-up example
    ref = compiled(model) if name == "torch.compile" else model
    block = result["systems"][name] = {}
    with torch.no_grad():
        for n in args.images:
            if model.card.family not in LOOP_BODIES:  # the pipeline's own loop, timed step by step
                block.setdefault("ms", {})[n] = harness.stats(pipeline_step_ms(ref, n, reps=1 if args.smoke else 2))
                continue
            body = loop_body(ref, step_inputs(example, model, n))
            measure(body, block, n, args)
    del example
    harness.free()


def markdown(result: dict) -> str:
    images = result["images"]
    lines = [f"# One denoising step: {result['model']} (median ms)", "", harness.hardware_line(result["env"]), ""]
    rows = []
    for name, block in result["systems"].items():
        ms = [block.get("ms", {}).get(n, {}).get("median") for n in images]
        rel = block.get("rel_diff", {})
        rows.append([name, *ms, block.get("warmup_s"), block.get("pool_mib"),
                     ", ".join(f"{rel[n]:.1e}" for n in images if n in rel) or None])
    lines += harness.table(["system", *(f"{n} image{'s' * (n > 1)}" for n in images), "warm-up s", "graph pool MiB",
                            "x_next vs default (rel.)"], rows)
    lines += [f"\n{name} skipped: {b['skipped']}" for name, b in result["systems"].items() if "skipped" in b]
    if (flops := result.get("flops")) and (peak := result.get("peak")):
        lines += ["", f"## Achieved TFLOP/s (share of the measured peak, {peak['tflops']} TFLOP/s of "
                  f"{peak['size']}-square {peak['dtype']} products)", "",
                  "The step's work: " + ", ".join(f"{n} image{'s' * (n > 1)} {flops[n] / 1e12:.3g} TFLOP"
                                                   for n in images if n in flops), ""]
        rows = []
        for name, block in result["systems"].items():
            got = [achieved(flops.get(n), block.get("ms", {}).get(n, {}).get("median")) for n in images]
            if any(t is not None for t in got):
                rows.append([name, *(f"{t:g} ({t / peak['tflops']:.0%})" if t is not None else None for t in got)])
        lines += harness.table(["system", *(f"{n} image{'s' * (n > 1)}" for n in images)], rows)
    for name, block in result["systems"].items():
        for n, prof in block.get("profile", {}).items():
            lines += ["", f"## {name}, {n} image{'s' * (n > 1)}: {prof['total_ms']} ms of kernels a step", ""]
            lines += harness.table(["group", "ms", "share"], [[g, v["ms"], f"{v['share']:.0%}"]
                                                              for g, v in prof["groups"].items()])
    lines += [f"\n- {part} failed: `{err.splitlines()[0][:300]}`" for part, err in result.get("errors", {}).items()]
    return "\n".join(lines)


def achieved(flops: int | None, ms: float | None) -> float | None:
    """TFLOP/s of ``flops`` done in ``ms``."""
    return float(f"{flops / (ms * 1e-3) / 1e12:.3g}") if flops and ms else None


def report_name(model: str) -> str:
    return "step_" + Path(str(model)).name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dit-xl-2-256", help="a built-in or a model directory")
    p.add_argument("--images", type=int, nargs="+", default=[1, 64], help="images per step")
    p.add_argument("--systems", nargs="+", choices=harness.SYSTEMS, default=list(harness.SYSTEMS))
    p.add_argument("--profile", action="store_true", help="also each step's kernels by group (torch.profiler)")
    p.add_argument("--out", type=Path, help="report folder (default docs/benchmarks; a temp folder with --smoke)")
    p.add_argument("--smoke", action="store_true", help="a tiny random model on a CPU (--family picks which)")
    p.add_argument("--family", choices=harness.FAMILIES, default="dit", help="--smoke's model family")
    p.add_argument("--text-encoder-device", choices=tuple(harness.TEXT_ENCODER_DEVICES), default="gpu",
                   help=harness.TEXT_ENCODER_HELP)
    args = p.parse_args(argv)
    args.encoders = harness.TEXT_ENCODER_DEVICES[args.text_encoder_device]
    if args.smoke:
        args.model, args.images = harness.tiny_model(args.family), [1, 2]
        if "--systems" not in (argv if argv is not None else sys.argv):
            args.systems = ["diffusers", "default"]  # compiling on a CPU takes minutes
    args.cache = Path(tempfile.mkdtemp(prefix="bench-inductor-"))  # a cold compile: warm-up counts it
    result = {"model": Path(str(args.model)).name, "images": args.images, "systems": {}, "errors": {},
              "env": harness.environment(harness.device_and_dtype(args.smoke)[0])}
    report = harness.Report(harness.out_dir(args.out, args.smoke), report_name(args.model), markdown)
    models = {"bf16": harness.load(args.model, "bf16", args.smoke, args.encoders)}
    harness.attempt(result, "flops", lambda: result.update(
        flops=step_flops(models["bf16"], args.images), peak=measured_peak(args.smoke)), report)
    reference: dict = {}
    order = [s for s in harness.SYSTEMS if s in args.systems]  # baselines before any engine patches the model
    for name in order:
        run = run_baseline if name in harness.BASELINES else run_preset
        extra = () if name in harness.BASELINES else (reference,)
        harness.attempt(result, name, lambda: run(name, args, models, result, *extra), report)
    paths = report.save(result)
    print(markdown(result) + f"\nwrote {paths[0]}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
