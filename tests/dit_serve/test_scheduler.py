"""Where workers go (pure: no Ray); the scheduler itself runs in test_service and test_cluster."""

from __future__ import annotations

from functools import partial

from workers.config import WorkerConfig
from dit_serve.server.scheduler import SlotPlan, plan_slots


def _node(node_id: str, alive: bool = True, **resources) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 2.0, **resources}}


def test_one_worker_per_gpu():
    nodes = [_node("a" * 20, GPU=2.0), _node("b" * 20), _node("c" * 20, alive=False, GPU=8.0)]
    slots = plan_slots(nodes, WorkerConfig())
    assert slots == {"aaaaaaaaaaaa-0": SlotPlan("a" * 20, "GPU"), "aaaaaaaaaaaa-1": SlotPlan("a" * 20, "GPU")}


def test_one_cpu_worker_without_gpus():
    assert plan_slots([_node("a"), _node("b")], WorkerConfig()) == {"cpu-0": SlotPlan(None, "CPU")}
    assert list(plan_slots([_node("a")], WorkerConfig(cpu_workers=2))) == ["cpu-0", "cpu-1"]


def test_nodes_whose_ids_begin_alike_get_slots_of_their_own():
    a, b = "f" * 51 + "00001", "f" * 51 + "00002"  # Ray's fake multi-node provider names its nodes so
    slots = plan_slots([_node(a, GPU=1.0), _node(b, GPU=1.0), _node("c" * 56, GPU=1.0)], WorkerConfig())
    assert sorted(slots) == ["cccccccccccc-0", f"{a}-0", f"{b}-0"]


def test_custom_resource_per_unit():
    nodes = [_node("n1", dit_worker=1.0), _node("n2"), _node("n3", dit_worker=2.0)]
    slots = plan_slots(nodes, WorkerConfig(resource="dit_worker"))
    assert sorted(slots) == ["n1-0", "n3-0", "n3-1"] and slots["n3-1"] == SlotPlan("n3", "dit_worker")


def test_a_started_worker_gets_the_engine_switches_of_the_config(tmp_path, monkeypatch):
    """``[workers]`` reaches the actors the scheduler starts as it is (one config, no copy), with the compiled
    kernels' cache under the data directory unless the config names one."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from dit_serve.server import scheduler as sched_mod
    from dit_serve.server.config import SchedulerConfig
    from dit_serve.server.store import Store

    specs = []

    class FakeActor:
        @staticmethod
        def options(**opts):
            return SimpleNamespace(remote=lambda spec: specs.append(spec) or SimpleNamespace(
                info=SimpleNamespace(remote=lambda: SimpleNamespace(future=Future))))  # a ref never resolved

    monkeypatch.setattr(sched_mod, "_actor_class", lambda: FakeActor)
    from dit_serve.server.config import Config

    config = Config().with_overrides(
        store={"data_dir": str(tmp_path)},
        workers={"models": ("digits",), "speed": "fast", "precision": {"digits": "fp8"}, "png_compress_level": 4})
    cfg = config.worker_config()
    s = sched_mod.Scheduler(Store(f"sqlite:///{tmp_path}/s.db", tmp_path), cfg, SchedulerConfig(), 30.0)
    s._start("cpu-0", SlotPlan(None, "CPU"))
    (spec,) = specs
    assert spec is cfg and (spec.speed, spec.precision, spec.png_compress_level) == ("fast", {"digits": "fp8"}, 4)
    assert spec.compile_cache == str(tmp_path.resolve() / "compile-cache")
    mine = Config().with_overrides(workers={"compile_cache": str(tmp_path / "mine")}).worker_config()
    assert mine.compile_cache == str(tmp_path / "mine")


def test_a_fill_prefers_the_sizes_the_worker_runs_and_strict_order_is_a_switch(tmp_path):
    """``_fill`` leases with the worker's in-flight shapes (``[scheduler] group_shapes``, on by default),
    so a worker running 32 px images gets the queue's head and then the queued 32 px ones before the
    others; off: strict queue order."""
    from types import SimpleNamespace

    from dit_serve.schemas import JobParams
    from dit_serve.server.config import SchedulerConfig
    from dit_serve.server.scheduler import Scheduler, _Worker
    from dit_serve.server.store import Store

    sent: list[list] = []
    for group_shapes, want in ((True, [64, 32]), (False, [64, 48])):
        store = Store(f"sqlite:///{tmp_path}/{group_shapes}.db", tmp_path)
        for w in (32, 64, 48, 32, 48):
            store.submit("digits", JobParams(sampler="ddim", steps=5, guidance=1.0, width=w, height=w), [1], [0])
        sched = Scheduler(store, WorkerConfig(max_batch=4), SchedulerConfig(group_shapes=group_shapes), 30.0)
        w = _Worker("w", None, SimpleNamespace(submit=SimpleNamespace(remote=sent.append)), None, models=["digits"])
        sched.workers["w"] = w
        (first,) = store.lease("other", ["digits"], 1, ttl=30)  # the 32 px head runs on this worker already
        w.leases[first.key] = first
        sched.cfg = WorkerConfig(max_batch=4, max_inflight=3)
        sched._fill(w, expect=True)
        assert [spec.width for spec in sent[-1]] == want
    assert SchedulerConfig().group_shapes is True


def test_a_fill_holds_a_new_size_back_until_a_quarter_of_the_room_is_free_and_asks_again(tmp_path):
    """Admission rule 4 through ``_fill``: a worker holding 7 of 8 in-flight 32 px items gets nothing for a
    queued 48 px job while its room is 1 (a group of one beside the 32 px one), but marks that more may be
    queued, so the next finished item asks again; with 2 free the 48 px items start."""
    from types import SimpleNamespace

    from dit_serve.schemas import JobParams
    from dit_serve.server.config import SchedulerConfig
    from dit_serve.server.scheduler import Scheduler, _Worker
    from dit_serve.server.store import Store

    params = lambda w: JobParams(sampler="ddim", steps=5, guidance=1.0, width=w, height=w)  # noqa: E731
    store = Store(f"sqlite:///{tmp_path}/s.db", tmp_path)
    store.submit("digits", params(32), [1] * 7, list(range(7)))
    store.submit("digits", params(48), [1] * 3, list(range(3)))
    sent: list[list] = []
    sched = Scheduler(store, WorkerConfig(max_batch=8, max_inflight=8), SchedulerConfig(), 30.0)
    w = _Worker("w", None, SimpleNamespace(submit=SimpleNamespace(remote=sent.append)), None, models=["digits"])
    sched.workers["w"] = w
    w.leases = {ls.key: ls for ls in store.lease("other", ["digits"], 7, ttl=30)}  # the 32 px items run here
    sched._fill(w, expect=True)
    assert sent == [] and w.queue_left
    w.leases.pop(next(iter(w.leases)))  # one finished: the room is 2
    sched._fill(w, expect=True)
    assert [spec.width for spec in sent[-1]] == [48, 48]


def test_a_worker_gets_a_models_items_once_it_reports_serving_it_and_one_that_failed_to_load_is_dropped(tmp_path,
                                                                                                     monkeypatch):
    """A worker serves its first model while it loads the others: its polls say which it serves (``models``),
    and the scheduler leases it only those; a later model that failed to load (``load_failed``) drops it as a
    worker that failed to start (its items back to the queue, restarted after a back-off)."""
    from types import SimpleNamespace

    from dit_serve.schemas import JobParams
    from dit_serve.server import scheduler as sched_mod
    from dit_serve.server.config import SchedulerConfig
    from dit_serve.server.scheduler import Scheduler, _Worker
    from dit_serve.server.store import Store

    monkeypatch.setattr(sched_mod, "ray", SimpleNamespace(kill=lambda *a, **k: None), raising=False)
    import ray

    monkeypatch.setattr(ray, "kill", lambda *a, **k: None)
    store = Store(f"sqlite:///{tmp_path}/s.db", tmp_path)
    params = JobParams(sampler="ddim", steps=5, guidance=1.0)
    store.submit("digits-text", params, [1], [0])
    store.submit("digits", params, [1], [0])
    sent: list[list] = []
    sched = Scheduler(store, WorkerConfig(max_batch=4, max_inflight=4), SchedulerConfig(), 30.0)
    w = _Worker("w", None, SimpleNamespace(submit=SimpleNamespace(remote=sent.append)), None, models=["digits"])
    sched.workers["w"] = w
    sched._fill(w, expect=True)
    assert [s.model for s in sent[-1]] == ["digits"]
    report = {"progress": {}, "finished": [], "failed": [], "models": ["digits", "digits-text"], "loading": []}
    sched._apply_report(w, report)
    assert w.models == ["digits", "digits-text"] and sched._fill_now
    sched._fill(w, expect=True)
    assert [s.model for s in sent[-1]] == ["digits-text"]
    sched._apply_report(w, {**report, "load_failed": "loading model x failed: OSError: gone"})
    assert "w" not in sched.workers and sched._backoff["w"][0] == 1
    assert len(store.lease("other", ["digits", "digits-text"], 4, ttl=30)) == 2  # both items back in the queue


def _recording_handle(calls: list, name: str):
    """A stand-in actor handle whose ``submit``, ``add_lora`` and ``remove_lora`` calls append (name, method, *args)."""
    from types import SimpleNamespace

    return SimpleNamespace(**{m: SimpleNamespace(remote=lambda *a, m=m: calls.append((name, m, *a)))
                              for m in ("submit", "add_lora", "remove_lora")})


def test_a_worker_gets_an_items_adapters_before_the_item_and_workers_holding_them_are_preferred(tmp_path):
    """Adapters reach a worker once (``add_lora`` ahead of ``submit``, in the actor's call order); a worker whose
    poll reports an adapter gets items naming it instead of one that lacks it; an item whose adapter was deleted
    after its job was submitted fails with the reason."""

    from dit_serve.schemas import JobParams, LoraUse
    from dit_serve.server.config import SchedulerConfig
    from dit_serve.server.scheduler import Scheduler, _Worker
    from dit_serve.server.store import Store

    store = Store(f"sqlite:///{tmp_path}/s.db", tmp_path)
    lora = store.put_lora("ink", b"adapter bytes", "default", True, "digits", "dit", "peft", 2, 1)
    calls: list[tuple] = []

    handle = partial(_recording_handle, calls)

    def job(loras):
        params = JobParams(sampler="ddim", steps=5, guidance=1.0, loras=[LoraUse(name=n, scale=0.5, sha256=lora.sha256)
                                                                         for n in loras])
        return store.submit("digits", params, [1], [0])

    sched = Scheduler(store, WorkerConfig(max_batch=4, max_inflight=4), SchedulerConfig(group_shapes=False), 30.0)
    a = _Worker("a", None, handle("a"), None, models=["digits"])
    b = _Worker("b", None, handle("b"), None, models=["digits"])
    sched.workers.update(a=a, b=b)
    job(["ink"]), job([]), job(["ink"])
    sched._fill(a, expect=True)
    assert [c[:3] for c in calls] == [("a", "add_lora", "ink"), ("a", "submit", calls[1][2])]
    assert calls[0][3:] == (b"adapter bytes", "digits") and [s.loras for s in calls[1][2]] == \
        [(("ink", 0.5),), (), (("ink", 0.5),)]
    calls.clear()
    job(["ink"])  # a holds it now (sent once): no second add_lora
    sched._fill(a, expect=True)
    assert [c[1] for c in calls] == ["submit"]
    calls.clear()
    b.leases, a.leases = {}, {}
    sched._apply_report(b, {"progress": {}, "finished": [], "failed": [], "loras": ["ink"]})
    c = _Worker("c", None, handle("c"), None, models=["digits"])
    sched.workers["c"] = c
    del sched.workers["a"]
    job(["ink"])
    sched._fill(c, expect=True)  # c lacks it, b reports it: the item goes to b, nothing is sent to c
    assert [c_[:2] for c_ in calls] == [("b", "submit")] and len(b.leases) == 1
    calls.clear()
    doomed = job(["ink"])
    store.delete_lora("ink")
    del sched.workers["b"]
    sched._fill(c, expect=True)
    assert calls == []
    failed = store.get_job(doomed[0] if isinstance(doomed, tuple) else doomed)
    assert failed.state == "failed" and "adapter 'ink' was deleted" in failed.items[0].error


def test_an_item_goes_to_a_worker_whose_bank_holds_its_adapter_before_one_that_only_registered_it(tmp_path):
    """Two workers both registered adapter "ink"; only b's poll says it is loaded in its device bank: an item naming
    it that a's lease took goes to b (no load, no adapter switch), and stays with a once a's bank holds it too or b
    has no room."""

    from dit_serve.schemas import JobParams, LoraUse
    from dit_serve.server.config import SchedulerConfig
    from dit_serve.server.scheduler import Scheduler, _Worker
    from dit_serve.server.store import Store

    store = Store(f"sqlite:///{tmp_path}/s.db", tmp_path)
    lora = store.put_lora("ink", b"adapter bytes", "default", True, "digits", "dit", "peft", 2, 1)
    calls: list[tuple] = []

    handle = partial(_recording_handle, calls)

    def job():
        return store.submit("digits", JobParams(sampler="ddim", steps=5, guidance=1.0,
                                                loras=[LoraUse(name="ink", scale=0.5, sha256=lora.sha256)]), [1], [0])

    def report(resident):
        return {"progress": {}, "finished": [], "failed": [], "loras": ["ink"],
                "stats": {"lora": {"resident": {"digits": resident}}}}

    sched = Scheduler(store, WorkerConfig(max_batch=4, max_inflight=1), SchedulerConfig(group_shapes=False), 30.0)
    a = _Worker("a", None, handle("a"), None, models=["digits"])
    b = _Worker("b", None, handle("b"), None, models=["digits"])
    sched.workers.update(a=a, b=b)
    sched._apply_report(a, report([]))
    sched._apply_report(b, report(["ink"]))
    assert b.resident == {"digits": {"ink"}} and a.has_ready("digits", [LoraUse(name="ink", scale=1, sha256="x")]) \
        is False
    job()
    sched._fill(a, expect=True)
    assert [c[:2] for c in calls] == [("b", "submit")] and len(b.leases) == 1 and not a.leases
    calls.clear()
    job()  # b has no room now (max_inflight 1): a has it registered, so a runs it, nothing sent
    sched._fill(a, expect=True)
    assert [c[:2] for c in calls] == [("a", "submit")]
    calls.clear()
    a.leases, b.leases = {}, {}
    sched._apply_report(a, report(["ink"]))
    job()
    sched._fill(a, expect=True)  # both banks hold it: a keeps its own item
    assert [c[:2] for c in calls] == [("a", "submit")]
