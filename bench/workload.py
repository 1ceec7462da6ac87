"""Whole images through the engine against the family's diffusers pipeline: one image end to end, and mixed
workloads under seeded Poisson arrivals, for any family.

Sections (``--sections``):

  e2e          one image, conditioning to pixels (the card's sampler, steps and guidance; text encoding and
               VAE decode included), a prompt or label never seen before in every run (the encoding cache
               cleared): each preset's engine (warmed first) against the pipeline, median of --reps runs
               after one warm-up.
  mixed        requests of 1 image (70%), 2-8 (25%) or --largest/2 to --largest (5%), each at one of the
               models and sizes asked (--models, --sizes; 1:1 by request), seeded Poisson arrivals at each
               offered load (images/s), one single-threaded clock (a request's latency runs from its arrival
               to its last image decoded). A preset's engine batches at step level (images join at any step,
               admitted as the service leases: ``workers.request.admission``), at most --inflight images in flight,
               warmed at every size first; ``diffusers`` batches statically (the first queued request and the
               queued ones of its model and size, up to --inflight images a call, waiting at most 0.1 s). Per
               system: the max sustained images/s (a backlog with the mix exactly, queued at t=0, run to
               completion) and images/s, p50/p99 at each load.
  consistency  whether an image depends on its batch: the same requests generated each alone, then all
               together (power-of-two replays, padding where it pays); largest and mean uint8 difference.

Writes docs/benchmarks/workload_<model>.{json,md} (the first model's name).

    python bench/workload.py --models dit-xl-2-256 --sections e2e mixed --loads 4 8 12
    python bench/workload.py --models dit-xl-2-256 dit-xl-2-512 --sections mixed     # two models, one mix
    python bench/workload.py --models pixart-sigma-512 --sizes 512x512 512x768 768x512 --systems diffusers fast fastest
    python bench/workload.py --models flux-dev-1024 --sections e2e --systems diffusers fast fastest
    python bench/workload.py --smoke [--family pixart]      # a tiny random model on a CPU, seconds
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

SECTIONS = ("e2e", "mixed", "consistency")
SYSTEMS = ("diffusers", *harness.PRESETS)
PROMPTS = ("a red fox on a misty hill", "an old lighthouse under a starry sky", "a bowl of ramen, studio photo",
           "a vintage bicycle by a frozen lake", "a snow leopard in golden hour light", "a tiny robot in a busy market",
           "a watercolor painting of a harbour", "a pencil sketch of a cathedral", "a 3d render of a teapot")


@dataclass
class Job:
    """A request: ``n`` images of one model at one size (width, height), one conditioning."""

    id: int
    arrival: float
    n: int
    target: int  # index into the run's (model, size) targets
    cond: int    # a label, or an index into PROMPTS
    done: int = 0
    finished: float | None = None


# -- requests ----------------------------------------------------------------------------------------
def mix(rng: random.Random, largest: int) -> list[int]:
    """20 request sizes holding the mix exactly: 14 of 1, 5 of 2-8, one of largest/2-largest."""
    block = [1] * 14 + [rng.randint(2, 8) for _ in range(5)] + [rng.randint(max(1, largest // 2), largest)]
    rng.shuffle(block)
    return block


def make_jobs(load: float, seed: int, targets: int, largest: int, window_s: float) -> list[Job]:
    """Seeded arrivals at ``load`` images/s within ``window_s``: the count the load implies, arrival times
    uniform in the window (a Poisson process given its count), sizes in blocks that hold the mix."""
    rng = random.Random(seed)
    mean = (14 + 5 * 5 + 0.75 * largest) / 20
    count = max(1, round(load * window_s / mean))
    ns: list[int] = []
    while len(ns) < count:
        ns += mix(rng, largest)
    times = sorted(rng.uniform(0.0, window_s) for _ in range(count))
    return [Job(i, t, n, i % targets, rng.randrange(1000)) for i, (t, n) in enumerate(zip(times, ns))]


def backlog(targets: int, largest: int, seed: int = 99) -> list[Job]:
    """The mix exactly, once per target, all queued at t=0."""
    rng = random.Random(seed)
    return [Job(k * 20 + i, 0.0, n, k, rng.randrange(1000)) for k in range(targets) for i, n in enumerate(mix(rng, largest))]


def item(model, rid: str, seed: int, cond: int, size=(0, 0), steps: int | None = None):
    """One image of ``model`` as a request makes it: the card's sampler, steps (unless ``steps``) and
    guidance; a label or a prompt from ``cond``; made at ``size`` (width, height; (0, 0): native)."""
    from workers.request.spec import ItemSpec

    d, text = model.card.defaults, model.card.conditioning == "text"
    return ItemSpec(id=rid, model=model.name, seed=seed, sampler=d["sampler"], steps=steps or int(d["steps"]),
                    guidance=float(d["guidance"]), label=0 if text else cond % model.num_classes,
                    prompt=f"{PROMPTS[cond % len(PROMPTS)]}, {cond}" if text else "", width=size[0], height=size[1])


# -- diffusers' pipelines ----------------------------------------------------------------------------
def pipeline(model):
    """The family's diffusers pipeline over the loaded model's modules, with the card's scheduler
    (``Family.reference_pipeline``)."""
    from workers.families import family_of

    return family_of(model).reference_pipeline(model)


def call_pipeline(pipe, model, specs: list) -> np.ndarray:
    """One pipeline call making ``specs`` (one model, one size), pixels out as numpy (``Family.reference_call``)."""
    from workers.families import family_of

    return pipe(**family_of(model).reference_call(model, specs), output_type="np",
                generator=torch.Generator().manual_seed(specs[0].seed)).images


# -- systems -----------------------------------------------------------------------------------------
class Models:
    """The run's models at one precision at a time (a new precision drops the last one's weights first).
    An engine rewrites the model it runs in place, so diffusers (``engine=False``) gets them loaded again
    once an engine has had them."""

    def __init__(self, names: list, smoke: bool) -> None:
        self.names, self.smoke, self.precision, self.loaded, self.patched = names, smoke, None, [], False

    def get(self, precision: str, engine: bool = True) -> list:
        if precision != self.precision or (self.patched and not engine):
            self.loaded = []
            harness.free()
            self.loaded, self.precision = [harness.load(n, precision, self.smoke) for n in self.names], precision
            self.patched = False
        self.patched |= engine
        return self.loaded

    def family(self) -> str:
        return (self.loaded or self.get("bf16", engine=False))[0].card.family


def engine_for(preset: str, family: str, inflight: int, smoke: bool):
    """A preset's engine config and precision for a model of ``family``, or the reason it cannot run here."""
    config, precision = harness.engine_config(preset, family, max_batch=inflight)
    if (why := harness.unavailable(precision, harness.device_and_dtype(smoke)[0])) is not None:
        return None, why, precision
    return config, None, precision


def targets_of(models: list, sizes: list) -> list[tuple[int, tuple[int, int]]]:
    """(model index, made size) per target: each model at each asked size it makes (its native one if none)."""
    out = []
    for i, m in enumerate(models):
        made = {m.card.size_for(w, h) for w, h in sizes} if sizes else set()
        out += [(i, s) for s in sorted(made or {tuple(m.card.native_size)})]
    return out


def job_items(models, targets, j: Job, steps: int | None) -> list:
    m, size = targets[j.target]
    return [item(models[m], f"{j.id}:{k}", j.id * 1000 + k, j.cond, size, steps) for k in range(j.n)]


def run_engine(engine, models, targets, jobs: list[Job], inflight: int, stop_s: float, steps=None,
               items=None) -> None:
    """Step-level batching: arrived images join at any step boundary, the queue's head first, then images of
    the shapes in flight (``workers.request.admission``, as the service leases), while fewer than ``inflight`` are in
    flight. ``items(job)``: a job's requests (default ``job_items``)."""
    from workers.request import admission

    items = items or (lambda j: job_items(models, targets, j, steps))
    pending, queue, start, by_id = list(jobs), [], time.perf_counter(), {j.id: j for j in jobs}
    while pending or queue or engine.num_active:
        now = time.perf_counter() - start
        if now > stop_s:
            for rid in list(engine.progress()):  # leave the engine empty for the next point
                engine.cancel(rid)
            return
        while pending and pending[0].arrival <= now:
            queue += items(pending.pop(0))
        room = max(0, inflight - engine.num_active)
        if room and queue and (started := admission.take(queue, room, engine.in_flight_shapes(), capacity=inflight)):
            engine.add_many(started)
        if engine.num_active == 0:
            time.sleep(max(0.0, min(0.005, pending[0].arrival - now)) if pending else 0.0)
            continue
        for r in engine.step():
            j = by_id[int(r.request.id.split(":")[0])]
            j.done += 1
            if j.done == j.n:
                harness.sync()
                j.finished = time.perf_counter() - start


def run_static(pipes, models, targets, jobs: list[Job], inflight: int, stop_s: float, steps=None,
               wait_s: float = 0.1, key=None, before=None, call=None) -> None:
    """Static batching: once the first queued request has waited ``wait_s`` (or the call is full), one
    pipeline call of it and the queued requests of its batch key (``key(job)``, default its target) that fit in
    ``inflight`` images. ``before(pipe, batch)`` runs before each call (e.g. to set its adapters); ``call(batch)``
    replaces the call (default: ``call_pipeline`` of the target's pipeline over the batch's ``job_items``)."""
    key = key or (lambda j: j.target)
    pending, start = list(jobs), time.perf_counter()
    while pending:
        now = time.perf_counter() - start
        if now > stop_s:
            return
        if pending[0].arrival > now:
            time.sleep(min(0.005, pending[0].arrival - now))
            continue
        while True:
            now = time.perf_counter() - start
            batch, total = [pending[0]], pending[0].n
            for j in pending[1:]:
                if j.arrival <= now and key(j) == key(batch[0]) and total + j.n <= inflight:
                    batch.append(j)
                    total += j.n
            if total >= inflight or now >= batch[0].arrival + wait_s:
                break
            time.sleep(0.002)
        m = targets[batch[0].target][0]
        if before is not None:
            before(pipes[m], batch)
        if call is not None:
            call(batch)
        else:
            call_pipeline(pipes[m], models[m], [x for j in batch for x in job_items(models, targets, j, steps)])
        harness.sync()
        for j in batch:
            pending.remove(j)
            j.finished = time.perf_counter() - start


def summarise(load: float | None, jobs: list[Job], stop_s: float, window_s: float | None = None) -> dict:
    """Completed images/s over the run; latency percentiles with unfinished requests censored at the stop
    (a saturated system's p99 is then a lower bound)."""
    end = max([j.finished for j in jobs if j.finished is not None] + [0.0])
    elapsed = stop_s if any(j.finished is None for j in jobs) else end
    lat = [((j.finished if j.finished is not None else stop_s) - j.arrival) * 1e3 for j in jobs]
    done = sum(j.n for j in jobs if j.finished is not None)
    row = {"offered_images_per_s": load, "images_per_s": round(done / max(elapsed, 1e-9), 3),
           "p50_ms": round(harness.percentile(lat, 50), 1), "p99_ms": round(harness.percentile(lat, 99), 1),
           "requests": len(jobs), "unfinished": sum(j.finished is None for j in jobs)}
    if window_s is not None:
        row["arrived_images_per_s"] = round(sum(j.n for j in jobs) / window_s, 3)
    return row


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
    for section in SECTIONS:
        lines += [f"\n{s} skipped ({section}): {b['skipped']}" for s, b in result.get(section, {}).items()
                  if isinstance(b, dict) and "skipped" in b]
    lines += [f"\n- {part} failed: `{err.splitlines()[0][:300]}`" for part, err in result.get("errors", {}).items()]
    return "\n".join(lines)


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["dit-xl-2-256"], help="built-ins or model directories")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=["e2e", "mixed"])
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=["diffusers", "default", "fast", "fastest"])
    p.add_argument("--sizes", nargs="*", default=[], help="WxH sizes asked in the mix (default: each model's native)")
    p.add_argument("--loads", type=float, nargs="*", default=[2.0, 4.0], help="offered images/s of the mix")
    p.add_argument("--largest", type=int, default=32, help="the mix's largest request")
    p.add_argument("--inflight", type=int, default=32, help="images in flight (engine) or per call (diffusers)")
    p.add_argument("--window-s", type=float, default=10.0, help="seconds of arrivals per load")
    p.add_argument("--drain-s", type=float, default=5.0, help="seconds a load point runs past its window")
    p.add_argument("--backlog-stop-s", type=float, default=180.0)
    p.add_argument("--steps", type=int, help="steps per image (default: each model card's)")
    p.add_argument("--reps", type=int, default=5, help="e2e runs per system")
    p.add_argument("--e2e-batch", type=int, default=8, help="e2e: the engine's largest bucket")
    p.add_argument("--requests", type=int, default=16, help="consistency: requests")
    p.add_argument("--out", type=Path, help="report folder (default docs/benchmarks; a temp folder with --smoke)")
    p.add_argument("--smoke", action="store_true", help="a tiny random model on a CPU (--family picks which)")
    p.add_argument("--family", choices=harness.FAMILIES, default="dit", help="--smoke's model family")
    args = p.parse_args(argv)
    args.sizes = [tuple(int(v) for v in s.lower().split("x")) for s in args.sizes]
    if args.smoke:
        args.models = [harness.tiny_model(args.family)]
        args.loads, args.largest, args.inflight, args.window_s, args.drain_s = [8.0], 2, 4, 0.5, 2.0
        args.reps, args.e2e_batch, args.requests, args.backlog_stop_s, args.steps = 2, 2, 3, 60.0, 2
        if "--systems" not in (argv if argv is not None else sys.argv):
            args.systems = ["diffusers", "default"]  # compiling on a CPU takes minutes
        if "--sections" not in (argv if argv is not None else sys.argv):
            args.sections = list(SECTIONS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    names = [Path(str(m)).name for m in args.models]
    result = {"models": names, "loads": args.loads, "settings": {k: v for k, v in vars(args).items()
                                                                 if k not in ("models", "out")},
              "env": harness.environment(harness.device_and_dtype(args.smoke)[0]), "errors": {}}
    models = Models(args.models, args.smoke)
    for section in args.sections:
        block = result.setdefault(section, {})
        # diffusers first: each engine patches the model it runs in place
        for system in [s for s in SYSTEMS if s in args.systems and not (section == "consistency" and s == "diffusers")]:
            harness.attempt(result, f"{section}/{system}", lambda: SECTION[section](system, models, args, block))
            harness.free()
    paths = harness.write_report(harness.out_dir(args.out, args.smoke), f"workload_{names[0]}", result, markdown(result))
    print(markdown(result) + f"\nwrote {paths[0]}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
