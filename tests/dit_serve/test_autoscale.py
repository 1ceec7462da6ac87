"""Autoscaling's policy (pure: no Ray) and its inputs: the store's backlog, the rates, the [autoscale] config."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from dit_serve.schemas import JobParams
from dit_serve.server.autoscale import Backlog, Demand, Rates, demand, fit, workers_for
from dit_serve.server.config import AutoscaleConfig, Config, ConfigError, load_config
from dit_serve.server.store import Store

PARAMS = JobParams(sampler="ddim", steps=20, guidance=1.0)


@pytest.fixture(params=["sqlite", "postgresql"])
def any_store(request, tmp_path):
    url = f"sqlite:///{tmp_path}/s.db" if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    store = Store(url, tmp_path)
    yield store
    store.close()


def test_workers_needed_is_the_backlog_over_what_one_worker_drains_in_the_target():
    assert workers_for(0, 100.0, 60.0) == 0
    assert workers_for(1, 100.0, 60.0) == 1
    assert workers_for(6000, 100.0, 60.0) == 1  # exactly one worker's 60 s
    assert workers_for(6001, 100.0, 60.0) == 2
    assert workers_for(60000, 100.0, 60.0) == 10


def test_demand_per_model_within_its_bounds_and_the_total_within_the_services():
    cfg = AutoscaleConfig(enabled=True, target_drain_s=10, default_rate=100, rates={"b": 50.0}, max_workers=6,
                          max_workers_per_model={"a": 3}, min_workers_per_model={"c": 1})
    backlog = {"a": Backlog(queued=400, steps=8000), "b": Backlog(queued=10, running=2, steps=1200)}
    d = demand(backlog, Rates.from_config(cfg), cfg, ["a", "b", "c"])
    # a: 8000 / (100 x 10) = 8, at most 3; b: 1200 / (50 x 10) = 2.4 -> 3; c: none, but its floor of 1; then
    # 7 > max_workers: b gives one (the least backlog per worker of those above their floors)
    assert d.workers == {"a": 3, "b": 2, "c": 1} and d.total == 6
    assert d.seconds == {"a": 80.0, "b": 24.0, "c": 0.0}
    idle = demand({}, Rates.from_config(cfg), cfg.model_copy(update={"min_workers": 2}), ["a", "b", "c"])
    assert idle.workers == {"a": 0, "b": 0, "c": 1} and idle.total == 2 and idle.spare == 1
    zero = demand({}, Rates.from_config(cfg), AutoscaleConfig(enabled=True), ["a"])
    assert zero == Demand({"a": 0}, 0, {"a": 0.0})


def test_the_total_is_cut_from_the_models_that_lose_least_and_each_model_with_work_keeps_a_worker():
    # b's backlog per worker is the smallest: it gives first, but keeps one while a has more than one
    assert fit({"a": 4, "b": 3}, 5, {"a": 400.0, "b": 30.0}) == {"a": 4, "b": 1}
    assert fit({"a": 4, "b": 3}, 2, {"a": 400.0, "b": 30.0}) == {"a": 1, "b": 1}
    assert fit({"a": 4, "b": 3, "c": 1}, 2, {"a": 400.0, "b": 30.0, "c": 5.0}) == {"a": 1, "b": 1, "c": 0}
    assert fit({"a": 2, "b": 2}, 2, {"a": 1.0, "b": 100.0}, floors={"a": 2}) == {"a": 2, "b": 0}
    cfg = AutoscaleConfig(enabled=True, target_drain_s=1, max_workers=3)
    d = demand({"a": Backlog(queued=10**4, steps=10**6), "b": Backlog(queued=1, steps=10)}, Rates(default=100), cfg,
               ["a", "b"])
    assert d.workers == {"a": 2, "b": 1} and d.total == 3


def test_a_model_gets_no_more_workers_than_its_work_can_go_to():
    """A running item stays on its worker; queued items fill one more worker per ``per_worker`` of them: a tail
    of running items on one worker asks for that one worker, however many steps it has left."""
    cfg = AutoscaleConfig(enabled=True, target_drain_s=1, max_workers=8)
    tail = {"a": Backlog(queued=0, running=20, steps=400)}
    assert demand(tail, Rates(default=100), cfg, ["a"]).workers == {"a": 4}  # no holders given: by the items
    assert demand(tail, Rates(default=100), cfg, ["a"], holding={"a": 1}, per_worker=8).workers == {"a": 1}
    more = {"a": Backlog(queued=17, running=20, steps=10**4)}
    assert demand(more, Rates(default=100), cfg, ["a"], holding={"a": 1}, per_worker=8).workers == {"a": 1 + 3}


def test_rates_are_measured_from_busy_seconds_then_configured_then_the_default():
    rates = Rates({"b": 40.0}, default=100.0, memory_s=60.0, min_busy_s=1.0)
    assert rates.rate("a") == 100.0 and rates.rate("b") == 40.0 and rates.measured("a") is None
    rates.observe("a", 100, 0.5)  # half a second of stepping: not yet enough to go by
    assert rates.rate("a") == 100.0
    rates.observe("a", 130, 0.65)
    assert rates.rate("a") == pytest.approx(200.0, rel=0.01)
    for _ in range(100):  # the worker got slower (larger images): the old reports decay away
        rates.observe("a", 50, 1.0)
    assert rates.rate("a") == pytest.approx(50.0, rel=0.02)
    rates.observe("a", 0, 1.0)  # nothing stepped: no measurement
    rates.observe("b", 10, 0.0)
    assert rates.rate("b") == 40.0


def test_until_measured_a_model_goes_by_its_configured_rate_else_its_cards_estimate_else_the_default(tmp_path):
    """GPU workers: a built-in's card gives its family's measured figure scaled to it (workers.families.rates);
    the tiny digits has none (the default); a configured rate is over the card's; a measurement over both. CPU
    workers take nothing from the cards (their figures are a GPU's)."""
    from workers.config import WorkerConfig
    from workers.families.rates import estimate
    from workers.request.cards import read_card

    models = ("dit-xl-2-512", "pixart-sigma-1024", "digits")
    auto = AutoscaleConfig(enabled=True, default_rate=7.0)
    sched = _scheduler(tmp_path, auto, WorkerConfig(models=models))
    dit, pixart = (estimate(read_card(m)).rate for m in models[:2])
    assert dit == pytest.approx(753.75 / 4)  # DiT-XL/2 256's 753.75 on an H100, at 4x the pixels
    assert [sched.rates.rate(m) for m in models] == [dit, pixart, 7.0]
    assert [sched.rates.source(m) for m in models] == ["model card", "model card", "default"]
    configured = _scheduler(tmp_path / "c", auto.model_copy(update={"rates": {"dit-xl-2-512": 50.0}}),
                            WorkerConfig(models=models))
    assert configured.rates.rate("dit-xl-2-512") == 50.0 and configured.rates.source("dit-xl-2-512") == "configured"
    configured.rates.observe("dit-xl-2-512", 300, 2.0)
    assert configured.rates.rate("dit-xl-2-512") == 150.0 and configured.rates.source("dit-xl-2-512") == "measured"
    for cpu in (WorkerConfig(models=models, resource="CPU"), WorkerConfig(models=models, device="cpu")):
        assert _scheduler(tmp_path / "cpu", auto, cpu).rates.rate("dit-xl-2-512") == 7.0
    assert _scheduler(tmp_path / "off", AutoscaleConfig(), WorkerConfig(models=models)).rates.estimated == {}
    # the demand of a backlog of DiT-XL/2 512 at its estimate: 50 x 50 steps / (188.4 x 10 s) -> 2 workers
    d = demand({"dit-xl-2-512": Backlog(queued=50, steps=2500)}, sched.rates,
               auto.model_copy(update={"target_drain_s": 10}), list(models))
    assert d.workers["dit-xl-2-512"] == 2 and d.seconds["dit-xl-2-512"] == pytest.approx(2500 / dit)


def test_the_store_reports_the_steps_left_per_model(any_store):
    store = any_store
    assert store.backlog() == {}
    store.submit("digits", PARAMS, [1, 2, 3], [0, 1, 2])
    store.submit("digits-text", PARAMS.model_copy(update={"steps": 10}), [0, 0], [0, 1], prompts=["a", "b"])
    (ls,) = store.lease("w", ["digits"], 1, ttl=30)
    ls.step = 15
    store.heartbeat([ls], ttl=30)
    assert store.backlog() == {"digits": {"queued": 2, "running": 1, "steps": 2 * 20 + 5},
                               "digits-text": {"queued": 2, "running": 0, "steps": 20}}
    assert store.commit_result(ls, b"png")
    assert Backlog.of(store.backlog())["digits"] == Backlog(queued=2, running=0, steps=40)
    # a lease that expired (its scheduler died): the item waits for a worker again, its whole plan left
    (gone,) = store.lease("dead", ["digits"], 1, ttl=30)
    gone.step = 12
    store.heartbeat([gone], ttl=-1.0)
    assert Backlog.of(store.backlog())["digits"] == Backlog(queued=2, running=0, steps=40)
    assert len(store.lease("next", ["digits"], 2, ttl=30)) == 2  # it is leasable, as the backlog says
    assert Backlog.of(store.backlog())["digits"] == Backlog(queued=0, running=2, steps=40)


def test_autoscaling_is_off_by_default_and_a_bad_section_says_what_is_wrong(tmp_path):
    assert Config().autoscale.enabled is False
    path = tmp_path / "a.toml"
    path.write_text('[autoscale]\nenabled = true\nmin_workers = 0\nmax_workers = 4\ntarget_drain_s = 120\n'
                    '[autoscale.rates]\ndigits = 800.0\n')
    cfg = load_config(path).autoscale
    assert cfg.enabled and cfg.max_workers == 4 and cfg.rates == {"digits": 800.0}
    for text, words in [
        ("[autoscale]\nmin_workers = 5\nmax_workers = 2\n", r"autoscale: min_workers \(5\) is more than max_workers \(2\)"),
        ("[autoscale]\ntarget_drain_s = 0\n", "autoscale.target_drain_s: Input should be greater than 0"),
        ("[autoscale]\nidle_timeouts = 3\n", "autoscale.idle_timeouts: Extra inputs are not permitted"),
        ("[autoscale.rates]\nflux = 3.0\n", "autoscale.rates names 'flux', not among the served models"),
        ("[autoscale.rates]\ndigits = 0\n", "autoscale.rates: 'digits' = 0.0: must be more than 0"),
        ("[autoscale.min_workers_per_model]\ndigits = 3\n[autoscale.max_workers_per_model]\ndigits = 1\n",
         r"min_workers_per_model\['digits'\] \(3\) is more than that model may have \(1\)"),
        ("[autoscale]\nmax_workers = 2\n[autoscale.min_workers_per_model]\ndigits = 2\ndigits-text = 1\n",
         r"min_workers_per_model adds up to 3, more than max_workers \(2\)"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=words) as e:
            load_config(path)
        assert str(path) in str(e.value)


def test_the_scheduler_measures_a_models_rate_from_its_workers_step_reports(tmp_path):
    """Steps a report's window advanced (progress, and the rest of the finished items' plans) over its busy
    seconds, from a worker that ran one model at half its in-flight limit or more; nothing from a worker that
    ran two models at once, or ran nearly empty."""
    from types import SimpleNamespace

    from dit_serve.server.config import SchedulerConfig
    from dit_serve.server.scheduler import Scheduler, _Worker
    from workers.config import WorkerConfig

    store = Store(f"sqlite:///{tmp_path}/s.db", tmp_path)
    store.submit("digits", PARAMS, [1] * 4, list(range(4)))
    store.submit("digits-text", PARAMS, [0], [0], prompts=["a"])
    sched = Scheduler(store, WorkerConfig(max_batch=4), SchedulerConfig(), 30.0,
                      autoscale=AutoscaleConfig(enabled=True, default_rate=7.0))
    w = _Worker("w", None, SimpleNamespace(), None, models=["digits"])
    w.leases = {ls.key: ls for ls in store.lease("o", ["digits"], 4, ttl=30)}
    a, b, c, d = w.leases
    w.leases[d].step = 18
    report = {"progress": {a: (5, 20), b: (5, 20), c: (5, 20)}, "finished": [(d, b"png")], "busy_s": 1.7}
    sched._measure(w, report)
    assert sched.rates.rate("digits") == pytest.approx((15 + 2) / 1.7)
    assert sched.rates.rate("digits-text") == 7.0
    w.leases = {k: ls for k, ls in w.leases.items() if k == a}  # one item of four: too empty to go by
    sched._measure(w, {"progress": {a: (20, 20)}, "finished": [], "busy_s": 100.0})
    assert sched.rates.rate("digits") == pytest.approx(17 / 1.7)
    (t,) = store.lease("o", ["digits-text"], 1, ttl=30)
    w.leases = {a: w.leases[a], t.key: t, **{f"x{i}": w.leases[a] for i in range(2)}}
    sched._measure(w, {"progress": {a: (20, 20), t.key: (3, 20)}, "finished": [], "busy_s": 100.0})  # two models
    assert sched.rates.rate("digits") == pytest.approx(17 / 1.7) and sched.rates.measured("digits-text") is None


class _FakeRay:
    """What the scheduler's reconcile reads of Ray and starts on it, in memory: the nodes, the autoscaler's
    requests, and the worker actors (each a record of its options and config, ready when told)."""

    def __init__(self, monkeypatch):
        import ray
        from ray.autoscaler import sdk

        from dit_serve.server import scheduler as sched_mod

        self.nodes: list[dict] = [{"NodeID": "f" * 56, "Alive": True, "Resources": {"CPU": 2.0}}]
        self.requests: list[list[dict]] = []
        self.selectors: list[list[dict] | None] = []  # each request's bundle_label_selectors (None: not given)
        self.started: list[tuple[dict, object]] = []
        self.killed: list = []
        self.calls: list[tuple[str, object, object]] = []  # (method, actor handle, argument)
        monkeypatch.setattr(ray, "nodes", lambda: self.nodes)
        monkeypatch.setattr(ray, "kill", lambda handle, **_: self.killed.append(handle))
        monkeypatch.setattr(sdk, "request_resources", self._request)
        fake = self

        class Actor:
            @staticmethod
            def options(**opts):
                from types import SimpleNamespace

                def remote(cfg):
                    handle = SimpleNamespace(opts=opts, cfg=cfg, info=SimpleNamespace(remote=lambda: SimpleNamespace(future=Future)))
                    for method in ("load", "unload", "submit"):
                        setattr(handle, method, SimpleNamespace(
                            remote=lambda arg, method=method, handle=handle: fake.calls.append((method, handle, arg))))
                    fake.started.append((opts, cfg))
                    return handle
                return SimpleNamespace(remote=remote)

        monkeypatch.setattr(sched_mod, "_actor_class", lambda: Actor)

    def _request(self, num_cpus=None, bundles=None, bundle_label_selectors=None):
        self.requests.append(bundles)
        self.selectors.append(bundle_label_selectors)

    def add_gpu_node(self, name: str, gpus: int = 1, labels: dict | None = None, **resources: float) -> None:
        self.nodes.append({"NodeID": name * 56, "Alive": True, "Labels": {"ray.io/node-id": name * 56, **(labels or {})},
                           "Resources": {"CPU": 8.0, "GPU": float(gpus), **resources}})


def _scheduler(tmp_path, auto: AutoscaleConfig, workers=None):
    from dit_serve.server.config import SchedulerConfig
    from dit_serve.server.scheduler import Scheduler
    from workers.config import WorkerConfig

    store = Store(f"sqlite:///{tmp_path}/s.db", tmp_path)
    return Scheduler(store, workers or WorkerConfig(max_batch=8), SchedulerConfig(), 30.0, autoscale=auto)


def test_ray_is_asked_for_the_workers_the_backlog_needs_and_less_as_it_drains(tmp_path, monkeypatch):
    """``request_resources`` gets one bundle per worker wanted (a GPU each, [workers] resource auto), the
    workers start on the GPUs the cluster has as nodes join (packed: a node's slots before another's), and
    the request goes down as the backlog drains, to nothing once it is gone."""
    ray = _FakeRay(monkeypatch)
    sched = _scheduler(tmp_path, AutoscaleConfig(enabled=True, target_drain_s=5, default_rate=100, max_workers=3))
    sched.reconcile()
    assert ray.requests == [[]] and sched.workers == {}  # no backlog: nothing asked (a stale request cleared)
    job = sched.store.create_job("digits", PARAMS, [1] * 100, list(range(100)))  # 2000 steps: 4 workers' 5 s
    sched.reconcile()
    assert ray.requests[1:] == [[{"GPU": 1.0}] * 3] and sched.workers == {}  # at most 3; no GPU node yet
    ray.add_gpu_node("a", gpus=2)
    ray.add_gpu_node("b")
    sched.reconcile()
    assert sorted(sched.workers) == ["aaaaaaaaaaaa-0", "aaaaaaaaaaaa-1", "bbbbbbbbbbbb-0"]
    assert all(opts["num_gpus"] == 1 for opts, _ in ray.started) and len(ray.requests) == 2  # unchanged: not again
    for ls in sched.store.lease("other", ["digits"], 60, ttl=30):  # 60 items done: 800 steps left, 2 workers
        assert sched.store.commit_result(ls, b"png")
    sched.reconcile()
    assert ray.requests[-1] == [{"GPU": 1.0}] * 2 and len(sched.workers) == 3  # idle ones stop on their own
    sched.store.cancel_job(job)
    sched.reconcile()
    assert ray.requests[-1] == [] and sched.asked == 0


def test_autoscaling_off_asks_ray_for_nothing_and_starts_a_worker_per_gpu(tmp_path, monkeypatch):
    ray = _FakeRay(monkeypatch)
    ray.add_gpu_node("a", gpus=2)
    sched = _scheduler(tmp_path, AutoscaleConfig())
    sched.store.create_job("digits", PARAMS, [1] * 100, list(range(100)))
    sched.reconcile()
    assert ray.requests == [] and sorted(sched.workers) == ["aaaaaaaaaaaa-0", "aaaaaaaaaaaa-1"]
    assert [cfg.models for _, cfg in ray.started] == [("digits", "digits-text")] * 2
    off = _scheduler(tmp_path / "off", AutoscaleConfig(enabled=True, request_resources=False, max_workers=1))
    off.store.create_job("digits", PARAMS, [1], [0])
    off.reconcile()
    assert ray.requests == [] and len(off.workers) == 1  # the cluster as it is, no request


def test_a_custom_bundle_and_a_custom_resource_are_what_ray_is_asked_for(tmp_path, monkeypatch):
    from workers.config import WorkerConfig

    ray = _FakeRay(monkeypatch)
    sched = _scheduler(tmp_path, AutoscaleConfig(enabled=True, max_workers=2), WorkerConfig(resource="dit_gpu"))
    sched.store.create_job("digits", PARAMS, [1], [0])
    sched.reconcile()
    custom = _scheduler(tmp_path / "c", AutoscaleConfig(enabled=True, bundle={"GPU": 1, "CPU": 4}))
    custom.store.create_job("digits", PARAMS, [1], [0])
    custom.reconcile()
    assert ray.requests == [[{"dit_gpu": 1.0}], [{"GPU": 1.0, "CPU": 4.0}]]


def _ready(sched, models=("digits",)):
    """Every worker the fake Ray started is ready now, serving ``models``."""
    for w in sched.workers.values():
        w.ready_ref, w.models, w.loading = None, list(models), []


def test_an_idle_worker_stops_cleanly_after_the_timeout_down_to_zero_and_a_new_job_starts_one(tmp_path, monkeypatch):
    """Nothing leased and nothing queued for its models for ``idle_timeout_s``: the worker is stopped (not a
    crash, nothing requeued), down to ``min_workers`` (0: none left, the service scales to zero); a new job
    makes the scheduler ask Ray again and start one."""
    clock = [1000.0]
    from dit_serve.server import scheduler as sched_mod

    monkeypatch.setattr(sched_mod.time, "monotonic", lambda: clock[0])
    ray = _FakeRay(monkeypatch)
    ray.add_gpu_node("a", gpus=2)
    sched = _scheduler(tmp_path, AutoscaleConfig(enabled=True, target_drain_s=1, default_rate=100, max_workers=2,
                                                 idle_timeout_s=60))
    job = sched.store.create_job("digits", PARAMS, [1] * 20, list(range(20)))  # 400 steps: 2 workers (at most)
    sched.reconcile()
    _ready(sched)
    assert len(sched.workers) == 2 and ray.requests[-1] == [{"GPU": 1.0}] * 2
    busy, idle = sched.workers.values()
    busy.leases = {ls.key: ls for ls in sched.store.lease("o", ["digits"], 20, ttl=30)}  # it runs them all
    clock[0] += 100
    sched.reconcile()  # the other has nothing leased and nothing is queued: idle from now
    assert idle.idle_since == clock[0] and busy.idle_since is None and len(sched.workers) == 2
    clock[0] += 59
    sched.reconcile()
    assert len(sched.workers) == 2
    clock[0] += 1
    sched.reconcile()
    assert list(sched.workers.values()) == [busy] and ray.killed == [idle.handle]
    for ls in list(busy.leases.values()):
        assert sched.store.commit_result(ls, b"png")
    busy.leases = {}
    sched.reconcile()
    assert ray.requests[-1] == [] and sched.store.get_job(job).state == "done"
    clock[0] += 60
    sched.reconcile()
    assert sched.workers == {} and ray.killed == [idle.handle, busy.handle]  # scaled to zero
    assert sched.metrics.worker_crashes._value.get() == 0 and sched.store.list_workers() == []
    sched.store.create_job("digits", PARAMS, [1], [0])  # a new job: asked for again, and a worker starts
    sched.reconcile()
    assert ray.requests[-1] == [{"GPU": 1.0}] and len(sched.workers) == 1


def test_idle_workers_stay_at_the_minimums(tmp_path, monkeypatch):
    clock = [1000.0]
    from dit_serve.server import scheduler as sched_mod

    monkeypatch.setattr(sched_mod.time, "monotonic", lambda: clock[0])
    ray = _FakeRay(monkeypatch)
    ray.add_gpu_node("a", gpus=4)
    sched = _scheduler(tmp_path, AutoscaleConfig(enabled=True, min_workers=1, max_workers=4, idle_timeout_s=10,
                                                 min_workers_per_model={"digits-text": 1}))
    sched.reconcile()  # the minimums with no backlog: digits-text's worker, and no spare beyond it
    assert len(sched.workers) == 1
    sched.store.create_job("digits", PARAMS, [1] * 1000, list(range(1000)))
    sched.reconcile()
    assert len(sched.workers) == 1 + 1  # 20000 steps at 100/s: 1 worker in 300 s
    first, second = sched.workers.values()
    for w, models in ((first, ["digits-text"]), (second, ["digits"])):
        w.ready_ref, w.models, w.loading = None, models, []
    sched.store.cancel_job(sched.store.list_jobs(1, 0)[0][0].id)
    for _ in range(3):
        clock[0] += 10
        sched.reconcile()
    assert list(sched.workers.values()) == [first]  # digits-text's own minimum keeps it


def test_the_store_tells_of_the_workers_and_whether_a_model_waits_for_one(any_store):
    from dit_serve.server.store import WorkerRow

    store = any_store
    assert store.waiting_note("digits") == "waiting for a worker: none serves model 'digits' now"
    store.put_workers("sched-1", [WorkerRow("cpu-0", "starting", loading=["digits"], started_at=1.0)])
    assert store.waiting_note("digits") == "waiting for a worker: one is loading model 'digits'"
    store.put_workers("sched-1", [WorkerRow("cpu-0", "ready", models=["digits"], held=3, started_at=1.0)])
    store.put_workers("sched-2", [WorkerRow("gpu-0", "ready", models=["digits-text"], started_at=2.0)])
    assert store.waiting_note("digits") is None and store.waiting_note("digits-text") is None
    assert [(r.owner, r.key, r.models, r.held) for r in store.list_workers()] == [
        ("sched-1", "cpu-0", ["digits"], 3), ("sched-2", "gpu-0", ["digits-text"], 0)]
    assert store.list_workers(fresh_s=-1) == []  # a scheduler that stopped writing is gone
    store.put_workers("sched-1", [])
    assert store.waiting_note("digits") == "waiting for a worker: none serves model 'digits' now"


# -- placement ---------------------------------------------------------------------------------------------
def test_a_switch_pays_when_the_backlog_outlasts_its_cost_on_the_workers_it_has():
    from dit_serve.server.autoscale import switch_gain

    assert switch_gain(100.0, 0, 30.0) == float("inf")  # nothing serves it: it waits for one
    assert switch_gain(0.0, 0, 30.0) == 0.0
    assert switch_gain(100.0, 1, 30.0) == pytest.approx((100 - 30) / 2)  # 100 s alone; 30 + 70/2 = 65 s with one more
    assert switch_gain(100.0, 2, 30.0) == pytest.approx((100 - 60) / 6)  # 50 s; 30 + 40/3 = 43.3 s
    assert switch_gain(50.0, 2, 30.0) == 0.0  # the two finish in 25 s, before the switch would


def _place(backlog, workers, free, auto=None, fits=lambda ms: len(ms) <= 1, start_s=120.0, switch_s=None,
           models=("a", "b")):
    from dit_serve.server.autoscale import Costs, place

    cfg = auto or AutoscaleConfig(enabled=True, target_drain_s=10, default_rate=10, max_workers=4)
    held = {}
    for w in workers:
        for m in w.models:
            if not w.idle:
                held[m] = held.get(m, 0) + 1
    d = demand(backlog, Rates(default=10), cfg, list(models), held, per_worker=8)
    return place(d, backlog, workers, free, Costs(start_s, switch_s or {}, 30.0), cfg, list(models), fits)


def test_an_idle_worker_switches_to_a_model_that_no_worker_serves_rather_than_a_new_one_starting():
    from dit_serve.server.autoscale import WorkerState

    idle_a, busy_a = WorkerState("w1", ("a",), idle=True, idle_s=5), WorkerState("w2", ("a",), idle=False)
    b = {"a": Backlog(running=8, steps=80), "b": Backlog(queued=4, steps=400)}
    p = _place(b, [idle_a, busy_a], free=2)
    assert p.switch == [("w1", "b", ["a"])] and p.start == []
    # the switch costs more than a start on a free slot: a new worker for b, the idle one left to time out
    p = _place(b, [idle_a, busy_a], free=2, switch_s={"b": 200.0})
    assert p.switch == [] and p.start == [["b"]]
    # no free slot: the switch, whatever it costs (nothing serves b)
    assert _place(b, [idle_a, busy_a], free=0, switch_s={"b": 200.0}).switch == [("w1", "b", ["a"])]
    # room for both on the idle worker: b loads beside a
    assert _place(b, [idle_a, busy_a], free=0, fits=lambda ms: True).switch == [("w1", "b", [])]


def test_a_switch_to_a_model_that_workers_serve_only_where_it_finishes_the_backlog_sooner():
    from dit_serve.server.autoscale import WorkerState

    busy_b, idle_a = WorkerState("w1", ("b",), idle=False), WorkerState("w2", ("a",), idle=True)
    big = {"b": Backlog(queued=40, running=8, steps=2000)}  # 200 s on the one worker serving it: 2 wanted
    assert _place(big, [busy_b, idle_a], free=0).switch == [("w2", "b", ["a"])]
    small = {"b": Backlog(queued=9, running=8, steps=250)}  # 25 s: the switch's 30 s would not pay
    assert _place(small, [busy_b, idle_a], free=0).switch == []
    assert _place(small, [busy_b, idle_a], free=0, switch_s={"b": 5.0}).switch == [("w2", "b", ["a"])]
    gain = AutoscaleConfig(enabled=True, target_drain_s=10, default_rate=10, max_workers=4, min_switch_gain_s=20)
    assert _place(small, [busy_b, idle_a], free=0, auto=gain, switch_s={"b": 5.0}).switch == []  # gain 10 s


def test_new_workers_load_the_model_that_lacks_workers_then_what_fits_beside_it():
    b = {"a": Backlog(queued=100, steps=5000), "b": Backlog(queued=10, steps=300), "c": Backlog(queued=1, steps=10)}
    models = ("a", "b", "c")
    p = _place(b, [], free=3, models=models, fits=lambda ms: len(ms) <= 2)
    # at most 4 workers: a (500 s of work) gets 2, b and c one each; the two for a hold b too (two models fit),
    # so b lacks none, and c's worker holds a beside it; three free slots: three start
    assert p.start == [["a", "b"], ["a", "b"], ["c", "a"]]
    one = _place(b, [], free=1, models=models, fits=lambda ms: True)
    assert one.start == [["a", "b", "c"]]
    spare = _place({}, [], free=2, models=models, fits=lambda ms: len(ms) <= 2,
                   auto=AutoscaleConfig(enabled=True, min_workers=1))
    assert spare.start == [["a", "b"]] and spare.switch == []


def test_an_idle_worker_at_its_models_minimum_is_not_switched():
    from dit_serve.server.autoscale import WorkerState

    auto = AutoscaleConfig(enabled=True, target_drain_s=10, default_rate=10, max_workers=4,
                           min_workers_per_model={"a": 1})
    b = {"b": Backlog(queued=4, steps=400)}
    p = _place(b, [WorkerState("w1", ("a",), idle=True)], free=1, auto=auto)
    assert p.switch == [] and p.start == [["b"]]


def test_the_scheduler_switches_an_idle_worker_and_leases_it_only_what_it_serves(tmp_path, monkeypatch):
    """Two slots, a backlog of digits and then of digits-text: two workers start with digits; once digits is
    done, one idle worker is told to unload it and load digits-text. From then it is leased no digits item,
    even from a report older than the switch; the item it hands back goes to the queue uncounted; the switch's
    time is measured when a report shows it serving digits-text."""
    from workers.config import WorkerConfig

    ray = _FakeRay(monkeypatch)
    sched = _scheduler(tmp_path, AutoscaleConfig(enabled=True, target_drain_s=1, default_rate=100, max_workers=2,
                                                 idle_timeout_s=600), WorkerConfig(resource="CPU", cpu_workers=2,
                                                                                   max_batch=8))
    a = sched.store.create_job("digits", PARAMS, [1] * 16, list(range(16)))
    sched.reconcile()
    assert [cfg.models for _, cfg in ray.started] == [("digits",), ("digits",)]
    _ready(sched)
    w1, w2 = sched.workers.values()
    for w in (w1, w2):
        sched._fill(w, expect=True)
    assert len(w1.leases) == len(w2.leases) == 8
    for w in (w1, w2):
        for ls in w.leases.values():
            assert sched.store.commit_result(ls, b"png")
        w.leases = {}
    assert sched.store.get_job(a).state == "done"
    b = sched.store.create_job("digits-text", PARAMS, [0] * 4, list(range(4)), prompts=["a seven"] * 4)
    sched.reconcile()
    switched = [(m, h) for m, h, _ in ray.calls if m in ("unload", "load")]
    assert [m for m, _ in switched] == ["unload", "load"] and switched[0][1] is switched[1][1]
    w = next(w for w in (w1, w2) if w.handle is switched[0][1])
    assert [arg for m, h, arg in ray.calls if m in ("unload", "load")] == [["digits"], ["digits-text"]]
    assert w.models == [] and w.loading == ["digits-text"] and sched.switches == {"digits-text": 1}
    sched.reconcile()
    assert sched.switches == {"digits-text": 1} and len(sched.workers) == 2  # once
    old = {"progress": {}, "finished": [], "failed": [], "models": ["digits"], "loading": []}
    sched._apply_report(w, old)  # sent before the switch: digits is not taken back
    assert w.models == [] and w.loading == ["digits-text"]
    sched.store.create_job("digits", PARAMS, [1], [0])
    sched._fill(w, expect=True)
    assert w.leases == {}
    sched._apply_report(w, {**old, "models": ["digits-text"], "loading": []})
    assert w.models == ["digits-text"] and w.switching is None and "digits-text" in sched.switch_s
    sched._fill(w, expect=True)
    assert {ls.model for ls in w.leases.values()} == {"digits-text"} and len(w.leases) == 4
    back = next(iter(w.leases))
    sched._apply_report(w, {**old, "models": ["digits-text"], "returned": [back]})  # handed back unrun
    (item,) = [it for it in sched.store.get_job(b).items if f"{b}/{it.index}" == back]
    assert item.state == "queued" and item.attempts == 0 and item.requeues == 0


def test_metrics_show_each_models_desired_workers_and_backlog_and_the_request(tmp_path, monkeypatch):
    ray = _FakeRay(monkeypatch)
    sched = _scheduler(tmp_path, AutoscaleConfig(enabled=True, target_drain_s=10, default_rate=100, max_workers=4))
    sched.store.create_job("digits", PARAMS, [1] * 100, list(range(100)))  # 2000 steps: 20 s of one worker
    sched.reconcile()
    text = sched.metrics.render().decode()
    for line in ('dit_serve_autoscale_desired_workers{model="digits"} 2.0',
                 'dit_serve_autoscale_desired_workers{model="digits-text"} 0.0',
                 'dit_serve_autoscale_backlog_gpu_seconds{model="digits"} 20.0',
                 "dit_serve_autoscale_requested_workers 2.0", 'dit_serve_workers_serving{model="digits"} 0.0'):
        assert line in text, line
    assert ray.requests[-1] == [{"GPU": 1.0}] * 2


def test_a_draining_scheduler_starts_no_worker(tmp_path, monkeypatch):
    ray = _FakeRay(monkeypatch)
    ray.add_gpu_node("a", gpus=2)
    sched = _scheduler(tmp_path, AutoscaleConfig(enabled=True, max_workers=2))
    sched.store.create_job("digits", PARAMS, [1] * 100, list(range(100)))
    sched.draining = True
    sched.reconcile()
    assert sched.workers == {} and ray.started == []


# -- models pinned to nodes ([autoscale.placement]) --------------------------------------------------------
def _pins(**models):
    from dit_serve.server.config import ModelPlacement

    return {m: ModelPlacement(**pin) for m, pin in models.items()}


def test_a_pinned_model_is_placed_only_where_its_labels_and_resources_are():
    from dit_serve.server.autoscale import WorkerState, allowed, pin_allows, reservation

    pins = _pins(a={"labels": {"gpu": "h100"}, "resources": {"accelerator_type:H100": 0.001}})
    assert pin_allows(None, {}, {}) and not pin_allows(pins["a"], {"gpu": "h100"}, {})
    assert pin_allows(pins["a"], {"gpu": "h100", "zone": "x"}, {"accelerator_type:H100": 1.0})
    assert not pin_allows(pins["a"], {"gpu": "a100"}, {"accelerator_type:H100": 1.0})
    h100 = allowed(["a", "b"], pins, {"gpu": "h100"}, {"accelerator_type:H100": 1.0})
    other = allowed(["a", "b"], pins, {"gpu": "a100"}, {})
    assert h100 == {"a", "b"} and other == {"b"}
    assert reservation(["a", "b"], pins) == {"accelerator_type:H100": 0.001} and reservation(["b"], pins) == {}
    b = {"a": Backlog(queued=4, steps=400)}
    # free slots in the scheduler's order (the other node first): a's worker starts on the H100 slot
    p = _place(b, [], free=[other, h100])
    assert p.start == [["a"]] and p.slots == [1]
    assert _place(b, [], free=[other, other]).start == []  # no node for it: it waits for the one Ray was asked for
    # an idle worker on the other node is not switched to a, whatever the switch would gain; one that may is
    idle_b = WorkerState("w1", ("b",), idle=True, idle_s=5, allows=other)
    assert _place(b, [idle_b], free=0).switch == []
    assert _place(b, [idle_b], free=[other, h100]).start == [["a"]]
    assert _place(b, [WorkerState("w1", ("b",), idle=True, allows=h100)], free=0).switch == [("w1", "a", ["b"])]
    # a new worker's other models are only those its slot may hold; spare workers load what their slot may
    two = _place({"a": Backlog(queued=4, steps=400), "b": Backlog(queued=4, steps=400)}, [], free=[other, h100],
                 fits=lambda ms: True)
    assert sorted(zip(two.slots, map(tuple, two.start))) == [(0, ("b",)), (1, ("a", "b"))]
    spare = _place({}, [], free=[other], auto=AutoscaleConfig(enabled=True, min_workers=1))
    assert spare.start == [["b"]] and spare.slots == [0]


def test_ray_is_asked_for_a_pinned_models_workers_with_its_labels_and_resources():
    from dit_serve.server.autoscale import bundles

    pins = _pins(a={"labels": {"gpu": "h100"}, "resources": {"accelerator_type:H100": 0.001}})
    d = Demand({"a": 2, "b": 1}, 4)  # 3 for the models, one spare (min_workers 4)
    assert bundles(d, {"GPU": 1.0}, pins) == [
        ({"GPU": 1.0, "accelerator_type:H100": 0.001}, {"gpu": "h100"}),
        ({"GPU": 1.0, "accelerator_type:H100": 0.001}, {"gpu": "h100"}),
        ({"GPU": 1.0}, {}), ({"GPU": 1.0}, {})]
    assert bundles(Demand({"a": 0}, 0), {"GPU": 1.0}, pins) == []


def test_the_scheduler_starts_a_pinned_models_workers_on_labelled_nodes_only(tmp_path, monkeypatch):
    """digits-text is pinned to nodes labelled gpu=h100: Ray is asked for its worker with that label selector;
    node a (no label) gets no worker for it, node b does, and takes Ray's per-node H100 resource; an idle digits
    worker on node a is never switched to digits-text, one on b may be. With autoscaling off, the worker on node
    a holds digits only."""
    from workers.config import WorkerConfig

    ray = _FakeRay(monkeypatch)
    ray.add_gpu_node("a", gpus=2)
    auto = AutoscaleConfig(enabled=True, max_workers=2, idle_timeout_s=600, target_drain_s=1, default_rate=100,
                           placement=_pins(**{"digits-text": {"labels": {"gpu": "h100"},
                                                              "resources": {"accelerator_type:H100": 0.001}}}))
    sched = _scheduler(tmp_path, auto, WorkerConfig(max_batch=8))
    sched.store.create_job("digits-text", PARAMS, [0] * 4, list(range(4)), prompts=["a seven"] * 4)
    sched.reconcile()
    assert ray.requests[-1] == [{"GPU": 1.0, "accelerator_type:H100": 0.001}]
    assert ray.selectors[-1] == [{"gpu": "h100"}] and sched.workers == {}  # node a may not hold it
    ray.add_gpu_node("b", gpus=1, labels={"gpu": "h100"}, **{"accelerator_type:H100": 1.0})
    sched.reconcile()
    (w,) = sched.workers.values()
    assert w.plan.node_id == "b" * 56 and w.models == [] and w.loading == ["digits-text"]
    assert ray.started[-1][0]["resources"] == {"accelerator_type:H100": 0.001}
    assert w.pinned == {"accelerator_type:H100": 0.001}
    sched.store.create_job("digits", PARAMS, [1] * 4, list(range(4)))
    sched.reconcile()
    on_a = [x for x in sched.workers.values() if x.plan.node_id == "a" * 56]
    assert len(on_a) == 1 and on_a[0].loading == ["digits"] and "resources" not in ray.started[-1][0]
    _ready(sched, models=())
    for x in sched.workers.values():  # both idle now: nothing queued for what they serve
        x.models = ["digits"]
        x.loading = []
    for job in sched.store.list_jobs(10, 0)[0]:
        sched.store.cancel_job(job.id)
    sched.store.create_job("digits-text", PARAMS, [0] * 40, list(range(40)), prompts=["a seven"] * 40)
    sched.reconcile()
    sched.reconcile()
    switched = [h for m, h, _ in ray.calls if m == "load"]
    assert switched and all(h is w.handle for h in switched)  # b's worker, never a's

    off = _scheduler(tmp_path / "off", auto.model_copy(update={"enabled": False}), WorkerConfig(max_batch=8))
    off.reconcile()
    held = {x.plan.node_id[0]: x.loading for x in off.workers.values()}
    assert held == {"a": ["digits"], "b": ["digits", "digits-text"]}  # node a: 2 slots, both digits only
    assert len(off.workers) == 3


def test_placement_is_configured_per_served_model_and_checked(tmp_path):
    path = tmp_path / "a.toml"
    path.write_text('[autoscale]\nenabled = true\n[autoscale.placement]\n'
                    '"digits-text" = {labels = {gpu = "h100"}, resources = {"accelerator_type:H100" = 0.001}}\n')
    pin = load_config(path).autoscale.placement["digits-text"]
    assert pin.labels == {"gpu": "h100"} and pin.resources == {"accelerator_type:H100": 0.001}
    for text, words in [
        ('[autoscale.placement]\nflux = {labels = {gpu = "h100"}}\n', "autoscale.placement names 'flux'"),
        ('[autoscale.placement]\ndigits = {labels = {gpu = "in(h100,h200)"}}\n', "operators such as in"),
        ('[autoscale.placement]\ndigits = {resources = {GPU = 1}}\n', "pin a model by a custom resource"),
        ('[autoscale.placement]\ndigits = {resources = {h100 = 0}}\n', "must be more than 0"),
        ('[autoscale.placement]\ndigits = {zone = "x"}\n', "Extra inputs are not permitted"),
        ('[workers]\nresource = "CPU"\n[autoscale.placement]\ndigits = {labels = {gpu = "h100"}}\n',
         "CPU workers are not placed on nodes"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=words):
            load_config(path)


def test_a_worker_that_dies_with_its_node_returns_its_items_uncharged(tmp_path, monkeypatch):
    """A worker's poll fails: if its node is gone from the cluster (the autoscaler removed it, it was preempted)
    its items go back as an infrastructure failure (a requeue, no crash); if the node is alive, as a crash."""
    import ray as ray_mod

    ray = _FakeRay(monkeypatch)
    ray.add_gpu_node("a")
    ray.add_gpu_node("b")
    sched = _scheduler(tmp_path, AutoscaleConfig(enabled=True, max_workers=2, target_drain_s=1, default_rate=100))
    job = sched.store.create_job("digits", PARAMS, [1] * 16, list(range(16)))
    sched.reconcile()
    _ready(sched)
    for w in sched.workers.values():
        sched._fill(w, expect=True)
    on = {w.plan.node_id[0]: w for w in sched.workers.values()}
    assert len(on["a"].leases) == len(on["b"].leases) == 8

    def died(ref):
        raise ray_mod.exceptions.ActorDiedError()

    monkeypatch.setattr(ray_mod, "get", died)
    ray.nodes[1]["Alive"] = False  # node a went; b is alive
    sched._receive(on["a"], object())
    sched._receive(on["b"], object())
    items = {it.index: it for it in sched.store.get_job(job).items}
    assert all(it.state == "queued" and it.requeues == 1 for it in items.values())
    assert sorted(it.crashes for it in items.values()) == [0] * 8 + [1] * 8
    assert sched.metrics.worker_crashes._value.get() == 1 and sched.workers == {}
    assert sched.metrics.requeued.labels("infra")._value.get() == 8
