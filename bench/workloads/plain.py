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
    """One image at each size the first model makes of --sizes (its native one if none), a row set per size."""
    fresh = iter(range(10_000))
    if system == "diffusers":
        model = models.get("bf16", engine=False)[0]
        pipe = pipeline(model)
    else:
        config, why, precision = engine_for(system, models, args.e2e_batch)
        if why:
            block[system] = {"skipped": why}
            return
        model = models.get(precision)[0]
    for _, size in targets_of([model], args.sizes):
        row = block.setdefault(f"{size[0]}x{size[1]}", {})
        make = lambda: item(model, "e2e", 0, next(fresh), size, args.steps)  # noqa: E731
        if system == "diffusers":
            row[system] = one_image(model, lambda: call_pipeline(pipe, model, [make()]), args)
            continue
        engine, warm_s = harness.build_engine(model, config, sizes=[size])
        row.setdefault("warmup_s", {})[system] = round(warm_s, 2)

        def one():
            model.cache.clear()
            engine.generate([make()])
        row[system] = {**one_image(model, one, args), "config": harness.describe(config)}
        del engine, one  # its graphs go before the next size's are captured
        harness.free()


def one_image(model, one, args) -> dict:
    """``stats`` of --reps runs of ``one()`` after one warm-up, and where the text encoders ran; with them on the
    host (--text-encoder-device cpu), each run's host encode time too."""
    where = {"text_encoder": w} if (w := harness.encoder_device(model)) else {}
    if args.text_encoder_device != "cpu" or not where:
        return {**harness.stats(harness.wall_ms(one, args.reps, warmup=1), digits=1), **where}
    encode: list[float] = []
    with harness.EncodeClock(model) as clock:
        def run():
            one()
            encode.append(clock.take())
        row = harness.stats(harness.wall_ms(run, args.reps, warmup=1), digits=1)
    return {**row, **where, "encode_ms": harness.stats(encode[1:], digits=1)}  # the warm-up's left out


def mixed(system: str, models: Models, args, block: dict) -> None:
    if system == "diffusers":
        ms = models.get("bf16", engine=False)
        pipes = [pipeline(m) for m in ms]
        run = lambda jobs, stop: run_static(pipes, ms, targets, jobs, args.inflight, stop, args.steps)
    else:
        config, why, precision = engine_for(system, models, args.inflight)
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
    config, why, precision = engine_for(system, models, args.inflight)
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
        lines += e2e_tables(e, result["settings"].get("text_encoder_device", "gpu"))
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


def e2e_tables(e: dict, text_encoder_device: str) -> list[str]:
    """One table per size made: each system's ms, its ratio to diffusers', and where its text encoders ran (with
    them on the host, the host's encode ms and its share of the image)."""
    lines = []
    for size, rows in e.items():
        if size in SYSTEMS:  # a system skipped at every size: the notes say why
            continue
        lines += ["", f"## One image end to end at {size} (ms)", ""]
        if text_encoder_device == "cpu":
            lines += ["Text encoders on the host (`--text-encoder-device cpu`): ours as a worker with "
                      "`text_encoder_device = \"cpu\"`, diffusers' pipeline over the same encoders (token ids in, "
                      "embeddings out); host encode: the encoders' own time.", ""]
        base = rows.get("diffusers", {}).get("median")
        timed = {s: r for s, r in rows.items() if s in SYSTEMS and "median" in r}
        share = any("encode_ms" in r for r in timed.values())
        cells = lambda r: [r["encode_ms"]["median"], f"{r['encode_ms']['median'] / r['median']:.0%}"]  # noqa: E731
        lines += harness.table(["system", "median", "p10", "p90", "vs diffusers", "warm-up s", "text encoder",
                                *(["host encode", "encode share"] if share else [])],
                               [[s, r["median"], r["p10"], r["p90"], round(r["median"] / base, 3) if base else None,
                                 rows.get("warmup_s", {}).get(s), r.get("text_encoder"),
                                 *((cells(r) if "encode_ms" in r else [None, None]) if share else [])]
                                for s, r in timed.items()])
    return lines


def run(args, report: harness.Report | None = None) -> dict:
    """The asked sections' result: each asked system in turn, diffusers first (each engine patches the model it
    runs in place)."""
    names = [Path(str(m)).name for m in args.models]
    result = {"models": names, "loads": args.loads, "settings": {k: v for k, v in vars(args).items()
                                                                 if k not in ("models", "out")},
              "env": harness.environment(harness.device_and_dtype(args.smoke)[0]), "errors": {}}
    models = Models(args.models, args.smoke, harness.TEXT_ENCODER_DEVICES[args.text_encoder_device])
    for section in [NAMES[s] for s in args.sections]:
        block = result.setdefault(section, {})
        for system in [s for s in SYSTEMS if s in args.systems and not (section == "consistency" and s == "diffusers")]:
            part = lambda: SECTION[section](system, models, args, block)  # noqa: E731
            harness.attempt(result, f"{section}/{system}", part, report)
            harness.free()
    return result
