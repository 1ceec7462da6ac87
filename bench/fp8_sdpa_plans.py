"""Every execution plan cuDNN offers for its FP8 attention at a shape, timed (median us), on a GPU.

``workers.fp8_attention`` builds the first plan of heuristics mode A (FALLBACK after it) and runs that one.
This benchmark asks for the plans of modes A, B and FALLBACK, builds all of them, and times each as CUDA
graph replays on the engine's layout (q, k, v and the output (B, T, heads, d) codes read as (B, heads, T, d)
views), with the codes each plan writes compared with the first plan's. Which plan would be worth picking
per shape, and by how much, is its answer.

    python bench/fp8_sdpa_plans.py [--out DIR] [--shapes NAME ...]   # DIR/fp8_sdpa_plans.json and .md
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fp8_sdpa import SHAPES, tflops, versions  # noqa: E402
from workers import fp8_attention as fa  # noqa: E402
from workers import sdpa  # noqa: E402

MODES = ("A", "B", "FALLBACK")


def plans(q, k, v, o, softmax_scale: float, mode: str):
    """A graph built with every plan heuristics ``mode`` offers; (graph, tensors, count)."""
    cudnn = fa._frontend()
    graph, tensors = fa.operation_graph(q, k, v, o, softmax_scale)
    graph.create_execution_plans([getattr(cudnn.heur_mode, mode)])
    graph.check_support()
    graph.build_plans(cudnn.build_plan_policy.ALL)
    return graph, tensors, graph.get_execution_plan_count()


def name_of(graph, i: int) -> str:
    try:
        return graph.get_plan_name_at_index(i)
    except Exception:  # an older frontend: the index alone
        return f"plan {i}"


def measure(name: str, shape) -> dict:
    b, t, h, d = shape
    g = torch.Generator("cuda").manual_seed(0)
    make = lambda: (torch.randn(b, t, h, d, device="cuda", generator=g) * 2).to(fa.FP8)
    q8, k8, v8 = make(), make(), make()
    out = torch.empty_like(q8)
    q, k, v, o = (x.transpose(1, 2) for x in (q8, k8, v8, out))
    one = torch.ones(1, 1, 1, 1, device="cuda")
    descale_s, scale_s, amax = fa._constants(q.device)
    handle = fa._handle(q.device)
    row = {"shape": list(shape), "plans": []}
    reference = None
    for mode in MODES:
        try:
            graph, tensors, count = plans(q, k, v, o, 1 / math.sqrt(d), mode)
        except Exception as exc:  # a mode without plans here is a result
            row["plans"].append({"mode": mode, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        tq, tk, tv, dq, dk, dv, ds, ss, so, to, amax_s, amax_o = tensors
        pack = {tq: q, tk: k, tv: v, dq: one, dk: one, dv: one, ds: descale_s, ss: scale_s,
                so: fa.output_scale(one), to: o, amax_s: amax[0:1], amax_o: amax[1:2]}
        for i in range(count):
            entry = {"mode": mode, "index": i, "name": name_of(graph, i)}
            try:
                ws = torch.empty(max(1, graph.get_workspace_size_plan_at_index(i)), dtype=torch.uint8, device="cuda")

                def call(i=i, ws=ws):
                    fa._frontend().set_stream(handle, torch.cuda.current_stream().cuda_stream)
                    graph.execute_plan_at_index(pack, ws, i, handle=handle)

                call()
                torch.cuda.synchronize()
                codes = out.view(torch.uint8).clone()
                if reference is None:
                    reference = codes
                ms, captured = sdpa.replay_ms(call)
                entry.update(us=round(ms * 1000, 1), tflops=tflops(shape, ms), captured=captured,
                             codes_differ=round((codes != reference).float().mean().item(), 5))
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(name, entry, flush=True)
            row["plans"].append(entry)
    return row


def report(rows: dict, info: dict) -> str:
    lines = ["# cuDNN's FP8 attention: every plan it offers, timed (NVIDIA H200)", "",
             f"`python bench/fp8_sdpa_plans.py`; {info}. Median us of one call as CUDA graph replays (TFLOP/s); "
             "codes against the first plan's.", "",
             "| shape | B, T, heads, d | mode | plan | us (TFLOP/s) | codes differ |", "|---|---|---|---|---|---|"]
    for name, row in rows.items():
        for p in row["plans"]:
            got = f"{p['us']} ({p['tflops']})" if "us" in p else p.get("error", "")
            lines.append(f"| {name} | {', '.join(map(str, row['shape']))} | {p['mode']} | {p.get('name', '')} | "
                         f"{got} | {p.get('codes_differ', '')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--shapes", nargs="*", default=["flux-dev-1024, 1 image", "sd35-medium-1024, 1 image"])
    args = parser.parse_args()
    if (why := fa.unavailable_reason("cuda")) is not None:
        raise SystemExit(f"fp8_sdpa_plans: {why}")
    info = ", ".join(f"{k} {v}" for k, v in versions().items())
    rows = {}
    for name in args.shapes:
        rows[name] = measure(name, SHAPES[name])
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fp8_sdpa_plans.json").write_text(json.dumps({"versions": versions(), "shapes": rows}, indent=1))
        (args.out / "fp8_sdpa_plans.md").write_text(report(rows, info))


if __name__ == "__main__":
    main()
