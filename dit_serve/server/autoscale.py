"""Autoscaling policy: how many workers each model needs, and which models each worker holds. Pure functions and
small records, no Ray and no store: the scheduler reads the backlog from the store and the rates from its
workers' reports, asks ``demand`` how many workers to run and ``place`` which to start or switch, and acts on
the answer (``[autoscale]``, docs/service.md, Autoscaling). ``bench/autoscale_sim.py`` replays a day through
the same two functions.

The unit of work is the image-step: one denoising step of one item. A model's backlog is the steps left in
its queued items (their whole plans) and its running items (the rest of theirs); a worker does ``rate``
image-steps a second of that model. Then

    workers(model) = ceil(steps left / (rate x target_drain_s))

within the model's bounds, and the total within ``min_workers`` and ``max_workers``: enough workers to finish
the backlog in about ``target_drain_s``. A backlog in seconds of one worker (``Demand.seconds``) is what
``/metrics`` shows as GPU-seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

from dit_serve.server.config import AutoscaleConfig, ModelPlacement


@dataclass(frozen=True)
class Backlog:
    """One model's work waiting for workers (``Store.backlog``)."""

    queued: int = 0   # items waiting for a worker
    running: int = 0  # items leased to one
    steps: int = 0    # image-steps left: queued items' whole plans, running items' rest

    @staticmethod
    def of(rows: Mapping[str, Mapping[str, int]]) -> dict[str, "Backlog"]:
        """``Store.backlog()``'s answer as records."""
        return {m: Backlog(int(r.get("queued", 0)), int(r.get("running", 0)), int(r.get("steps", 0)))
                for m, r in rows.items()}

    @property
    def items(self) -> int:
        return self.queued + self.running


class Rates:
    """Image-steps per second that one worker does of each model: measured from the workers' step reports,
    else the configured rate (``[autoscale] rates``), else the estimate from the model's card (``estimated``:
    ``workers.families.rates``, for GPU workers), else ``default_rate``.

    A measurement is steps done over the seconds spent stepping, from a worker's report in which it ran one
    model only (a step of several models cannot be split between them) and held enough items to step at a
    full batch (the caller says which reports qualify: a half-empty worker reads low). The estimate is an
    average over the last ``memory_s`` busy seconds or so (older reports decay), and counts only once it
    covers ``min_busy_s`` of stepping."""

    def __init__(self, configured: Mapping[str, float] = {}, default: float = 100.0, memory_s: float = 60.0,
                 min_busy_s: float = 1.0, estimated: Mapping[str, float] = {}):
        self.configured, self.default, self.estimated = dict(configured), default, dict(estimated)
        self.memory_s, self.min_busy_s = memory_s, min_busy_s
        self._seen: dict[str, tuple[float, float]] = {}  # model -> decayed (steps, busy seconds)

    def observe(self, model: str, steps: float, busy_s: float) -> None:
        if steps <= 0 or busy_s <= 0:
            return
        done, busy = self._seen.get(model, (0.0, 0.0))
        decay = math.exp(-busy_s / self.memory_s)
        self._seen[model] = (done * decay + steps, busy * decay + busy_s)

    def measured(self, model: str) -> float | None:
        done, busy = self._seen.get(model, (0.0, 0.0))
        return done / busy if busy >= self.min_busy_s else None

    def rate(self, model: str) -> float:
        measured = self.measured(model)
        if measured is not None:
            return measured
        return self.configured.get(model, self.estimated.get(model, self.default))

    def source(self, model: str) -> str:
        """Where ``rate(model)`` comes from now: measured, configured, model card or default."""
        if self.measured(model) is not None:
            return "measured"
        return "configured" if model in self.configured else "model card" if model in self.estimated else "default"

    @staticmethod
    def from_config(cfg: AutoscaleConfig, estimated: Mapping[str, float] = {}) -> "Rates":
        return Rates(cfg.rates, cfg.default_rate, estimated=estimated)


def workers_for(steps: float, rate: float, target_drain_s: float) -> int:
    """Workers that finish ``steps`` image-steps in ``target_drain_s`` at ``rate`` each: 0 for no work."""
    if steps <= 0:
        return 0
    return max(1, math.ceil(steps / (rate * target_drain_s) - 1e-9))


@dataclass(frozen=True)
class Demand:
    """How many workers to run: per model (within its bounds), and in total (within ``min_workers`` and
    ``max_workers``: models' shares cut to fit, spare workers beyond them kept for ``min_workers``)."""

    workers: dict[str, int] = field(default_factory=dict)
    total: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # each model's backlog in one worker's seconds

    @property
    def spare(self) -> int:
        """Workers of the total beyond the models' shares (``min_workers`` with no backlog)."""
        return max(0, self.total - sum(self.workers.values()))


def demand(backlog: Mapping[str, Backlog], rates: Rates, cfg: AutoscaleConfig, models: list[str],
           holding: Mapping[str, int] | None = None, per_worker: int = 1) -> Demand:
    """The workers each of ``models`` needs for its ``backlog`` at its rate to drain in ``target_drain_s``, at
    least its ``min_workers_per_model`` and at most its ``max_workers_per_model``; their sum cut to
    ``max_workers`` (``fit``) and raised to ``min_workers``.

    ``holding`` (the workers that hold running items of each model) bounds a model's workers by where its work
    can go: a running item stays on its worker, and its queued items fill at most one more worker per
    ``per_worker`` of them (the items one worker runs at once). Without it, the bound is the items."""
    want, seconds = {}, {}
    for m in models:
        b = backlog.get(m, Backlog())
        rate = rates.rate(m)
        seconds[m] = b.steps / rate
        useful = b.items if holding is None else holding.get(m, 0) + math.ceil(b.queued / max(1, per_worker))
        n = max(min(workers_for(b.steps, rate, cfg.target_drain_s), useful), cfg.min_workers_per_model.get(m, 0))
        want[m] = min(n, cfg.max_workers_per_model.get(m, cfg.max_workers))
    want = fit(want, cfg.max_workers, seconds, cfg.min_workers_per_model)
    return Demand(want, max(cfg.min_workers, sum(want.values())), seconds)


def fit(want: Mapping[str, int], limit: int, seconds: Mapping[str, float],
        floors: Mapping[str, int] = {}) -> dict[str, int]:
    """``want`` cut to add up to at most ``limit``, one worker at a time from the model that loses least by it
    (the least backlog per worker), never below a model's floor, and a model with backlog keeps its last
    worker while another model has more than one."""
    out = dict(want)
    while sum(out.values()) > limit:
        cut = [m for m, n in out.items() if n > floors.get(m, 0)]
        if not cut:
            break
        m = min(cut, key=lambda m: (out[m] == 1 and seconds.get(m, 0) > 0, seconds.get(m, 0.0) / out[m], m))
        out[m] -= 1
    return out


# -- placement: which models each worker holds ---------------------------------------------------------------
@dataclass(frozen=True)
class WorkerState:
    """A running worker as placement sees it."""

    key: str
    models: tuple[str, ...]  # what it serves or loads
    idle: bool = False       # ready, nothing leased, nothing queued for its models, loading nothing
    idle_s: float = 0.0      # for how long
    allows: frozenset[str] | None = None  # the models it may load (``[autoscale.placement]``); None: any


@dataclass(frozen=True)
class Costs:
    """What a new worker and a switch of an idle one cost, in seconds until it serves: measured, else
    configured (``start_cost_s``, ``switch_cost_s``)."""

    start_s: float
    switch_s: Mapping[str, float] = field(default_factory=dict)  # per model switched to
    default_switch_s: float = 30.0

    def switch(self, model: str) -> float:
        return self.switch_s.get(model, self.default_switch_s)


@dataclass
class Placement:
    """What to do: workers to start (each with its models, the first served first, on the free slot of the
    same place in ``slots``) and idle workers to switch (their key, the model they load, and the models they
    unload to make room)."""

    start: list[list[str]] = field(default_factory=list)
    switch: list[tuple[str, str, list[str]]] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # per start, the index of its free slot


def pin_allows(pin: ModelPlacement | None, labels: Mapping[str, str], resources: Mapping[str, float]) -> bool:
    """Whether a worker on a node with ``labels``, with ``resources`` (custom ones) to take, may hold a model
    pinned by ``pin`` (None: not pinned, anywhere)."""
    if pin is None:
        return True
    return all(labels.get(k) == v for k, v in pin.labels.items()) and \
        all(resources.get(r, 0.0) >= amount - 1e-9 for r, amount in pin.resources.items())


def allowed(models: Sequence[str], pins: Mapping[str, ModelPlacement], labels: Mapping[str, str],
            resources: Mapping[str, float]) -> frozenset[str]:
    """Those of ``models`` a worker may hold on a node with ``labels`` and ``resources`` left (``pin_allows``)."""
    return frozenset(m for m in models if pin_allows(pins.get(m), labels, resources))


def reservation(models: Collection[str], pins: Mapping[str, ModelPlacement]) -> dict[str, float]:
    """The custom resources a worker holding ``models`` takes of its node: of each, the most one of its models'
    pins names (a pinned resource marks a kind of node; one worker needs it once, whatever it holds)."""
    out: dict[str, float] = {}
    for m in models:
        for r, amount in (pins[m].resources if m in pins else {}).items():
            out[r] = max(out.get(r, 0.0), amount)
    return out


def bundles(d: Demand, base: Mapping[str, float], pins: Mapping[str, ModelPlacement]) -> list[tuple[dict, dict]]:
    """What Ray's autoscaler is asked for: one (bundle, label selector) per worker of ``d``. A model's workers ask
    for ``base`` and its pinned resources, on nodes with its pinned labels; the spare workers (``min_workers``)
    for ``base`` anywhere."""
    out = []
    for m, n in d.workers.items():
        pin = pins.get(m)
        bundle = {**base, **(pin.resources if pin else {})}
        out += [(bundle, dict(pin.labels) if pin else {})] * n
    return out + [(dict(base), {})] * d.spare


def switch_gain(backlog_s: float, serving: int, switch_s: float) -> float:
    """Seconds sooner a model's backlog (``backlog_s`` of one worker's time) is done when one more worker joins
    the ``serving`` ones after ``switch_s``: with n workers it takes B/n; with one more, s + (B - n s)/(n + 1);
    the difference is (B - n s) / (n (n + 1)), and nothing when B <= n s (the others finish first). With none
    serving it, infinite: the backlog waits until one does."""
    if backlog_s <= 0:
        return 0.0
    if serving <= 0:
        return math.inf
    return max(0.0, (backlog_s - serving * switch_s) / (serving * (serving + 1)))


def place(d: Demand, backlog: Mapping[str, Backlog], workers: list[WorkerState],
          free_slots: int | Sequence[Collection[str]], costs: Costs, cfg: AutoscaleConfig, models: list[str],
          fits=lambda models: len(models) <= 1) -> Placement:
    """Which workers to start and which idle workers to switch, for the models whose workers (``d.workers``)
    outnumber those serving them, the largest backlog first (only models with queued items, or below their own
    minimum).

    For each worker a model lacks: an idle worker that holds none of it, and may (``WorkerState.allows``), is
    switched when the switch pays (``switch_gain`` at least ``min_switch_gain_s``, after its cost) and costs no
    more than starting one; else a new worker starts on a free slot that may hold the model while the total is
    under ``d.total``; else the model waits (Ray was asked for the nodes). An idle worker whose models would
    fall below their minimum is not switched. A new worker loads its model and then, while ``fits`` says their
    weights fit together, the other models with queued items (the largest backlog first), then the rest (it
    serves the first while it loads the others), each one its slot may hold; spare workers for ``min_workers``
    load the models in their order. An idle worker that has room loads the model beside its own instead of
    unloading them.

    ``free_slots``: how many free slots there are, each of which may hold any model, or per free slot the
    models it may hold (``allowed``: the models pinned to nodes, ``[autoscale.placement]``)."""
    slots = [None] * free_slots if isinstance(free_slots, int) else [frozenset(s) for s in free_slots]
    may = lambda i, m: slots[i] is None or m in slots[i]  # noqa: E731 (slot i may hold model m)
    open_slots = list(range(len(slots)))
    serving = {m: sum(m in w.models for w in workers) for m in models}
    floors = cfg.min_workers_per_model
    queued = {m: backlog.get(m, Backlog()).queued for m in models}
    order = sorted(models, key=lambda m: (-d.seconds.get(m, 0.0), models.index(m)))
    idle = sorted((w for w in workers if w.idle), key=lambda w: (-w.idle_s, w.key))
    out, waiting = Placement(), 0  # waiting: workers models lack that no slot here may hold (Ray was asked)
    # new workers: on free slots, within max_workers, and up to the total beyond the workers that are busy (an
    # idle worker may be switched instead, or time out)
    starts = max(0, min(len(slots), cfg.max_workers - len(workers), d.total - (len(workers) - len(idle))))

    def extras(first: str, slot: int) -> list[str]:
        chosen = [first]
        for m in [m for m in order if m != first and queued[m]] + [m for m in models if not queued[m]]:
            if m not in chosen and may(slot, m) and fits(chosen + [m]):
                chosen.append(m)
        return chosen

    for m in order:
        lacking = d.workers.get(m, 0) - serving[m]
        if lacking <= 0 or not (queued[m] or serving[m] < floors.get(m, 0)):
            continue
        for k in range(lacking):
            movable = [w for w in idle if m not in w.models and (w.allows is None or m in w.allows)
                       and all(serving[x] - 1 >= floors.get(x, 0) or fits(list(w.models) + [m]) for x in w.models)]
            pays = switch_gain(d.seconds.get(m, 0.0), serving[m], costs.switch(m)) >= max(cfg.min_switch_gain_s, 1e-9)
            slot = next((i for i in open_slots if may(i, m)), None) if starts > 0 else None
            if movable and pays and (slot is None or costs.switch(m) <= costs.start_s):
                w = movable[0]
                idle.remove(w)
                unload = [] if fits(list(w.models) + [m]) else list(w.models)
                out.switch.append((w.key, m, unload))
                for x in unload:
                    serving[x] -= 1
                serving[m] += 1
            elif slot is not None:
                chosen = extras(m, slot)
                out.start.append(chosen)
                out.slots.append(slot)
                open_slots.remove(slot)
                for x in chosen:
                    serving[x] += 1
                starts -= 1
            else:
                waiting += lacking - k
                break
    for _ in range(min(starts, d.total - len(workers) - len(out.start) - waiting)):  # spare ones for min_workers
        slot = next((i for i in open_slots if any(may(i, m) for m in models)), None)
        if slot is None:
            break
        chosen: list[str] = []
        for m in models:
            if may(slot, m) and fits(chosen + [m]):
                chosen.append(m)
        out.start.append(chosen or [m for m in models if may(slot, m)][:1])
        out.slots.append(slot)
        open_slots.remove(slot)
    return out
