"""Throughput and latency of the batch engine under seeded Poisson arrivals, against diffusers.

Workload (interactive use): requests of 1 image (70%), 2-8 images (25%) or 16-100 images (5%),
DDIM 50 steps, CFG 4, VAE decode; arrivals are a seeded Poisson process at an offered load in
images/s. Variant `mixed`: each request is 256 or 512 px with equal odds (two models).
Systems, each driven by the same single-threaded clock (a request's latency runs from its arrival
to its last image decoded):
  a  our engine with graphs and step-level batching (requests join at any step)
  b  our engine with request-level batching only (queued requests start together when it is idle)
  c  diffusers DiTPipeline, one call per request, first come first served
  d  diffusers DiTPipeline with static batching (queued requests up to 64 images or a wait limit)
  e  our engine as a, tuned: steps compiled by Inductor inside whole-step graphs (backend full), bf16,
     the VAE decode captured too (``decode_graphs``)
  f  e with FP8 linears where the GPU has them (compute capability 8.9+; skipped elsewhere). Until
     2026-12-01 e was this system (reports of that day's run were renamed)
For each system: images/s and p50/p99 latency at each offered load (every system sees the same
arrivals at the same load); the maximum sustained images/s (a backlog with exactly the workload's size
mix, all queued at t=0, run to completion); single-image latency with nothing else running (a and c);
padding waste. Systems a and b hold at most 64 images in flight, as a service worker does
(`max_inflight` defaults to the largest bucket): beyond that a step only gets slower, not more
productive, and everyone's latency grows.

    python bench/engine_throughput.py                       # on a GPU: DiT-XL/2, random weights, bf16 (~7 min)
    python bench/engine_throughput.py --workloads 256 --systems a b --loads 16 24
                                                            # a part of it: parts merge into one report
    python bench/engine_throughput.py --merge-only          # rebuild the report from the saved parts
    python bench/engine_throughput.py --smoke               # a seconds-long run of every system on a tiny DiT (CPU)
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch


@dataclass
class Job:
    id: int
    arrival: float
    n: int
    res: int
    label: int
    done_images: int = 0
    finished: float | None = None


@dataclass
class Setup:
    models: dict  # res -> LoadedModel
    steps: int
    guidance: float
    max_batch: int
    wait_s: float
    window_s: float   # arrivals at each load point come within this window...
    drain_s: float    # ...and the point stops this long after it (unfinished requests are censored)
    loads: dict = field(default_factory=dict)  # system -> workload -> offered images/s
    backlog_stop_s: float = 180.0  # the backlog runs to completion, within this


def make_jobs(load: float, seed: int, resolutions: tuple[int, ...], classes: int, window_s: float) -> list[Job]:
    """Seeded arrivals at ``load`` images/s within ``window_s``: a Poisson process given its count (the
    count the load implies; arrival times uniform in the window), with request sizes drawn in blocks
    of 20 that hold the mix exactly (14 single images, 5 of 2-8, one of 16-100), so a short window
    offers close to the nominal load."""
    rng = random.Random(seed)
    count = max(1, round(load * window_s / MEAN_SIZE))
    sizes: list[int] = []
    while len(sizes) < count:
        block = [1] * 14 + [rng.randint(2, 8) for _ in range(5)] + [rng.randint(16, 100)]
        rng.shuffle(block)
        sizes += block
    times = sorted(rng.uniform(0.0, window_s) for _ in range(count))
    return [Job(i, t, n, rng.choice(resolutions), rng.randrange(classes)) for i, (t, n) in enumerate(zip(times, sizes))]


MEAN_SIZE = 4.85  # mean request size of the mix: 0.7 * 1 + 0.25 * 5 + 0.05 * 58


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# -- systems a and b: our engine ---------------------------------------------------------------------
def run_engine(engine, jobs: list[Job], s: Setup, step_level: bool, stop_s: float) -> None:
    """Step level (a): queued images join at any step boundary, first come first served, while fewer
    than ``max_batch`` are in flight. Request level (b): when the engine is idle, queued requests start
    together (whole requests, up to ``max_batch`` images; a larger one starts alone)."""
    from workers.spec import ItemSpec

    pending, start, by_id = list(jobs), time.perf_counter(), {j.id: j for j in jobs}
    queue: list[tuple[Job, int]] = []  # arrived images not yet in the engine
    while pending or queue or engine.num_active:
        now = time.perf_counter() - start
        if now > stop_s:
            for rid in list(engine.progress()):  # leave the engine empty for the next point
                engine.cancel(rid)
            return
        while pending and pending[0].arrival <= now:
            j = pending.pop(0)
            queue += [(j, k) for k in range(j.n)]
        if step_level:
            admit = max(0, s.max_batch - engine.num_active)
        elif engine.num_active == 0 and queue:
            admit, seen = 0, set()
            for j, _ in queue:
                if j.id not in seen and admit and admit + j.n > s.max_batch:
                    break
                admit += 0 if j.id in seen else j.n
                seen.add(j.id)
        else:
            admit = 0
        for j, k in queue[:admit]:
            engine.add(ItemSpec(id=f"{j.id}:{k}", label=j.label, seed=j.id * 1000 + k, sampler="ddim",
                                steps=s.steps, guidance=s.guidance, model=s.models[j.res].name))
        del queue[:admit]
        if engine.num_active == 0:
            time.sleep(max(0.0, min(0.005, pending[0].arrival - now)) if pending else 0.0)
            continue
        for r in engine.step():
            j = by_id[int(r.request.id.split(":")[0])]
            j.done_images += 1
            if j.done_images == j.n:
                sync()
                j.finished = time.perf_counter() - start


# -- systems c and d: diffusers DiTPipeline -----------------------------------------------------------
def pipelines(s: Setup) -> dict:
    from diffusers import DDIMScheduler, DiTPipeline

    out = {}
    for res, m in s.models.items():
        sched = DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear", clip_sample=False)
        pipe = DiTPipeline(transformer=m.transformer, vae=m.vae, scheduler=sched)
        pipe.set_progress_bar_config(disable=True)
        out[res] = pipe
    return out


def run_pipeline(pipes: dict, jobs: list[Job], s: Setup, static: bool, stop_s: float) -> None:
    pending, start = list(jobs), time.perf_counter()
    while pending:
        now = time.perf_counter() - start
        if now > stop_s:
            return
        if pending[0].arrival > now:
            time.sleep(min(0.005, pending[0].arrival - now))
            continue
        batch = [pending.pop(0)]
        if static:  # what has queued (same resolution, up to max_batch images), then waiting at most wait_s
            deadline = batch[0].arrival + s.wait_s
            while True:
                now, total = time.perf_counter() - start, sum(j.n for j in batch)
                ready = [j for j in pending if j.arrival <= now and j.res == batch[0].res
                         and total + j.n <= s.max_batch]
                if ready:
                    batch.append(ready[0])
                    pending.remove(ready[0])
                elif total >= s.max_batch or now >= deadline:
                    break
                else:
                    time.sleep(0.002)
        labels = [j.label for j in batch for _ in range(j.n)]
        pipes[batch[0].res](class_labels=labels, guidance_scale=s.guidance, num_inference_steps=s.steps,
                            output_type="np", generator=torch.Generator().manual_seed(batch[0].id))
        sync()
        for j in batch:
            j.finished = time.perf_counter() - start


# -- measurement -------------------------------------------------------------------------------------
def summarise(system: str, workload: str, load: float, jobs: list[Job], stop_s: float,
              window_s: float | None = None) -> dict:
    """Completed images/s over the run; latency percentiles with unfinished requests censored at the stop
    (so a saturated system's p99 is a lower bound). ``arrived_images_per_s`` is the load the seeded
    arrivals really offered within the window (a heavy-tailed mix strays from the nominal load)."""
    end = max([j.finished for j in jobs if j.finished is not None] + [0.0])
    elapsed = stop_s if any(j.finished is None for j in jobs) else end
    lat = np.array([((j.finished if j.finished is not None else stop_s) - j.arrival) * 1e3 for j in jobs])
    done = sum(j.n for j in jobs if j.finished is not None)
    row = {"system": system, "workload": workload, "offered_images_per_s": load,
           "images_per_s": round(done / max(elapsed, 1e-9), 3),
           "p50_ms": round(float(np.percentile(lat, 50)), 1), "p99_ms": round(float(np.percentile(lat, 99)), 1),
           "requests": len(jobs), "unfinished": sum(j.finished is None for j in jobs)}
    if window_s is not None:
        row["arrived_images_per_s"] = round(sum(j.n for j in jobs) / window_s, 3)
        row["sustained"] = sustained(row)
    return row


def backlog(resolutions: tuple[int, ...], classes: int, seed: int = 99) -> list[Job]:
    """20 requests, all queued at t=0, with exactly the workload's mix: 14 single images, 5 of 2-8
    (mean 5) and one of 58 (the mean of 16-100): 97 images, 4.85 a request. A random sample of a
    heavy-tailed mix that small would make the figure a lottery."""
    rng = random.Random(seed)
    sizes = [1] * 14 + [2, 4, 5, 6, 8] + [58]
    rng.shuffle(sizes)
    return [Job(i, 0.0, n, resolutions[i % len(resolutions)], rng.randrange(classes)) for i, n in enumerate(sizes)]


def run_system(system: str, jobs: list[Job], s: Setup, engines: dict, pipes: dict, stop_s: float) -> None:
    if system in ("a", "b", "e", "f"):
        run_engine(engines[system], jobs, s, step_level=system != "b", stop_s=stop_s)
    else:
        run_pipeline(pipes, jobs, s, static=system == "d", stop_s=stop_s)


def bench(s: Setup, workloads: dict, save) -> dict:
    """Runs everything; ``save(result)`` after each figure, so a run cut short keeps what it measured."""
    from workers.engine import Engine, EngineConfig

    backend = "breakable" if torch.cuda.is_available() else "eager"
    systems = list(s.loads)
    engines = {k: Engine(list(s.models.values()), EngineConfig(backend=backend, max_batch=s.max_batch))
               for k in ("a", "b") if k in systems}
    for k in [k for k in ("e", "f") if k in systems]:
        engines[k] = Engine(tuned_models(s, "fp8" if k == "f" else "bf16"),
                            EngineConfig(backend="full" if backend != "eager" else "eager", max_batch=s.max_batch,
                                         compile="inductor", decode_graphs=True))
    for e in engines.values():
        e.warmup()
    pipes = pipelines(s) if {"c", "d"} & set(systems) else {}
    classes = min(m.num_classes for m in s.models.values())
    out = {"rows": [], "max_images_per_s": {}, "single_image_ms": {}, "padding_fraction": None}

    def record() -> None:
        if "a" in engines:  # rows replayed for padding, over all of system a's runs
            a = engines["a"]
            out.update(padded_rows=a.padded_rows, real_rows=a.real_rows,
                       padding_fraction=round(a.padded_rows / max(1, a.padded_rows + a.real_rows), 4))
        save(out)

    for system in [x for x in ("a", "c", "e", "f") if x in systems]:
        lat = []
        for rep in range(3):
            job = [Job(rep, 0.0, 1, min(s.models), 7)]
            run_system(system, job, s, engines, pipes, float("inf"))
            lat.append(job[0].finished * 1e3)
        out["single_image_ms"][system] = round(float(np.median(lat)), 1)
        print(f"single image {system}: {out['single_image_ms'][system]} ms", flush=True)
    for workload, res in workloads.items():  # the maximum sustained throughput of every system first...
        for system in systems:
            jobs = backlog(res, classes)
            run_system(system, jobs, s, engines, pipes, s.backlog_stop_s)
            row = summarise(system, workload, float("inf"), jobs, s.backlog_stop_s)
            out["max_images_per_s"][f"{system}/{workload}"] = row["images_per_s"]
            print("backlog", row, flush=True)
            record()
    order = [x for x in ("a", "d", "e", "f", "c", "b") if x in systems]  # ...then the load points, a and d first
    for group in (order[:2], order[2:]):
        for workload, res in workloads.items():
            for system in group:
                for load in s.loads[system].get(workload, []):
                    seed = int(load * 1000) + (7 if workload == "mixed" else 0)  # same arrivals for every system
                    jobs = make_jobs(load, seed=seed, resolutions=res, classes=classes, window_s=s.window_s)
                    stop = s.window_s + s.drain_s
                    run_system(system, jobs, s, engines, pipes, stop)
                    out["rows"].append(summarise(system, workload, load, jobs, stop, window_s=s.window_s))
                    print(out["rows"][-1], flush=True)
                    record()
    return out


def tuned_models(s: Setup, precision: str) -> list:
    """System e's models (s's own), or f's: FP8 copies (the same seeded weights) where the device has FP8
    (a CPU runs the FP8 arithmetic too, for the smoke run)."""
    from workers.fp8 import unsupported_reason
    from workers.loading import load_model

    out = []
    for m in s.models.values():
        if precision == "fp8" and unsupported_reason(m.device) is None:
            m = load_model(m.name if m.card.builtin else m.card.path, device=m.device, dtype=m.dtype, precision="fp8")
        out.append(m)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, workload in zip(axes, sorted({r["workload"] for r in result["rows"]})):
        for system in sorted({r["system"] for r in result["rows"]}):
            pts = [(r["offered_images_per_s"], r["p99_ms"]) for r in result["rows"]
                   if r["system"] == system and r["workload"] == workload]
            ax.plot(*zip(*pts), marker="o", label=system)
        ax.set(xlabel="offered load (images/s)", ylabel="p99 latency (ms)", title=workload, yscale="log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def sustained(row: dict) -> bool:
    """A load point is sustained when every request finished and completions kept up with what arrived
    (within 20%: the last arrivals' own latency is counted in the elapsed time, but not a queue that grows)."""
    arrived = row.get("arrived_images_per_s", row["offered_images_per_s"])
    return row["unfinished"] == 0 and row["images_per_s"] >= 0.8 * arrived


def targets(result: dict) -> list[dict]:
    """The issue's targets, checked on whatever systems and workloads the result holds."""
    out, rows, mx = [], result["rows"], result["max_images_per_s"]
    for workload in sorted({r["workload"] for r in rows}):
        a, c = mx.get(f"a/{workload}"), mx.get(f"c/{workload}")
        if a is not None and c:
            out.append({"target": f"{workload}: max sustained a >= 3x c", "value": round(a / c, 2), "met": a / c >= 3})
        p99 = {(r["system"], r["offered_images_per_s"]): r["p99_ms"] for r in rows if r["workload"] == workload}
        for r in rows:
            load = r["offered_images_per_s"]
            if r["system"] == "d" and r["workload"] == workload and sustained(r) and ("a", load) in p99:
                ratio = p99[("a", load)] / r["p99_ms"]
                out.append({"target": f"{workload}: p99 a <= 0.6x d at {load} img/s",
                            "value": round(ratio, 3), "met": ratio <= 0.6})
    if "a" in result["single_image_ms"]:
        ms = result["single_image_ms"]["a"]
        out.append({"target": "single 256 px image (a) <= 250 ms", "value": ms, "met": ms <= 250})
    for k in ("e", "f"):  # the kernel issue's targets for the tuned engines
        if k in result["single_image_ms"]:
            ms = result["single_image_ms"][k]
            out.append({"target": f"single 256 px image ({k}) <= 150 ms", "value": ms, "met": ms <= 150})
        if (v := mx.get(f"{k}/256")) is not None:
            out.append({"target": f"256: max sustained {k} >= 20 images/s", "value": v, "met": v >= 20})
    return out


def markdown(result: dict) -> str:
    lines = [f"# Engine throughput on {result['gpu']} (torch {result['torch']}, diffusers {result['diffusers']})", "",
             (f"Each load point: {result.get('window_s', '?')} s of seeded Poisson arrivals, then up to "
              f"{result.get('drain_s', '?')} s to finish; unfinished requests are censored at the stop."), "",
             ("Systems: a = dit-serve, step-level batching through CUDA graphs; b = dit-serve, request-level "
             "batching; c = diffusers DiTPipeline, one call per request; d = DiTPipeline, static batching "
             "(queued requests up to 64 images, waiting at most 0.1 s); e = dit-serve as a, compiled by Inductor "
             "inside whole-step graphs, its VAE decode captured too; f = e with FP8 linears. DiT-XL/2 (random weights, bf16), "
             "DDIM 50 steps, guidance 4, VAE decode. Every system sees the same arrivals at a given load; "
             "`arrived` is what they really offered. A point is sustained when every request finished and "
             "completions kept within 20% of arrivals."), "",
             "| system | workload | offered img/s | arrived img/s | done img/s | p50 ms | p99 ms | unfinished | sustained |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['system']} | {r['workload']} | {r['offered_images_per_s']:g} | {r.get('arrived_images_per_s', '')} | "
              f"{r['images_per_s']} | {r['p50_ms']} | {r['p99_ms']} | {r['unfinished']}/{r['requests']} | "
              f"{'yes' if sustained(r) else 'no'} |" for r in result["rows"]]
    lines += ["", "Max sustained images/s (a backlog of 97 images in the workload's mix, run to completion): "
              + ", ".join(f"{k} {v}" for k, v in result["max_images_per_s"].items()),
              "", "Single image ms (nothing else running): "
              + ", ".join(f"{k} {v}" for k, v in result["single_image_ms"].items()),
              "", f"Padding fraction (system a): {result['padding_fraction']}", "",
              "| target | value | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['value']} | {'yes' if t['met'] else 'no'} |" for t in targets(result)]
    return "\n".join(lines) + "\n"


# offered loads (images/s) per system and workload: a and d at the same loads (the p99 target compares
# them there), each list reaching past the system's saturation where the time allows
SYSTEM_LOADS = {"a": {"256": [2, 4, 8, 12], "mixed": [1, 2, 4]},
                "d": {"256": [2, 4, 8, 12], "mixed": [1, 2, 4]},
                "c": {"256": [1, 2]},
                "b": {"256": [4, 8]},
                "e": {"256": [4, 8, 12, 16, 20], "mixed": [1, 2, 4, 6]},
                "f": {"256": [4, 8, 12, 16, 20], "mixed": [1, 2, 4, 6]}}
WORKLOADS = {"256": (256,), "mixed": (256, 512)}


def publish(result: dict) -> dict:
    """The report's JSON: ``max_images_per_s`` keyed by system for the main workload (256 px), every
    workload's figures under ``max_images_per_s_by_workload``."""
    by: dict = {}
    for key, value in result["max_images_per_s"].items():
        system, workload = key.split("/", 1)
        by.setdefault(workload, {})[system] = value
    main = "256" if "256" in by else next(iter(by), None)
    return {**result, "max_images_per_s": by.get(main, {}), "max_images_per_s_by_workload": by}


def merge(parts: list[dict]) -> dict:
    """One report from runs of single workloads or systems (each within one call's time limit): rows
    and figures of later parts replace those of earlier parts for the same system and workload."""
    keys = {(p["gpu"], p["torch"], p["diffusers"]) for p in parts}
    if len(keys) != 1:
        raise SystemExit(f"cannot merge results from different machines or versions: {sorted(keys)}")
    out = {k: parts[0][k] for k in ("gpu", "torch", "diffusers")}
    out.update({k: parts[-1][k] for k in ("window_s", "drain_s") if k in parts[-1]})
    rows: dict = {}
    out.update(rows=[], max_images_per_s={}, single_image_ms={}, padding_fraction=None)
    parts = list({(tuple(p["systems"]), tuple(p["workloads"])): p for p in parts}.values())  # a rerun replaces
    for part in parts:
        for r in part["rows"]:
            rows.setdefault((r["system"], r["workload"]), {})[r["offered_images_per_s"]] = r
        out["max_images_per_s"].update(part["max_images_per_s"])
        out["single_image_ms"].update(part["single_image_ms"])
        for k in ("padded_rows", "real_rows"):
            if k in part:
                out[k] = out.get(k, 0) + part[k]
    if "real_rows" in out:
        out["padding_fraction"] = round(out["padded_rows"] / max(1, out["padded_rows"] + out["real_rows"]), 4)
    out["rows"] = [r for key in sorted(rows) for _, r in sorted(rows[key].items())]
    return out


def main() -> None:
    import diffusers

    from workers.loading import load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a seconds-long run of every system on a tiny random DiT (CPU is fine)")
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--systems", nargs="+", default=list(SYSTEM_LOADS), choices=list(SYSTEM_LOADS))
    p.add_argument("--window", type=float, default=12.0, help="seconds of arrivals per load point")
    p.add_argument("--drain", type=float, default=8.0, help="seconds a load point may run past its window")
    p.add_argument("--loads", type=float, nargs="+", help="offered loads (images/s) for every system given, "
                   "instead of the built-in lists")
    p.add_argument("--merge-only", action="store_true", help="rebuild the report from the parts in --out")
    args = p.parse_args()
    name = "engine_throughput_smoke" if args.smoke else "engine_throughput"
    if args.merge_only:
        return report(args.out, name, parts=True)
    if args.smoke:
        import tempfile

        from workers.models.tiny_dit import write_tiny_dit

        tiny = Path(tempfile.mkdtemp()) / "tiny-dit"  # DiT-XL/2's layout, small: every system, VAE included
        write_tiny_dit(tiny)
        m = load_model(tiny)
        s = Setup({m.image_size: m}, steps=5, guidance=4.0, max_batch=16, wait_s=0.05, window_s=1.0,
                  drain_s=4.0, loads={k: {"single": [20.0]} for k in args.systems}, backlog_stop_s=60.0)
        workloads = {"single": (m.image_size,)}
    else:
        dev, dt = "cuda", torch.bfloat16
        workloads = {w: WORKLOADS[w] for w in args.workloads}
        resolutions = sorted({r for res in workloads.values() for r in res})
        models = {r: load_model(f"dit-xl-2-{r}", device=dev, dtype=dt) for r in resolutions}
        s = Setup(models, steps=50, guidance=4.0, max_batch=64, wait_s=0.1, window_s=args.window,
                  drain_s=args.drain, loads={k: ({w: args.loads for w in workloads} if args.loads else SYSTEM_LOADS[k])
                                             for k in args.systems})
    head = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "diffusers": diffusers.__version__,
            "systems": args.systems, "workloads": list(workloads), "window_s": s.window_s, "drain_s": s.drain_s}
    args.out.mkdir(parents=True, exist_ok=True)
    # each call's part is kept, and the report is rebuilt from all parts of this machine
    part = args.out / f"{name}_{'-'.join(workloads)}_{''.join(args.systems)}.part.json"
    save = lambda result: part.write_text(json.dumps({**head, **result}, indent=1) + "\n")
    t0 = time.perf_counter()
    bench(s, workloads, save)
    print(f"benchmark took {time.perf_counter() - t0:.0f} s", flush=True)
    report(args.out, name, parts=not args.smoke, only=None if not args.smoke else part)


def report(out: Path, name: str, parts: bool, only: Path | None = None) -> None:
    """engine_throughput.{json,md} (and the p99 plot) from the parts in ``out``."""
    files = [only] if only else sorted(out.glob(f"{name}_*.part.json"), key=lambda f: f.stat().st_mtime)
    if not files:
        raise SystemExit(f"no {name}_*.part.json in {out}")
    loaded = [json.loads(f.read_text()) for f in files]
    newest = loaded[-1]
    result = merge([x for x in loaded if x["gpu"] == newest["gpu"] and x["torch"] == newest["torch"]])
    result["targets"] = targets(result)
    (out / f"{name}.json").write_text(json.dumps(publish(result), indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown(result))
    if parts and result["rows"]:
        try:
            plot(result, out / f"{name}_p99.png")
        except ImportError:  # matplotlib is a GPU-machine extra; the JSON and the table are the record
            print("matplotlib is not installed: no plot")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
