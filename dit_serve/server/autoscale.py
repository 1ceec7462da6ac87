"""Autoscaling policy: how many workers each model needs. Pure functions and small records, no Ray and no
store: the scheduler reads the backlog from the store and the rates from its workers' reports, asks
``demand`` how many workers to run, and acts on the answer (``[autoscale]``, docs/service.md).

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
from typing import Mapping

from dit_serve.server.config import AutoscaleConfig


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
    else the configured rate (``[autoscale] rates``), else ``default_rate``.

    A measurement is steps done over the seconds spent stepping, from a worker's report in which it ran one
    model only (a step of several models cannot be split between them) and held enough items to step at a
    full batch (the caller says which reports qualify: a half-empty worker reads low). The estimate is an
    average over the last ``memory_s`` busy seconds or so (older reports decay), and counts only once it
    covers ``min_busy_s`` of stepping."""

    def __init__(self, configured: Mapping[str, float] = {}, default: float = 100.0, memory_s: float = 60.0,
                 min_busy_s: float = 1.0):
        self.configured, self.default = dict(configured), default
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
        return measured if measured is not None else self.configured.get(model, self.default)

    @staticmethod
    def from_config(cfg: AutoscaleConfig) -> "Rates":
        return Rates(cfg.rates, cfg.default_rate)


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
