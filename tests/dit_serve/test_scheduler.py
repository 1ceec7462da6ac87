"""Where workers go (pure: no Ray); the scheduler itself runs in test_service and test_cluster."""

from __future__ import annotations

from dit_serve.server.config import WorkerConfig
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


def test_custom_resource_per_unit():
    nodes = [_node("n1", dit_worker=1.0), _node("n2"), _node("n3", dit_worker=2.0)]
    slots = plan_slots(nodes, WorkerConfig(resource="dit_worker"))
    assert sorted(slots) == ["n1-0", "n3-0", "n3-1"] and slots["n3-1"] == SlotPlan("n3", "dit_worker")
