"""The plain workload sections of bench/workload.py (e2e, mixed, consistency; its docstring says what each
measures) and their report, workload_<model>: images as a request makes them, of any family, the engine's
presets against the family's diffusers pipeline."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import harness

from .shared import (SYSTEMS, Models, backlog, call_pipeline, engine_for, item, make_jobs, pipeline, run_engine,
                   run_static, summarise, targets_of)

REPORT = "workload"
NAMES = {"e2e": "e2e", "mixed": "mixed", "consistency": "consistency"}  # section on the command line -> report key
DEFAULTS = {"models": ["dit-xl-2-256"], "systems": ["diffusers", "default", "fast", "fastest"], "loads": [2.0, 4.0],
            "largest": 32, "inflight": 32, "window_s": 10.0, "drain_s": 5.0, "steps": None, "family": "dit"}
SMOKE = {"loads": [8.0], "largest": 2, "inflight": 4, "window_s": 0.5, "drain_s": 2.0, "reps": 2, "e2e_batch": 2,
         "requests": 3, "backlog_stop_s": 60.0, "steps": 2}
SMOKE_FAMILIES = harness.FAMILIES


# -- sections ----------------------------------------------------------------------------------------
def e2e(system: str, models: Models, args, block: dict) -> None:
    fresh = iter(range(10_000))
    if system == "diffusers":
        model = models.get("bf16", engine=False)[0]
        pipe = pipeline(model)
        one = lambda: call_pipeline(pipe, model, [item(model, "e2e", 0, next(fresh), steps=args.steps)])
    else:
        config, why, precision = engine_for(system, models.family(), args.e2e_batch, args.smoke)
        if why:
            block[system] = {"skipped": why}
            return
        model = models.get(precision)[0]
        engine, warm_s = harness.build_engine(model, config)
        block.setdefault("warmup_s", {})[system] = round(warm_s, 2)

        def one():
            model.cache.clear()
            engine.generate([item(model, "e2e", 0, next(fresh), steps=args.steps)])
    block[system] = harness.stats(harness.wall_ms(one, args.reps, warmup=1), digits=1)


def mixed(system: str, models: Models, args, block: dict) -> None:
    if system == "diffusers":
        ms = models.get("bf16", engine=False)
        pipes = [pipeline(m) for m in ms]
        run = lambda jobs, stop: run_static(pipes, ms, targets, jobs, args.inflight, stop, args.steps)
    else:
        config, why, precision = engine_for(system, models.family(), args.inflight, args.smoke)
        if why:
            block[system] = {"skipped": why}
            return
        ms = models.get(precision)
        run = lambda jobs, stop: run_engine(engine, ms, targets, jobs, args.inflight, stop, args.steps)
    targets = targets_of(ms, args.sizes)
    block["targets"] = [[ms[m].name, list(s)] for m, s in targets]
    if system != "diffusers":
        engine, warm_s = harness.build_engine(ms, config, sizes=[s for _, s in targets])
        block.setdefault("warmup_s", {})[system] = round(warm_s, 2)
    runs = [(None, backlog(len(targets), args.largest), args.backlog_stop_s)]
    runs += [(load, make_jobs(load, int(load * 1000) + 7, len(targets), args.largest, args.window_s),
              args.window_s + args.drain_s) for load in args.loads]
    out = block[system] = {"loads": []}
    for load, jobs, stop in runs:
        for m in models.loaded:
            m.cache.clear()
        run(jobs, stop)
        if load is None:
            out["backlog"] = summarise(None, jobs, stop)
            out["max_images_per_s"] = out["backlog"]["images_per_s"]
        else:
            out["loads"].append(summarise(load, jobs, stop, args.window_s))
        print(system, load, out["loads"][-1] if load else out["backlog"], flush=True)


def consistency(system: str, models: Models, args, block: dict) -> None:
    """Each of --requests images alone, then all together: the uint8 pixels' differences."""
    config, why, precision = engine_for(system, models.family(), args.inflight, args.smoke)
    if why:
        block[system] = {"skipped": why}
        return
    model = models.get(precision)[0]
    engine, _ = harness.build_engine(model, config)
    reqs = [item(model, str(i), i, i, steps=args.steps) for i in range(args.requests)]
    pixels = lambda results: np.stack([np.asarray(r.image, dtype=np.int16) for r in
                                       sorted(results, key=lambda r: int(r.request.id))])
    alone = pixels([engine.generate([r])[0] for r in reqs])
    together = pixels(engine.generate(reqs))
    diff = np.abs(alone - together)
    block[system] = {"requests": len(reqs), "max_uint8_diff": int(diff.max()), "mean_uint8_diff": float(diff.mean()),
                     "identical_images": int((diff.reshape(len(reqs), -1).max(1) == 0).sum())}


SECTION = {"e2e": e2e, "mixed": mixed, "consistency": consistency}


# -- the report --------------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    lines = [f"# Workloads: {', '.join(result['models'])}", "", harness.hardware_line(result["env"])]
    if e := result.get("e2e"):
        lines += ["", "## One image end to end (ms)", ""]
        lines += harness.table(["system", "median", "p10", "p90", "warm-up s"],
                               [[s, b.get("median"), b.get("p10"), b.get("p90"), e.get("warmup_s", {}).get(s)]
                                for s, b in e.items() if s in SYSTEMS and "median" in b])
    if m := result.get("mixed"):
        loads = result["loads"]
        lines += ["", f"## Mixed workload at {', '.join(f'{n} {w}x{h}' for n, (w, h) in m.get('targets', []))}: "
                      "images/s (p50 / p99 ms)", ""]
        rows = []
        for s, b in m.items():
            if s in SYSTEMS and "loads" in b:
                cells = [f"{r['images_per_s']:.2f} ({r['p50_ms']:.0f} / {r['p99_ms']:.0f})" for r in b["loads"]]
                rows.append([s, b.get("max_images_per_s"), *cells])
        lines += harness.table(["system", "max sustained", *(f"at {x} images/s" for x in loads)], rows)
    if c := result.get("consistency"):
        lines += ["", "## An image alone against batched", ""]
        lines += harness.table(["system", "requests", "identical", "max uint8 diff", "mean"],
                               [[s, b["requests"], b["identical_images"], b["max_uint8_diff"], b["mean_uint8_diff"]]
                                for s, b in c.items() if "requests" in b])
    return "\n".join(lines + harness.notes(result, SECTION))


def run(args, report: harness.Report | None = None) -> dict:
    """The asked sections' result: each asked system in turn, diffusers first (each engine patches the model it
    runs in place)."""
    names = [Path(str(m)).name for m in args.models]
    result = {"models": names, "loads": args.loads, "settings": {k: v for k, v in vars(args).items()
                                                                 if k not in ("models", "out")},
              "env": harness.environment(harness.device_and_dtype(args.smoke)[0]), "errors": {}}
    models = Models(args.models, args.smoke)
    for section in [NAMES[s] for s in args.sections]:
        block = result.setdefault(section, {})
        for system in [s for s in SYSTEMS if s in args.systems and not (section == "consistency" and s == "diffusers")]:
            part = lambda: SECTION[section](system, models, args, block)  # noqa: E731
            harness.attempt(result, f"{section}/{system}", part, report)
            harness.free()
    return result
