"""The scheduler: keeps one worker actor per GPU (or CPU slot) of the Ray cluster, leases queued
items from the store to them, and commits what they finish.

One loop, one thread; each turn:

1. every ``reconcile_seconds``: read ``ray.nodes()``; start a worker for each new slot (a GPU, a
   unit of the configured custom resource, or the CPU worker) and drop workers whose node left. With
   ``[autoscale]`` on (and within 0.5 s of new work), as many workers as the backlog needs instead
   (``dit_serve.server.autoscale``): Ray's autoscaler is asked for their resources, workers start on the
   free slots with the models that lack workers, idle ones switch to a model with backlog when that pays,
   and stop after ``idle_timeout_s``; the workers are written to the store (``Store.put_workers``);
2. wait up to ``tick_seconds`` for the workers' outstanding (long) ``poll()`` and ``info()`` calls,
   or less: the first answer, or new work in the store, ends the wait; commit
   finished PNGs (exactly once, through the lease), record failures, note progress, write the
   previews of items still held (``Store.put_preview``: the latest per item, before their endings);
3. every ``heartbeat_seconds``: renew the leases and write progress in one store call; items whose
   lease is gone (the job was cancelled) are cancelled on their worker;
4. lease new items for every ready worker with room (``max_inflight``); the engine batches
   whatever a worker holds, so grouping by model and shape happens there, step by step.

A worker that dies, or whose poll stalls for a lease period, is dropped: its leases go back to the
queue at once (``Store.release``) and the slot is filled again at the next reconcile if its node is
still there. The scheduler's own state is only the leases it holds; if it dies they expire and any
scheduler picks the items up again.

Failure accounting (docs/reliability.md): a worker that dies or stalls, or a step that raises, is a
*crash*: the items it held go back to the queue uncharged, each with one more crash on record. Items
that crashed workers twice are *suspects*: they run only on a worker that holds nothing else (one
worker is reserved: it takes no new work until it is empty), in groups that halve with each crash,
so the poison item ends up alone and fails with the reason while its batch-mates finish. A node that
leaves is an infrastructure failure without a crash.

``draining`` (SIGTERM): no new leases; what workers hold finishes, and ``shutdown`` hands back the rest.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from dit_serve.server.autoscale import (Backlog, Costs, Demand, Rates, WorkerState, allowed, bundles, demand, place,
                                        reservation)
from dit_serve.server.config import AutoscaleConfig, SchedulerConfig
from dit_serve.server.metrics import Metrics
from dit_serve.server.store import Lease, Store, WorkerRow, lease_shape
from workers.actor import remote_worker_class
from workers.config import WorkerConfig

log = logging.getLogger(__name__)

# the scheduler writes its workers to the store (``Store.put_workers``) when they change, and at least this
# often: readers take rows older than ``store.workers.FRESH_S`` for a scheduler that is gone
PUBLISH_EVERY_S = 10.0


@dataclass(frozen=True)
class SlotPlan:
    """Where one worker should run: a node (None: anywhere) and the resource it takes one of."""

    node_id: str | None
    resource: str  # GPU | CPU | a custom resource


def plan_slots(nodes: list[dict], cfg: WorkerConfig) -> dict[str, SlotPlan]:
    """Slot key -> plan for the alive nodes of ``ray.nodes()``: one per GPU (or per unit of a custom
    resource) on each node; with ``resource = auto`` and no GPU anywhere, ``cpu_workers`` CPU workers."""
    alive = [n for n in nodes if n.get("Alive")]
    resource = cfg.resource
    if resource == "auto":
        resource = "GPU" if any(n["Resources"].get("GPU", 0) >= 1 for n in alive) else "CPU"
    if resource == "CPU":
        return {f"cpu-{i}": SlotPlan(None, "CPU") for i in range(cfg.cpu_workers)}
    prefixes: dict[str, int] = {}
    for n in alive:
        prefixes[n["NodeID"][:12]] = prefixes.get(n["NodeID"][:12], 0) + 1
    short = lambda node_id: node_id[:12] if prefixes[node_id[:12]] == 1 else node_id  # noqa: E731 (unique names)
    return {f"{short(n['NodeID'])}-{i}": SlotPlan(n["NodeID"], resource)
            for n in alive for i in range(int(n["Resources"].get(resource, 0)))}


@dataclass
class _Worker:
    key: str
    plan: SlotPlan
    handle: Any
    ready_ref: Any                      # info(): resolves once models are loaded and warm
    models: list[str] = field(default_factory=list)
    leases: dict[str, Lease] = field(default_factory=dict)
    poll_ref: Any = None
    poll_sent: float = 0.0
    reply_at: float = 0.0  # time.time() when its last poll's answer reached this process (sub-phases)
    reserved: bool = False  # for suspects: takes no new work until empty, then runs an isolated group
    queue_left: bool = False  # its last lease got all it asked for: more may be queued
    news: bool = False  # its last answer ended items: poll again at once (others: at most once a tick)
    started_at: float = field(default_factory=time.time)
    loading: list[str] = field(default_factory=list)  # models it loads: before it is ready, all it was started with
    idle_since: float | None = None  # (monotonic) nothing leased and nothing queued for its models since then
    asked_at: float = field(default_factory=time.monotonic)  # when it was started (its start's cost)
    switching: tuple[str, float] | None = None  # (model, monotonic time) it was told to load, until it serves it
    dropping: set[str] = field(default_factory=set)  # models it was told to unload: a late report may still list them
    pinned: dict[str, float] = field(default_factory=dict)  # custom resources it took for pinned models (placement)
    loras: set[str] = field(default_factory=set)  # adapters it reports registered (its poll's ``loras``)
    pushed: dict[str, str] = field(default_factory=dict)  # adapters this scheduler sent it: name -> the file's sha256
    resident: dict[str, set[str]] = field(default_factory=dict)  # per model, the adapters in its device bank (polled)

    def holds(self, name: str, sha256: str) -> bool:
        """Whether it has adapter ``name`` as registered now (sent by us at that hash, or its own and never sent)."""
        return self.pushed.get(name) == sha256 or (name in self.loras and name not in self.pushed)

    def has_ready(self, model: str, loras) -> bool:
        """Whether every adapter of ``loras`` is registered here and, as last polled, loaded in ``model``'s bank."""
        return all(self.holds(u.name, u.sha256) and u.name in self.resident.get(model, ()) for u in loras)

    @property
    def name(self) -> str:
        return f"worker-{self.key}"

    @property
    def ready(self) -> bool:
        return self.ready_ref is None


@lru_cache(maxsize=1)
def _actor_class():
    return remote_worker_class()


class Scheduler:
    def __init__(self, store: Store, workers: WorkerConfig, config: SchedulerConfig, lease_seconds: float,
                 metrics: Metrics | None = None, autoscale: AutoscaleConfig = AutoscaleConfig()):
        self.store, self.cfg, self.sched = store, workers, config
        # [autoscale]'s per-model tables name models as [workers] models does; the store, by the names they serve as
        self.auto = autoscale.model_copy(update={t: {_name(k): v for k, v in getattr(autoscale, t).items()}
                                                 for t in ("min_workers_per_model", "max_workers_per_model", "rates",
                                                           "placement")})
        self.lease_seconds = lease_seconds
        self.metrics = metrics or Metrics()
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.workers: dict[str, _Worker] = {}
        self._backoff: dict[str, tuple[int, float]] = {}  # slot -> (failed starts, when to retry)
        self._last_reconcile = self._last_heartbeat = 0.0
        self._suspects = False  # items wait to run in isolation (checked at heartbeats)
        self.draining = False
        self._last_fill = 0.0    # when _dispatch last asked the store for work (monotonic)
        self._fill_now = False   # a worker became ready: ask at the next turn
        # autoscaling ([autoscale]): the workers the backlog asks for, and what Ray's autoscaler was asked for
        self.demand = Demand()
        self.asked: int | None = None  # workers' bundles last requested (None: never)
        self._asked: list[tuple[dict, dict]] | None = None  # those bundles, with their label selectors
        self._slot_cfg = workers.model_copy(update={"resource": "GPU"}) \
            if autoscale.enabled and workers.resource == "auto" else workers  # no GPU node yet at scale from zero
        self._published: list[WorkerRow] | None = None  # the workers as last written to the store
        self._published_at = 0.0
        self._specs = {_name(spec): spec for spec in workers.models}  # served name -> its [workers] models entry
        # image-steps per second of one worker, per model: the cards' estimates until the workers measure them
        self.rates = Rates.from_config(self.auto, card_rates(self._specs, self._slot_cfg) if autoscale.enabled else {})
        self.start_s: float | None = None  # a worker's start until ready, measured (an average)
        self.switch_s: dict[str, float] = {}  # per model, an idle worker's switch to it until it serves it, measured
        self.switches: dict[str, int] = {}  # switches to each model
        self._need: dict[str, int] = {}  # per model, the bytes of its weights on a worker (placement)
        self._zero_since: float | None = None  # (monotonic) backlog came while no worker ran: scale from zero

    @property
    def held(self) -> int:
        """Items leased to this scheduler's workers."""
        return sum(len(w.leases) for w in list(self.workers.values()))

    @property
    def num_ready(self) -> int:
        return sum(w.ready for w in self.workers.values())

    def run(self, stop: threading.Event) -> None:
        """Loop until ``stop`` is set, then hand the leases back and stop the workers."""
        try:
            while not stop.is_set():
                try:
                    self.turn()
                except Exception:  # a store or cluster hiccup must not end scheduling
                    log.exception("scheduler turn failed; retrying")
                    stop.wait(1.0)
        finally:
            self.shutdown()

    def turn(self) -> None:
        now = time.monotonic()
        since = now - self._last_reconcile
        if since >= self.sched.reconcile_seconds or (self.auto.enabled and self.store.queued.is_set() and since >= min(
                0.5, self.sched.reconcile_seconds)):  # new work may need a worker: do not wait for the next reconcile
            self._last_reconcile = now
            self.reconcile()
        self._collect()
        self._dispatch()  # first: work that woke this turn is not held up by a heartbeat's writes
        now = time.monotonic()
        if now - self._last_heartbeat >= self.sched.heartbeat_seconds:
            self._last_heartbeat = now
            self._heartbeat()

    # -- workers -----------------------------------------------------------------------------------
    def reconcile(self) -> None:
        import ray

        if self.auto.enabled:
            self._autoscale(ray.nodes())
        else:
            nodes = ray.nodes()
            wanted = plan_slots(nodes, self.cfg)
            for key in [k for k in self.workers if k not in wanted]:
                self._drop(self.workers[key], "its node left the cluster", "infra")
            room = self._room(nodes)
            for key, plan in wanted.items():
                if key not in self.workers and self._backoff.get(key, (0, 0.0))[1] <= time.monotonic():
                    models = None  # every model, unless some are pinned to other nodes
                    if self.auto.placement:
                        models = [m for m in self._specs if m in self._allowed(plan.node_id, room)]
                    if models != []:
                        self._start(key, plan, models, room)
        self.metrics.workers.set(self.num_ready)
        for m in self._specs:
            self.metrics.serving.labels(m).set(sum(w.ready and m in w.models for w in self.workers.values()))
        self._publish()

    def _publish(self, force: bool = False) -> None:
        """Write this scheduler's workers to the store (any API process reads them) if they changed, or
        ``PUBLISH_EVERY_S`` passed (the rows' age tells readers the scheduler lives)."""
        rows = [WorkerRow(key=w.key, state="ready" if w.ready else "starting", models=sorted(w.models),
                          loading=list(w.loading), node=w.plan.node_id if w.plan else None,
                          resource=w.plan.resource if w.plan else None, held=len(w.leases), started_at=w.started_at)
                for w in self.workers.values()]
        old, now = self._published, time.monotonic()
        if not force and old is not None and now - self._published_at < PUBLISH_EVERY_S and len(old) == len(rows) \
                and all(a.same(b) for a, b in zip(old, rows)):
            return
        self.store.put_workers(self.owner, rows)
        self._published, self._published_at = rows, now

    def _autoscale(self, nodes: list[dict]) -> None:
        """Reconcile with autoscaling on: the workers the backlog needs (``autoscale.demand``), asked of Ray's
        autoscaler as bundles of the worker's resources, and started on the free slots the cluster has, up to
        that many (on the nodes that run workers already first, so that whole nodes empty and go)."""
        slots = plan_slots(nodes, self._slot_cfg)
        for key in [k for k in self.workers if k not in slots]:
            self._drop(self.workers[key], "its node left the cluster", "infra")
        if self.draining:  # the service stops: no worker started, switched or stopped now
            return
        backlog = Backlog.of(self.store.backlog())
        holding: dict[str, int] = {}
        for w in self.workers.values():
            for m in {ls.model for ls in w.leases.values()}:
                holding[m] = holding.get(m, 0) + 1
        self.demand = demand(backlog, self.rates, self.auto, [_name(m) for m in self.cfg.models], holding,
                             self.cfg.inflight())
        self._ask(bundles(self.demand, self.auto.worker_bundle(self.cfg), self.auto.placement))
        now = time.monotonic()
        for m in self._specs:
            self.metrics.desired.labels(m).set(self.demand.workers.get(m, 0))
            self.metrics.backlog_seconds.labels(m).set(round(self.demand.seconds.get(m, 0.0), 3))
        if not self.workers:  # scale from zero: timed from the first backlog with no worker to the first ready
            self._zero_since = (self._zero_since or now) if self.demand.total else None
        for w in self.workers.values():
            if not w.ready or w.leases or w.loading or w.switching or any(backlog.get(m, Backlog()).queued
                                                                          for m in w.models):
                w.idle_since = None
            elif w.idle_since is None:
                w.idle_since = now
        free = [k for k in slots if k not in self.workers and self._backoff.get(k, (0, 0.0))[1] <= now]
        used: dict[str | None, int] = {}
        for w in self.workers.values():
            used[w.plan.node_id] = used.get(w.plan.node_id, 0) + 1
        free.sort(key=lambda k: (-used.get(slots[k].node_id, 0), k))
        room = self._room(nodes)
        pinned = bool(self.auto.placement)  # else every slot and worker may hold every model
        states = [WorkerState(w.key, tuple(dict.fromkeys(w.models + w.loading)), w.idle_since is not None,
                              now - w.idle_since if w.idle_since is not None else 0.0,
                              self._allowed(w.plan.node_id, room, w.pinned) if pinned else None)
                  for w in self.workers.values()]
        costs = Costs(self.auto.start_cost_s if self.start_s is None else self.start_s, dict(self.switch_s),
                      self.auto.switch_cost_s)
        may_hold = [self._allowed(slots[k].node_id, room) for k in free] if pinned else len(free)
        placement = place(self.demand, backlog, states, may_hold, costs, self.auto, list(self._specs), self._fits)
        for key, model, unload in placement.switch:
            self._switch(self.workers[key], model, unload)
        for models, i in zip(placement.start, placement.slots):
            self._start(free[i], slots[free[i]], models, room)
        for w in list(self.workers.values()):  # idle ones stop (not a crash): their resources go back to Ray
            if w.idle_since is not None and now - w.idle_since >= self.auto.idle_timeout_s and self._may_stop(w):
                self._retire(w, f"idle for {now - w.idle_since:.0f} s")

    def _room(self, nodes: list[dict]) -> dict[str, tuple[dict, dict]]:
        """Per alive node: its labels, and its resources less the custom ones this scheduler's workers took there
        for pinned models (``[autoscale.placement]``)."""
        room = {n["NodeID"]: (n.get("Labels") or {}, dict(n.get("Resources") or {})) for n in nodes if n.get("Alive")}
        for w in self.workers.values():
            if w.plan.node_id in room:
                for r, amount in w.pinned.items():
                    room[w.plan.node_id][1][r] = room[w.plan.node_id][1].get(r, 0.0) - amount
        return room

    def _allowed(self, node_id: str | None, room: dict[str, tuple[dict, dict]],
                 held: dict[str, float] | None = None) -> frozenset[str]:
        """The models a worker on ``node_id`` may hold: a new one, with the node's room; a running one, with the
        resources it ``held`` (it takes no more once started). A slot of no particular node (CPU workers, which
        Ray places) holds only models pinned nowhere."""
        labels, free = room.get(node_id, ({}, {})) if node_id is not None else ({}, {})
        return allowed(list(self._specs), self.auto.placement, labels, free if held is None else held)

    def _fits(self, models: list[str]) -> bool:
        """Whether ``models``' weights fit one worker together (``[autoscale] memory_gib``, 85% of it: the rest is
        for activations and graphs, as the worker's own check keeps it); with no memory given, one model."""
        if self.auto.memory_gib <= 0:
            return len(models) <= 1
        from workers.families.memory import weight_bytes
        from workers.request.cards import read_card

        for m in models:
            if m not in self._need:
                card = read_card(self._specs.get(m, m))
                self._need[m] = weight_bytes(card, card.dtype)
        return sum(self._need[m] for m in models) <= 0.85 * self.auto.memory_gib * 2**30

    def _switch(self, w: _Worker, model: str, unload: list[str]) -> None:
        """Move idle ``w`` to ``model``: it unloads ``unload`` (leased none of them from now) and loads it."""
        log.info("switching %s to %s%s", w.name, model, f" (unloading {', '.join(unload)})" if unload else "")
        if unload:
            w.handle.unload.remote(unload)
            w.dropping |= set(unload)
            w.models = [m for m in w.models if m not in unload]
        w.dropping.discard(model)
        w.handle.load.remote([self._specs.get(model, model)])
        w.loading = list(dict.fromkeys(w.loading + [model]))
        w.switching, w.idle_since = (model, time.monotonic()), None
        self.switches[model] = self.switches.get(model, 0) + 1
        self.metrics.switches.labels(model).inc()

    def _may_stop(self, w: _Worker) -> bool:
        """Whether stopping ``w`` keeps ``min_workers`` running, and each of its models' own minimum."""
        if len(self.workers) - 1 < self.auto.min_workers:
            return False
        for m in w.models:
            others = sum(m in o.models or m in o.loading for o in self.workers.values() if o is not w)
            if others < self.auto.min_workers_per_model.get(m, 0):
                return False
        return True

    def _retire(self, w: _Worker, reason: str) -> None:
        """Stop ``w`` on purpose (it is idle): not a crash; anything it holds goes back uncounted."""
        import ray

        log.info("stopping %s (%s): %s", w.name, ", ".join(w.models) or "no model", reason)
        if w.leases:
            self.store.release(list(w.leases.values()), "stop")
        self.workers.pop(w.key, None)
        self.metrics.forget_worker(w.name)
        try:
            ray.kill(w.handle, no_restart=True)
        except Exception:  # already gone
            pass

    def _ask(self, wanted: list[tuple[dict, dict]]) -> None:
        """Ask Ray's autoscaler for the workers' resources (``request_resources``: the cluster is kept big enough
        for them, idle nodes beyond go): one bundle per worker, with the label selector of a pinned model's
        (``autoscale.bundles``); again only when they changed."""
        if not self.auto.request_resources or wanted == self._asked:
            return
        from ray.autoscaler import sdk

        n, shown = len(wanted), sorted({str(b) + (f" on {s}" if s else "") for b, s in wanted})
        selectors = {"bundle_label_selectors": [s for _, s in wanted]} if any(s for _, s in wanted) else {}
        try:
            sdk.request_resources(bundles=[b for b, _ in wanted], **selectors)
        except Exception as e:  # a cluster without an autoscaler: the workers fit the nodes it has
            log.warning("could not ask Ray's autoscaler for %d workers: %s: %s", n, type(e).__name__, e)
            return
        log.info("asked Ray's autoscaler for %d worker%s (%s)", n, "" if n == 1 else "s", ", ".join(shown) or "none")
        self.asked, self._asked = n, wanted
        self.metrics.requested.set(n)

    def _start(self, key: str, plan: SlotPlan, models: list[str] | None = None,
               room: dict[str, tuple[dict, dict]] | None = None) -> None:
        """Start a worker on ``plan``'s slot with ``models`` (None: every model); it takes the custom resources its
        pinned models name (``reservation``) of ``room``, and does not start where they are no longer free."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        pinned = reservation(models if models is not None else list(self._specs), self.auto.placement)
        if pinned and room is not None and plan.node_id in room:
            free = room[plan.node_id][1]
            if any(free.get(r, 0.0) < amount - 1e-9 for r, amount in pinned.items()):
                return  # another worker took them this turn: placed again at the next reconcile
            for r, amount in pinned.items():
                free[r] -= amount
        opts: dict[str, Any] = {"num_cpus": self.cfg.num_cpus}
        if plan.resource == "GPU":
            opts["num_gpus"] = 1
        elif plan.resource != "CPU":
            opts["resources"] = {plan.resource: 1}
        if pinned:
            opts["resources"] = {**opts.get("resources", {}), **pinned}
        if plan.node_id is not None:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(plan.node_id, soft=False)
        cfg = self.cfg if models is None else self.cfg.model_copy(
            update={"models": tuple(self._specs.get(m, m) for m in models)})  # autoscaling's placement
        handle = _actor_class().options(**opts).remote(cfg)
        ready = handle.info.remote()
        ready.future().add_done_callback(lambda _: self.store.work.set())  # ready (or failed): seen at once
        self.workers[key] = _Worker(key, plan, handle, ready, loading=[_name(m) for m in cfg.models], pinned=pinned)
        log.info("starting worker %s (%s%s)", key, plan.resource, f" on node {plan.node_id[:12]}" if plan.node_id else "")

    def _drop(self, w: _Worker, reason: str, kind: str = "crash", failed_start: bool = False) -> None:
        """Forget a worker; its leases go back to the queue now (uncharged: ``kind`` is ``crash`` or
        ``infra``) rather than when they expire."""
        import ray

        log.warning("dropping %s (%d items back to the queue): %s", w.name, len(w.leases), reason)
        self._requeue(list(w.leases.values()), kind, f"worker {reason}")
        if kind == "crash" and not failed_start:
            self.metrics.worker_crashes.inc()
        self.workers.pop(w.key, None)
        self.metrics.forget_worker(w.name)
        if failed_start:
            n = self._backoff.get(w.key, (0, 0.0))[0] + 1
            self._backoff[w.key] = (n, time.monotonic() + min(60.0, 2.0 ** n))
        try:
            ray.kill(w.handle, no_restart=True)
        except Exception:  # already gone
            pass

    # -- results -----------------------------------------------------------------------------------
    def _collect(self) -> None:
        """Wait up to a tick for the workers' answers, and no longer than the first answer or new work in
        the store. One event wakes the loop: ``Store.work``, which the store sets when items may have become
        queued and each outstanding call sets when it completes (a callback on its future), so a submission
        is leased, and a finished image committed, without waiting for a tick. Polls are long polls
        (``Worker.poll(wait_s)``): a worker answers when an item ends. A worker is polled at most once a
        tick (an answered poll sent again at once kept a core busy polling idle workers), except right
        after an answer that ended items: the next ending (a staggered batch-mate, the next single image)
        is then not held back by up to a tick."""
        import ray

        wake = self.store.work  # cleared by _dispatch before it leases; answers that came since are seen below
        now, refs = time.monotonic(), {}
        for w in self.workers.values():
            if not w.ready:
                refs[w.ready_ref] = w
            elif w.poll_ref is not None:
                refs[w.poll_ref] = w
            elif w.news or now - w.poll_sent >= self.sched.tick_seconds:
                w.poll_ref = w.handle.poll.options(concurrency_group="poll").remote(self._poll_wait_s())
                w.poll_sent = now
                w.poll_ref.future().add_done_callback(lambda _, w=w: _replied(w, wake))
                refs[w.poll_ref] = w
        if not refs:
            wake.wait(self.sched.tick_seconds / 2)
            return
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        if not done and wake.wait(self.sched.tick_seconds):
            if self.store.queued.is_set():  # a submission woke the loop: lease it first; any answer that came
                return                      # too is taken at the next turn's first look (ray.wait above)
            done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in done:
            self._receive(refs[ref], ref)
        for w in [w for w in self.workers.values() if w.ready and w.poll_ref is not None]:
            if time.monotonic() - w.poll_sent > self.lease_seconds:
                self._drop(w, f"stalled: no answer to poll() for {self.lease_seconds:.0f} s", "crash")

    def _poll_wait_s(self) -> float:
        """How long an idle worker holds a poll: progress and previews still arrive twice a heartbeat,
        and far inside the lease period that declares a silent worker stalled."""
        return min(self.sched.heartbeat_seconds / 2, self.lease_seconds / 4)

    def _receive(self, w: _Worker, ref) -> None:
        import ray

        starting = not w.ready
        try:
            value = ray.get(ref)
        except ray.exceptions.RayError as e:
            if _node_left(w, e):  # removed by the autoscaler, preempted, lost: not the worker's doing
                self._drop(w, f"its node left the cluster ({type(e).__name__})", "infra")
            else:
                self._drop(w, f"{'failed to start' if starting else 'died'}: {type(e).__name__}: {_first_line(e)}",
                           "crash", failed_start=starting)
            return
        if starting:
            w.ready_ref, w.models, self._fill_now = None, list(value["models"]), True
            w.loading = [_name(m) for m in value.get("loading", ())]
            took = time.monotonic() - w.asked_at
            self.start_s = took if self.start_s is None else 0.5 * self.start_s + 0.5 * took
            if self._zero_since is not None:  # the first worker after none
                self.metrics.scale_from_zero.observe(time.monotonic() - self._zero_since)
                log.info("first worker ready %.1f s after the backlog came with none running",
                         time.monotonic() - self._zero_since)
                self._zero_since = None
            self._backoff.pop(w.key, None)
            log.info("%s ready: %s on %s (%s)%s", w.name, ", ".join(w.models), value["device"], value["backend"],
                     f"; loading {', '.join(value['loading'])}" if value.get("loading") else "")
            for model, kernel in value.get("attention", {}).items():
                log.info("%s: %s runs %s", w.name, model, kernel)
            for model, p in [(m, p) for m, p in value.get("precision", {}).items() if p != "bf16"]:
                log.info("%s: %s runs %s in fp8", w.name, model,
                         "its blocks' linears and attention" if p == "fp8+attention" else "its blocks' linears")
            for model, speed in value.get("speed", {}).items():
                log.info("%s: %s at speed %s%s", w.name, model, speed,
                         " (compiled steps)" if value.get("compiled", {}).get(model) else "")
            return
        w.poll_ref = None
        w.news = bool(value["finished"] or value["failed"] or value.get("crashed"))
        self._apply_report(w, value)

    def _apply_report(self, w: _Worker, report: dict) -> None:
        if "models" in report:  # a worker serves its first model while it loads the others; and switches
            w.dropping &= set(report["models"])  # a report without a model it was told to unload: gone for good
            models = [m for m in report["models"] if m not in w.dropping]
            w.loading = [_name(m) for m in report.get("loading", ())]
            if w.switching is not None:
                model, since = w.switching
                if model in models:
                    took = time.monotonic() - since
                    old = self.switch_s.get(model)
                    self.switch_s[model] = took if old is None else 0.5 * old + 0.5 * took
                    w.switching = None
                    self.metrics.switch_seconds.observe(took)
                    log.info("%s switched to %s in %.1f s", w.name, model, took)
                elif model not in w.loading:
                    w.loading.append(model)  # the report is older than the load
            if models != w.models:
                w.models, self._fill_now = list(models), True
                log.info("%s serves %s now", w.name, ", ".join(w.models) or "no model")
        if "loras" in report:
            w.loras = set(report["loras"])
        if isinstance(lora := (report.get("stats") or {}).get("lora"), dict):
            w.resident = {m: set(names) for m, names in lora.get("resident", {}).items()}
        self._measure(w, report)
        for key, (done, _total) in report["progress"].items():
            if key in w.leases:
                w.leases[key].step = done
        for key, step, png in report.get("previews", ()):
            if key in w.leases:  # before the endings below: an ended item's preview is removed, not written
                self.store.put_preview(w.leases[key], step, png)
        received, timings = time.time(), report.get("timings", {})
        finished = [(w.leases.pop(key, None), png) for key, png in report["finished"]]
        failed = [(w.leases.pop(key, None), error) for key, error in report["failed"]]
        crashed = [(w.leases.pop(key, None), error) for key, error in report.get("crashed", ())]
        returned = [ls for ls in (w.leases.pop(key, None) for key in report.get("returned", ())) if ls is not None]
        if returned:  # a model it no longer serves (a switch): back to the queue, not counted
            self.store.release(returned, "stop")
        if (finished or failed) and not self._suspects and (w.queue_left or self.store.queued.is_set()):
            self._fill(w, expect=True)  # the next items are on their way before the commits: the GPU does not wait
        committed = []
        for lease, png in finished:
            if lease is not None and self.store.commit_result(lease, png):
                committed.append((lease, time.time()))
        for lease, error in failed:
            if lease is not None and self.store.fail_item(lease, error):
                log.warning("item %s failed: %s", lease.key, error)
                self.metrics.item_finished("failed")
        if finished:  # hand the interpreter lock to the threads the commits woke (the job's event stream)
            time.sleep(0)  # before this loop's own work, its metrics too: the image reaches its client sooner
        for lease, at in committed:
            self.metrics.item_finished("done")
            self.metrics.item_phases(lease, timings.get(lease.key), received, at, answered=report.get("answered"),
                                     reply_at=w.reply_at)
        for lease, error in crashed:  # the step they were in raised: a crash of their batch, not their failure
            if lease is not None:
                self._requeue([lease], "crash", error)
        self.metrics.worker_report(w.name, report)
        if failed := report.get("load_failed"):  # as a worker that failed to start: dropped, restarted later
            self._drop(w, f"failed to start: {failed}", "crash", failed_start=True)

    def _measure(self, w: _Worker, report: dict) -> None:
        """The worker's rate (``Rates``): the image-steps this report's window advanced over its seconds spent
        stepping, when it ran one model only and held at least half its in-flight limit (a fuller batch steps
        more images a second; a worker that ran half-empty would read low)."""
        steps: dict[str, int] = {}
        for key, (done, _total) in report["progress"].items():
            if (ls := w.leases.get(key)) is not None:
                steps[ls.model] = steps.get(ls.model, 0) + max(0, done - ls.step)
        for key, _png in report["finished"]:
            if (ls := w.leases.get(key)) is not None:
                steps[ls.model] = steps.get(ls.model, 0) + max(0, ls.params.steps - ls.step)
        if len(steps) == 1 and 2 * len(w.leases) >= self.cfg.inflight():
            (model, n), = steps.items()
            self.rates.observe(model, n, report.get("busy_s", 0.0))

    def _requeue(self, leases: list[Lease], kind: str, error: str) -> None:
        if not leases:
            return
        failed = self.store.release(leases, kind, error)
        self.metrics.requeued.labels(kind).inc(len(leases) - len(failed))
        for lease in failed:
            log.warning("item %s failed: %s", lease.key, error)
            self.metrics.item_finished("failed")

    # -- leases ------------------------------------------------------------------------------------
    def _heartbeat(self) -> None:
        self._publish()  # a worker that became ready, or serves another model: readers learn it now
        self._suspects = bool(self.workers) and self.store.has_suspects(sorted({m for w in self.workers.values()
                                                                                 for m in w.models}))
        held = [ls for w in self.workers.values() for ls in w.leases.values()]
        self.metrics.items_running.set(len(held))
        lost = {ls.key for ls in self.store.heartbeat(held, self.lease_seconds)}
        for w in self.workers.values():
            gone = [k for k in w.leases if k in lost]
            if gone:
                w.handle.cancel.remote(gone)
                for k in gone:
                    del w.leases[k]

    def _dispatch(self) -> None:
        """Lease for every ready worker: at once when the store says items may be queued (``queued``: a
        submission, retry or release, here or, on PostgreSQL, in another process) or a worker became
        ready; else at most once a tick, for what comes due without a signal (backoffs ending, leases of
        a dead scheduler expiring). A turn woken by an answer alone does not query the store again."""
        signalled = self.store.queued.is_set() or self._fill_now
        self.store.work.clear()  # before leasing: a submission after the lease query sets them again
        self.store.queued.clear()
        if self.draining:
            return
        now = time.monotonic()
        if not signalled and now - self._last_fill < self.sched.tick_seconds:
            return
        self._last_fill, self._fill_now = now, False
        ready = [w for w in self.workers.values() if w.ready]
        if self._suspects and ready and not any(w.reserved for w in ready):
            min(ready, key=lambda w: len(w.leases)).reserved = True  # it empties, then runs suspects alone
        for w in ready:
            self._fill(w, expect=signalled)

    def _fill(self, w: _Worker, expect: bool = False) -> None:
        """Lease queued items for ``w`` up to its room (``max_inflight``) and send them; ``expect``: items
        are known to be queued (``Store.lease``). With ``group_shapes``, items of the shapes ``w`` runs now
        are preferred (``workers.admission``): fewer, fuller replays per step."""
        capacity = self.cfg.inflight()
        room = capacity - len(w.leases)
        if self.draining or room <= 0 or (w.reserved and w.leases) or not w.models:
            return
        prefer = {lease_shape(ls.model, ls.params) for ls in w.leases.values()} if self.sched.group_shapes else None
        leases = self.store.lease(f"{self.owner}/{w.key}", w.models, room, self.lease_seconds, isolate=w.reserved,
                                  announce=False, expect=expect, prefer=prefer, capacity=capacity)
        returned = time.time()
        w.reserved = bool(leases) and leases[0].suspect  # stays reserved while its isolated group runs
        # more may be queued: the lease got all it asked for, or it may have held items back for a fuller
        # group while the worker runs others (admission rule 4): the next finished items ask again
        w.queue_left = len(leases) == room or bool(prefer)
        for target, batch in self._route_loras(w, leases):
            target.handle.submit.remote([ls.spec for ls in batch])
            sent = time.time()
            for ls in batch:
                ls.returned_at, ls.sent_at = returned, sent
            target.leases.update({ls.key: ls for ls in batch})
        if leases:
            self.store.changes.notify(sorted({ls.job_id for ls in leases}))  # after the sending: see Store.lease

    # -- adapters ----------------------------------------------------------------------------------
    def _route_loras(self, w: _Worker, leases: list[Lease]) -> list[tuple[_Worker, list[Lease]]]:
        """Where the leased items go: an item naming adapters goes to ``w`` if their weights are in its device bank
        (as last polled); else to another ready worker of its model with room whose bank has them, else to ``w`` if
        it has them registered, else to another with room that has them registered; else to ``w``. Before a worker
        gets an item, it has the item's adapters: each one it lacks is sent to it (``add_lora``, ahead of ``submit``
        in the actor's call order) once. An item whose adapter was deleted (or changed) since its job was submitted
        fails, saying so."""
        out: dict[str, tuple[_Worker, list[Lease]]] = {}
        room = {v.key: self.cfg.inflight() - len(v.leases) for v in self.workers.values() if v.ready and v is not w}
        for ls in leases:
            target, uses = w, ls.params.loras
            if uses and not w.has_ready(ls.model, uses):
                others = [v for v in self.workers.values() if room.get(v.key, 0) > 0 and ls.model in v.models]
                target = next((v for v in others if v.has_ready(ls.model, uses)), None) or (
                    w if all(w.holds(u.name, u.sha256) for u in uses)
                    else next((v for v in others if all(v.holds(u.name, u.sha256) for u in uses)), w))
                if target is not w:
                    room[target.key] -= 1
            if (why := self._push_loras(target, ls)) is not None:
                if self.store.fail_item(ls, why):
                    self.metrics.item_finished("failed")
                continue
            out.setdefault(target.key, (target, []))[1].append(ls)
        return list(out.values())

    def _push_loras(self, w: _Worker, ls: Lease) -> str | None:
        """Send ``w`` the adapters of ``ls`` it lacks; the reason the item cannot run, or None."""
        for use in ls.params.loras:
            if w.holds(use.name, use.sha256):
                continue
            found = self.store.lora_data(use.name)
            if found is None or found[0].sha256 != use.sha256:
                return (f"adapter {use.name!r} was {'deleted' if found is None else 'replaced'} after the job was "
                        "submitted")
            lora, data = found
            if use.name in w.pushed or use.name in w.loras:  # another file under that name: the old one goes
                w.handle.remove_lora.remote(use.name)
            w.handle.add_lora.remote(use.name, data, lora.model or None)
            w.pushed[use.name] = use.sha256
            self.metrics.lora_pushes.inc()
        return None

    def shutdown(self) -> None:
        """Give every lease back (not counted as an attempt) and stop the workers."""
        import ray

        for w in list(self.workers.values()):
            try:
                self.store.release(list(w.leases.values()), "stop")
            except Exception:
                log.exception("could not release the leases of %s; they expire on their own", w.name)
            try:
                ray.kill(w.handle, no_restart=True)
            except Exception:
                pass
        self.workers.clear()
        if self.asked:  # the service stops: its nodes are no longer wanted
            self._ask([])
        try:
            self.store.put_workers(self.owner, [])
        except Exception:  # the rows age out on their own
            pass


def card_rates(specs: dict[str, str], cfg: WorkerConfig) -> dict[str, float]:
    """Per served model (name -> its ``[workers] models`` entry), the rate its card gives one GPU worker
    (``workers.families.rates``), where it gives one; nothing for CPU workers (the figures are a GPU's)."""
    if cfg.resource == "CPU" or cfg.device.startswith("cpu"):
        return {}
    from workers.families.rates import estimate
    from workers.request.cards import read_card

    out = {}
    for name, spec in specs.items():
        try:
            found = estimate(read_card(spec))
        except Exception:  # an unreadable model: the worker will say what is wrong with it
            found = None
        if found is not None:
            out[name] = found.rate
            log.info("autoscaling counts %.4g image-steps/s of %s per worker until measured: %s", found.rate, name,
                     found.source)
    return out


@lru_cache(maxsize=256)
def _name(spec: str) -> str:
    """The name a model of ``[workers] models`` is served under (its card's; a directory's is its folder's)."""
    from workers.request.cards import read_card

    try:
        return read_card(spec).name
    except Exception:  # the worker will say what is wrong with it
        return str(spec)


def _replied(w: _Worker, wake: threading.Event) -> None:
    """A poll's answer arrived (Ray's callback thread): stamp it for the sub-phases and wake the loop."""
    w.reply_at = time.time()
    wake.set()


def _node_left(w: _Worker, e: BaseException) -> bool:
    """Whether ``w`` died with its node: the node was preempted (Ray says so) or is no longer alive. Such a
    death is an infrastructure failure, as a node seen gone at a reconcile is, not a crash of its items."""
    import ray

    if getattr(e, "preempted", False):
        return True
    if w.plan is None or w.plan.node_id is None:  # CPU workers: placed by Ray, on any node
        return False
    try:
        return not any(n["NodeID"] == w.plan.node_id and n.get("Alive") for n in ray.nodes())
    except Exception:  # the cluster cannot be asked now: as before, a crash
        return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[-1] if text else ""
