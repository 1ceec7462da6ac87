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
For each system: images/s and p50/p99 latency at each offered load; the maximum sustained images/s
(everything queued at t=0); single-image latency with nothing else running (a and c); padding waste.

    python bench/engine_throughput.py                       # on a GPU: DiT-XL/2, random weights, bf16
    python bench/engine_throughput.py --workloads 256       # one workload (fits one 10-minute slot)...
    python bench/engine_throughput.py --workloads mixed     # ...then the other: both merge into one report
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
    loads: dict = field(default_factory=dict)  # system -> offered images/s list


def make_jobs(load: float, seed: int, resolutions: tuple[int, ...], classes: int,
              window_s: float = float("inf"), count: int | None = None) -> list[Job]:
    """Poisson arrivals at ``load`` images/s within ``window_s`` (or ``count`` requests)."""
    rng = random.Random(seed)
    jobs, t = [], 0.0
    while (count is None and t < window_s) or (count is not None and len(jobs) < count):
        u = rng.random()
        n = 1 if u < 0.70 else rng.randint(2, 8) if u < 0.95 else rng.randint(16, 100)
        jobs.append(Job(len(jobs), t, n, rng.choice(resolutions), rng.randrange(classes)))
        t += rng.expovariate(load / 4.85)  # mean request size of the mix: 0.7 + 0.25*5 + 0.05*58 = 4.85
    return jobs


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# -- systems a and b: our engine ---------------------------------------------------------------------
def run_engine(engine, jobs: list[Job], s: Setup, step_level: bool, stop_s: float) -> None:
    from workers.engine import ImageRequest

    pending, start, by_id = list(jobs), time.perf_counter(), {j.id: j for j in jobs}
    while pending or engine.num_active:
        now = time.perf_counter() - start
        if now > stop_s:
            for rid in list(engine.progress()):  # leave the engine empty for the next point
                engine.cancel(rid)
            return
        if step_level or engine.num_active == 0:
            while pending and pending[0].arrival <= now:
                j = pending.pop(0)
                for k in range(j.n):
                    engine.add(ImageRequest(id=f"{j.id}:{k}", label=j.label, seed=j.id * 1000 + k,
                                            steps=s.steps, guidance=s.guidance, model=s.models[j.res].name))
        if engine.num_active == 0:
            time.sleep(max(0.0, min(0.005, pending[0].arrival - now)))
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
        if static:  # same resolution, up to max_batch images, waiting at most wait_s for more
            deadline = batch[0].arrival + s.wait_s
            while sum(j.n for j in batch) < s.max_batch and time.perf_counter() - start < deadline:
                ready = [j for j in pending if j.arrival <= time.perf_counter() - start and j.res == batch[0].res
                         and sum(b.n for b in batch) + j.n <= s.max_batch]
                if ready:
                    batch.append(ready[0])
                    pending.remove(ready[0])
                else:
                    time.sleep(0.002)
        labels = [j.label for j in batch for _ in range(j.n)]
        pipes[batch[0].res](class_labels=labels, guidance_scale=s.guidance, num_inference_steps=s.steps,
                            output_type="np", generator=torch.Generator().manual_seed(batch[0].id))
        sync()
        for j in batch:
            j.finished = time.perf_counter() - start


# -- measurement -------------------------------------------------------------------------------------
def summarise(system: str, workload: str, load: float, jobs: list[Job], stop_s: float) -> dict:
    """Completed images/s over the run; latency percentiles with unfinished requests censored at the stop
    (so a saturated system's p99 is a lower bound)."""
    end = max([j.finished for j in jobs if j.finished is not None] + [0.0])
    elapsed = stop_s if any(j.finished is None for j in jobs) else end
    lat = np.array([((j.finished if j.finished is not None else stop_s) - j.arrival) * 1e3 for j in jobs])
    done = sum(j.n for j in jobs if j.finished is not None)
    return {"system": system, "workload": workload, "offered_images_per_s": load,
            "images_per_s": round(done / max(elapsed, 1e-9), 3),
            "p50_ms": round(float(np.percentile(lat, 50)), 1), "p99_ms": round(float(np.percentile(lat, 99)), 1),
            "requests": len(jobs), "unfinished": sum(j.finished is None for j in jobs)}


def run_system(system: str, jobs: list[Job], s: Setup, engines: dict, pipes: dict, stop_s: float) -> None:
    if system in ("a", "b"):
        run_engine(engines[system], jobs, s, step_level=system == "a", stop_s=stop_s)
    else:
        run_pipeline(pipes, jobs, s, static=system == "d", stop_s=stop_s)


def bench(s: Setup, workloads: dict, out: Path, label: str) -> dict:
    from workers.engine import Engine, EngineConfig

    backend = "breakable" if torch.cuda.is_available() else "eager"
    engines = {k: Engine(list(s.models.values()), EngineConfig(backend=backend, max_batch=s.max_batch))
               for k in ("a", "b") if k in s.loads}
    for e in engines.values():
        e.warmup()
    pipes = pipelines(s) if {"c", "d"} & set(s.loads) else {}
    classes = min(m.num_classes for m in s.models.values())
    rows, max_ips, single = [], {}, {}
    for workload, res in workloads.items():
        for system, loads in s.loads.items():
            stop = s.window_s + s.drain_s
            for i, load in enumerate(loads):
                jobs = make_jobs(load, seed=i, resolutions=res, classes=classes, window_s=s.window_s)
                run_system(system, jobs, s, engines, pipes, stop)
                rows.append(summarise(system, workload, load, jobs, stop))
                print(rows[-1], flush=True)
            backlog = make_jobs(1e9, seed=99, resolutions=res, classes=classes, count=40)  # all queued at t=0
            run_system(system, backlog, s, engines, pipes, stop)
            max_ips[f"{system}/{workload}"] = summarise(system, workload, float("inf"), backlog, stop)["images_per_s"]
    for system in [x for x in ("a", "c") if x in s.loads]:
        lat = []
        for rep in range(3):
            job = [Job(rep, 0.0, 1, min(s.models), 7)]
            run_system(system, job, s, engines, pipes, float("inf"))
            lat.append(job[0].finished * 1e3)
        single[system] = round(float(np.median(lat)), 1)
    out = {"rows": rows, "max_images_per_s": max_ips, "single_image_ms": single, "padding_fraction": None}
    if "a" in engines:  # rows replayed for padding, over all of system a's runs
        a = engines["a"]
        out.update(padded_rows=a.padded_rows, real_rows=a.real_rows,
                   padding_fraction=round(a.padded_rows / max(1, a.padded_rows + a.real_rows), 4))
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
    """A load point is sustained when every request finished and completions kept up with arrivals."""
    return row["unfinished"] == 0 and row["images_per_s"] >= 0.9 * row["offered_images_per_s"]


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
    return out


def markdown(result: dict) -> str:
    lines = [f"# Engine throughput on {result['gpu']} (torch {result['torch']}, diffusers {result['diffusers']})", "",
             "| system | workload | offered img/s | done img/s | p50 ms | p99 ms | unfinished |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['system']} | {r['workload']} | {r['offered_images_per_s']} | {r['images_per_s']} | {r['p50_ms']} | "
              f"{r['p99_ms']} | {r['unfinished']}/{r['requests']} |" for r in result["rows"]]
    lines += ["", "Max sustained images/s: " + ", ".join(f"{k} {v}" for k, v in result["max_images_per_s"].items()),
              "", "Single image ms: " + ", ".join(f"{k} {v}" for k, v in result["single_image_ms"].items()),
              "", f"Padding fraction (system a): {result['padding_fraction']}", "",
              "| target | value | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['value']} | {'yes' if t['met'] else 'no'} |" for t in targets(result)]
    return "\n".join(lines) + "\n"


SYSTEM_LOADS = {"a": [2, 5, 10, 20, 40], "b": [5, 10, 20], "c": [1, 2, 4], "d": [2, 5, 10, 20]}
WORKLOADS = {"256": (256,), "mixed": (256, 512)}


def merge(parts: list[dict]) -> dict:
    """One report from runs of single workloads or systems (each within one call's time limit): rows
    and figures of later parts replace those of earlier parts for the same system and workload."""
    keys = {(p["gpu"], p["torch"], p["diffusers"]) for p in parts}
    if len(keys) != 1:
        raise SystemExit(f"cannot merge results from different machines or versions: {sorted(keys)}")
    out = {k: parts[0][k] for k in ("gpu", "torch", "diffusers")}
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
    args = p.parse_args()
    if args.smoke:
        import tempfile

        from workers.models.tiny_dit import write_tiny_dit

        tiny = Path(tempfile.mkdtemp()) / "tiny-dit"  # DiT-XL/2's layout, small: every system, VAE included
        write_tiny_dit(tiny)
        m = load_model(tiny)
        s = Setup({m.image_size: m}, steps=5, guidance=4.0, max_batch=16, wait_s=0.05, window_s=1.0,
                  drain_s=4.0, loads={k: [20.0] for k in args.systems})
        workloads = {"single": (m.image_size,)}
    else:
        dev, dt = "cuda", torch.bfloat16
        workloads = {w: WORKLOADS[w] for w in args.workloads}
        resolutions = sorted({r for res in workloads.values() for r in res})
        models = {r: load_model(f"dit-xl-2-{r}", device=dev, dtype=dt) for r in resolutions}
        s = Setup(models, steps=50, guidance=4.0, max_batch=64, wait_s=0.1, window_s=args.window,
                  drain_s=args.window, loads={k: SYSTEM_LOADS[k] for k in args.systems})
    result = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "diffusers": diffusers.__version__}
    t0 = time.perf_counter()
    result.update(systems=args.systems, workloads=list(workloads))
    result.update(bench(s, workloads, args.out, "smoke" if args.smoke else "full"))
    print(f"benchmark took {time.perf_counter() - t0:.0f} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        name = "engine_throughput_smoke"
    else:  # each call's part is kept, and engine_throughput.json is rebuilt from all parts of this machine
        name = "engine_throughput"
        part = args.out / f"{name}_{'+'.join(args.workloads)}_{''.join(args.systems)}.part.json"
        part.write_text(json.dumps(result, indent=1) + "\n")
        parts = [json.loads(f.read_text()) for f in sorted(args.out.glob(f"{name}_*.part.json"),
                                                           key=lambda f: f.stat().st_mtime)]
        result = merge([x for x in parts if x["gpu"] == result["gpu"] and x["torch"] == result["torch"]])
    result["targets"] = targets(result)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / f"{name}.md").write_text(markdown(result))
    if not args.smoke:
        plot(result, args.out / f"{name}_p99.png")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
