"""Service overhead: the real `dit-serve serve` against the engine it runs, in one run on one machine.

First the engine alone, in this process on GPU 0, built as a worker builds it (`workers/actor.py`: the
model card's dtype on CUDA, float32 on a CPU; the "graphs" backend on CUDA (--backend), eager on a CPU;
buckets up to 64; the worker actor's torch threads; warmed up); then the service starts as a subprocess
(`dit-serve serve --model M`, a fresh data folder, `[workers] max_batch = 64`, GPU 0 alone; then GPUs 0
and 1 if asked) and is driven through the Python SDK. The engine stays up beside the 1-GPU service for
the paired single images and is freed before a 2-GPU one. Both sides make PNG bytes: the engine's times
include `workers.actor._png` of each image, as a worker encodes each finished image. Sampler, steps and
guidance are the model card's defaults on both sides unless --sampler / --steps say otherwise; item i has
label i % 10 and seed i.

  single image  engine: generate 1 item and encode it, median of --single runs after 2 warm-ups. Service:
                client wall time from submit to wait() returning the job done (the SDK follows the job's
                events), and to its PNG in hand, median of --single sequential 1-image jobs after 2
                warm-up jobs. Target: service (until done) <= engine + 15 ms. Paired: the engine stays up
                beside the service and generates one image just before each of the service's, so both
                see the same GPU state (clocks, heat); the median of the pairs' differences, the same
                target.
  throughput    one job of --images images: the engine's images/s (generate all, 64 at a time, PNGs
                included) against the service's, from the job's created_at to finished_at (server clock;
                also submit to done on the client's clock); medians of --repeats, each side after one
                warm-up batch of 64. Target: service >= 95% of the engine.
  scaling       the same job through a service that sees GPUs 0 and 1 (two workers) against GPU 0 alone;
                only with --gpus 2 on a machine with 2 GPUs, else "not run". Target: >= 1.9x.
  preview cost  the engine's time per step with preview_every=1 on every item against none, at 1 and at
                64 images: a run of all steps but the last (that one decodes), synchronised at both ends,
                over its number of steps; previews taken after each step, each item's latest PNG-encoded by a
                poller thread, as the worker does. Off and on alternate; medians of --repeats. Target: <= 3%
                added.

Targets are checked and printed (ok / MISSED / not run), not asserted. Writes docs/benchmarks/service.json
(hardware, versions, the command line, settings, every raw sample, medians, comparisons, targets) and
service.md; --smoke writes service_smoke.json only.

    python bench/service.py [--model dit-xl-2-256] [--images 256] [--repeats 2] [--single 10] [--gpus 1|2]
                            [--steps N] [--sampler S] [--out docs/benchmarks]
    python bench/service.py --smoke     # digits on whatever device there is, tiny sizes (~40 s on a 2-core CPU)
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from samplers.rules import RULES, check_settings
from workers.request.cards import read_card

_spec = importlib.util.spec_from_file_location("chaos", Path(__file__).with_name("chaos.py"))
chaos = sys.modules["chaos"] = importlib.util.module_from_spec(_spec)  # bench/ is not a package
_spec.loader.exec_module(chaos)

FULL = {"model": "dit-xl-2-256", "images": 256, "repeats": 2, "single": 10, "gpus": 1}
SMOKE = {"model": "digits", "images": 32, "repeats": 1, "single": 3, "gpus": 1}
WARMUP = 2           # single-image runs and jobs before the measured ones
MAX_BATCH = 64       # the engine's largest bucket and max_active; the service's [workers] max_batch (and so
                     # its max_inflight: a worker holds 64 items at once, as the engine here does)
PREVIEW_BATCHES = (1, 64)
POLL_S = 0.05  # the preview cost's poller: how often it takes and encodes the latest previews
SMALL_PREVIEW_REPEATS = 8  # off/on pairs at one image: a 50-step run is short and, host-bound, noisy
                          # (+1.9% and +11.7% in two H200 runs of the same code with 2 pairs)
TIMEOUT_S = 3600.0   # longest wait for one job

# comparison -> (op, limit, as the table shows it, what it says)
TARGETS = {"single_added_ms": ("<=", 15.0, "<= +15 ms", "service single image (until done) <= engine + 15 ms"),
           "single_added_paired_ms": ("<=", 15.0, "<= +15 ms", "the same, paired: each service image <= the engine's "
                                      "image just before it + 15 ms (median of the pairs)"),
           "throughput_ratio": (">=", 0.95, ">= 95%", "service images/s (server clock) >= 95% of the engine's"),
           "scaling": (">=", 1.9, ">= 1.9x", "service images/s on 2 GPUs >= 1.9x on 1 GPU"),
           "preview_added_pct_1": ("<=", 3.0, "<= +3%", "previews add <= 3% to the step time at 1 image"),
           "preview_added_pct_64": ("<=", 3.0, "<= +3%", "previews add <= 3% to the step time at 64 images")}

# the table: what it compares, the baseline's and the measurement's medians, the comparison, its format
ROWS = [("1 image ms: engine -> service, until done", "engine_single_ms", "service_single_done_ms",
         "single_added_ms", "{:+.1f} ms"),
        ("1 image ms: the same, paired (engine just before)", "engine_paired_ms", "service_single_done_ms",
         "single_added_paired_ms", "{:+.1f} ms"),
        ("1 image ms: engine -> service, PNG in hand", "engine_single_ms", "service_single_png_ms",
         "png_added_ms", "{:+.1f} ms"),
        ("ms/step at 1 image: engine -> service's worker", "step_ms_1_off", "worker_step_ms_1",
         "worker_step_added_ms", "{:+.2f} ms"),
        ("images/s: engine -> service (server clock)", "engine_images_per_s", "service_images_per_s",
         "throughput_ratio", "{:.1%}"),
        ("images/s: engine -> service (client clock)", "engine_images_per_s", "service_client_images_per_s",
         "client_throughput_ratio", "{:.1%}"),
        ("images/s: service 1 GPU -> 2 GPUs", "service_images_per_s", "service_2gpu_images_per_s",
         "scaling", "{:.2f}x"),
        *[(f"ms/step at {b} image{'s' * (b > 1)}: previews off -> on", f"step_ms_{b}_off", f"step_ms_{b}_on",
           f"preview_added_pct_{b}", "{:+.1f}%") for b in PREVIEW_BATCHES]]


# -- the engine alone ----------------------------------------------------------------------------------
def worker_threads(environ: dict) -> int:
    """A worker actor's torch threads: OMP_NUM_THREADS where the service's environment sets it, else what
    Ray sets it to in the actor, its num_cpus rounded down ([workers] num_cpus, 1 by default)."""
    from workers.config import WorkerConfig

    return int(environ.get("OMP_NUM_THREADS") or max(1, math.floor(WorkerConfig().num_cpus)))


def build_engine(model: str, backend: str = "graphs"):
    """An engine as a worker builds one (workers/actor.py), on GPU 0 or the CPU, with the worker's
    threads (on a CPU, two threads against the worker's one would not compare the service) and thread
    switch interval, warmed up."""
    import torch

    from workers.actor import SWITCH_INTERVAL_S
    from workers.config import WorkerConfig
    from workers.engine import Engine
    from workers.loading import load_model

    torch.set_num_threads(worker_threads(dict(os.environ)))
    # the worker's switch interval (Python's default is 5 ms): the preview cost's poller thread then hands
    # the interpreter lock over as a worker's threads do
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    cuda = torch.cuda.is_available()
    loaded = load_model(model, device="cuda" if cuda else "cpu", dtype=chaos.worker_dtype(model, cuda))
    engine = Engine(loaded, WorkerConfig(backend=backend if cuda else "eager", max_batch=MAX_BATCH))
    engine.warmup()
    return engine


def specs(s: dict, n: int, preview_every: int = 0) -> list:
    from workers.request.spec import ItemSpec

    return [ItemSpec(id=str(i), seed=i, sampler=s["sampler"], steps=s["steps"], guidance=s["guidance"],
                     label=i % s["classes"], preview_every=preview_every) for i in range(n)]


def generate_s(engine, items: list) -> float:
    """Seconds to generate ``items`` (at most MAX_BATCH at a time) and PNG-encode each image."""
    from workers.actor import _png

    t0 = time.perf_counter()
    for r in engine.generate(items, max_active=MAX_BATCH):
        _png(r.image)
    return time.perf_counter() - t0


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_ms(engine, s: dict, batch: int, preview_every: int, poll_s: float | None = POLL_S,
            encode: bool = True, final: str = "latest") -> float:
    """ms per step of ``batch`` items over all their steps but the last (it decodes; at least one step
    is timed). As in the worker (`Worker._step` and `Worker.poll`): after each step the step loop takes the
    previews whose copies arrived and keeps each item's latest; a poller thread PNG-encodes what it takes,
    every ``poll_s`` (the service polls a busy worker about every 0.25 s: POLL_S polls more often, so costs
    more); the last previews are waited for inside the timed run, and each item's latest of them encoded,
    as the worker's next poll would (``final`` "all": every one of them, as this harness did before: the
    host runs several steps ahead of the GPU, so that was several PNGs per item in the timed run that no
    worker makes). ``poll_s`` None: no poller (the previews taken are dropped); ``encode`` False: the poller
    takes them and encodes nothing (bench/preview_cost.py (in git history) compares these)."""
    import threading

    from workers.actor import _png

    steps = max(2, s["steps"])
    engine.add_many(specs({**s, "steps": steps}, batch, preview_every))
    latest, lock, done = {}, threading.Lock(), threading.Event()

    def poller() -> None:
        while not done.wait(poll_s):
            with lock:
                taken = dict(latest)
                latest.clear()
            for image in taken.values() if encode else ():
                _png(image)

    thread = None if poll_s is None else threading.Thread(target=poller, daemon=True)
    sync()
    t0 = time.perf_counter()
    if thread is not None:
        thread.start()
    for _ in range(steps - 1):
        engine.step()
        kept = {p.request_id: p.image for p in engine.take_previews()}
        if thread is not None:
            with lock:
                latest.update(kept)
    last = engine.take_previews(wait=True)
    if thread is not None and encode:
        with lock:
            latest.update({p.request_id: p.image for p in last})
            taken = [p.image for p in last] if final == "all" else list(latest.values())
            latest.clear()
        for image in taken:
            _png(image)
    done.set()
    if thread is not None:
        thread.join()
    sync()
    elapsed = time.perf_counter() - t0
    engine.step()  # the last step: decodes and finishes every item
    return elapsed * 1e3 / (steps - 1)


def engine_previews(engine, s: dict) -> dict:
    """{batch: {"off": [ms/step...], "on": [...]}}, off and on alternating after one untimed run of each;
    ``repeats`` pairs, at least SMALL_PREVIEW_REPEATS at one image. Every other pair runs "on" first, so
    a drift over the run (clocks, heat) does not always fall on the same side of the pairs."""
    out = {}
    for batch in PREVIEW_BATCHES:
        runs = {"off": [], "on": []}
        pairs = max(s["repeats"], SMALL_PREVIEW_REPEATS) if batch == 1 else s["repeats"]
        for n, warm in enumerate([True] + [False] * pairs):
            order = (("off", 0), ("on", 1)) if n % 2 == 0 else (("on", 1), ("off", 0))
            for key, every in order:
                ms = step_ms(engine, s, batch, every, final=s.get("preview_final", "latest"))
                if not warm:
                    runs[key].append(round(ms, 3))
        out[str(batch)] = runs
    return out


def measure_engine(s: dict, engine) -> dict:
    single = [generate_s(engine, specs(s, 1)) * 1e3 for _ in range(WARMUP + s["single"])][WARMUP:]
    generate_s(engine, specs(s, min(s["images"], MAX_BATCH)))  # warm-up batch
    rates = [s["images"] / generate_s(engine, specs(s, s["images"])) for _ in range(s["repeats"])]
    return {"single_ms": [round(x, 2) for x in single], "images_per_s": [round(x, 3) for x in rates],
            "step_ms": engine_previews(engine, s)}


# -- the service -------------------------------------------------------------------------------------
def visible_devices(gpus: int, environ: dict) -> str:
    """CUDA_VISIBLE_DEVICES for a service on the first ``gpus`` GPUs this process sees (GPU 0 is the
    engine's): the first entries of this process's own list, if it has one."""
    mine = environ.get("CUDA_VISIBLE_DEVICES")
    ids = mine.split(",") if mine else [str(i) for i in range(gpus)]
    return ",".join(ids[:gpus])


def scaling_skipped(gpus: int, device_count: int) -> str | None:
    """Why the 2-GPU service does not run, or None when it does."""
    if gpus < 2:
        return "--gpus 1"
    return None if device_count >= 2 else f"needs 2 GPUs, found {device_count}"


def service_phase(s: dict, gpus: int, tmp: Path, drive) -> dict:
    """Start a service on ``gpus`` GPUs (no GPU: its one CPU worker), wait for all its workers, run
    ``drive(client, s)``, stop it (SIGTERM, a drain); its measurements, with the start-up and the stop."""
    import torch

    from dit_serve.client import Client

    cuda = torch.cuda.is_available()
    run = Path(tempfile.mkdtemp(prefix=f"serve-{gpus}gpu-", dir=tmp))
    backend = f'backend = "{s["backend"]}"\n' if cuda and s["backend"] != "graphs" else ""  # graphs: the default
    (run / "dit-serve.toml").write_text(f"[workers]\nmax_batch = {MAX_BATCH}\n{backend}")
    env = {"CUDA_VISIBLE_DEVICES": visible_devices(gpus, dict(os.environ))} if cuda else {}
    t0 = time.monotonic()
    served = chaos.start_serve(run / "data", run / "serve.log", config=run / "dit-serve.toml",
                               models=[s["model"]], env=env)
    try:
        chaos.wait_ready(served, workers=gpus if cuda else 1, timeout=900.0)
        ready_s = time.monotonic() - t0
        with Client(served.url, timeout=120.0) as c:
            result = drive(c, s)
    finally:
        stopped = chaos.stop_serve(served)
    return {"ready_s": round(ready_s, 1), **result, "after_stop": stopped}


def submit(c, s: dict, n: int):
    return c.submit([i % s["classes"] for i in range(n)], model=s["model"], seed=0, sampler=s["sampler"],
                    steps=s["steps"], guidance=s["guidance"])


def finished(c, job):
    """The job once done; a job that ends otherwise stops the benchmark."""
    job = c.wait(job, progress=False, timeout=TIMEOUT_S)
    if job.state != "done":
        raise RuntimeError(f"job {job.id} ended {job.state}: {job.counts}")
    return job


def service_single(c, s: dict, engine=None) -> dict:
    """Also the worker's own mean step time over the measured jobs (its step histogram in /metrics), to
    tell time spent in the worker's steps from time spent around them. With ``engine`` (this process's,
    still up), one image through it just before each service job: the pairs."""
    done, png, ends, paired = [], [], {"submit_ms": [], "end_ms": []}, []
    for i in range(WARMUP + s["single"]):
        if engine is not None:
            engine_ms = generate_s(engine, specs(s, 1)) * 1e3
        if i == WARMUP:
            before, phases_before = step_totals(c.url), phase_totals(c.url)
            subs_before = phase_totals(c.url, "dit_serve_item_subphase_seconds")
        t0, w0 = time.perf_counter(), time.time()
        job = finished(c, submit(c, s, 1))
        t1, w1 = time.perf_counter(), time.time()
        c.image_bytes(job, 0)
        t2 = time.perf_counter()
        if i >= WARMUP:
            if engine is not None:
                paired.append(round(engine_ms, 2))
            done.append(round((t1 - t0) * 1e3, 2))
            png.append(round((t2 - t0) * 1e3, 2))
            ends["submit_ms"].append(round((job.created_at - w0) * 1e3, 2))  # the client's call -> stored
            ends["end_ms"].append(round((w1 - job.finished_at) * 1e3, 2))   # stored -> the client has it
    time.sleep(1.0)  # the last poll's step times reach the metrics at the scheduler's next heartbeat
    after, phases_after = step_totals(c.url), phase_totals(c.url)
    subs_after = phase_totals(c.url, "dit_serve_item_subphase_seconds")
    steps = after[1] - before[1]
    return {"single_done_ms": done, "single_png_ms": png, **({"paired_engine_ms": paired} if paired else {}),
            "worker_step_ms": round(1e3 * (after[0] - before[0]) / steps, 3) if steps else None,
            "phases_ms": phase_means(phases_before, phases_after),
            "subphases_ms": phase_means(subs_before, subs_after),
            "client_ms": {k: statistics.median(v) for k, v in ends.items() if v}}


def phase_totals(url: str, metric: str = "dit_serve_item_phase_seconds") -> dict[str, tuple[float, float]]:
    """Per phase of a finished image (``metric``: the phases, or ``dit_serve_item_subphase_seconds``, the
    finer cuts of two of them): (seconds, count) so far."""
    m = chaos.metrics(url, counters=False)
    out: dict[str, list[float]] = {}
    for key, value in m.items():
        for part, slot in (("_sum{", 0), ("_count{", 1)):
            if key.startswith(metric + part):
                out.setdefault(key.split('phase="', 1)[1].split('"', 1)[0], [0.0, 0.0])[slot] += value
    return {k: (v[0], v[1]) for k, v in out.items()}


def phase_means(before: dict, after: dict) -> dict[str, float]:
    """Mean ms per phase over the images finished between two ``phase_totals`` (an older service without
    the phases: empty)."""
    out = {}
    for phase, (total, n) in after.items():
        t0, n0 = before.get(phase, (0.0, 0.0))
        if n > n0:
            out[phase] = round(1e3 * (total - t0) / (n - n0), 2)
    return out


def step_totals(url: str) -> tuple[float, float]:
    """(seconds, count) of every worker's engine steps so far (``dit_serve_step_seconds``)."""
    m = chaos.metrics(url, counters=False)
    return (sum(v for k, v in m.items() if k.startswith("dit_serve_step_seconds_sum")),
            sum(v for k, v in m.items() if k.startswith("dit_serve_step_seconds_count")))


def service_throughput(c, s: dict) -> dict:
    finished(c, submit(c, s, min(s["images"], MAX_BATCH)))  # warm-up batch
    server, client = [], []
    for _ in range(s["repeats"]):
        t0 = time.perf_counter()
        job = finished(c, submit(c, s, s["images"]))
        client.append(round(s["images"] / (time.perf_counter() - t0), 3))
        server.append(round(s["images"] / (job.finished_at - job.created_at), 3))
    return {"images_per_s": server, "client_images_per_s": client}


def service_both(c, s: dict, engine=None) -> dict:
    return {**service_single(c, s, engine), **service_throughput(c, s)}


def measure(s: dict) -> dict:
    """Every raw sample: the engine, then a service on GPU 0, then (if asked and there) on GPUs 0 and 1."""
    import torch

    engine = build_engine(s["model"], s["backend"])
    raw = {"engine": measure_engine(s, engine), "service": {}}
    skipped = scaling_skipped(s["gpus"], torch.cuda.device_count())
    with tempfile.TemporaryDirectory(prefix="bench-service-") as tmp:
        raw["service"]["1"] = service_phase(s, 1, Path(tmp), functools.partial(service_both, engine=engine))
        del engine  # its graphs and pool go before the 2-GPU service starts
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        raw["service"]["2"] = {"not_run": skipped} if skipped else service_phase(s, 2, Path(tmp), service_throughput)
    return raw


# -- the report ----------------------------------------------------------------------------------------
def median(xs: list | None) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def medians(raw: dict) -> dict:
    e, one, two = raw["engine"], raw["service"]["1"], raw["service"]["2"]
    out = {"engine_single_ms": median(e["single_ms"]), "service_single_done_ms": median(one["single_done_ms"]),
           "service_single_png_ms": median(one["single_png_ms"]), "engine_images_per_s": median(e["images_per_s"]),
           "service_images_per_s": median(one["images_per_s"]),
           "service_client_images_per_s": median(one["client_images_per_s"]),
           "service_2gpu_images_per_s": median(two.get("images_per_s")),
           "worker_step_ms_1": one.get("worker_step_ms"), "engine_paired_ms": median(one.get("paired_engine_ms")),
           "paired_added_ms": median([b - a for a, b in zip(one.get("paired_engine_ms") or [], one["single_done_ms"])])}
    for batch, runs in e["step_ms"].items():
        out.update({f"step_ms_{batch}_{k}": median(v) for k, v in runs.items()})
    return out


def comparisons(m: dict) -> dict:
    """Service against engine (ms added, ratios), 2 GPUs against 1, previews on against off (% added)."""
    def added(a, b):
        return None if a is None or b is None else round(b - a, 2)

    def ratio(a, b):
        return None if not a or b is None else round(b / a, 4)

    out = {"single_added_ms": added(m["engine_single_ms"], m["service_single_done_ms"]),
           "single_added_paired_ms": None if m.get("paired_added_ms") is None else round(m["paired_added_ms"], 2),
           "png_added_ms": added(m["engine_single_ms"], m["service_single_png_ms"]),
           "throughput_ratio": ratio(m["engine_images_per_s"], m["service_images_per_s"]),
           "client_throughput_ratio": ratio(m["engine_images_per_s"], m["service_client_images_per_s"]),
           "scaling": ratio(m["service_images_per_s"], m["service_2gpu_images_per_s"]),
           "worker_step_added_ms": added(m.get("step_ms_1_off"), m.get("worker_step_ms_1"))}
    for b in PREVIEW_BATCHES:
        r = ratio(m.get(f"step_ms_{b}_off"), m.get(f"step_ms_{b}_on"))
        out[f"preview_added_pct_{b}"] = None if r is None else round((r - 1) * 100, 2)
    return out


def targets(c: dict) -> list[dict]:
    """Each target with its value and whether it was met (None: not measured)."""
    out = []
    for key, (op, limit, _, text) in TARGETS.items():
        v = c.get(key)
        met = None if v is None else (v <= limit if op == "<=" else v >= limit)
        out.append({"key": key, "target": text, "value": v, "met": met})
    return out


def status(met: bool | None) -> str:
    return "not run" if met is None else "ok" if met else "MISSED"


def rows(report: dict) -> list[list[str]]:
    """The table's rows: measure, baseline, measured, change, target, status."""
    m, c = report["medians"], report["comparisons"]
    met = {t["key"]: t["met"] for t in report["targets"]}
    out = []
    for label, base, value, key, fmt in ROWS:
        shown = [f"{m[k]:g}" if m.get(k) is not None else "-" for k in (base, value)]
        change = fmt.format(c[key]) if c.get(key) is not None else "-"
        target = TARGETS[key][2] if key in TARGETS else ""
        out.append([label, *shown, change, target, status(met[key]) if key in TARGETS else ""])
    return out


HEADER = ["measure", "baseline", "measured", "change", "target", "status"]


def table(report: dict) -> str:
    body = [HEADER] + rows(report)
    widths = [max(len(r[i]) for r in body) for i in range(len(HEADER))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in body]
    return "\n".join(lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:] + notes(report))


def notes(report: dict) -> list[str]:
    """The 2-GPU row when skipped, and where one image's time went in the service (``phases_ms``: mean ms
    per phase, the rest is the client's side: HTTP, the event stream)."""
    out = []
    if skipped := report["raw"]["service"]["2"].get("not_run"):
        out.append(f"2 GPUs: not run ({skipped})")
    phases = report["raw"]["service"]["1"].get("phases_ms") or {}
    done = report["medians"].get("service_single_done_ms")
    if phases and done is not None:
        listed = ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
        outside = report["raw"]["service"]["1"].get("client_ms") or {}
        split = f" (median: submit {outside['submit_ms']:.2f}, end {outside['end_ms']:.2f})" if outside else ""
        out.append(f"one image in the service, mean ms per phase: {listed}; outside them (HTTP, events, the "
                   f"client): {done - sum(phases.values()):.2f}{split}")
        if subs := report["raw"]["service"]["1"].get("subphases_ms"):
            out.append("finer: " + ", ".join(f"{k} {v:.2f}" for k, v in subs.items())
                       + " (lease = lease_txn + send; handoff = reply + transport + pickup)")
    return out


def markdown(report: dict) -> str:
    s, h = report["settings"], report["hardware"]
    lines = [f"# The service against its engine: {s['model']} on {h.get('gpu') or h['cpu']}", "",
             f"`{report['command']}`", "",
             f"{h.get('gpus', 0)} GPU(s), torch {h['torch']}, diffusers {h.get('diffusers')}, ray {h.get('ray')}. "
             f"{s['sampler']} {s['steps']} steps, guidance {s['guidance']}; {s['single']} single-image runs and "
             f"jobs after {s['warmup']} warm-ups; jobs of {s['images']} images, medians of {s['repeats']}; "
             f"at most {s['max_batch']} images in flight on each side. The engine ran alone in the benchmark's "
             "process (PNG encoding included), then the service (`dit-serve serve`) on GPU 0, then on GPUs 0 "
             "and 1. Definitions: the docstring of `bench/service.py`.", "",
             "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(report)]
    lines += [""] + [f"{n}." for n in notes(report)] + ["", "## Targets", ""]
    lines += [f"- {t['target']}: {'-' if t['value'] is None else t['value']} ({status(t['met'])})"
              for t in report["targets"]]
    return "\n".join(lines) + "\n"


def hardware() -> dict:
    """chaos' hardware() and versions, with diffusers and the GPUs this process sees."""
    import diffusers
    import torch

    cuda = torch.cuda.is_available()
    return {**chaos.hardware(), "diffusers": diffusers.__version__, "gpus": torch.cuda.device_count(),
            "gpu": torch.cuda.get_device_name(0) if cuda else None}


def build_report(raw: dict, s: dict, info: dict, command: str) -> dict:
    m = medians(raw)
    c = comparisons(m)
    return {"bench": "service", "smoke": s["smoke"], "hardware": info, "command": command, "settings": s,
            "raw": raw, "medians": m, "comparisons": c, "targets": targets(c)}


def write(report: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    name = "service_smoke" if report["smoke"] else "service"
    paths = [out / f"{name}.json"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n")
    if not report["smoke"]:
        paths.append(out / "service.md")
        paths[1].write_text(markdown(report))
    return paths


# -- the command line --------------------------------------------------------------------------------
def positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help=f"a class-conditional model (default {FULL['model']}; --smoke: {SMOKE['model']})")
    p.add_argument("--images", type=positive, help=f"images per throughput job (default {FULL['images']}; "
                                                   f"--smoke: {SMOKE['images']})")
    p.add_argument("--repeats", type=positive, help=f"throughput jobs and preview runs (default {FULL['repeats']})")
    p.add_argument("--single", type=positive, help=f"measured single-image runs (default {FULL['single']})")
    p.add_argument("--gpus", type=int, choices=(1, 2), help="2: also a service on GPUs 0 and 1 (scaling)")
    p.add_argument("--steps", type=positive, help="denoising steps (default: the model card's)")
    p.add_argument("--sampler", choices=sorted(RULES), help="the sampler (default: the model card's)")
    p.add_argument("--backend", choices=("graphs", "breakable", "full"), default="graphs",
                   help="the graph backend of the engine and of the service's workers on a GPU (default graphs, "
                        "the workers' own default there)")
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    p.add_argument("--smoke", action="store_true", help="tiny sizes on any device: " + json.dumps(SMOKE))
    return p


def settings(args: argparse.Namespace) -> dict:
    """The run's settings: each size as given, else --smoke's or the full run's; sampler, steps and
    guidance as given, else the model card's defaults. ValueError for a model or sampler that cannot run."""
    base = SMOKE if args.smoke else FULL
    s = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in base.items()}
    card = read_card(s["model"])  # CardError (a ValueError) for an unknown model
    if card.conditioning != "class":
        raise ValueError(f"{s['model']} is a {card.conditioning} model: the benchmark submits class labels")
    s.update(sampler=args.sampler or card.defaults["sampler"], steps=args.steps or card.defaults["steps"],
             guidance=card.defaults["guidance"], classes=min(10, card.num_classes), max_batch=MAX_BATCH,
             warmup=WARMUP, smoke=args.smoke, backend=args.backend,
             # what the preview cost's timed run encodes at its end (reports before this key: every preview
             # still on its way, several per item at one image; see step_ms)
             preview_final="latest")
    check_settings(s["sampler"], s["steps"], 0.0, card.prediction_type, card.num_train_timesteps)
    return s


def parse(argv: list[str]) -> tuple[argparse.Namespace, dict]:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        return args, settings(args)
    except ValueError as e:
        p.error(str(e))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, s = parse(argv)
    t0 = time.monotonic()
    raw = measure(s)
    report = build_report(raw, s, hardware(), shlex.join(["python", "bench/service.py", *argv]))
    report["seconds"] = round(time.monotonic() - t0, 1)
    paths = write(report, args.out)
    print(table(report), flush=True)
    print("  report: " + ", ".join(map(str, paths)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
