"""FP8's quality per family: the final images of FP8 linears against bf16 from the same initial latents.

For each model, the same items (seeds 0..n-1; class labels, or prompts for text models; the card's
sampler, steps and guidance) are generated twice by the engine (eager, one image at a time): once with
the model in bf16, once loaded with ``precision="fp8"`` (workers/fp8.py: the block linears as FP8
products, activations quantized per row by workers/quant_kernel.py on CUDA). Reported per model: PSNR
of each FP8 image against its bf16 image (8-bit, peak 255), the largest and the mean absolute difference
in 8-bit levels, and the relative norm of the final latents' difference; medians over the items. The
full-size models are the built-ins with random weights, made on the GPU.

    python bench/fp8_quality.py                         # on a GPU with FP8 (compute capability 8.9+)
    python bench/fp8_quality.py --models dit-xl-2-256 flux-dev-1024 --images 2
    python bench/fp8_quality.py --smoke --out /tmp/q    # digits and digits-text on a CPU, float32
    python bench/fp8_quality.py --fast-accum            # FP8 with promoted and with fast accumulation
    python bench/fp8_quality.py --attention             # FP8 linears with bf16, then with FP8 attention

Writes fp8_quality.json and fp8_quality.md (fp8_quality_smoke.* with --smoke) under --out after each model.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

MODELS = ["dit-xl-2-256", "pixart-sigma-512", "sd35-medium-1024", "flux-dev-1024"]
SMOKE_MODELS = ["digits", "digits-text"]
PROMPTS = ["a red fox in the snow", "a bowl of fruit on a wooden table", "a lighthouse at dusk",
           "an astronaut riding a horse"]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two uint8 images (peak 255); inf when they are equal."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def compare(bf16: list, fp8: list) -> dict:
    """Per-item PSNR, max and mean 8-bit difference, latent relative difference; and their medians."""
    rows = []
    for a, b in zip(bf16, fp8):
        diff = np.abs(a.image.astype(np.int16) - b.image.astype(np.int16))
        rel = ((b.latents - a.latents).norm() / a.latents.norm().clamp_min(1e-12)).item()
        rows.append({"psnr_db": round(psnr(a.image, b.image), 2), "max_abs_diff": int(diff.max()),
                     "mean_abs_diff": round(float(diff.mean()), 3), "latent_rel_diff": round(rel, 5)})
    return {"items": rows, **{f"median_{k}": round(statistics.median(r[k] for r in rows), 5) for k in rows[0]}}


def specs(model, n: int) -> list:
    from workers.spec import ItemSpec

    d, text = model.card.defaults, model.card.conditioning == "text"
    return [ItemSpec(id=str(i), seed=i, sampler=d["sampler"], steps=d["steps"], guidance=d["guidance"],
                     label=0 if text else i % model.num_classes, prompt=PROMPTS[i % len(PROMPTS)] if text else "")
            for i in range(n)]


def generate(name: str, precision: str, n: int, device: str, dtype, variants: tuple = ((None, False),)
             ) -> tuple[list, dict]:
    """The images of ``n`` items of ``name`` at ``precision``, one list per variant: (fast accumulation,
    FP8 attention). Fast accumulation is ``workers.fp8.FAST_ACCUM`` (read at each product; None: as it is);
    FP8 attention routes the joint attention of SD3 and FLUX.1 through ``workers.fp8_attention`` (the eager
    engine keeps diffusers' processors otherwise). The same loaded model generates once per variant."""
    from workers import fp8
    from workers.engine import Engine, EngineConfig
    from workers.families import family_of
    from workers.joint_attention import restore_joint_attention, route_joint_attention
    from workers.loading import load_model

    model = load_model(name, device=device, dtype=dtype, precision=precision)
    items = specs(model, n)
    engine = Engine(model, EngineConfig(backend="eager", max_batch=1))
    t0 = time.perf_counter()
    runs, before = [], fp8.FAST_ACCUM
    try:
        for fast, attention in variants:
            fp8.FAST_ACCUM = before if fast is None else fast
            if attention and getattr(family_of(model), "JOINT_ATTENTION", False):
                route_joint_attention(model.transformer, fp8=True)
            else:
                restore_joint_attention(model.transformer)
            runs.append(engine.generate(items))
    finally:
        fp8.FAST_ACCUM = before
        restore_joint_attention(model.transformer)
    seconds = (time.perf_counter() - t0) / len(variants)
    d = model.card.defaults
    info = {"sampler": d["sampler"], "steps": d["steps"], "guidance": d["guidance"], "family": model.card.family,
            "fp8_linears": getattr(model, "fp8_linears", 0), "generate_s": round(seconds, 2)}
    del engine, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return runs, info


def hardware() -> dict:
    import diffusers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"gpu": gpu, "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "diffusers": diffusers.__version__, "python": platform.python_version()}


def markdown(report: dict) -> str:
    hw = report["hardware"]
    base = "bf16" if report["device"] == "cuda" else "float32"
    lines = [f"# FP8 against {base}: final images from the same latents ({hw['gpu'] or 'CPU'})", "",
             f"`{report['command']}`; torch {hw['torch']}, diffusers {hw['diffusers']}. {report['images']} images per "
             "model (seeds 0..n-1), the card's sampler, steps and guidance, eager engine; medians over the images.", "",
             "| model | family | FP8 linears | sampler, steps, guidance | PSNR dB | max diff (8-bit) | mean diff | "
             "latent rel. diff |", "|---|---|---|---|---|---|---|---|"]
    for name, r in report["models"].items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | | | | |")
            continue
        i = r["settings"]
        both = "fast_accum" in r  # --fast-accum: the first FP8 run promoted its sums, the second did not
        second = "fp8_attention" in r  # --attention: the first FP8 run's attention was bf16, the second's FP8
        first = f"{name}, promoted accumulation" if both else f"{name}, bf16 attention" if second else name
        for label, q in ((first, r), (f"{name}, fast accumulation", r.get("fast_accum")),
                         (f"{name}, FP8 attention", r.get("fp8_attention"))):
            if q is not None:
                lines.append(f"| {label} | {i['family']} | {i['fp8_linears']} | {i['sampler']}, {i['steps']}, "
                             f"{i['guidance']} | {q['median_psnr_db']} | {q['median_max_abs_diff']} | "
                             f"{q['median_mean_abs_diff']} | {q['median_latent_rel_diff']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", help=f"built-ins or model directories (default {' '.join(MODELS)})")
    p.add_argument("--images", type=int, default=2, help="items per model (default 2)")
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    p.add_argument("--smoke", action="store_true", help=f"{' and '.join(SMOKE_MODELS)} on a CPU, float32")
    p.add_argument("--fast-accum", action="store_true", help="FP8 twice against the same bf16 images: the products' "
                   "sums promoted to float32 every few k-blocks, then cuBLASLt's fast accumulation "
                   "(workers.fp8.FAST_ACCUM); the report's name gets _fastaccum")
    p.add_argument("--attention", action="store_true", help="FP8 twice against the same bf16 images: bf16 attention, "
                   "then FP8 attention where the family has it (SD3, FLUX.1: workers.fp8_attention, cuDNN's kernel on "
                   "Hopper); the report's name gets _attention")
    args = p.parse_args(argv)
    from workers import fp8
    from workers.fp8 import unsupported_reason

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if (why := unsupported_reason(device)) is not None:
        print(f"fp8_quality: {why}", file=sys.stderr)
        return 2
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    models = args.models or (SMOKE_MODELS if args.smoke else MODELS)
    report = {"command": " ".join(["python", "bench/fp8_quality.py", *(argv if argv is not None else sys.argv[1:])]),
              "hardware": hardware(), "images": args.images, "device": device, "models": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = (("fp8_quality_smoke" if args.smoke else "fp8_quality") + ("_fastaccum" if args.fast_accum else "")
            + ("_attention" if args.attention else ""))
    variants = [(False, False), (True, False)] if args.fast_accum else [(None, False)]
    if args.attention:
        variants.append((None, True))
    for name in models:
        t0 = time.perf_counter()
        try:
            (bf16,), settings = generate(name, "bf16", args.images, device, dtype)
            runs, quantized = generate(name, "fp8", args.images, device, dtype, tuple(variants))
            settings["fp8_linears"] = quantized["fp8_linears"]
            fast = {"fast_accum": compare(bf16, runs[1])} if args.fast_accum else {}
            if args.attention:
                fast["fp8_attention"] = compare(bf16, runs[-1])
            report["models"][name] = {**compare(bf16, runs[0]), **fast,
                                      "settings": {**settings, "fp8_generate_s": quantized["generate_s"]}}
        except Exception as e:  # one model's failure is recorded; the others still run
            report["models"][name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        print(f"{name}: {time.perf_counter() - t0:.1f} s {json.dumps(report['models'][name])[:300]}", flush=True)
        (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1))
        (args.out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
