"""Where the preview cost goes: the engine's time per step with previews on every step against none, at
one image (and more with --images), under five harnesses that differ only in what happens to the
previews once the step loop has taken them.

  engine        the step loop takes the previews whose copies arrived and drops them (the preview's GPU
                work and host launches only)
  poller        bench/service.py's preview cost, as a worker does it: each item's latest kept, a poller
                thread PNG-encodes what it finds every 0.05 s; at the end each item's latest encoded
                inside the timed run
  poller-all-at-end  the same, but at the end every preview still on its way encoded (what
                bench/service.py did until 2026-12-01: the host runs steps ahead of the GPU, so several per item)
  poller-noPNG  the same poller, encoding nothing
  poller-250ms  the poller every 0.25 s, as often as the service polls a busy worker

The engine is built as bench/service.py builds it (a worker's: the "graphs" backend on CUDA, the card's
dtype, buckets up to 64, warmed). Every harness runs --pairs off/on pairs after one untimed pair, on first
in every other pair; the report has the medians and the % added. Steps: the model card's sampler and
steps (DDIM 50 for DiT-XL/2), guidance 4, labels i % 10.

    python bench/preview_cost.py                        # DiT-XL/2 256 on a GPU, 1 image, 8 pairs (~1 min)
    python bench/preview_cost.py --images 1 64 --pairs 4
    python bench/preview_cost.py --smoke --out /tmp/p   # digits on a CPU, seconds

Writes preview_cost.json and preview_cost.md (preview_cost_smoke.* with --smoke) under --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
HARNESSES = {"engine": {"poll_s": None, "encode": False}, "poller": {"poll_s": 0.05, "encode": True},
             "poller-all-at-end": {"poll_s": 0.05, "encode": True, "final": "all"},
             "poller-noPNG": {"poll_s": 0.05, "encode": False}, "poller-250ms": {"poll_s": 0.25, "encode": True}}


def _service():
    """bench/service.py as a module (bench/ is not a package), loaded once."""
    if "service_bench" not in sys.modules:
        spec = importlib.util.spec_from_file_location("service_bench", BENCH / "service.py")
        sys.modules["service_bench"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["service_bench"])
    return sys.modules["service_bench"]


def pairs_ms(engine, s: dict, batch: int, pairs: int, harness: dict) -> dict:
    """{"off": [ms/step...], "on": [...]}: ``pairs`` timed pairs after one untimed one, on first in every
    other pair (a drift over the run falls on both sides)."""
    svc = _service()
    runs = {"off": [], "on": []}
    for n in range(pairs + 1):
        order = (("off", 0), ("on", 1)) if n % 2 == 0 else (("on", 1), ("off", 0))
        for key, every in order:
            ms = svc.step_ms(engine, s, batch, every, **harness)
            if n:
                runs[key].append(round(ms, 4))
    return runs


def summary(runs: dict) -> dict:
    off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
    return {"off_ms": round(off, 4), "on_ms": round(on, 4), "added_ms": round(on - off, 4),
            "added_pct": round((on / off - 1) * 100, 2)}


def markdown(result: dict) -> str:
    hw = result["hardware"]
    lines = [f"# Preview cost per harness: {result['settings']['model']} on {hw.get('gpu') or hw['cpu']}", "",
             f"`{result['command']}` (torch {hw['torch']}; {result['settings']['pairs']} off/on pairs each)", "",
             "| images | harness | ms/step off | ms/step on | added | added % |", "|---|---|---|---|---|---|"]
    for batch, block in result["results"].items():
        for name, r in block.items():
            s = r["summary"]
            lines.append(f"| {batch} | {name} | {s['off_ms']} | {s['on_ms']} | {s['added_ms']:+.3f} | "
                         f"{s['added_pct']:+.2f}% |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a class-conditional model (default dit-xl-2-256; --smoke: digits)")
    p.add_argument("--images", type=int, nargs="+", default=[1])
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--harnesses", nargs="+", default=list(HARNESSES), choices=list(HARNESSES))
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    p.add_argument("--smoke", action="store_true", help="digits, 4 steps, 2 pairs, on any device")
    args = p.parse_args(argv)
    svc = _service()
    model = args.model or ("digits" if args.smoke else "dit-xl-2-256")
    s = svc.parse(["--model", model, *(["--smoke"] if args.smoke else [])])[1]
    if args.smoke:
        s["steps"], args.pairs = 4, min(args.pairs, 2)
    t0 = time.perf_counter()
    engine = svc.build_engine(model)
    result = {"bench": "preview_cost", "smoke": args.smoke, "hardware": svc.hardware(),
              "command": "python bench/preview_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "settings": {"model": model, "steps": s["steps"], "sampler": s["sampler"], "pairs": args.pairs,
                           "images": args.images, "harnesses": {h: HARNESSES[h] for h in args.harnesses}},
              "results": {}}
    for batch in args.images:
        result["results"][str(batch)] = {}
        for name in args.harnesses:
            runs = pairs_ms(engine, s, batch, args.pairs, HARNESSES[name])
            result["results"][str(batch)][name] = {"raw": runs, "summary": summary(runs)}
            print(f"{batch} image(s), {name}: {summary(runs)}", flush=True)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "preview_cost_smoke" if args.smoke else "preview_cost"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
