"""The VAE decode as the engine captures it (``workers.engine.decode_runner``, compiled), per bucket, with and
without cuDNN's convolution autotuning and channels-last weights, on a GPU.

For a model (default PixArt-Σ 512's VAE, bf16) each variant builds the decode runner with buckets up to 16
images (``DECODE_PIXELS`` raised for the probe) and reads its warm-up's replay timings (median of its timed
replays per bucket): ms per replay and per image. Variants:

    plain                    contiguous weights, cuDNN's heuristics pick each convolution's algorithm
    benchmark                torch.backends.cudnn.benchmark on: each convolution shape timed once, the fastest kept
    channels-last            the VAE's weights in channels-last (NHWC) memory format, cuDNN's heuristics
    channels-last+benchmark  both
    engine                   what the engine does (``workers.engine.decode_runner``): channels-last on CUDA

The largest difference of each variant's pixels from plain's on one batch is reported beside them.

    python bench/decode_layouts.py [--model pixart-sigma-512] [--out DIR]   # DIR/decode_layouts.json, .md
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = ("plain", "benchmark", "channels-last", "channels-last+benchmark", "engine")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="pixart-sigma-512")
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = p.parse_args()
    from workers import engine as eng
    from workers.loading import load_model

    model = load_model(args.model, device="cuda", dtype=torch.bfloat16)
    shape = tuple(model.latent_shape)
    eng.DECODE_PIXELS = 16 * (model.image_size ** 2)
    probe = torch.randn(4, *shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    result = {"model": args.model, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "latent": list(shape), "variants": {}}
    ref = None
    for name in VARIANTS:
        t0 = time.perf_counter()
        runner = eng.decode_runner(model, shape, compiled=True)  # the engine's: the VAE in channels-last
        if name != "engine":  # "engine": the layout decode_runner chose, cuDNN's heuristics
            layout = torch.channels_last if name.startswith("channels-last") else torch.contiguous_format
            model.vae.to(memory_format=layout)
        torch.backends.cudnn.benchmark = name.endswith("benchmark")
        runner.warmup()
        torch.backends.cudnn.benchmark = False
        ready = time.perf_counter() - t0
        pixels = runner.run(latents=probe)["pixels"].clone()
        ref = pixels if ref is None else ref
        ms = runner.replay_ms
        result["variants"][name] = {"ready_s": round(ready, 1), "ms": {b: round(v, 3) for b, v in ms.items()},
                                    "ms_per_image": {b: round(v / b, 3) for b, v in ms.items()},
                                    "max_diff_vs_plain": round((pixels - ref).abs().max().item(), 4)}
        print(name, json.dumps(result["variants"][name]), flush=True)
        del runner
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_layouts.json").write_text(json.dumps(result, indent=1))
    buckets = sorted(result["variants"]["plain"]["ms"])
    lines = [f"# The compiled, captured VAE decode per bucket: {args.model} ({result['gpu']})", "",
             f"`python bench/decode_layouts.py --model {args.model}`; torch {result['torch']}, cuDNN {result['cudnn']}. "
             "ms per image of each bucket's replay (its warm-up timing).", "",
             "| variant | ready s | " + " | ".join(f"{b} img" for b in buckets) + " | max diff vs plain |",
             "|---|---|" + "---|" * len(buckets) + "---|"]
    for name, v in result["variants"].items():
        lines.append(f"| {name} | {v['ready_s']} | " + " | ".join(f"{v['ms_per_image'][b]}" for b in buckets)
                     + f" | {v['max_diff_vs_plain']} |")
    (args.out / "decode_layouts.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
