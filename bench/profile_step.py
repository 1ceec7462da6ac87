"""Where one denoising step's time goes: the GPU kernels of one step, grouped by what they do.

For a model (a built-in with random weights, or a model directory) and an image count, each system's
engine is built and warmed as a worker builds it, then one step of its runner is profiled (torch.profiler,
CUDA activity, after warm-up; the median of --iters steps' totals). Kernels are grouped by name into
matrix products, attention, normalisation, fused/elementwise (Inductor's Triton kernels among them),
copies and the rest; the report has each group's ms per step and share, and the heaviest kernels.

Systems: ``plain`` (breakable graphs, the model's dtype), ``fused`` (compiled by Inductor inside the
graphs: ``compile="inductor"``, backend ``full`` for DiT, ``breakable`` otherwise), ``fp8`` (plain with
FP8 linears), ``fused+fp8``. Writes profile_<model>.json and .md under --out. ``--kernel-source N``
also copies the source of each row's N heaviest Inductor kernels (Triton, found by name in Inductor's
cache directory) to profile_<model>_kernels/, to read why a fused kernel is slow. ``--scope blocks``
compiles the transformer's blocks instead of the whole step; ``--by-shape`` adds the step's matrix
products by operand shape, each with its operands' strides and address alignments (the step run
uncaptured), to compare one product across systems.

    python bench/profile_step.py --model dit-xl-2-256 --images 1 64
    python bench/profile_step.py --model flux-dev-512 --images 8 --systems plain fused --scope blocks --by-shape
    python bench/profile_step.py --model flux-dev-1024 --images 1 --systems plain fp8
    python bench/profile_step.py --systems fused+fp8 --kernel-source 3
    python bench/profile_step.py --smoke          # digits on a CPU: operator names instead of kernels
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch

BENCH = Path(__file__).resolve().parent
SYSTEMS = {"plain": ("off", "bf16"), "fused": ("inductor", "bf16"), "fp8": ("off", "fp8"), "fused+fp8": ("inductor", "fp8"),
           "fused+fp8+nonorms": ("inductor", "fp8"),  # +nonorms: the blocks without workers.norm_fusion
           "fused+fp8+rawbreaks": ("inductor", "fp8"),  # +rawbreaks: without workers.patches.QUANTIZED_BREAKS
           "fused+fp8+promoted": ("inductor", "fp8"),  # +promoted: without workers.fp8.FAST_ACCUM
           "fused+fp8+fp8attention": ("inductor", "fp8+attention"),
           "fused+fp8+fp8attention+unfolded": ("inductor", "fp8+attention"),
           "fused+fp8+fp8attention+inductorcodes": ("inductor", "fp8+attention"),
           "fused+fp8+fp8attention+nonorms": ("inductor", "fp8+attention"),
           "fused+fp8+fp8attention+nohoist": ("inductor", "fp8+attention"),
           "fused+fp8+fp8attention+notables": ("inductor", "fp8+attention"),
           "fused+notables": ("inductor", "bf16")}  # +nohoist: without workers.modulation
# fp8attention: SD3's, FLUX.1's attention in FP8 too; +unfolded: FLUX.1's single blocks' GELU a pass of its own
# (workers.fp8.unfold_single_block_gelus); +inductorcodes: FLUX.1's q, k, v codes by Inductor's kernels, not
# workers.rope_kernel's
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


def _kernels():
    """bench/step_kernels.py (its engine builder, step inputs and cleanup), loaded through its own sibling loader."""
    if "step_kernels" not in sys.modules:
        spec = importlib.util.spec_from_file_location("step_kernels", BENCH / "step_kernels.py")
        sys.modules["step_kernels"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["step_kernels"])
    return sys.modules["step_kernels"]


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


def profile(runner, inputs: dict, iters: int, cuda: bool) -> dict[str, float]:
    """Total device ms per kernel name (CPU: per operator, self time) over ``iters`` steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with torch.no_grad():
        runner.run(**inputs)
        with torch_profile(activities=activities) as prof:
            for _ in range(iters):
                runner.run(**inputs)
            if cuda:
                torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        ms = (ev.device_time_total if cuda else ev.self_cpu_time_total) / 1e3
        if ms > 0 and (cuda or not ev.key.startswith(("ProfilerStep", "cuda"))):
            out[ev.key] = out.get(ev.key, 0.0) + ms
    return out


PRODUCT_OPS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm")


def _alignment(t: torch.Tensor) -> int:
    """The largest power of two, at most 256, that divides the tensor's address in bytes (cuBLAS picks among
    its kernels by the operands' alignment)."""
    ptr, a = t.data_ptr(), 1
    while a < 256 and ptr % (2 * a) == 0:
        a *= 2
    return a


def _layout_key(op: str, shapes) -> tuple:
    """How a product's layouts meet its by-shape row: the operator and its first three operand shapes (an
    ``out=`` tensor, when passed, comes fourth)."""
    return op, tuple(tuple(x) for x in list(shapes)[:3])


def product_layouts(runner, bucket: int, compiled: bool) -> dict[tuple, list[dict]]:
    """One uncaptured step's matrix products, each with its operands' strides and address alignments (the
    output's too when it is given), keyed as the by-shape rows are: (operator, first three operand shapes).
    A compiled step's products are Inductor's extern kernel calls (``extern_kernels.addmm`` and the like),
    recorded by wrapping them (the uncompiled code between a blocks-compiled step's blocks is not: its rows
    have no layouts); an uncompiled step's are recorded by a dispatch mode (under which a compiled step
    would not run its compiled code)."""
    from torch._inductor.select_algorithm import extern_kernels
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: dict[tuple, dict[tuple, int]] = {}

    def record(op: str, args: tuple, kwargs: dict) -> None:
        tensors = [a for a in (*args, kwargs.get("out")) if isinstance(a, torch.Tensor)]
        detail = (tuple(tuple(t.stride()) for t in tensors), tuple(_alignment(t) for t in tensors))
        by = seen.setdefault(_layout_key(op, (t.shape for t in tensors)), {})
        by[detail] = by.get(detail, 0) + 1

    ops = [op.removeprefix("aten::") for op in PRODUCT_OPS]
    with torch.no_grad():
        if compiled:
            saved = {op: getattr(extern_kernels, op) for op in ops if hasattr(extern_kernels, op)}

            def wrap(op, fn):
                def recorded(*args, **kwargs):
                    record(op, args, kwargs)
                    return fn(*args, **kwargs)
                return recorded

            try:
                for op, fn in saved.items():
                    setattr(extern_kernels, op, wrap(op, fn))
                runner._step(bucket)
            finally:
                for op, fn in saved.items():
                    setattr(extern_kernels, op, fn)
        else:
            class Products(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    name = func.overloadpacket.__name__
                    if name in ops:
                        record(name, args, kwargs or {})
                    return func(*args, **(kwargs or {}))

            with Products():
                runner._step(bucket)
    return {key: [{"strides": [list(x) for x in st], "alignment": list(al), "calls": c}
                  for (st, al), c in by.items()] for key, by in seen.items()}


def products_by_shape(runner, inputs: dict, iters: int, cuda: bool, compiled: bool = False) -> list[dict]:
    """The step's matrix products grouped by operator and operand shapes: calls and device ms per step (CPU:
    self ms), heaviest first, each with its operands' strides and alignments (``product_layouts``). The
    step runs uncaptured (its function on the runner's static inputs, as the capture records it), since a
    graph replay carries no operators to attribute its kernels to."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    n = next(iter(inputs.values())).shape[0]
    bucket = min(b for b in runner.buckets if b >= n)
    with torch.no_grad():
        runner.run(**inputs)  # the static inputs of bucket ``n`` hold the inputs now
        runner._step(bucket)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with torch_profile(activities=activities, record_shapes=True) as prof:
            for _ in range(iters):
                runner._step(bucket)
            if cuda:
                torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages(group_by_input_shape=True):
        if ev.key not in PRODUCT_OPS:
            continue
        ms = (ev.device_time_total if cuda else ev.self_cpu_time_total) / 1e3 / iters
        shapes = [list(x) for x in ev.input_shapes if x]
        rows.append({"op": ev.key.removeprefix("aten::"), "shapes": shapes, "calls": ev.count / iters,
                     "ms": round(ms, 3)})
    layouts = product_layouts(runner, bucket, compiled)
    for r in rows:
        r["layouts"] = layouts.get(_layout_key(r["op"], r["shapes"]), [])
    return sorted(rows, key=lambda r: -r["ms"])


def run_system(args, name: str, device: str, dtype, result: dict) -> None:
    from workers.fp8 import unsupported_reason
    from workers.loading import load_model

    compile_mode, precision = SYSTEMS[name]
    if precision != "bf16" and (why := unsupported_reason(device)) is not None:
        result["systems"][name] = {"skipped": why}
        return
    kernels = _kernels()
    model = load_model(args.model, device=device, dtype=dtype, precision=precision)
    if name.endswith("+unfolded"):
        from workers.fp8 import unfold_single_block_gelus

        unfold_single_block_gelus(model.transformer)
    backend = "full" if compile_mode == "inductor" and model.card.family == "dit" else "breakable"
    from workers import fp8, modulation, norm_fusion, patches, rope_kernel
    from workers.engine import table_inputs

    with mock.patch.object(norm_fusion, "ENABLED", not name.endswith("+nonorms")), \
            mock.patch.object(rope_kernel, "ENABLED", not name.endswith("+inductorcodes")), \
            mock.patch.object(modulation, "ENABLED", not name.endswith("+nohoist")), \
            mock.patch.object(modulation, "TABLES", not name.endswith("+notables")), \
            mock.patch.object(patches, "QUANTIZED_BREAKS", not name.endswith("+rawbreaks")), \
            mock.patch.object(fp8, "FAST_ACCUM", not name.endswith("+promoted")):
        engine, runner, _ = kernels.build_engine(model, backend, compile_mode, max(args.images), "", scope=args.scope,
                                                 cross_attention=args.cross_attention)
        block = result["systems"][name] = {"backend": backend}
        block["fused_norm_blocks"] = norm_fusion.fused_blocks(model.transformer)
        if model.card.family == "pixart":  # the mode the engine runs ("auto" resolved)
            from workers.families.pixart import DEFAULT_CROSS_ATTENTION

            block["cross_attention"] = DEFAULT_CROSS_ATTENTION if args.cross_attention == "auto" else args.cross_attention
        if compile_mode != "off":
            block["scope"] = args.scope
        for n in args.images:
            inputs = table_inputs(model, kernels.step_inputs(model, n))  # with the step's tables where it reads some
            block[n] = summarise(profile(runner, inputs, args.iters, device == "cuda"), args.iters, args.top)
            if args.by_shape:
                block[n]["products"] = products_by_shape(runner, inputs, args.iters, device == "cuda",
                                                         compiled=compile_mode != "off")
    del engine, runner, model
    kernels.free()


def inductor_cache_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def kernel_sources(names: list[str], root: Path) -> dict[str, str]:
    """Inductor kernel name -> the source file under ``root`` that defines it (``def <name>(``), for the
    names found; a kernel compiled in several files (several graphs) gives the first."""
    wanted, out = set(names), {}
    if not wanted:
        return out
    for path in sorted(root.rglob("*.py")):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for name in [n for n in wanted if f"def {n}(" in text]:
            out[name] = text
            wanted.discard(name)
        if not wanted:
            break
    return out


def save_kernel_sources(result: dict, n: int, out: Path, root: Path) -> list[str]:
    """The ``n`` heaviest Inductor (``triton_``) kernels of every profiled row, their sources written to
    ``out``; returns the names found."""
    names = []
    for block in result["systems"].values():
        for key, s in block.items():
            if isinstance(s, dict) and "top" in s:
                names += [t["kernel"] for t in s["top"] if t["kernel"].startswith("triton_")][:n]
    found = kernel_sources(list(dict.fromkeys(names)), root)
    if found:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in found.items():
            (out / f"{name[:120]}.py").write_text(text)
    return sorted(found)


def _layouts_text(layouts: list[dict]) -> str:
    return "; ".join(f"{' '.join(str(tuple(x)) for x in l['strides'])} @ {'/'.join(map(str, l['alignment']))}"
                     f" (x{l['calls']})" for l in layouts)


def markdown(result: dict) -> str:
    lines = [f"# Where a step's time goes: {result['model']} on {result['hardware']}", "",
             f"torch {result['torch']}; {result['iters']} profiled steps per row, after warm-up. ms per step by "
             "kernel group (share of the step's kernel time).", ""]
    for name, block in result["systems"].items():
        if "skipped" in block:
            lines += [f"## {name}: skipped ({block['skipped']})", ""]
            continue
        for n in result["images"]:
            s = block.get(n) or block.get(str(n))
            if s is None:
                continue
            how = block["backend"] + (f", {block['scope']} compiled" if "scope" in block else "") + \
                (f", {block['cross_attention']} cross-attention" if "cross_attention" in block else "")
            lines += [f"## {name} ({how}), {n} image{'s' * (n > 1)}: {s['total_ms']:.2f} ms of kernels", "",
                      "| group | ms | share |", "|---|---|---|"]
            lines += [f"| {g} | {v['ms']:.3f} | {v['share']:.0%} |" for g, v in s["groups"].items()]
            lines += ["", "| heaviest kernels | group | ms |", "|---|---|---|"]
            lines += [f"| `{t['kernel'][:90]}` | {t['group']} | {t['ms']:.3f} |" for t in s["top"]]
            lines.append("")
            if s.get("products"):
                lines += ["| matrix product (step uncaptured) | operand shapes | calls | ms | strides; alignment (bytes) |",
                          "|---|---|---|---|---|"]
                lines += [f"| {r['op']} | {' x '.join(str(tuple(x)) for x in r['shapes'])} | {r['calls']:g} | "
                          f"{r['ms']:.3f} | {_layouts_text(r.get('layouts', []))} |" for r in s["products"]]
                lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dit-xl-2-256")
    p.add_argument("--images", type=int, nargs="+", default=[1, 64])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--top", type=int, default=10, help="how many of the heaviest kernels each row lists")
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    p.add_argument("--smoke", action="store_true", help="digits on a CPU, 1 and 4 images, plain and fp8")
    p.add_argument("--scope", choices=["step", "blocks"], default="step",
                   help="what the compiled systems compile: the whole step, or the transformer's blocks "
                        "(EngineConfig.compile_scope; DiT compiles its whole step either way)")
    p.add_argument("--cross-attention", choices=["auto", "padded", "varlen"], default="auto",
                   help="PixArt's cross-attention (EngineConfig.cross_attention; auto: the family's default)")
    p.add_argument("--stem", help="report name (default profile_<model>)")
    p.add_argument("--by-shape", action="store_true",
                   help="also the matrix products by operand shapes, from the step run uncaptured")
    p.add_argument("--kernel-source", type=int, default=0, metavar="N",
                   help="copy the sources of each row's N heaviest Inductor kernels next to the report")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.images, args.iters = "digits", [1, 4], 2
        args.systems = [s for s in args.systems if s in ("plain", "fp8")]
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    result = {"model": args.model, "images": args.images, "iters": args.iters, "torch": torch.__version__,
              "argv": sys.argv[1:] if argv is None else argv,
              "hardware": torch.cuda.get_device_name() if cuda else "CPU", "systems": {}, "errors": {}}
    for name in args.systems:
        try:
            run_system(args, name, device, dtype, result)
        except Exception as exc:  # one system failing is a result, not a reason to stop
            result["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
            print(f"{name} failed: {result['errors'][name][:300]}", flush=True)
    stem = args.stem or f"profile_{Path(args.model).name}" + ("_smoke" if args.smoke else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.kernel_source:
        found = save_kernel_sources(result, args.kernel_source, args.out / f"{stem}_kernels", inductor_cache_dir())
        print(f"kernel sources saved: {found or 'none found'}", flush=True)
    (args.out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
