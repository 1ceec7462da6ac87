"""Autoscaling replayed over a day, on a CPU in seconds: GPU-hours against job latency.

A synthetic day (seeded): interactive jobs from 08:00 to 20:00, a steady trickle with bursts (``--bursts`` of
ten minutes at ``--burst-factor`` times the rate), and a large batch at 01:00 (``--night-jobs`` jobs of
``--night-images`` images of the last model). It is replayed in simulated time through the policy the
scheduler runs (``dit_serve.server.autoscale``: ``demand`` and ``place``, every ``--reconcile-s``), and beside
it through a fixed fleet: one worker per GPU (``--gpus``), always on, each serving every model (the service
without [autoscale]).

The models' figures are measured ones (``FIGURES``, each citing its report under docs/benchmarks): a worker's
rate at a full batch (``workers.families.rates.MEASURED``, the figures autoscaling itself starts from), one
image's speed alone, and a model's load and warm-up on a worker. Where a figure was not measured (FLUX.1-dev's
load) it is a parameter (``--load-s``), and so is a new node's boot (``--node-boot-s``: a cloud VM's, typically
2 to 5 minutes). A new worker serves after the node's boot, the worker's start (``WORKER_START_S``) and its first
model's load and warm-up; a worker switched to a model serves it after that model's load and warm-up.

What a worker does in the simulation: it holds up to ``--inflight`` items of the models it serves (the
queue's oldest first) and advances them together, each at min(its model's one-image speed, rate / items held)
image-steps a second: a fuller batch steps more images a second, up to the model's rate. A node is counted
from its launch until ``--node-release-s`` (Ray's node idle timeout) after its worker stopped. Not modelled: a
model's start on several sizes, requeues after failures, several workers per node, a worker serving its first
model while it loads the others.

Reports, for each (target_drain_s, idle_timeout_s, min_workers), with one model per worker (``[autoscale]
memory_gib = 0``: a worker switches to serve the other) and with the models together on each worker (their
weights fit one GPU), and for the fixed fleet: GPU-hours, the daytime jobs' p50 and p95 latency (submission to
last image), when the night batch was done, node starts and model switches.

    python bench/autoscale_sim.py                 # writes docs/benchmarks/autoscale_sim.{json,md}
    python bench/autoscale_sim.py --smoke         # ten hours (the batch and a morning), a temporary folder
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402

from dit_serve.server.autoscale import Backlog, Costs, Rates, WorkerState, demand, place  # noqa: E402
from dit_serve.server.config import AutoscaleConfig  # noqa: E402
from workers.families.rates import MEASURED  # noqa: E402

DAY_S = 86400.0


@dataclass(frozen=True)
class Figures:
    """A model as the simulation runs it: measured figures, and where they come from."""

    steps: int              # a job's denoising steps (its card's default)
    rate: float             # image-steps per second of one worker at a full batch
    single: float           # image-steps per second of one image alone
    load_s: float | None    # loading it on a worker; None: not measured (--load-s)
    warmup_s: float         # capturing (and compiling) its steps once loaded
    source: str


FIGURES = {
    "dit-xl-2-256": Figures(
        50, MEASURED["dit-xl-2-256"].rate, 50 / 0.162608, 9.56, 1.95,
        "rate: an H100's 15.075 images/s of 50 steps, 128 images 64 at a time; alone: an H100's one image of 50 "
        "steps in 162.6 ms end to end (docs/benchmarks/parity.md, speed default); load 9.56 s and graph warm-up "
        "1.95 s: an H200's (docs/benchmarks/kernels.md)"),
    "flux-dev-1024": Figures(
        28, MEASURED["flux-dev-1024"].rate, MEASURED["flux-dev-1024"].rate, None, 15.68,
        "rate and alone: an H100's step of one image in 128.6 ms at speed fast (docs/benchmarks/parity.md; the "
        "step is bound by arithmetic, so a batch steps no image faster); warm-up 15.68 s, its steps compiled by "
        "blocks: an H200's (docs/benchmarks/kernels_flux1024_tables.md); load: not measured"),
}
WORKER_START_S = 15.0  # a worker's process and Ray's start of it: about 15 s on an H200 (docs/reliability.md,
                       # "Measured": a killed worker back with the tiny digits model)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    figures: Figures
    share: float       # of the daytime jobs

    @property
    def steps(self) -> int:
        return self.figures.steps

    @property
    def rate(self) -> float:
        return self.figures.rate

    @property
    def single(self) -> float:
        return self.figures.single


@dataclass
class Job:
    id: int
    model: str
    arrival: float
    images: int
    night: bool = False
    left: int = 0
    done_at: float | None = None


@dataclass
class Item:
    job: Job
    steps: float  # left


@dataclass
class Worker:
    key: int
    models: list[str]
    launched: float
    serves_at: float          # ready (a start or a switch) from then
    active: list[Item] = field(default_factory=list)
    idle_since: float | None = None
    stopped: float | None = None


def trace(models: list[ModelSpec], args, seed: int) -> list[Job]:
    """The day's jobs, by arrival: a trickle and bursts from 08:00 to 20:00, the batch at 01:00."""
    rng = random.Random(seed)
    start, end = 8 * 3600.0, min(20 * 3600.0, args.hours * 3600.0)
    bursts = sorted(rng.uniform(start, max(start, end - 600)) for _ in range(args.bursts))
    sizes, weights = (1, 4, 8, 16, 64, 256), (25, 25, 20, 15, 10, 5)
    jobs: list[Job] = []
    t = start
    while True:
        rate = args.jobs_per_hour / 3600 * (args.burst_factor if any(b <= t < b + 600 for b in bursts) else 1.0)
        t += rng.expovariate(rate)
        if t >= end:
            break
        model = rng.choices([m.name for m in models], [m.share for m in models])[0]
        jobs.append(Job(len(jobs), model, t, rng.choices(sizes, weights)[0]))
    night_at = 1 * 3600.0
    if night_at < args.hours * 3600:
        for _ in range(args.night_jobs):
            jobs.append(Job(len(jobs), models[-1].name, night_at, args.night_images, night=True))
    jobs.sort(key=lambda j: (j.arrival, j.id))
    return jobs


class Sim:
    """One replay: ``policy`` None is the fixed fleet."""

    def __init__(self, models: list[ModelSpec], jobs: list[Job], args, policy: AutoscaleConfig | None):
        self.models, self.spec = [m.name for m in models], {m.name: m for m in models}
        self.jobs = [Job(j.id, j.model, j.arrival, j.images, j.night) for j in jobs]
        self.args, self.policy = args, policy
        self.queues: dict[str, deque[Item]] = {m: deque() for m in self.models}
        self.queued_steps = {m: 0.0 for m in self.models}
        self.workers: list[Worker] = []
        self.starts = self.switches = 0
        self.rates = Rates({m.name: m.rate for m in models})
        self.switch_s = {m.name: (args.load_s if m.figures.load_s is None else m.figures.load_s) + m.figures.warmup_s
                         for m in models}
        self.start_s = {m: args.node_boot_s + WORKER_START_S + s for m, s in self.switch_s.items()}
        self.fits = (lambda ms: True) if policy is not None and policy.memory_gib > 0 else (lambda ms: len(ms) <= 1)

    def run(self) -> dict:
        a = self.args
        if self.policy is None:  # one worker per GPU, every model, from the start
            self.workers = [Worker(i, list(self.models), 0.0, 0.0) for i in range(a.gpus)]
        arrivals = deque(self.jobs)
        t, dt, next_policy = 0.0, a.tick_s, 0.0
        horizon = a.hours * 3600.0
        while arrivals or self._busy() or t < horizon:
            while arrivals and arrivals[0].arrival <= t:
                self._submit(arrivals.popleft())
            if self.policy is not None and t >= next_policy:
                self._reconcile(t)
                next_policy = t + a.reconcile_s
            self._work(t, dt)
            t += dt
            if not self._busy() and all(w.serves_at <= t for w in self._live()):  # nothing to do: jump ahead
                wake = [arrivals[0].arrival] if arrivals else [horizon]
                if self.policy is not None:
                    wake += [w.idle_since + self.policy.idle_timeout_s for w in self._live() if w.idle_since is not None]
                t = max(t, math.floor(min(wake) / dt) * dt)
                next_policy = min(next_policy, t)
            if t > horizon + 7 * DAY_S:
                raise RuntimeError("the simulation did not drain within a week: too few workers for the trace")
        end = max(t, horizon)
        gpu_s = sum(((w.stopped + a.node_release_s) if w.stopped is not None else end) - w.launched
                    for w in self.workers)
        day = sorted(j.done_at - j.arrival for j in self.jobs if not j.night)
        night = [j for j in self.jobs if j.night]
        return {"gpu_hours": round(gpu_s / 3600, 2), "jobs": len(day), "images": sum(j.images for j in self.jobs),
                "day_p50_s": round(harness.percentile(day, 50), 1) if day else None,
                "day_p95_s": round(harness.percentile(day, 95), 1) if day else None,
                "night_done_min": round((max(j.done_at for j in night) - night[0].arrival) / 60, 1) if night else None,
                "node_starts": self.starts, "switches": self.switches}

    # -- the trace's work -----------------------------------------------------------------------------------
    def _submit(self, job: Job) -> None:
        job.left = job.images
        steps = self.spec[job.model].steps
        self.queues[job.model].extend(Item(job, steps) for _ in range(job.images))
        self.queued_steps[job.model] += steps * job.images

    def _busy(self) -> bool:
        return any(self.queues.values()) or any(w.active for w in self.workers)

    def _live(self) -> list[Worker]:
        return [w for w in self.workers if w.stopped is None]

    def _work(self, t: float, dt: float) -> None:
        for w in self._live():
            if w.serves_at > t:
                continue
            while len(w.active) < self.args.inflight:  # the oldest queued item of its models
                heads = [(self.queues[m][0].job.arrival, m) for m in w.models if self.queues[m]]
                if not heads:
                    break
                item = self.queues[min(heads)[1]].popleft()
                self.queued_steps[item.job.model] -= item.steps
                w.active.append(item)
            if not w.active:
                continue
            n, kept = len(w.active), []
            for item in w.active:
                spec = self.spec[item.job.model]
                speed = min(spec.single, spec.rate / n)
                if item.steps <= speed * dt:
                    done = t + item.steps / speed
                    item.job.left -= 1
                    if item.job.left == 0:
                        item.job.done_at = done
                else:
                    item.steps -= speed * dt
                    kept.append(item)
            w.active = kept

    # -- the policy -----------------------------------------------------------------------------------------
    def _reconcile(self, t: float) -> None:
        cfg, live = self.policy, self._live()
        running = {m: 0 for m in self.models}
        running_steps = {m: 0.0 for m in self.models}
        holding = {m: 0 for m in self.models}
        for w in live:
            held = set()
            for item in w.active:
                running[item.job.model] += 1
                running_steps[item.job.model] += item.steps
                held.add(item.job.model)
            for m in held:
                holding[m] += 1
        backlog = {m: Backlog(len(self.queues[m]), running[m], math.ceil(self.queued_steps[m] + running_steps[m]))
                   for m in self.models}
        d = demand(backlog, self.rates, cfg, self.models, holding, self.args.inflight)
        for w in live:
            if w.serves_at > t or w.active or any(self.queues[m] for m in w.models):
                w.idle_since = None
            elif w.idle_since is None:
                w.idle_since = t
        states = [WorkerState(str(w.key), tuple(w.models), w.idle_since is not None,
                              t - w.idle_since if w.idle_since is not None else 0.0) for w in live]
        # the costs as the scheduler knows them: a start's on average (it measures one figure), a switch's per model
        costs = Costs(sum(self.start_s.values()) / len(self.start_s), self.switch_s)
        plan = place(d, backlog, states, max(0, cfg.max_workers - len(live)), costs, cfg, self.models, self.fits)
        by_key = {str(w.key): w for w in live}
        for key, model, unload in plan.switch:
            w = by_key[key]
            w.models = [m for m in w.models if m not in unload] + [model]
            w.serves_at, w.idle_since = t + self.switch_s[model], None
            self.switches += 1
        for models in plan.start:
            self.workers.append(Worker(len(self.workers), list(models), t, t + self.start_s[models[0]]))
            self.starts += 1
        for w in live:
            if w.idle_since is not None and t - w.idle_since >= cfg.idle_timeout_s \
                    and len(self._live()) - 1 >= cfg.min_workers:
                w.stopped = t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="ten hours of trace (the night batch and a morning)")
    p.add_argument("--out", type=Path, help="where the report goes (default docs/benchmarks; --smoke: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hours", type=float, default=24.0)
    p.add_argument("--gpus", type=int, default=8, help="the cluster's GPUs: the fixed fleet, and max_workers")
    p.add_argument("--models", nargs="+", default=["dit-xl-2-256:0.7", "flux-dev-1024:0.3"],
                   help=f"name:share of the daytime jobs, the names among {', '.join(FIGURES)} (their figures: "
                        "FIGURES); the last one's is the night batch")
    p.add_argument("--jobs-per-hour", type=float, default=30.0, help="daytime jobs outside bursts")
    p.add_argument("--bursts", type=int, default=12, help="ten-minute bursts between 08:00 and 20:00")
    p.add_argument("--burst-factor", type=float, default=10.0)
    p.add_argument("--night-jobs", type=int, default=10, help="jobs of the batch at 01:00 (the last model's)")
    p.add_argument("--night-images", type=int, default=1000)
    p.add_argument("--node-boot-s", type=float, default=180.0, help="a new node's boot until Ray runs on it "
                                                                    "(not measured here: a cloud VM's)")
    p.add_argument("--load-s", type=float, default=60.0, help="a model's load where FIGURES has none measured")
    p.add_argument("--node-release-s", type=float, default=60.0, help="Ray's idle timeout of a node after its "
                                                                     "worker stopped")
    p.add_argument("--inflight", type=int, default=64, help="items one worker holds at once")
    p.add_argument("--drain", type=float, nargs="+", default=[60.0, 300.0], help="target_drain_s values")
    p.add_argument("--idle", type=float, nargs="+", default=[60.0, 600.0], help="idle_timeout_s values")
    p.add_argument("--min-workers", type=int, nargs="+", default=[0, 1], help="min_workers values")
    p.add_argument("--reconcile-s", type=float, default=2.0)
    p.add_argument("--tick-s", type=float, default=1.0)
    args = p.parse_args(argv)
    if args.smoke:
        args.hours, args.night_jobs, args.night_images, args.drain, args.idle = 10.0, 2, 100, [300.0], [60.0]
        args.min_workers = [0]
    models = []
    for text in args.models:
        name, share = text.rsplit(":", 1)
        if name not in FIGURES:
            p.error(f"--models: no measured figures for {name!r} (FIGURES has {', '.join(FIGURES)})")
        models.append(ModelSpec(name, FIGURES[name], float(share)))
    jobs = trace(models, args, args.seed)

    fixed = Sim(models, jobs, args, None).run()
    print(f"fixed: {fixed}", flush=True)
    rows = [{"system": f"fixed: {args.gpus} workers, always on", "models_per_worker": "all", "target_drain_s": None,
             "idle_timeout_s": None, "min_workers": None, **fixed}]
    for together in (False, True):
        for low in args.min_workers:
            for drain in args.drain:
                for idle in args.idle:
                    cfg = AutoscaleConfig(enabled=True, min_workers=low, max_workers=args.gpus, target_drain_s=drain,
                                          idle_timeout_s=idle, memory_gib=80.0 if together else 0.0)
                    r = Sim(models, jobs, args, cfg).run()
                    rows.append({"system": "autoscale", "models_per_worker": "all" if together else "one",
                                 "target_drain_s": drain, "idle_timeout_s": idle, "min_workers": low, **r})
                    print(f"{'together' if together else 'one model'}, min_workers {low}, target_drain_s {drain:g}, "
                          f"idle_timeout_s {idle:g}: {r}", flush=True)

    params = {k: v for k, v in vars(args).items() if k not in ("out", "smoke")}
    params["figures"] = {m.name: {**vars(m.figures), "share": m.share} for m in models}
    result = {"environment": harness.environment("cpu"), "params": params, "rows": rows,
              "trace": {"jobs": len(jobs), "night_jobs": sum(j.night for j in jobs),
                        "images": sum(j.images for j in jobs)}}
    md = _markdown(result, models, args)
    out = harness.out_dir(args.out, args.smoke)
    for path in harness.write_report(out, "autoscale_sim", result, md):
        print(f"wrote {path}")
    (out / "autoscale_sim.svg").write_text(_svg(rows))
    print(f"wrote {out / 'autoscale_sim.svg'}")
    return 0


def _svg(rows: list[dict], width: int = 720, height: int = 420) -> str:
    """The rows as a scatter plot, GPU-hours (x) against the daytime p95 job latency (y), one point per setting
    (black: the fixed fleet; blue: one model per worker; orange: all models per worker), labelled with its
    target_drain_s / idle_timeout_s / min_workers. A plain SVG: no plotting library."""
    left, right, top, bottom = 70, 20, 30, 50
    xs, ys = [r["gpu_hours"] for r in rows], [r["day_p95_s"] for r in rows]
    x_max, y_max = max(xs) * 1.08, max(ys) * 1.12

    def at(x: float, y: float) -> tuple[float, float]:
        return (left + x / x_max * (width - left - right), height - bottom - y / y_max * (height - top - bottom))

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             'font-size="11">', f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="13">GPU-hours over the day against '
             'daytime p95 job latency</text>']
    x0, y0 = at(0, 0)
    x1, y1 = at(x_max, y_max)
    parts += [f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}" stroke="black"/>',
              f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}" stroke="black"/>',
              f'<text x="{(x0 + x1) / 2}" y="{height - 12}" text-anchor="middle">GPU-hours</text>',
              f'<text x="16" y="{(y0 + y1) / 2}" text-anchor="middle" transform="rotate(-90 16 {(y0 + y1) / 2})">'
              'daytime p95 (s)</text>']
    for i in range(6):
        gx, gy = x_max * i / 5, y_max * i / 5
        px, _ = at(gx, 0)
        _, py = at(0, gy)
        parts += [f'<text x="{px}" y="{y0 + 15}" text-anchor="middle">{gx:.0f}</text>',
                  f'<text x="{x0 - 6}" y="{py + 4}" text-anchor="end">{gy:.0f}</text>']
    colours = {"one": "#1f77b4", "all": "#ff7f0e"}
    for r in rows:
        px, py = at(r["gpu_hours"], r["day_p95_s"])
        fixed = r["system"] != "autoscale"
        colour = "black" if fixed else colours[r["models_per_worker"]]
        label = r["system"] if fixed else (f"{r['target_drain_s']:g}/{r['idle_timeout_s']:g}/{r['min_workers']}")
        parts += [f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="{colour}"/>',
                  f'<text x="{px + 6:.1f}" y="{py - 5:.1f}" fill="{colour}" font-size="9">{label}</text>']
    parts += [f'<text x="{width - right}" y="{top + 12}" text-anchor="end" fill="#1f77b4">one model per worker</text>',
              f'<text x="{width - right}" y="{top + 26}" text-anchor="end" fill="#ff7f0e">all models per worker</text>',
              f'<text x="{width - right}" y="{top + 40}" text-anchor="end">labels: target_drain_s / idle_timeout_s '
              '/ min_workers</text>', "</svg>"]
    return "\n".join(parts) + "\n"


def _markdown(result: dict, models: list[ModelSpec], args) -> str:
    rows, base = result["rows"], result["rows"][0]["gpu_hours"]
    sim = Sim(models, [], args, None)  # the costs it ran with
    figures = [[m.name, m.steps, f"{m.rate:.4g}", f"{m.single:.4g}",
                f"{m.figures.load_s:g}" if m.figures.load_s is not None else f"{args.load_s:g} (assumed)",
                f"{m.figures.warmup_s:g}", f"{sim.switch_s[m.name]:g}", f"{sim.start_s[m.name]:g}", f"{m.share:.0%}",
                m.figures.source] for m in models]
    lines = ["# Autoscaling over a simulated day: GPU-hours against job latency", "",
             "`bench/autoscale_sim.py` replays one synthetic day through the scheduler's autoscaling policy "
             "(`dit_serve.server.autoscale`: `demand` and `place`) in simulated time, and through a fixed fleet "
             "of one worker per GPU, always on. The figures are the policy's, under the costs below; nothing ran "
             "on a GPU.", "",
             f"Trace (seed {args.seed}): {result['trace']['jobs'] - result['trace']['night_jobs']} daytime jobs "
             f"(08:00-20:00, {args.jobs_per_hour:g} an hour, {args.bursts} ten-minute bursts at "
             f"{args.burst_factor:g}x; 1-256 images each), and {args.night_jobs} jobs of {args.night_images} images "
             f"of {models[-1].name} at 01:00; {result['trace']['images']} images in all; {args.gpus} GPUs at most.",
             "",
             "The models' figures are measured ones, from the reports named beside them (`FIGURES` in the script; "
             "the rates are `workers/families/rates.py`'s, which autoscaling starts from before its workers measure "
             "a model). A switch to a model costs its load and warm-up; a new worker serves after the node's boot "
             f"({args.node_boot_s:g} s, a parameter: a cloud VM's, not measured here), the worker's start "
             f"({WORKER_START_S:g} s, an H200's, docs/reliability.md) and its first model's load and warm-up. A node "
             f"goes {args.node_release_s:g} s after its worker stopped (Ray's idle timeout, a parameter). Models per "
             "worker: `one` (`[autoscale] memory_gib = 0`: a worker switches to serve the other model) or `all` "
             "(their weights fit one 80 GB GPU together: a new worker loads both).", "",
             *harness.table(["model", "steps", "image-steps/s, full batch", "image-steps/s, alone", "load s",
                             "warm-up s", "switch s", "start s", "share of day jobs", "from"], figures),
             "",
             *harness.table(["system", "models per worker", "min_workers", "target_drain_s", "idle_timeout_s",
                             "GPU-hours", "of always-on", "day p50 (s)", "day p95 (s)", "night batch done (min)",
                             "node starts", "switches"],
                            [[r["system"], r["models_per_worker"], r["min_workers"],
                              None if r["target_drain_s"] is None else f"{r['target_drain_s']:g}",
                              None if r["idle_timeout_s"] is None else f"{r['idle_timeout_s']:g}", r["gpu_hours"],
                              f"{r['gpu_hours'] / base:.0%}", r["day_p50_s"], r["day_p95_s"], r["night_done_min"],
                              r["node_starts"], r["switches"]] for r in rows]),
             "", "![GPU-hours against daytime p95, one point per setting](autoscale_sim.svg)",
             "", f"{harness.hardware_line(result['environment'])}"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
