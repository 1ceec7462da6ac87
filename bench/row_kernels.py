"""The two kernels a compiled FP8 step leaves on its own: row quantization and attention (median us).

Row quantization (``workers.quant_kernel``): the FP8 linears' activation quantization, at the shapes each
family's step runs (rows = tokens of a batch; K = a linear's input width; the feed-forward's second
linear with its GELU folded in). Systems per shape:
  copy         PyTorch's bf16 -> float8 cast of the same rows: the same bytes read and written, no
               reduction, the roof a quantization can reach
  torch        workers.fp8's PyTorch path (what runs off CUDA), eager
  inductor     the same compiled by Inductor (what the step got before the kernel)
  whole/...    the Triton kernel, a row (or ``rows`` rows) per program held in registers, by warps
  split/...    the same, one row held as powers of two side by side (/fast: the tanh GELU's tanh by the
               approximate instruction)
  chunked/...  the Triton kernel reading each row in chunks twice
Each is timed as 20 calls in one CUDA graph (as the step replays them), by CUDA events, median of 15
replays. Every Triton plan's codes and scales must equal the first plan's of its kind bit for bit (exact
or fast tanh: each kind computes the same float32 arithmetic); a plan that differs or fails is reported,
not timed; the fast tanh's codes are compared with the exact ones (share differing, largest step). GB/s counts the bf16
read, the FP8 write and the scales.

Attention (``workers.sdpa``'s candidates) at the families' shapes, head dim 72 also zero-padded to 80,
96 and 128 (q and k padded with zeros keep every score; v padded gives zero columns, sliced off; the
scale stays 1/sqrt(72)): whether a kernel runs a padded head faster than the real one. Tensors in the
(B, T, heads, d) layout the projections write, viewed as (B, heads, T, d). TFLOP/s count the real
head dim. Each output is checked against the math kernel on the first batch row. On GPUs with FP8
tensor cores, also ``bench/fp8_attention.py``'s FP8 kernel (a candidate the engine does not run): alone
at several tilings, then with its quantization of q, k and v; its error against the math kernel reported.

    python bench/row_kernels.py                  # on a GPU (~2 min on an H200)
    python bench/row_kernels.py --smoke          # CPU: the PyTorch systems on small shapes
Writes row_kernels.json and row_kernels.md (row_kernels_smoke.* with --smoke) under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from workers import fp8, quant_kernel, sdpa
from workers.quant_kernel import Plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fp8_attention  # noqa: E402 - beside this script

QUANT_SHAPES = [  # (where, rows, K, gelu folded in)
    ("dit-xl-2-256, 64 images: q/k/v, out", 32768, 1152, "none"),
    ("dit-xl-2-256, 64 images: ff out", 32768, 4608, "tanh"),
    ("pixart-sigma-1024, 1 image: q/k/v, out", 8192, 1152, "none"),
    ("pixart-sigma-1024, 1 image: ff out", 8192, 4608, "tanh"),
    ("sd35-medium-1024, 1 image: image q/k/v, out", 8192, 1536, "none"),
    ("sd35-medium-1024, 1 image: image ff out", 8192, 6144, "tanh"),
    ("flux-dev-1024, 1 image: double q/k/v, out", 4096, 3072, "none"),
    ("flux-dev-1024, 1 image: double ff out", 4096, 12288, "tanh"),
    ("flux-dev-1024, 1 image: single proj_out", 4608, 15360, "none"),
]
SMOKE_QUANT = [("small", 64, 1152, "none"), ("small ff", 64, 4608, "tanh")]
ATTN_SHAPES = [  # (where, batch, heads, q tokens, k tokens, head dim)
    ("dit-xl-2-256, 64 images", 128, 16, 256, 256, 72),
    ("pixart-sigma-512, 1 image", 2, 16, 1024, 1024, 72),
    ("pixart-sigma-1024, 1 image", 2, 16, 4096, 4096, 72),
    ("pixart-sigma-1024, 1 image, cross", 2, 16, 4096, 300, 72),
    ("sd35-medium-1024, 1 image", 2, 24, 4429, 4429, 64),
    ("flux-dev-1024, 1 image", 1, 24, 4608, 4608, 128),
    ("flux-dev-512, 1 image", 1, 24, 1536, 1536, 128),
    ("dit-xl-2-256, 1 image", 2, 16, 256, 256, 72),
]
SMOKE_ATTN = [("small", 2, 4, 64, 64, 72)]
PADS = (80, 96, 128)
BACKENDS = ("flash", "cudnn", "efficient")
TILES = [fp8_attention.Tiles(m, n, w, st) for m, n, w, st in  # (queries, keys, warps, stages) per program
         ((128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 3),
          (128, 64, 8, 4), (128, 32, 4, 4))]


def plans(k: int, gelu: str = "none") -> list[Plan]:
    """The layouts worth timing for rows of K: whole rows at 4..64 values a thread, several small rows a
    program, split rows at 8..128 values a thread (the tanh GELU exact and fast), and chunks of 256..2048
    at 2..16 values a thread. The first is the first kernel's layout."""
    block, parts = quant_kernel._next_pow2(k), quant_kernel.split_parts(k)
    out = [Plan("whole", block, 1, w) for w in (1, 2, 4, 8, 16, 32) if 4 <= block // (32 * w) <= 64]
    out += [Plan("whole", block, r, w) for r in (2, 4, 8) for w in (4, 8) if block * r <= 8192
            and 4 <= block * r // (32 * w) <= 64]
    out += [Plan("split", parts[0], 1, w, parts, fast) for fast in ((False, True) if gelu == "tanh" else (False,))
            for w in (1, 2, 4, 8, 16) if 8 <= sum(parts) // (32 * w) <= 128]
    out += [Plan("chunked", c, 1, w) for c in (256, 512, 1024, 2048) for w in (1, 2, 4, 8) if c <= k
            and 2 <= c // (32 * w) <= 16]
    first = quant_kernel.whole_plan(k)
    return [first] + [p for p in out if p != first]


def label(plan: Plan) -> str:
    if plan.kind == "split":
        return f"split/{'+'.join(map(str, plan.parts))}/w{plan.warps}{'/fast' * plan.fast}"
    return f"{plan.kind}/b{plan.block}/r{plan.rows}/w{plan.warps}"


def code_steps(q: torch.Tensor, ref: torch.Tensor) -> dict:
    """How two FP8 quantizations of the same rows differ: the share of codes that differ and the largest
    difference in code steps (e4m3's codes of one sign are ordered like their bit patterns)."""
    a, b = q.view(torch.uint8).int(), ref.view(torch.uint8).int()
    signed = lambda c: torch.where(c >= 128, -(c - 128), c)  # noqa: E731 - sign-magnitude -> ordered integers
    steps = (signed(a) - signed(b)).abs()
    return {"differ": round((steps > 0).float().mean().item(), 6), "max_steps": int(steps.max().item())}


def graph_us(fn, calls: int = 20, reps: int = 15) -> float:
    """Median microseconds of one ``fn()`` captured ``calls`` times into one CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times[2:])


def cpu_us(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def torch_quant(x: torch.Tensor, gelu: str):
    """workers.fp8's PyTorch path (its row kernel off)."""
    saved, fp8.ROW_KERNEL = fp8.ROW_KERNEL, False
    try:
        return fp8.quantize_rows(x, gelu)
    finally:
        fp8.ROW_KERNEL = saved


def bench_quant(shape, cuda: bool) -> dict:
    where, m, k, gelu = shape
    device = "cuda" if cuda else "cpu"
    g = torch.Generator(device=device).manual_seed(k)
    x = torch.randn(m, k, device=device, generator=g, dtype=torch.bfloat16)
    timer = graph_us if cuda else cpu_us
    bytes_moved = m * k * 3 + m * 4
    row = {"where": where, "rows": m, "K": k, "gelu": gelu, "us": {}, "errors": {}}
    out = torch.empty(m, k, dtype=fp8.FP8, device=device)
    row["us"]["copy"] = timer(lambda: out.copy_(x))
    row["us"]["torch"] = timer(lambda: torch_quant(x, gelu))
    if cuda:
        compiled = torch.compile(lambda t: torch_quant(t, gelu), dynamic=False)
        row["us"]["inductor"] = timer(lambda: compiled(x))
        references = {}  # fast or not -> the first such plan's codes and scales
        for plan in plans(k, gelu):
            name = label(plan)
            fast = plan.fast and gelu == "tanh"
            try:
                q, s = quant_kernel.launch(x, gelu, plan)
                if fast not in references:
                    references[fast] = (q.view(torch.uint8).clone(), s.clone())
                    if fast:  # the approximate tanh against the exact formula
                        row["fast_vs_exact"] = {**code_steps(q, references[False][0].view(fp8.FP8)),
                                                "scale_rel": (s / references[False][1] - 1).abs().max().item()}
                elif not (torch.equal(q.view(torch.uint8), references[fast][0]) and torch.equal(s, references[fast][1])):
                    row["errors"][name] = "differs from the first plan of its kind"
                    continue
                row["us"][name] = timer(lambda plan=plan: quant_kernel.launch(x, gelu, plan))
            except Exception as e:  # noqa: BLE001 - a plan Triton cannot build is reported, the rest run
                row["errors"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    row["us"] = {n: round(v, 2) for n, v in row["us"].items()}
    row["gb_s"] = {n: round(bytes_moved / (v * 1e-6) / 1e9, 1) for n, v in row["us"].items()}
    triton_rows = {n: v for n, v in row["us"].items() if "/" in n}
    if triton_rows:
        row["best"] = min(triton_rows, key=triton_rows.get)
    return row


def padded(t: torch.Tensor, d: int) -> torch.Tensor:
    """(B, T, heads, d0) -> (B, T, heads, d) with zero columns, as a projection with zero rows writes it."""
    return F.pad(t, (0, d - t.shape[-1])) if d > t.shape[-1] else t


def bench_attention(shape, cuda: bool) -> dict:
    where, b, h, lq, lk, d = shape
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    g = torch.Generator(device=device).manual_seed(lq + lk)
    q, k, v = (torch.randn(b, n, h, d, device=device, dtype=dtype, generator=g) for n in (lq, lk, lk))
    ref = F.scaled_dot_product_attention(*(t[:1].transpose(1, 2).float() for t in (q, k, v)))
    flops = 4 * b * h * lq * lk * d
    row = {"where": where, "shape": [b, h, lq, lk, d], "us": {}, "tflops": {}, "errors": {}}
    timer = graph_us if cuda else cpu_us
    from torch.nn.attention import sdpa_kernel

    from workers.sdpa import KERNELS

    for backend in BACKENDS if cuda else ("math",):
        for dp in (d, *[p for p in PADS if p > d]) if d == 72 else (d,):
            name = f"{backend}/d{dp}"
            qp, kp, vp = (padded(t, dp).transpose(1, 2) for t in (q, k, v))

            def call(qp=qp, kp=kp, vp=vp, backend=backend):
                with sdpa_kernel([KERNELS[backend]]):
                    return F.scaled_dot_product_attention(qp, kp, vp, scale=1 / math.sqrt(d))
            try:
                err = ((call()[:1, ..., :d].float() - ref).abs().max() / ref.abs().max()).item()
                if err > 2e-2:
                    row["errors"][name] = f"differs from the math kernel by {err:.1e}"
                    continue
                row["us"][name] = round(timer(call), 2)
                row["tflops"][name] = round(flops / (row["us"][name] * 1e-6) / 1e12, 1)
            except RuntimeError as e:
                row["errors"][name] = f"does not run: {str(e).splitlines()[0][:120]}"
    if cuda and sdpa.fa4_forward() is not None and torch.cuda.get_device_capability()[0] >= 9:
        bench_fa4(row, q, k, v, ref, flops, timer)
    if cuda and fp8_attention.available(q):
        bench_fp8_attention(row, q, k, v, ref, flops, timer)
    if row["us"]:
        row["best"] = min(row["us"], key=row["us"].get)
    return row


def bench_fa4(row: dict, q, k, v, ref, flops: float, timer) -> None:
    """FlashAttention-4 (``workers.sdpa``'s "fa4" candidate) at the real head size, as the engine calls it:
    (B, heads, T, d) views of the projections' layout, the output written into a (B, T, heads, d) buffer."""
    b, lq, h, _ = q.shape
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    out = torch.empty(b, lq, h, v.shape[-1], dtype=q.dtype, device=q.device).transpose(1, 2)
    for kernel in sdpa.FA4_TILES:
        name = f"{kernel}/d{q.shape[-1]}"
        try:
            err = ((sdpa.run(kernel, qt, kt, vt, out)[:1].float() - ref).abs().max() / ref.abs().max()).item()
            if err > 2e-2:
                row["errors"][name] = f"differs from the math kernel by {err:.1e}"
                continue
            row["us"][name] = round(timer(lambda kernel=kernel: sdpa.run(kernel, qt, kt, vt, out)), 2)
            row["tflops"][name] = round(flops / (row["us"][name] * 1e-6) / 1e12, 1)
        except Exception as e:  # noqa: BLE001 - a shape or tiling the package does not take is reported
            row["errors"][name] = f"does not run: {type(e).__name__}: {str(e).splitlines()[0][:160]}"


def bench_fp8_attention(row: dict, q, k, v, ref, flops: float, timer) -> None:
    """``fp8_attention``'s kernel at each of TILES on inputs quantized beforehand (the kernel alone), then
    the fastest tiling with its PyTorch quantization of q, k and v timed in. Errors are reported (largest
    and rms, relative to the reference's), not judged: FP8 changes the result by design."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    out = torch.empty(qt.shape, dtype=q.dtype, device=q.device)
    quantized = fp8_attention.quantize_qkv(qt, kt, vt)
    row["fp8_error"] = {}
    for tiles in TILES:
        name = f"ours-fp8/{tiles.block_m}x{tiles.block_n}w{tiles.warps}s{tiles.stages}"
        try:
            err = fp8_attention.launch(*quantized, out, tiles)[:1].float() - ref
            rms = (err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
            row["fp8_error"][name] = {"max": round((err.abs().max() / ref.abs().max()).item(), 4), "rms": round(rms, 4)}
            row["us"][name] = round(timer(lambda tiles=tiles: fp8_attention.launch(*quantized, out, tiles)), 2)
            row["tflops"][name] = round(flops / (row["us"][name] * 1e-6) / 1e12, 1)
        except Exception as e:  # a tiling the compiler or the GPU cannot run (shared memory, registers)
            row["errors"][name] = f"does not run: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    ours = {n: u for n, u in row["us"].items() if n.startswith("ours-fp8/")}
    if ours:
        best = min(ours, key=ours.get)
        tiles = next(t for t in TILES if best.endswith(f"/{t.block_m}x{t.block_n}w{t.warps}s{t.stages}"))
        name = "ours-fp8+quantize/" + best.split("/")[-1]
        row["us"][name] = round(timer(lambda: fp8_attention.attention(qt, kt, vt, out, tiles)), 2)
        row["tflops"][name] = round(flops / (row["us"][name] * 1e-6) / 1e12, 1)


def markdown(result: dict) -> str:
    lines = [f"# Row quantization and attention kernels on {result['versions']['hardware']}", "",
             f"`{result['command']}`", "",
             f"torch {result['versions']['torch']}, triton {result['versions']['triton']}. Median us of one call "
             "(20 calls in one CUDA graph). Row quantization GB/s: bf16 read + FP8 write + scales.", "",
             "## Row quantization", "",
             "| where | rows x K | copy | torch | inductor | first kernel | best exact plan: us (GB/s) | "
             "best fast-tanh plan: us | fast vs exact codes: differ, max steps |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["quant"]:
        us, first = r["us"], label(quant_kernel.whole_plan(r["K"]))
        exact = {n: v for n, v in us.items() if "/" in n and not n.endswith("/fast")}
        fast = {n: v for n, v in us.items() if n.endswith("/fast")}
        best = min(exact, key=exact.get) if exact else None
        best_fast = min(fast, key=fast.get) if fast else None
        fe = r.get("fast_vs_exact")
        gelu = " +gelu" if r["gelu"] != "none" else ""
        exact_cell = f"{best}: {us[best]} ({r['gb_s'][best]})" if best else ""
        fast_cell = f"{best_fast}: {us[best_fast]}" if best_fast else ""
        fe_cell = f"{fe['differ']:.2%}, {fe['max_steps']}" if fe else ""
        lines.append(f"| {r['where']} | {r['rows']} x {r['K']}{gelu} | {us['copy']} ({r['gb_s']['copy']} GB/s) | "
                     f"{us['torch']} | {us.get('inductor', '')} | {us.get(first, '')} | {exact_cell} | {fast_cell} | "
                     f"{fe_cell} |")
    lines += ["", "## Attention", "", "| where | B, heads, Tq, Tk, d | kernel: us (TFLOP/s at the real d) | best |",
              "|---|---|---|---|"]
    for r in result["attention"]:
        cells = ", ".join(f"{n} {u} ({r['tflops'][n]})" for n, u in r["us"].items())
        lines.append(f"| {r['where']} | {', '.join(map(str, r['shape']))} | {cells} | {r.get('best', '')} |")
    errors = [(r["where"], n, e) for r in result["quant"] + result["attention"] for n, e in r["errors"].items()]
    if errors:
        lines += ["", "Not timed: " + "; ".join(f"{w} {n}: {e}" for w, n, e in errors)]
    return "\n".join(lines) + "\n"


def versions(cuda: bool) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    hardware = torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()})"
    return {"hardware": hardware, "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
            "python": platform.python_version()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    p.add_argument("--smoke", action="store_true", help="the PyTorch systems on small shapes on a CPU")
    p.add_argument("--sections", nargs="+", default=["quant", "attention"], choices=["quant", "attention"])
    p.add_argument("--stem", default=None, help="the report's file name (default row_kernels, or row_kernels_smoke)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    result = {"command": " ".join(["python bench/row_kernels.py", *(argv if argv is not None else sys.argv[1:])]),
              "versions": versions(cuda),
              "quant": [], "attention": []}
    if "quant" in args.sections:
        for shape in SMOKE_QUANT if args.smoke else QUANT_SHAPES:
            result["quant"].append(bench_quant(shape, cuda))
            print(json.dumps(result["quant"][-1]), flush=True)
    if "attention" in args.sections:
        for shape in SMOKE_ATTN if args.smoke else ATTN_SHAPES:
            result["attention"].append(bench_attention(shape, cuda))
            print(json.dumps(result["attention"][-1]), flush=True)
    stem = args.stem or ("row_kernels_smoke" if args.smoke else "row_kernels")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{stem}.md").write_text(text := markdown(result))
    print(text)
    return result


if __name__ == "__main__":
    main()
