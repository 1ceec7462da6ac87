"""The kernels a step runs, alone, at the shapes the families' steps run them (median us a call).

Sections (``--sections``):

  quant      the FP8 linears' row quantization (``workers.speed.fp8.quantize_rows``: on CUDA the Triton row
             kernel of ``workers.kernels.quant``, elsewhere PyTorch operations), against a plain bf16 ->
             float8 cast of the same rows (the same bytes read and written: the roof); GB/s of each
  gelu       a feed-forward, down(gelu_tanh(up(x))), with the GELU as a pass of its own and in the product's
             epilogue (``torch._addmm_activation``, what ``workers.speed.epilogues`` runs)
  attention  each of PyTorch's attention kernels the engine measures per shape (``workers.kernels.attention``), in the
             (B, T, heads, d) layout the projections write; on Hopper with the cuDNN frontend also the FP8
             attention (``workers.kernels.fp8_attention``: quantization, kernel and the output back), its error
             against float32 attention (rms of the difference over the reference's)
  lora       a linear's per-row LoRA term added in place (rank 64, the rows spread over 8 adapters) at the three
             LoRA benchmark models' projection shapes: the gathered products (``bmm``) and the Triton kernels
             (``workers.kernels.lora``) at each candidate blocking (``Tiles``), beside the linear itself and
             ``y += z`` over its output (the output's read and write an in-place term cannot avoid)

On a GPU each call is captured 20 times in a CUDA graph and replayed (harness.replay_us: the GPU's time
without the host's launches); on a CPU timed plainly. Writes docs/benchmarks/kernels.{json,md}. (Not named
kernels.py: a script's folder comes first on the import path, and diffusers imports a package of that name.)

    python bench/kernel_times.py                       # on a GPU (~2 min)
    python bench/kernel_times.py --sections attention
    python bench/kernel_times.py --smoke               # small shapes on a CPU, seconds
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

SECTIONS = ("quant", "gelu", "attention", "lora")
QUANT = [  # (where, rows, K, GELU folded in)
    ("dit-xl-2-256, 64 images: q/k/v, out", 32768, 1152, "none"),
    ("dit-xl-2-256, 64 images: ff out", 32768, 4608, "tanh"),
    ("pixart-sigma-1024, 1 image: ff out", 8192, 4608, "tanh"),
    ("sd35-medium-1024, 1 image: image ff out", 8192, 6144, "tanh"),
    ("flux-dev-1024, 1 image: double q/k/v, out", 4096, 3072, "none"),
    ("flux-dev-1024, 1 image: double ff out", 4096, 12288, "tanh"),
    ("flux-dev-1024, 1 image: single proj_out", 4608, 15360, "none"),
]
GELU = [  # (where, rows, K): the feed-forward is K -> 4K -> K
    ("dit-xl-2-256, 1 image", 512, 1152), ("dit-xl-2-256, 64 images", 32768, 1152),
    ("pixart-sigma-1024, 1 image", 8192, 1152), ("flux-dev-512, 8 images", 8192, 3072),
]
ATTENTION = [  # (where, B, T, heads, d)
    ("dit-xl-2-256, 64 images", 128, 256, 16, 72),
    ("pixart-sigma-512, 1 image", 2, 1024, 16, 72),
    ("pixart-sigma-1024, 1 image", 2, 4096, 16, 72),
    ("sd35-medium-1024, 1 image", 2, 4429, 24, 64),
    ("flux-dev-512, 1 image", 1, 1536, 24, 128),
    ("flux-dev-1024, 1 image", 1, 4608, 24, 128),
]
LORA = [  # (where, rows, tokens, in, out): a step of 16 images, classifier-free guidance's copies included
    ("pixart-sigma-512, 16 images: attention projections", 32, 1024, 1152, 1152),
    ("sd35-medium-1024, 16 images: image attention projections", 32, 4096, 1536, 1536),
    ("flux-dev-1024, 16 images: double-block image projections", 16, 4096, 3072, 3072),
]
LORA_TILES = [(t, 64, o, w, 3) for t in (64, 128) for o in (64, 128) for w in (4, 8)]  # (t, k, o, warps, stages)
SMOKE = {"quant": [("small", 64, 1152, "none"), ("small ff", 64, 4608, "tanh")],
         "gelu": [("small", 32, 64), ("small", 128, 64)], "attention": [("small", 2, 64, 4, 72)],
         "lora": [("small", 4, 64, 64, 64)]}


def us(fn) -> float:
    return round(harness.stats(harness.replay_us(fn))["median"], 2)


def quant(where: str, m: int, k: int, gelu: str, device: str) -> dict:
    from workers.speed import fp8

    x = torch.randn(m, k, device=device, generator=torch.Generator(device).manual_seed(k), dtype=torch.bfloat16)
    out = torch.empty(m, k, dtype=fp8.FP8, device=device)
    row = {"where": where, "rows": m, "K": k, "gelu": gelu,
           "us": {"cast": us(lambda: out.copy_(x)), "quantize_rows": us(lambda: fp8.quantize_rows(x, gelu))}}
    moved = m * k * 3 + m * 4  # bf16 read, FP8 written, a float32 scale a row
    row["gb_s"] = {n: round(moved / (v * 1e-6) / 1e9, 1) for n, v in row["us"].items()}
    return row


def gelu(where: str, m: int, k: int, device: str, dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    up_w, up_b = (torch.randn(4 * k, k, generator=g) * 0.02).to(device, dtype), torch.randn(4 * k, generator=g).to(device, dtype)
    down_w = (torch.randn(k, 4 * k, generator=g) * 0.02).to(device, dtype)
    separate = us(lambda: F.linear(F.gelu(F.linear(x, up_w, up_b), approximate="tanh"), down_w))
    epilogue = us(lambda: F.linear(torch._addmm_activation(up_b, x, up_w.t(), use_gelu=True), down_w))
    return {"where": where, "rows": m, "K": k, "us": {"separate": separate, "epilogue": epilogue},
            "speedup": round(separate / epilogue, 3)}


def attention(where: str, b: int, t: int, h: int, d: int, device: str, dtype) -> dict:
    from workers.kernels import attention as sdpa
    from workers.kernels import fp8_attention

    g = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(b, t, h, d, generator=g).to(device, dtype).transpose(1, 2) for _ in range(3))  # (B, h, T, d) views
    ref = sdpa.run("math", q[:1].float(), k[:1].float(), v[:1].float())
    err = lambda out: round(((out[:1].float() - ref).norm() / ref.norm()).item(), 5)
    row = {"where": where, "shape": [b, t, h, d], "us": {}, "rel_error": {}}
    for kernel in sdpa.candidates(q, k):
        try:
            row["rel_error"][kernel] = err(sdpa.run(kernel, q, k, v))
            row["us"][kernel] = us(lambda kernel=kernel: sdpa.run(kernel, q, k, v))
        except Exception as e:  # a kernel that refuses the shape is reported, the others still run
            row["us"][kernel] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    if fp8_attention.unavailable_reason(device) is None:
        row["rel_error"]["fp8"] = err(fp8_attention.attention(q, k, v))
        row["us"]["fp8"] = us(lambda: fp8_attention.attention(q, k, v))
    flops = 4 * b * h * t * t * d
    row["tflops"] = {n: round(flops / (v * 1e-6) / 1e12, 1) for n, v in row["us"].items() if isinstance(v, float)}
    return row


def lora(where: str, n: int, t: int, fin: int, fout: int, device: str, dtype, rank: int = 64, places: int = 4,
         adapters: int = 8) -> dict:
    """A linear's per-row LoRA term added in place (rank ``rank``, each row one of ``adapters`` adapters in the
    first of ``places`` places, the others empty) by the gathered products (``bmm``) and by the Triton kernels at
    each of LORA_TILES; beside them the linear itself and ``y += z`` over its output (``out += x`` shaped: the
    reads and writes an in-place term cannot avoid where in = out)."""
    from workers.kernels import lora as lora_kernel
    from workers.lora.linear import lora_add

    g = torch.Generator().manual_seed(fin)
    x = torch.randn(n, t, fin, generator=g).to(device, dtype)
    w = (torch.randn(fout, fin, generator=g) * 0.02).to(device, dtype)
    a = (torch.randn(adapters + 1, rank, fin, generator=g) * 0.02).to(device, dtype)
    b = (torch.randn(adapters + 1, fout, rank, generator=g) * 0.02).to(device, dtype)
    a[0], b[0] = 0, 0  # the empty slot
    live = torch.ones(adapters + 1, dtype=torch.int32, device=device)
    live[0] = 0
    slots = torch.zeros(n, places, dtype=torch.int64, device=device)
    slots[:, 0] = torch.arange(n, device=device) % adapters + 1
    scales = torch.zeros(n, places, device=device)
    scales[:, 0] = 1.0
    y, z = torch.zeros(n, t, fout, device=device, dtype=dtype), torch.randn(n, t, fout, generator=g).to(device, dtype)
    row = {"where": where, "shape": [n, t, fin, fout], "rank": rank,
           "us": {"linear": us(lambda: torch.matmul(x, w.t(), out=y)), "y += z": us(lambda: y.add_(z)),
                  "bmm": us(lambda: lora_add(x, a, b, slots, scales, y, "bmm"))}}
    if lora_kernel.available(x):
        for tiles in (lora_kernel.Tiles(*c) for c in LORA_TILES):
            name = f"triton t{tiles.t} o{tiles.o} w{tiles.warps}"
            row["us"][name] = us(lambda tiles=tiles: lora_kernel.add_rows_(x, a, b, live, slots, scales, y, tiles))
        best = min((v, k) for k, v in row["us"].items() if k.startswith("triton"))
        row["best"] = {"tiles": best[1], "us": best[0], "over_y_plus_z": round(best[0] / row["us"]["y += z"], 3),
                       "default": f"triton t{lora_kernel.TILES.t} o{lora_kernel.TILES.o} w{lora_kernel.TILES.warps}"}
    return row


def markdown(result: dict) -> str:
    lines = ["# Kernels alone (median us a call)", "", harness.hardware_line(result["env"])]
    for section in SECTIONS:
        rows = result.get(section)
        if not rows:
            continue
        names = list(dict.fromkeys(n for r in rows for n in r["us"]))
        lines += ["", f"## {section}", ""]
        lines += harness.table(["where", *names], [[r["where"], *(r["us"].get(n) for n in names)] for r in rows])
    lines += [f"\n- {part} failed: `{err.splitlines()[0][:300]}`" for part, err in result.get("errors", {}).items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--out", type=Path, help="report folder (default docs/benchmarks; a temp folder with --smoke)")
    p.add_argument("--smoke", action="store_true", help="small shapes on a CPU")
    args = p.parse_args(argv)
    device, dtype = harness.device_and_dtype(args.smoke)
    shapes = SMOKE if args.smoke else {"quant": QUANT, "gelu": GELU, "attention": ATTENTION, "lora": LORA}
    result = {"env": harness.environment(device), "errors": {}}
    run = {"quant": lambda s: quant(*s, device), "gelu": lambda s: gelu(*s, device, dtype),
           "attention": lambda s: attention(*s, device, dtype), "lora": lambda s: lora(*s, device, dtype)}
    report = harness.Report(harness.out_dir(args.out, args.smoke), "kernels", markdown)
    with torch.no_grad():
        for section in args.sections:
            rows = result.setdefault(section, [])
            for shape in shapes[section]:
                harness.attempt(result, f"{section} {shape[0]}", lambda: rows.append(run[section](shape)), report)
    paths = report.save(result)
    print(markdown(result) + f"\nwrote {paths[0]}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
