"""Inductor's kernels inside our graphs: one CFG denoising step of DiT-XL/2 at 256 px (random weights, bf16).

Systems, at 1 and 64 images (2 and 128 transformer rows), median ms of ``GraphRunner.run`` (or the loop
body), synchronised:
  diffusers            the loop body of diffusers' DiTPipeline, eager (bench/step_latency.py's)
  breakable            our engine's runner: breakable graphs, each layer's attention an eager break
  breakable+inductor   the same with ``EngineConfig(compile="inductor")``: the step compiled once with a
                       dynamic batch, Inductor's kernels captured between the breaks (graphs.compiled),
                       the breaks given non-owning aliases of Inductor's buffers (the default)
  breakable+inductor+staged  the same, its compiled breaks given staged copies instead
                       (graphs.compiled.set_break_args; reports before 2026-12-01 called this one
                       breakable+inductor, and the aliased one breakable+inductor+aliased)
  full+inductor        the compiled step captured whole, one CUDA graph per bucket, the model patched as
                       the engine serves DiT: q, k, v one product, the attention kernel measured per shape,
                       every block's modulation computed at once (workers.patches)
  full+inductor+blocks the same with ``compile_scope="blocks"``: the transformer's repeated blocks compiled,
                       one graph per block class, the code between them uncompiled in the same graph
                       (graphs.compiled, "Regions"; DiT keeps its whole step); +fp8 likewise
  full+inductor+unpatched  the same on diffusers' model as it is (its attention processor, q, k, v three
                       products, PyTorch's kernel rule, each block's own modulation): what ``full`` ran
                       before 2026-12-01, and what torch.compile of diffusers' model gets
  breakable+fp8        breakable with the model loaded in ``precision="fp8"`` (workers/fp8.py: the block
  full+inductor+fp8    linears as FP8 matrix products, the same seeded weights); skipped where the GPU has
                       no FP8 (compute capability below 8.9)
plus the graph pool and the segments per bucket of each; the largest |x_next| difference of each compiled
system from `breakable` on the same inputs and its relative norm (full+inductor+unpatched runs diffusers' own model); the seconds each engine took to warm (full+inductor compiles its own graph, cold);
and the start of a breakable+inductor worker in a fresh process, before anything else runs: cold (an
empty cache directory) and warm (the same directory again): seconds to a warmed engine, seconds spent in
calls that compiled, Inductor's FX-graph cache hits and misses. Also the step's FLOPs (torch's
FlopCounterMode on the uncompiled step) and the bf16 and FP8 matrix-product peaks measured in the same
run (8192^3), so each system's TFLOP/s and share of the peak are in the report, and in
kernels_tflops.png when matplotlib is installed. Each part runs in its own try: a failure
is recorded in the report and the rest still runs. Writes kernels.json and kernels.md (kernels_smoke.*
with --smoke) under --out after each part.

    python bench/step_kernels.py                                   # on a GPU (~5 min on an H200)
    python bench/step_kernels.py --model pixart-sigma-1024 --images 1 8 --max-batch 8
    python bench/step_kernels.py --systems breakable breakable+fp8 full+inductor+fp8 --no-start
    python bench/step_kernels.py --smoke                           # the digits model on a CPU (~1 min)
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

BENCH = Path(__file__).resolve().parent


def _bench_module(name: str):
    """A sibling benchmark file as a module (bench/ is not a package), loaded once."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


SYSTEMS = {  # name -> (backend, compile, precision, how compiled breaks get their tensors, model patched, scope)
    "breakable": ("breakable", "off", "bf16", "staged", True, "step"),
    "breakable+inductor": ("breakable", "inductor", "bf16", "aliased", True, "step"),
    "breakable+inductor+staged": ("breakable", "inductor", "bf16", "staged", True, "step"),
    "full+inductor": ("full", "inductor", "bf16", "aliased", True, "step"),
    "full+inductor+blocks": ("full", "inductor", "bf16", "aliased", True, "blocks"),
    "full+inductor+unpatched": ("full", "inductor", "bf16", "aliased", False, "step"),
    "breakable+fp8": ("breakable", "off", "fp8", "aliased", True, "step"),
    "full+inductor+fp8": ("full", "inductor", "fp8", "aliased", True, "step"),
    "full+inductor+fp8+blocks": ("full", "inductor", "fp8", "aliased", True, "blocks"),
    "breakable+fp8+torchquant": ("breakable", "off", "fp8", "aliased", True, "step"),
    "full+inductor+fp8+torchquant": ("full", "inductor", "fp8", "aliased", True, "step"),
}
SYSTEMS.update({f"{name}+nofa4": SYSTEMS[name] for name in  # the same systems, FlashAttention-4 left out
                ("breakable", "full+inductor", "full+inductor+blocks", "full+inductor+fp8", "full+inductor+fp8+blocks")})
SYSTEMS.update({f"{name}+nonorms": SYSTEMS[name] for name in ("breakable+fp8", "full+inductor+fp8", "full+inductor+fp8+blocks")})
SYSTEMS.update({f"{name}+rawbreaks": SYSTEMS[name] for name in ("breakable+fp8", "full+inductor+fp8", "full+inductor+fp8+blocks")})
SYSTEMS.update({f"{name}+promoted": SYSTEMS[name] for name in ("breakable+fp8", "full+inductor+fp8", "full+inductor+fp8+blocks")})
SYSTEMS.update({f"{name}+fp8attention": (*SYSTEMS[name][:2], "fp8+attention", *SYSTEMS[name][3:])
                for name in ("breakable+fp8", "full+inductor+fp8", "full+inductor+fp8+blocks")})
SYSTEMS.update({f"{name}+unfolded": SYSTEMS[name] for name in ("full+inductor+fp8+blocks",
                                                                  "full+inductor+fp8+blocks+fp8attention")})
SYSTEMS["full+inductor+fp8+blocks+fp8attention+requantized"] = SYSTEMS["full+inductor+fp8+blocks+fp8attention"]
SYSTEMS["full+inductor+fp8+blocks+fp8attention+inductorcodes"] = SYSTEMS["full+inductor+fp8+blocks+fp8attention"]
SYSTEMS["full+inductor+fp8+blocks+fp8attention+nonorms"] = SYSTEMS["full+inductor+fp8+blocks+fp8attention"]
SYSTEMS.update({f"{name}+nohoist": SYSTEMS[name] for name in ("full+inductor+blocks", "full+inductor+fp8+blocks",
                                                                 "full+inductor+fp8+blocks+fp8attention")})
SYSTEMS.update({f"{name}+inductorqkv": SYSTEMS[name] for name in ("full+inductor+blocks", "full+inductor+fp8+blocks")})
SYSTEMS.update({f"{name}+notables": SYSTEMS[name] for name in ("full+inductor+blocks", "full+inductor+fp8+blocks",
                                                                  "full+inductor+fp8+blocks+fp8attention")})
SYSTEMS["full+inductor+fp8+blocks+fp8attention+norotary"] = SYSTEMS["full+inductor+fp8+blocks+fp8attention"]
# +norotary: FLUX.1's transformer makes its rotary tables every step, as diffusers' forward does, instead of
# reading the ones make_step made once for the shape (workers.families.flux.ROTARY_ONCE off)
# +inductorqkv: FLUX.1's bf16 attention takes q, k, v from Inductor's kernels of the norms, the rotary embedding and
# the concatenation, instead of workers.rope_kernel.joint_qkv's one pass (rope_kernel.BF16 off)
# +notables: SD3's and FLUX.1's step multiplies its modulation itself (the one hoisted product a step), instead of
# reading its rows of the requests' modulation tables made at admission (workers.modulation.TABLES off)
# +nohoist: SD3's and FLUX.1's norms each multiply their own modulation, instead of one product of the step's
# embedding for all of them (workers.modulation)
# +inductorcodes: FLUX.1's q, k, v codes for FP8 attention made by Inductor from the norms and the rotation in the
# step's code, instead of by workers.rope_kernel's two kernels
# +requantized: FP8 attention's output turned into bf16 and quantized again by the output projections, instead of
# read as codes (workers.joint_attention.HAND_CODES off)
# +unfolded: FLUX.1's FP8 single blocks with their MLP's GELU as a pass of its own and proj_out's input concatenated
# and quantized after it, instead of folded into one quantization of the two (workers.fp8.fold_single_block_gelus)
# +torchquant: the FP8 systems with the activations quantized by PyTorch operations (what Inductor fuses
# them into when compiled, the GELU with them) instead of workers.quant_kernel's Triton kernel
# +nonorms: PixArt's, DiT's and FLUX.1's FP8 blocks without their norms fused with the quantizations
# (workers.norm_fusion; FLUX.1's norms and quantizations then by Inductor)
# +rawbreaks: the attention breaks write their bf16 output for the FP8 output projection to quantize, instead of
# its FP8 codes (workers.patches.QUANTIZED_BREAKS)
# +promoted: the FP8 products without cuBLASLt's fast accumulation (workers.fp8.FAST_ACCUM off: the partial sums
# promoted to float32 every few k-blocks); their difference from breakable (bf16) against the system's with it
# is the accuracy fast accumulation costs
# +fp8attention: the FP8 systems in precision "fp8+attention": SD3's and FLUX.1's joint attention in FP8 too
# (workers.fp8_attention, cuDNN's kernel); the same FP8 model as the system without it, its attention routed anew
# +nofa4: the system with FlashAttention-4 left out of the attention kernels measured per shape
# (workers.sdpa.candidates: PyTorch's three only); without the package installed it is the system itself


def device_setup(smoke: bool) -> tuple[str, torch.dtype]:
    return ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)


def iters(args, images: int) -> int:
    """Timed repetitions: as step_latency at 256 px."""
    return 3 if args.smoke else (30 if images <= 8 else 12)


def median_ms(fn, iters: int) -> float:
    """Median wall time of fn() in ms: step_latency's ``cuda_ms`` on a GPU, the same loop on a CPU."""
    if torch.cuda.is_available():
        return _bench_module("step_latency").cuda_ms(fn, iters)
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# -- what a step reads, per family ------------------------------------------------------------------
def step_inputs(model, images: int) -> dict[str, torch.Tensor]:
    """Our step's inputs for ``images`` images, seeded: DiT at step 10 of DDIM 50 with guidance 4 (as
    step_latency, with labels among the model's classes); PixArt as bench/pixart.py's step section, SD3
    and FLUX as bench/mmdit.py's."""
    if model.card.family == "pixart":
        px = _bench_module("pixart")
        return px.live_inputs(model, images, px.make_prompts(), px.Setup())
    if model.card.family in ("sd3", "flux"):
        mm = _bench_module("mmdit")
        return mm.live_inputs(model, images, mm.pb.make_prompts(), mm.Setup())
    from samplers import gather_rows, make_plan

    g, dev = torch.Generator().manual_seed(images), model.device
    t, coeffs = gather_rows([make_plan("ddim", 50, model.schedule)] * images, [10] * images)
    x = torch.randn(images, *model.latent_shape, generator=g)
    labels = torch.randint(0, model.num_classes, (images,), generator=g)
    return {k: v.to(dev) for k, v in dict(x=x, t=t, coeffs=coeffs, labels=labels, guidance=torch.full((images,), 4.0),
                                           hist=torch.zeros_like(x), noise=torch.zeros_like(x)).items()}


def diffusers_loop_body(model, images: int, inputs: dict):
    """The reference pipeline's loop body at ``images`` images, or a reason it cannot run on this model."""
    if model.card.family == "pixart":
        return _bench_module("pixart").diffusers_step(model, inputs, _bench_module("pixart").Setup())
    if model.card.family in ("sd3", "flux"):
        mm = _bench_module("mmdit")
        return mm.DIFFUSERS_STEP[model.card.family](model, inputs, mm.Setup())
    if model.num_classes != 1000:
        return f"step_latency.diffusers_step_fn draws ImageNet's 1000 classes; {model.name} has {model.num_classes}"
    return _bench_module("step_latency").diffusers_step_fn(model, images)


# -- systems ------------------------------------------------------------------------------------------
def build_engine(model, backend: str, compile_mode: str, max_batch: int, cache: str, patched: bool = True,
                 scope: str = "step", cross_attention: str = "auto"):
    """A warmed engine as a worker builds it; returns (engine, its runner, seconds to warm).
    ``cross_attention``: the text families' (``EngineConfig.cross_attention``)."""
    from workers.engine import Engine, EngineConfig

    t0 = time.perf_counter()
    engine = Engine(model, EngineConfig(backend=backend, max_batch=max_batch, compile=compile_mode,
                                        compile_cache=cache, attention_patch=patched, hoist_modulation=patched,
                                        compile_scope=scope, cross_attention=cross_attention))
    engine.warmup()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return engine, next(iter(engine.groups.values())).runner, time.perf_counter() - t0


def bench_system(model, name: str, args, inputs: dict, reference: dict) -> dict:
    """Median ms at each image count, pool, warm-up and compile stats; `breakable` fills ``reference``
    (x_next per image count), the others report their largest difference from it (and its norm relative
    to the reference's: the error FP8 adds)."""
    from workers import norm_fusion, sdpa
    from workers.families import family_of
    from workers.joint_attention import restore_joint_attention
    from workers.engine import table_inputs
    from workers.modulation import restore_temb_modulation
    from workers.patches import restore_attention, restore_modulation

    from graphs.compiled import break_args as current_break_args
    from graphs.compiled import set_break_args

    backend, compile_mode, _, break_args, patched, scope = SYSTEMS[name]
    before = current_break_args()
    if not patched:  # diffusers' own model (an earlier system patched it)
        norm_fusion.restore_block_norms(model.transformer)
        if family_of(model).BREAK_ATTENTION:
            restore_attention(model.transformer)
            restore_modulation(model.transformer)
        restore_joint_attention(model.transformer)
        restore_temb_modulation(model.transformer)
    set_break_args(break_args)
    try:
        engine, runner, warm_s = build_engine(model, backend, compile_mode, args.max_batch, str(args.cache),
                                              patched=patched, scope=scope)
    finally:
        set_break_args(before)
    stats = engine.stats()["groups"]
    block = {"warmup_s": round(warm_s, 2), "ms": {}, "max_abs_diff": {}, "rel_diff": {},
             "pool_mib": round(runner.stats()["pool_reserved_bytes"] / 2**20, 1),
             "compile": next(iter(stats.values())).get("compile"),
             "segments_per_bucket": {b: s["segments"] for b, s in runner.stats()["buckets"].items()},
             "fused_norm_blocks": norm_fusion.fused_blocks(model.transformer)}
    with torch.no_grad():
        for n, inp in inputs.items():
            inp = table_inputs(model, inp)  # the modulation tables where this system's step reads them
            block["ms"][n] = round(median_ms(lambda: runner.run(**inp), iters(args, n)), 3)
            x_next = runner.run(**inp)["x_next"].float()
            if name == "breakable":
                reference[n] = x_next
            elif n in reference:
                block["max_abs_diff"][n] = (x_next - reference[n]).abs().max().item()
                block["rel_diff"][n] = ((x_next - reference[n]).norm() / reference[n].norm()).item()
    block["attention_kernels"] = sdpa.CHOOSER.summary()  # what the shapes met so far were measured to run
    engine = runner = None  # its graphs and pool go before the next system's
    free()
    return block


def step_flops(model, inputs: dict) -> dict[int, int]:
    """FLOPs of one uncompiled step per image count (torch's FlopCounterMode: matrix products and
    attention), the work every system does."""
    from torch.utils.flop_counter import FlopCounterMode

    from workers.families import family_of

    step, out = family_of(model).make_step(model, tuple(model.latent_shape)), {}
    for n, inp in inputs.items():
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            step(**inp)
        out[n] = counter.get_total_flops()
    return out


def matmul_peak(device: str, fp8: bool = False, n: int = 8192) -> float | None:
    """TFLOP/s of an n x n x n bf16 matrix product on this GPU (FP8 with per-row scales: ``fp8``), the
    ceiling the steps are compared with; None on a CPU."""
    if device != "cuda":
        return None
    a, b = torch.randn(n, n, device=device, dtype=torch.bfloat16), torch.randn(n, n, device=device, dtype=torch.bfloat16)
    if fp8:
        from workers.fp8 import quantize_rows

        (aq, sa), (bq, sb) = quantize_rows(a), quantize_rows(b)
        fn = lambda: torch._scaled_mm(aq, bq.t(), sa, sb.t().contiguous(), out_dtype=torch.bfloat16)
    else:
        fn = lambda: a @ b
    ms = _bench_module("step_latency").cuda_ms(fn, 20)
    return round(2 * n ** 3 / (ms * 1e-3) / 1e12, 1)


def tflops_table(result: dict) -> list[str]:
    """TFLOP/s of each system at each image count, and its share of the bf16 matmul peak."""
    flops, peak = result.get("flops") or {}, result.get("matmul_peak_tflops") or {}
    if not flops:
        return []
    images = result["images"]
    lines = ["", f"TFLOP/s of a step (its FLOPs: {', '.join(f'{flops[n] / 1e12:.2f} T at {n}' for n in images if n in flops)}); "
             f"measured matmul peak {peak.get('bf16')} TFLOP/s bf16, {peak.get('fp8')} fp8:", "",
             "| system | " + " | ".join(f"{n} image{'s' * (n > 1)}" for n in images) + " |", "|---|" + "---|" * len(images)]
    for name, block in result["systems"].items():
        cells = []
        for n in images:
            ms = block.get("ms", {}).get(n)
            if ms is None or n not in flops:
                cells.append("-")
                continue
            t = flops[n] / (ms * 1e-3) / 1e12
            cells.append(f"{t:.0f}" + (f" ({t / peak['bf16']:.0%})" if peak.get("bf16") else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def plot_tflops(result: dict, path: Path) -> Path | None:
    """TFLOP/s against rows per system, with the measured peaks as lines (matplotlib, when installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    flops, peak = result.get("flops") or {}, result.get("matmul_peak_tflops") or {}
    rows = result.get("rows_per_image", 2)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, block in result["systems"].items():
        pts = [(rows * n, flops[n] / (ms * 1e-3) / 1e12) for n, ms in block.get("ms", {}).items() if n in flops]
        if pts:
            ax.plot(*zip(*sorted(pts)), marker="o", label=name)
    for kind, value in peak.items():
        if value:
            ax.axhline(value, linestyle="--", linewidth=1, color="grey")
            ax.annotate(f"{kind} matmul peak", (1, value), textcoords="offset points", xytext=(2, 2), fontsize=8)
    ax.set(xscale="log", xlabel=f"transformer rows ({rows} per image)", ylabel="TFLOP/s",
           title=f"{result['model']}: one step on {result['hardware']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# -- a worker's start, in a fresh process ---------------------------------------------------------------
def child(args) -> dict:
    """Load the model and warm a breakable+inductor engine with --cache; what the parent records."""
    from workers.loading import load_model

    device, dtype = device_setup(args.smoke)
    t0 = time.perf_counter()
    model = load_model(args.model, device=device, dtype=dtype)
    load_s = time.perf_counter() - t0
    engine, _, warm_s = build_engine(model, "breakable", "inductor", args.max_batch, str(args.cache))
    return {"load_s": round(load_s, 2), "ready_s": round(warm_s, 2),
            "compile": next(iter(engine.stats()["groups"].values()))["compile"]}


def start(args, kind: str) -> dict:
    """One child run (``kind``: "cold" or "warm" is what the cache holds by then) and its wall time."""
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--max-batch", str(args.max_batch),
           "--cache", str(args.cache)] + (["--smoke"] if args.smoke else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} start exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_s": round(time.perf_counter() - t0, 2)}


# -- the run --------------------------------------------------------------------------------------------
def run(args, result: dict, save) -> None:
    from workers.loading import load_model

    from workers import fp8, fp8_attention, joint_attention, modulation, norm_fusion, patches, rope_kernel, sdpa
    from workers.families import flux as flux_family
    from workers.fp8 import unsupported_reason

    for kind in ("cold", "warm") if args.start else ():  # first, while this process holds no GPU memory
        attempt(result, f"start/{kind}", lambda: result["start"].__setitem__(kind, start(args, kind)), save)
    device, dtype = device_setup(args.smoke)
    model = load_model(args.model, device=device, dtype=dtype)
    models = {"bf16": model}
    inputs = {n: step_inputs(model, n) for n in args.images}
    result["rows_per_image"] = _bench_module("mmdit").rows_per_image(model)  # 1 where guidance is not CFG
    reference: dict = {}
    attempt(result, "flops", lambda: result.__setitem__("flops", step_flops(model, inputs)), save)
    attempt(result, "matmul peak", lambda: result.__setitem__("matmul_peak_tflops", {
        "bf16": matmul_peak(device), "fp8": matmul_peak(device, fp8=True) if unsupported_reason(device) is None else None}),
        save)

    def diffusers() -> None:
        block = result["systems"]["diffusers"] = {"ms": {}}
        with torch.no_grad():
            for n, inp in inputs.items():
                body = diffusers_loop_body(model, n, inp)
                if isinstance(body, str):
                    block["skipped"] = body
                    return
                block["ms"][n] = round(median_ms(body, iters(args, n)), 3)

    def system(name: str) -> None:
        precision = SYSTEMS[name][2]
        if precision != "bf16" and (why := unsupported_reason(device)) is not None:
            result["systems"][name] = {"skipped": why}
            return
        if precision == "fp8+attention" and (why := fp8_attention.unavailable_reason(device)) is not None:
            result["systems"][name] = {"skipped": why}
            return
        loaded = "fp8" if precision == "fp8+attention" else precision  # one FP8 load: the engine routes attention
        if loaded not in models:  # the same seeded weights, its block linears in FP8
            models[loaded] = load_model(args.model, device=device, dtype=dtype, precision=loaded)
        sdpa.CHOOSER.choices.clear()  # each system measures its own kernels per shape
        offered = (lambda q, k=None: sdpa.CANDIDATES) if name.endswith("+nofa4") else sdpa.candidates
        norms = not name.endswith("+nonorms")
        if name.endswith("+unfolded"):  # FLUX.1's fused single blocks are folded ones: their own class first
            norm_fusion.restore_block_norms(models[loaded].transformer)
        unfolded = fp8.unfold_single_block_gelus(models[loaded].transformer) if name.endswith("+unfolded") else 0
        if not norms:  # an earlier system's engine patched the shared model's blocks
            norm_fusion.restore_block_norms(models[loaded].transformer)
        with mock.patch.object(fp8, "ROW_KERNEL", not name.endswith("+torchquant")), \
                mock.patch.object(sdpa, "candidates", offered), mock.patch.object(norm_fusion, "ENABLED", norms), \
                mock.patch.object(patches, "QUANTIZED_BREAKS", not name.endswith("+rawbreaks")), \
                mock.patch.object(fp8, "FAST_ACCUM", not name.endswith("+promoted")), \
                mock.patch.object(joint_attention, "HAND_CODES", not name.endswith("+requantized")), \
                mock.patch.object(rope_kernel, "ENABLED", not name.endswith("+inductorcodes")), \
                mock.patch.object(modulation, "ENABLED", not name.endswith("+nohoist")), \
                mock.patch.object(rope_kernel, "BF16", not name.endswith("+inductorqkv")), \
                mock.patch.object(modulation, "TABLES", not name.endswith("+notables")), \
                mock.patch.object(flux_family, "ROTARY_ONCE", not name.endswith("+norotary")), \
                mock.patch.object(models[loaded], "precision", precision):
            result["systems"][name] = bench_system(models[loaded], name, args, inputs, reference)
        if unfolded:
            fp8.fold_single_block_gelus(models[loaded].transformer)

    if "diffusers" in args.systems:
        attempt(result, "diffusers", diffusers, save)
    for name in [s for s in SYSTEMS if s in args.systems]:
        attempt(result, name, lambda: system(name), save)


def attempt(result: dict, part: str, fn, save) -> None:
    """Run one part; an exception is recorded under errors[part] (the report keeps the other parts)."""
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # a benchmark part failing is a result to report, not a reason to stop
        result["errors"][part] = f"{type(exc).__name__}: {exc}"[:4000]
        free()
    print(f"{part}: {time.perf_counter() - t0:.1f} s" + (f" FAILED {result['errors'][part][:300]}"
                                                         if part in result["errors"] else ""), flush=True)
    save()


def markdown(result: dict) -> str:
    images, rows = result["images"], result.get("rows_per_image", 2)
    step = "one CFG step" if rows == 2 else "one step (guidance embedded)"
    lines = [f"# Inductor inside our graphs: {result['model']}, {step} (median ms)", "",
             f"{result['hardware']}; torch {result['torch']}, triton {result['triton']}, diffusers "
             f"{result['diffusers']}; buckets up to {result['max_batch']}.", "",
             "| system | " + " | ".join(f"{n} image{'s' * (n > 1)} ({rows * n} row{'s' * (rows * n > 1)})" for n in images)
             + " | graph pool MiB | max abs diff x_next vs breakable | relative diff | warm-up s | compiling s (graphs) |",
             "|---|" + "---|" * (len(images) + 5)]
    for name, block in result["systems"].items():
        ms = [f"{block['ms'][n]:.2f}" if n in block.get("ms", {}) else "-" for n in images]
        diff = ", ".join(f"{d:.2e}" for d in block.get("max_abs_diff", {}).values())
        rel = ", ".join(f"{d:.2e}" for d in block.get("rel_diff", {}).values())
        c = block.get("compile")
        compiling = f"{c['compile_s']} ({c['graphs']} + {c.get('one_row_graphs', 0)} one-row)" if c else ""
        lines.append(f"| {name} | " + " | ".join(ms) + f" | {block.get('pool_mib', '')} | {diff} | {rel} | "
                     f"{block.get('warmup_s', '')} | {compiling} |")
    lines += [f"\n{name} skipped: {block['skipped']}" for name, block in result["systems"].items() if "skipped" in block]
    lines += tflops_table(result)
    lines += ["", "Worker start with compile=\"inductor\" (breakable), a fresh process each:", "",
              "| cache | process s | model load s | engine ready s | in compiling calls s | FX cache hits / misses |",
              "|---|---|---|---|---|---|"]
    for kind, s in result["start"].items():
        c = s["compile"] or {}
        lines.append(f"| {kind} | {s['process_s']} | {s['load_s']} | {s['ready_s']} | {c.get('compile_s')} | "
                     f"{c.get('fx_cache_hits')} / {c.get('fx_cache_misses')} |")
    lines += [""] + [f"- {part} failed: `{err.splitlines()[0][:300]}`" for part, err in result["errors"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dit-xl-2-256", help="a built-in or a model directory (default dit-xl-2-256)")
    p.add_argument("--images", type=int, nargs="+", default=[1, 64], help="images per step (rows are twice that)")
    p.add_argument("--max-batch", type=int, default=64, help="largest bucket of the engines")
    p.add_argument("--cache", type=Path, help="Inductor cache directory; must be empty (default: a fresh temp dir)")
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    p.add_argument("--child-timeout", type=float, default=420.0, help="seconds a worker start may take")
    p.add_argument("--smoke", action="store_true", help="the digits model on a CPU, small batches")
    p.add_argument("--systems", nargs="+", default=["diffusers", *SYSTEMS], choices=["diffusers", *SYSTEMS],
                   help="which systems to run (default: all; breakable is the reference of the differences)")
    p.add_argument("--no-start", dest="start", action="store_false", help="skip the cold and warm worker starts")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # a worker start, for the parent
    args = p.parse_args(argv)
    if args.smoke and args.model == "dit-xl-2-256":
        args.model, args.images, args.max_batch = "digits", [1, 4], 4
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.child:
        print(json.dumps(child(args)))
        return
    args.cache = args.cache or Path(tempfile.mkdtemp(prefix="kernels-inductor-"))
    if args.cache.exists() and any(args.cache.iterdir()):
        raise SystemExit(f"--cache {args.cache} is not empty: the cold start needs an empty cache")
    result = {"model": args.model, "images": args.images, "max_batch": args.max_batch, **versions(args.smoke),
              "cache": str(args.cache), "systems": {}, "start": {}, "errors": {}}
    name = "kernels_smoke" if args.smoke else "kernels"
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / f"{name}.md").write_text(markdown(result))
        if result.get("flops"):
            plot_tflops(result, args.out / f"{name}_tflops.png")

    t0 = time.perf_counter()
    run(args, result, save)
    result["bench_s"] = round(time.perf_counter() - t0, 1)
    save()
    print(markdown(result) + f"\nbenchmark took {result['bench_s']:.0f} s")


def versions(smoke: bool) -> dict:
    import diffusers

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    hardware = torch.cuda.get_device_name() if not smoke and torch.cuda.is_available() else \
        f"CPU ({platform.processor() or platform.machine()})"
    return {"hardware": hardware, "torch": torch.__version__, "triton": triton_version,
            "diffusers": diffusers.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}


if __name__ == "__main__":
    main()
