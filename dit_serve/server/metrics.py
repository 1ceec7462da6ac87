"""Prometheus metrics of one service process, in a registry of its own (not the global one), so
several services in one process (tests) do not collide.

The scheduler updates the worker-side numbers (step latency, graph replays, eager fallbacks, busy
fraction, items finished); the queue depth is read from the store at scrape time, so it is right
in an API-only process too.
"""

from __future__ import annotations

import math
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
PHASE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
                 300.0, 1800.0)
PHASES = ("wait", "lease", "dispatch", "admit", "run", "handoff", "commit")
# finer cuts of two phases: lease = lease_txn + send; handoff = reply + transport + pickup
SUBPHASES = ("lease_txn", "send", "reply", "transport", "pickup")


class Metrics:
    def __init__(self, window_s: float = 30.0):
        self.registry = r = CollectorRegistry()
        self.queue_depth = Gauge("dit_serve_queue_depth", "items waiting for a worker", registry=r)
        self.items_running = Gauge("dit_serve_items_running", "items leased to workers", registry=r)
        self.items = Counter("dit_serve_items", "items finished by this process's scheduler", ["state"], registry=r)
        self.items_per_second = Gauge("dit_serve_items_per_second",
                                      f"items done per second over the last {window_s:.0f} s", registry=r)
        self.step_seconds = Histogram("dit_serve_step_seconds", "one engine step (all active items advance once)",
                                      ["worker"], buckets=STEP_BUCKETS, registry=r)
        self.graph_replays = Gauge("dit_serve_graph_replays", "graph replays since the worker started",
                                   ["worker"], registry=r)
        self.eager_fallbacks = Gauge("dit_serve_graph_eager_fallbacks", "steps run eagerly instead of replayed "
                                     "(a bucket that failed to capture, or the eager backend)", ["worker"], registry=r)
        self.busy = Gauge("dit_serve_worker_busy_fraction", "fraction of wall time a worker spent stepping",
                          ["worker"], registry=r)
        self.rows = Gauge("dit_serve_engine_rows", "sample-steps a worker's engine ran: real, or padding that "
                          "filled a graph bucket", ["worker", "kind"], registry=r)
        self.workers = Gauge("dit_serve_workers", "worker actors ready", registry=r)
        self.loras_registered = Gauge("dit_serve_loras_registered", "adapters (LoRA) in the registry", registry=r)
        self.lora_pushes = Counter("dit_serve_lora_pushes", "adapters sent to a worker before items that name them",
                                   registry=r)
        # per-request adapters on the workers (workers.lora: Engine.stats()["lora"], polled with each report)
        self.lora_resident = Gauge("dit_serve_lora_resident", "adapters resident in a worker's bank for a model",
                                   ["worker", "model"], registry=r)
        self.lora_loads = Gauge("dit_serve_lora_loads", "adapters a worker loaded into its banks' slots since it "
                                "started", ["worker"], registry=r)
        self.lora_evictions = Gauge("dit_serve_lora_evictions", "adapters a worker evicted from its banks' slots "
                                    "since it started", ["worker"], registry=r)
        self.lora_rows = Gauge("dit_serve_lora_rows", "images a worker admitted with each adapter since it started",
                               ["worker", "adapter"], registry=r)
        self.lora_waiting = Gauge("dit_serve_lora_waiting", "images a worker admitted that wait for their adapters "
                                  "to load", ["worker"], registry=r)
        self.requeued = Counter("dit_serve_items_requeued", "items sent back to the queue without being charged, "
                                "by cause (crash: their worker died or its step raised; infra: a node left)",
                                ["reason"], registry=r)
        self.worker_crashes = Counter("dit_serve_worker_crashes", "workers that died or stalled holding items",
                                      registry=r)
        self.phase_seconds = Histogram(
            "dit_serve_item_phase_seconds", "where a finished image's time went: wait (submitted -> leased), "
            "lease (-> leased and sent: the lease's transaction and the actor call), dispatch (-> its worker "
            "received it), admit (-> its worker's engine took it), run (-> its PNG was ready in the worker), "
            "handoff (-> the scheduler had it), commit (-> stored and announced); clocks of the hosts involved",
            ["phase"], buckets=PHASE_BUCKETS, registry=r)
        self.subphase_seconds = Histogram(
            "dit_serve_item_subphase_seconds", "two phases cut finer: lease_txn (leased -> the lease's "
            "transaction returned) and send (-> the actor call made) make lease; reply (PNG ready -> the "
            "worker's poll answered), transport (-> the answer reached the scheduler's process) and pickup "
            "(-> the scheduler had it) make handoff", ["phase"], buckets=PHASE_BUCKETS, registry=r)
        self.rejected = Counter("dit_serve_submissions_rejected", "submissions refused with a 429 (queue full)",
                                registry=r)
        # autoscaling ([autoscale]; dit_serve.server.autoscale)
        self.serving = Gauge("dit_serve_workers_serving", "workers serving each model now (ready, the model loaded)",
                             ["model"], registry=r)
        self.desired = Gauge("dit_serve_autoscale_desired_workers", "workers each model's backlog asks for "
                             "(autoscaling on)", ["model"], registry=r)
        self.backlog_seconds = Gauge("dit_serve_autoscale_backlog_gpu_seconds", "each model's backlog (steps left "
                                     "over one worker's rate) in seconds of one worker (GPU-seconds)", ["model"],
                                     registry=r)
        self.requested = Gauge("dit_serve_autoscale_requested_workers", "workers' resources asked of Ray's "
                               "autoscaler (request_resources)", registry=r)
        self.switches = Counter("dit_serve_model_switches", "idle workers switched to (or loading beside) another "
                                "model, by the model loaded", ["model"], registry=r)
        self.switch_seconds = Histogram("dit_serve_model_switch_seconds", "a switch, from the order to the worker "
                                        "serving the model", buckets=PHASE_BUCKETS, registry=r)
        self.scale_from_zero = Histogram("dit_serve_scale_from_zero_seconds", "with no worker running, from the "
                                         "first backlog to the first worker ready (nodes, start, first model)",
                                         buckets=PHASE_BUCKETS, registry=r)
        self._window_s = window_s
        self._done_times: deque[float] = deque()
        self._busy: dict[str, tuple[float, float]] = {}  # worker -> decayed (busy s, wall s)
        self._lora_labels: dict[str, set[tuple[Gauge, tuple[str, ...]]]] = {}  # worker -> the LoRA series it set

    def item_phases(self, lease, timing: tuple[float, ...] | None, received: float, committed: float,
                    answered: float | None = None, reply_at: float = 0.0) -> None:
        """The phases of one committed item (``PHASES``); ``timing``: the worker's (received, admitted, PNG
        ready), absent from a worker that does not report it (then only wait and commit). ``answered``
        (the worker's clock when its poll answered) and ``reply_at`` (when the answer reached this process)
        give the ``SUBPHASES`` where known."""
        self.phase_seconds.labels("wait").observe(max(0.0, lease.leased_at - lease.created_at))
        if timing is not None:
            arrived, admitted, ready = timing
            sent = lease.sent_at or lease.leased_at
            self.phase_seconds.labels("lease").observe(max(0.0, sent - lease.leased_at))
            self.phase_seconds.labels("dispatch").observe(max(0.0, arrived - sent))
            self.phase_seconds.labels("admit").observe(max(0.0, admitted - arrived))
            self.phase_seconds.labels("run").observe(max(0.0, ready - admitted))
            self.phase_seconds.labels("handoff").observe(max(0.0, received - ready))
            sub = self.subphase_seconds.labels
            if lease.returned_at:
                sub("lease_txn").observe(max(0.0, lease.returned_at - lease.leased_at))
                sub("send").observe(max(0.0, sent - lease.returned_at))
            if answered is not None and reply_at:
                sub("reply").observe(max(0.0, answered - ready))
                sub("transport").observe(max(0.0, reply_at - answered))
                sub("pickup").observe(max(0.0, received - reply_at))
        self.phase_seconds.labels("commit").observe(max(0.0, committed - received))

    def item_finished(self, state: str, n: int = 1) -> None:
        self.items.labels(state).inc(n)
        if state == "done":
            now = time.monotonic()
            self._done_times.extend([now] * n)
            self._forget_before(now - self._window_s)  # bounded even when nobody scrapes

    def worker_report(self, worker: str, report: dict) -> None:
        """One actor poll's numbers: step durations, busy fraction and the engine's graph counters."""
        for dt in report.get("step_seconds", ()):
            self.step_seconds.labels(worker).observe(dt)
        # time-weighted over the last ~5 s: a poll covers a few ms, a step may span several polls
        busy_s, window_s = self._busy.get(worker, (0.0, 0.0))
        decay = math.exp(-report.get("window_s", 0.0) / 5.0)
        busy_s, window_s = busy_s * decay + report.get("busy_s", 0.0), window_s * decay + report.get("window_s", 0.0)
        self._busy[worker] = (busy_s, window_s)
        self.busy.labels(worker).set(min(1.0, busy_s / window_s) if window_s > 0 else 0.0)
        replays, fallbacks = graph_counts(report.get("stats", {}))
        self.graph_replays.labels(worker).set(replays)
        self.eager_fallbacks.labels(worker).set(fallbacks)
        for kind in ("real", "padded"):
            self.rows.labels(worker, kind).set(report.get("stats", {}).get(f"{kind}_rows", 0))
        if (lora := report.get("stats", {}).get("lora")) is not None:
            self._lora_report(worker, lora)

    def _lora_report(self, worker: str, lora: dict) -> None:
        """A worker's adapter numbers (``workers.lora.serving.Loras.stats``): resident per model, loads, evictions,
        images per adapter, images waiting for a load. Series of models or adapters it no longer reports go."""
        series = {(self.lora_resident, (worker, m)): len(names) for m, names in lora.get("resident", {}).items()}
        series |= {(self.lora_rows, (worker, str(a))): n for a, n in lora.get("rows", {}).items()}
        series |= {(self.lora_loads, (worker,)): lora.get("loads", 0),
                   (self.lora_evictions, (worker,)): lora.get("evictions", 0),
                   (self.lora_waiting, (worker,)): lora.get("waiting", 0)}
        for (gauge, labels), value in series.items():
            gauge.labels(*labels).set(value)
        for gauge, labels in self._lora_labels.get(worker, set()) - set(series):
            _remove(gauge, labels)
        self._lora_labels[worker] = set(series)

    def forget_worker(self, worker: str) -> None:
        self._busy.pop(worker, None)
        for gauge, labels in self._lora_labels.pop(worker, set()):
            _remove(gauge, labels)
        for g, labels in ((self.step_seconds, [(worker,)]), (self.busy, [(worker,)]), (self.graph_replays, [(worker,)]),
                          (self.eager_fallbacks, [(worker,)]), (self.rows, [(worker, "real"), (worker, "padded")])):
            for values in labels:
                _remove(g, values)

    def _forget_before(self, cutoff: float) -> None:
        while self._done_times and self._done_times[0] < cutoff:
            self._done_times.popleft()

    def render(self) -> bytes:
        self._forget_before(time.monotonic() - self._window_s)
        self.items_per_second.set(len(self._done_times) / self._window_s)
        return generate_latest(self.registry)


def _remove(metric, labels: tuple[str, ...]) -> None:
    """Drop one labelled series (gone already: nothing)."""
    try:
        metric.remove(*labels)
    except KeyError:
        pass


def graph_counts(stats: dict) -> tuple[int, int]:
    """Replays and eager fallbacks summed over the groups of an ``Engine.stats()``."""
    totals = [g.get("totals", {}) for g in stats.get("groups", {}).values()]
    return sum(t.get("replays", 0) for t in totals), sum(t.get("eager_fallbacks", 0) for t in totals)
