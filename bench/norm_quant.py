"""A block's norm and the FP8 quantization of its output: one Inductor kernel or two (median us).

An FP8 linear fed by a norm (a block's adaLN: the residual add, LayerNorm, the modulation) quantizes the
norm's output rows before its product. Two ways to run that in a compiled step:

  split        Inductor's kernel for the add + norm + modulation writes the bf16 rows, then the repo's
               Triton row quantization (``workers.quant_kernel``) reads them and writes FP8: the rows
               cross memory three times
  fused        the quantization written as PyTorch operations in the same compiled function, so Inductor
               makes one kernel of the norm and the quantization (``workers.fp8.FUSE_INPUTS``)
  kernel       the repo's own Triton kernel of the add, norm, modulation and quantization
               (``workers.norm_kernel``, what PixArt's FP8 blocks run, ``workers.norm_fusion``): each
               row held in registers, each input read once and each output written once
  kernel/one-warp  the same with one warp per 2048 lanes at every row count (``norm_kernel.base_warps``)

split and fused each under Inductor's default choice of reduction (a row wider than 1024 values is reduced
in a loop, read from memory once per loop) and, as split/persistent and fused/persistent, with persistent
reductions up to PERSISTENT_MAX values (the row held in registers; ``persistent_reductions``, through
Inductor's ``InductorChoices`` hook). Shapes are the ones the families' steps run. Each system is timed as
50 calls captured in one CUDA graph and replayed (``--no-graph``: called from Python, which at the small
shapes times the host's launch path), median of 15 repeats; codes are compared with the first system's
(``--systems``; the share of FP8 codes that differ, and the largest difference of the dequantized rows
relative to the row's peak).

    python bench/norm_quant.py                     # on a GPU
    python bench/norm_quant.py --smoke             # CPU: small shapes, the codes only compared
Writes norm_quant.json and norm_quant.md under --out (norm_quant_smoke.* with --smoke).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

from graphs.runner import event_ms
from workers import fp8, norm_kernel, quant_kernel

SYSTEMS = {"split": ("split", False), "split/persistent": ("split", True), "fused": ("fused", False),
           "fused/persistent": ("fused", True), "kernel": ("kernel", False),
           "kernel/one-warp": ("kernel/one-warp", False)}
PERSISTENT_MAX = 4096  # the "persistent" systems: rows up to this many values reduced in registers

SHAPES = [  # (where, batch rows, tokens, K)
    ("pixart-sigma-512, 32 images", 64, 1024, 1152),
    ("dit-xl-2-256, 64 images", 128, 256, 1152),
    ("pixart-sigma-1024, 1 image", 2, 4096, 1152),
    ("sd35-medium-1024, 1 image", 2, 4096, 1536),
    ("flux-dev-1024, 1 image", 1, 4608, 3072),
]
SMOKE_SHAPES = [("smoke", 2, 64, 1152), ("smoke", 1, 32, 3072)]


def torch_quant(n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``workers.fp8``'s PyTorch row quantization of (M, K) rows."""
    scale = fp8._row_scales(n)
    return (n * scale.reciprocal().to(n.dtype)).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8), scale


def norm(x, y, gate, shift, scale):
    """PixArt's ``x + gate * y`` then LayerNorm (no affine) and ``* (1 + scale) + shift``: (B, T, K) each."""
    x = x + gate * y
    n = F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + scale) + shift
    return x, n


def split_fn(x, y, gate, shift, scale):
    x, n = norm(x, y, gate, shift, scale)
    return x, n.reshape(-1, n.shape[-1])


def fused_fn(x, y, gate, shift, scale):
    x, n = norm(x, y, gate, shift, scale)
    return (x, *torch_quant(n.reshape(-1, n.shape[-1])))


def quant_rows(rows: torch.Tensor):
    if quant_kernel.available(rows):
        return torch.ops.dit_serve.quantize_rows(rows, "none")
    return torch_quant(rows)


def make_system(kind: str, persistent: bool):
    """A callable (inputs) -> (x, codes, scales), compiled fresh under the chosen reduction heuristic."""
    torch._dynamo.reset()
    persistent_reductions(PERSISTENT_MAX if persistent else None)
    if kind == "kernel":
        return lambda x, y, gate, shift, scale: norm_kernel.add_norm_quantize(x, y, gate, shift, scale)
    if kind == "kernel/one-warp":  # one warp per 2048 lanes whatever the rows (norm_kernel.base_warps)
        def one_warp(x, y, gate, shift, scale):
            if not norm_kernel.available(x):
                return norm_kernel.reference(x, y, gate, shift, scale)
            return norm_kernel.launch(x, y, gate, shift, scale, True, 1e-6, warps=norm_kernel.base_warps(x.shape[-1]))
        return one_warp
    if kind == "split":
        inner = torch.compile(split_fn, fullgraph=True)
        return lambda *a: (lambda x, rows: (x, *quant_rows(rows)))(*inner(*a))
    return torch.compile(fused_fn, fullgraph=True)


def persistent_reductions(threshold: int | None) -> None:
    """Inner reductions of up to ``threshold`` values persistent from the next compile on (None: Inductor's
    own rule, 1024), for this process; the choices' ``uuid`` keys the FX-graph cache."""
    from torch._inductor import config, virtualized
    from torch._inductor.choices import InductorChoices

    factory = None if threshold is None else functools.partial(_persistent_choices(), threshold)
    if hasattr(config, "inductor_choices_class"):  # what a thread's first lookup makes
        config.inductor_choices_class = factory
    virtualized._choices._set_handler(factory() if factory is not None else InductorChoices())  # this thread's


@functools.cache
def _persistent_choices() -> type:
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class PersistentRows(InductorChoices):
        def __init__(self, threshold: int) -> None:
            super().__init__()
            self.threshold = threshold

        def uuid(self) -> str:
            return f"persistent rows <= {self.threshold}"

        def should_use_persistent_reduction(self, features, cooperative_reduction: bool) -> bool:
            if InductorChoices.should_use_persistent_reduction(features, cooperative_reduction):
                return True
            if cooperative_reduction or not torch._inductor.config.triton.persistent_reductions:
                return False
            return (features.get_reduction_hint() == ReductionHint.INNER
                    and V.graph.sizevars.statically_known_leq(features.reduction_numel, self.threshold))

    return PersistentRows


def inputs(b: int, t: int, k: int, device: str, dtype: torch.dtype):
    g = torch.Generator(device).manual_seed(b * t + k)
    r = lambda *s: torch.randn(*s, generator=g, device=device, dtype=torch.float32).to(dtype)
    return r(b, t, k), r(b, t, k), r(b, 1, k) * 0.2, r(b, 1, k) * 0.1, r(b, 1, k) * 0.1


def time_us(fn, args, calls: int = 50, repeats: int = 15, graph: bool = True) -> float:
    """Median us of one call. ``graph``: ``calls`` calls captured in one CUDA graph and replayed, the GPU's
    time alone, as the engine's steps replay them; otherwise called from Python, which at small shapes
    measures the host's launch path (a Python Triton launch, a compiled wrapper) rather than the kernel."""
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    run = lambda: [fn(*args) for _ in range(calls)]
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        run = g.replay
    return round(event_ms(run, repeats) * 1000 / calls, 2)


def compare(ref, got) -> dict:
    """Share of codes that differ, and the largest dequantized difference over the row's peak (``ref``: the
first system's)."""
    (_, qa, sa), (_, qb, sb) = ref, got
    da, db = qa.float() * sa, qb.float() * sb
    peak = da.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    return {"codes_differ": round((qa.view(torch.uint8) != qb.view(torch.uint8)).float().mean().item(), 5),
            "max_rel": round(((da - db).abs() / peak).max().item(), 5)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default="docs/benchmarks")
    p.add_argument("--no-graph", action="store_true",
                   help="time calls from Python instead of CUDA-graph replays (host launch cost included)")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS),
                   help="the first is the one the others' codes are compared with")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    torch._inductor.config.force_disable_caches = True  # each system compiled under its own heuristic
    systems = [SYSTEMS[name] for name in a.systems]
    rows = []
    for where, b, t, k in (SHAPES if cuda else SMOKE_SHAPES):
        args = inputs(b, t, k, device, dtype)
        row = {"where": where, "rows": b * t, "k": k, "us": {}, "vs_first": {}}
        ref = None
        for kind, persistent in systems:
            name = f"{kind}{'/persistent' if persistent else ''}"  # the SYSTEMS key
            fn = make_system(kind, persistent)
            got = fn(*args)
            ref = ref or got
            row["vs_first"][name] = compare(ref, got)
            if cuda:
                row["us"][name] = time_us(fn, args, graph=not a.no_graph)
        persistent_reductions(None)
        bytes_min = b * t * k * (2 * 2 + 2 + 1) + b * t * 4  # x, y read; x, codes written; scales
        if cuda:
            best = min(row["us"].values())
            row["gbs_best"] = round(bytes_min / best / 1e3, 1)
        rows.append(row)
        print(row, flush=True)
    result = {"device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
              "torch": torch.__version__, "reference": a.systems[0], "timing": "calls" if a.no_graph else "graph replays",
              "rows": rows}
    write(result, Path(a.out), "norm_quant_smoke" if a.smoke else "norm_quant")


def write(result: dict, out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    names = list(result["rows"][0]["vs_first"])
    lines = [f"# A block's norm and its FP8 quantization on {result['device']}", "",
             f"`python bench/norm_quant.py`; torch {result['torch']}. Median us of one call (50 calls timed by "
             f"CUDA events, 15 repeats; {result.get('timing', 'calls')}); codes against the first system's.", "",
             "| where | rows x K | " + " | ".join(names) + " | best GB/s |", "|---|---|" + "---|" * (len(names) + 1)]
    for r in result["rows"]:
        cells = [f"{r['us'].get(n, '-')} ({r['vs_first'][n]['codes_differ']:.3%} codes differ)" for n in names]
        lines.append(f"| {r['where']} | {r['rows']} x {r['k']} | " + " | ".join(cells) + f" | {r.get('gbs_best', '-')} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
