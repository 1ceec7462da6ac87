"""What the workload sections share: requests (seeded Poisson arrivals holding a size mix), one image's spec,
diffusers' pipelines, the run's models, and the two batching loops timed against each other: the engine's
step-level batching (``run_engine``) and a diffusers user's static batching (``run_static``)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np
import torch

import harness

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
    (``Family.reference_pipeline``); where its text encoders are on the host, fed there (``harness.feed_encoders``)."""
    from workers.families import family_of

    pipe = family_of(model).reference_pipeline(model)
    harness.feed_encoders(model)  # text encoders on the host: their inputs moved there
    return pipe


def call_pipeline(pipe, model, specs: list) -> np.ndarray:
    """One pipeline call making ``specs`` (one model, one size), pixels out as numpy (``Family.reference_call``)."""
    from workers.families import family_of

    return pipe(**family_of(model).reference_call(model, specs), output_type="np",
                generator=torch.Generator().manual_seed(specs[0].seed)).images


# -- systems -----------------------------------------------------------------------------------------
class Models:
    """The run's models at one precision at a time (a new precision drops the last one's weights first), their
    text encoders on ``text_encoder_device`` ("": with the transformer; the engine configs say the same:
    ``engine_for``). An engine rewrites the model it runs in place, so diffusers (``engine=False``) gets them
    loaded again once an engine has had them."""

    def __init__(self, names: list, smoke: bool, text_encoder_device: str = "") -> None:
        self.names, self.smoke, self.precision, self.loaded, self.patched = names, smoke, None, [], False
        self.text_encoder_device = text_encoder_device

    def get(self, precision: str, engine: bool = True) -> list:
        if precision != self.precision or (self.patched and not engine):
            self.loaded = []
            harness.free()
            self.loaded = [harness.load(n, precision, self.smoke, self.text_encoder_device) for n in self.names]
            self.precision = precision
            self.patched = False
        self.patched |= engine
        return self.loaded

    def family(self) -> str:
        return (self.loaded or self.get("bf16", engine=False))[0].card.family


def engine_for(preset: str, models: Models, inflight: int):
    """A preset's engine config and precision for the run's models (their family; their text encoders where
    ``models`` loads them), or the reason it cannot run here."""
    config, precision = harness.engine_config(preset, models.family(), max_batch=inflight,
                                              text_encoder_device=models.text_encoder_device)
    if (why := harness.unavailable(precision, harness.device_and_dtype(models.smoke)[0])) is not None:
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

