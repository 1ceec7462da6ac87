"""cuDNN's FP8 attention (``workers.fp8_attention``) against PyTorch's bf16 attention kernels, on a GPU.

For each attention shape the steps run (B, T, heads, d, in the projections' (B, T, heads, d) layout, read as
(B, heads, T, d) views): the fastest of PyTorch's bf16 kernels (flash, cuDNN, memory-efficient, as
``workers.sdpa`` measures them), cuDNN's FP8 kernel alone (q, k, v already codes), and the FP8 path whole
(the per-tensor quantization of q, k, v, the kernel, the output back to bf16), its quantization as PyTorch
operations and compiled by Inductor. Each is timed as CUDA graph replays (4 calls a graph, median of 7, as
the chooser times kernels). The FP8 error is measured against float32 math attention on the first row:
rms of the difference over rms of the reference, and the largest difference over the reference's largest
magnitude; bf16 cuDNN's beside it.

    python bench/fp8_sdpa.py [--out DIR] [--shapes NAME ...]   # DIR/fp8_sdpa.json and .md
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers import fp8_attention as fa  # noqa: E402
from workers import sdpa  # noqa: E402

SHAPES = {  # name: (B, T, heads, d)
    "flux-dev-1024, 1 image": (1, 4608, 24, 128),
    "flux-dev-512, 1 image": (1, 1536, 24, 128),
    "sd35-medium-1024, 1 image": (2, 4429, 24, 64),
    "pixart-sigma-1024, 1 image": (2, 4096, 16, 72),
    "pixart-sigma-512, 32 images": (64, 1024, 16, 72),
    "pixart-sigma-512, 1 image": (2, 1024, 16, 72),
    "dit-xl-2-256, 64 images": (128, 256, 16, 72),
}


def graph_ms(fn) -> tuple[float, bool]:
    """Median ms of one call as CUDA graph replays (4 calls a graph, median of 7), and whether it captured."""
    ms, captured = sdpa.replay_ms(fn)
    if not captured:
        print("    not capturable: plain calls timed", flush=True)
    return ms, captured


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = out[:1].float() - ref
    return {"rms": round((diff.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item(), 5),
            "max": round((diff.abs().max() / ref.abs().max()).item(), 5)}


def tflops(shape, ms: float) -> float:
    b, t, h, d = shape
    return round(4 * b * h * t * t * d / ms / 1e9, 1)


def measure(name: str, shape: tuple[int, int, int, int]) -> dict:
    b, t, h, d = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, t, h, d, generator=gen, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               for _ in range(3))
    ref = sdpa.run("math", q[:1].float(), k[:1].float(), v[:1].float())
    row = {"shape": list(shape), "head_run": fa.padded_head(d), "bf16": {}, "fp8": {}}
    for kernel in sdpa.candidates(q, k):
        try:
            out = sdpa.run(kernel, q, k, v)
        except RuntimeError:
            continue
        ms, _ = graph_ms(lambda: sdpa.run(kernel, q, k, v))
        row["bf16"][kernel] = {"ms": round(ms, 4), "tflops": tflops(shape, ms), **errors(out, ref)}
    best = min(row["bf16"], key=lambda n: row["bf16"][n]["ms"])
    row["bf16_best"] = best

    dp = fa.padded_head(d)
    (q8, dq), (k8, dk), (v8, dv) = (fa.quantize(x.transpose(1, 2), dp) for x in (q, k, v))
    o8 = torch.empty_like(q8)
    scale = 1.0 / math.sqrt(d)
    started = time.perf_counter()
    fa.attention_codes(q8.transpose(1, 2), k8.transpose(1, 2), v8.transpose(1, 2), dq, dk, dv, o8.transpose(1, 2), scale)
    torch.cuda.synchronize()
    row["fp8"]["plan_s"] = round(time.perf_counter() - started, 3)
    kernel = lambda: fa.attention_codes(q8.transpose(1, 2), k8.transpose(1, 2), v8.transpose(1, 2), dq, dk, dv,
                                        o8.transpose(1, 2), scale)
    ms, captured = graph_ms(kernel)
    row["fp8"]["kernel"] = {"ms": round(ms, 4), "tflops": tflops(shape, ms), "captured": captured}
    out = fa.attention(q, k, v)
    ms, captured = graph_ms(lambda: fa.attention(q, k, v))
    row["fp8"]["whole_eager"] = {"ms": round(ms, 4), "captured": captured, **errors(out, ref)}
    quant = torch.compile(fa.quantize, dynamic=False)
    deq = torch.compile(fa.dequantize, dynamic=False)

    def whole_compiled():
        (a, da), (b_, db), (c, dc) = (quant(x.transpose(1, 2), dp) for x in (q, k, v))
        o = torch.empty_like(a)
        do = fa.attention_codes(a.transpose(1, 2), b_.transpose(1, 2), c.transpose(1, 2), da, db, dc, o.transpose(1, 2), scale)
        return deq(o, do, d, q.dtype)

    out = whole_compiled()
    ms, captured = graph_ms(whole_compiled)
    row["fp8"]["whole_compiled"] = {"ms": round(ms, 4), "captured": captured, **errors(out.transpose(1, 2), ref)}
    row["fp8_kernel_vs_bf16_best"] = round(row["fp8"]["kernel"]["ms"] / row["bf16"][best]["ms"], 3)
    row["fp8_whole_vs_bf16_best"] = round(row["fp8"]["whole_compiled"]["ms"] / row["bf16"][best]["ms"], 3)
    print(f"{name}: bf16 {best} {row['bf16'][best]['ms']:.4f} ms; fp8 kernel {row['fp8']['kernel']['ms']:.4f}, "
          f"whole {row['fp8']['whole_compiled']['ms']:.4f} ms; err {row['fp8']['whole_compiled']}", flush=True)
    return row


def versions() -> dict:
    cudnn = fa._frontend()
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
            "cudnn_backend": cudnn.backend_version_string() if cudnn else None,
            "cudnn_frontend": getattr(cudnn, "__version__", None), "torch_cudnn": torch.backends.cudnn.version()}


def report(rows: dict, info: dict) -> str:
    lines = [f"# cuDNN's FP8 attention against PyTorch's bf16 kernels ({info['gpu']})", "",
             f"`python bench/fp8_sdpa.py`; torch {info['torch']}, cuDNN {info['cudnn_backend']}, cuDNN frontend "
             f"{info['cudnn_frontend']}. Median us of one call as CUDA graph replays (TFLOP/s at the real head size); "
             "error against float32 math attention on the first row: rms of the difference / rms of the reference, "
             "largest difference / the reference's largest magnitude.", "",
             "| shape | B, T, heads, d (run as) | fastest bf16 us | FP8 kernel us | FP8 whole us | whole / bf16 | "
             "bf16 error rms, max | FP8 error rms, max |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | {r['shape']} | {r['error']} |  |  |  |  |  |")
            continue
        b = r["bf16"][r["bf16_best"]]
        kern, whole = r["fp8"]["kernel"], r["fp8"]["whole_compiled"]
        lines.append(f"| {name} | {', '.join(map(str, r['shape']))} ({r['head_run']}) | {r['bf16_best']}: "
                     f"{b['ms'] * 1000:.1f} ({b['tflops']}) | {kern['ms'] * 1000:.1f} ({kern['tflops']}) | "
                     f"{whole['ms'] * 1000:.1f} | {r['fp8_whole_vs_bf16_best']}x | {b['rms']}, {b['max']} | "
                     f"{whole['rms']}, {whole['max']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    args = parser.parse_args()
    reason = fa.unavailable_reason("cuda")
    if reason:
        sys.exit(f"fp8_sdpa: {reason}")
    info = versions()
    print(info, flush=True)
    rows = {}
    for name in args.shapes:
        try:
            rows[name] = measure(name, SHAPES[name])
        except Exception as e:  # noqa: BLE001 - a shape the kernel refuses is a row of the report
            print(f"{name}: {type(e).__name__}: {e}", flush=True)
            rows[name] = {"shape": list(SHAPES[name]), "error": f"{type(e).__name__}: {str(e)[:300]}"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_sdpa.json").write_text(json.dumps({"versions": info, "rows": rows}, indent=1))
    (args.out / "fp8_sdpa.md").write_text(report(rows, info))
    print(report(rows, info))


if __name__ == "__main__":
    main()
