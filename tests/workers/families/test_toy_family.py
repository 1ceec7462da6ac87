"""A family registered at run time, defined in this file and nowhere else: its built-in card is read by
the API's catalog (without anything of it but the registry line), its model loads, its step runs in the
graph runner and its requests through the engine. What a new family needs is one ``Family`` subclass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dit_serve.schemas import JobRequest
from dit_serve.server.catalog import Catalog, RequestError, model_entry
from dit_serve.server.config import LimitsConfig
from workers.config import WorkerConfig
from graphs import GraphRunner, TensorSpec
from samplers import NoiseSchedule, cfg_combine, model_input, sampler_step
from workers.request.cards import builtin_names, read_card
from workers.engine import Engine, step_specs
from workers.families import FAMILIES, family_named, preview_map_of, register
from workers.families.base import DIT_SCHEDULER, Builtin, Family, ModelCard
from workers.families.memory import weight_params
from workers.loading import LoadedModel, load_model
from workers.families.previews import IDENTITY
from workers.request.spec import ItemSpec

CLASSES, SIDE = 3, 4  # three classes of 1 x 4 x 4 pixel images


class ToyNet(torch.nn.Module):
    """eps(x, t, label) = x / 2 + a learned image per class (the null class the last row)."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(out_channels=1)
        self.images = torch.nn.Embedding(CLASSES + 1, SIDE * SIDE)

    def forward(self, x, t, labels):
        return x / 2 + self.images(labels).view(-1, 1, SIDE, SIDE)            # (B, 1, 4, 4)


class Toy(Family):
    """Class-conditional, pixel space, one built-in: the smallest family the engine serves."""

    name = "toy"
    builtins = {"toy-4": Builtin(SIDE, (CLASSES + 1) * SIDE * SIDE)}

    def builtin_card(self, name: str) -> ModelCard:
        return ModelCard(name, "toy", "class", builtin=name, num_classes=CLASSES, image_size=SIDE, latent_channels=1,
                         latent_size=SIDE, pixel_space=True, dtype="float32", scheduler=dict(DIT_SCHEDULER),
                         defaults={"sampler": "ddim", "steps": 4, "guidance": 2.0})

    def load(self, card, device, dtype) -> LoadedModel:
        torch.manual_seed(0)
        net = ToyNet().to(device, dtype).eval().requires_grad_(False)
        return LoadedModel(card.name, net, None, NoiseSchedule.from_config(card.scheduler), card.num_classes,
                           (1, SIDE, SIDE), SIDE, learned_sigma=False, defaults=card.defaults, card=card)

    def cond_specs(self, model) -> dict[str, TensorSpec]:
        return {"labels": TensorSpec((), torch.long)}

    def encode(self, model, specs) -> list[dict[str, torch.Tensor]]:
        return [{"labels": torch.tensor(s.label)} for s in specs]

    def make_step(self, model, shape=None):
        def step(x, t, guidance, coeffs, hist, noise, labels):  # as DiT's
            xin = model_input(x, coeffs)                                         # (B, 1, 4, 4)
            both = torch.cat([labels, torch.full_like(labels, model.null_class)])
            cond, uncond = model.transformer(torch.cat([xin, xin]), torch.cat([t, t]), both).chunk(2)
            x_next, denoised = sampler_step(x, cfg_combine(cond, uncond, guidance), hist, noise, coeffs)
            return {"x_next": x_next, "hist_next": denoised}

        return step


@pytest.fixture
def toy():
    """The toy registered for one test; the registry as it was afterwards."""
    saved = dict(FAMILIES)
    register(Toy())
    try:
        yield
    finally:
        FAMILIES.clear()
        FAMILIES.update(saved)


def test_the_catalog_reads_and_validates_the_toy(toy):
    assert "toy-4" in builtin_names() and read_card("toy-4").family == "toy"
    catalog = Catalog.of(["toy-4"], LimitsConfig())
    entry = model_entry(catalog.model("toy-4"))
    assert (entry.family, entry.conditioning, entry.num_classes, entry.sizes) == ("toy", "class", 3, ["4x4"])
    job = catalog.resolve_job(JobRequest(model="toy-4", labels=[0, 2], preview_every=1))
    assert job.labels == [0, 2] and job.params.steps == 4 and job.params.sampler == "ddim"
    with pytest.raises(RequestError, match=r"label 3 is outside model 'toy-4''s classes 0\.\.2"):
        catalog.resolve_job(JobRequest(model="toy-4", labels=[3]))
    with pytest.raises(RequestError, match="class-conditional"):
        catalog.resolve_job(JobRequest(model="toy-4", prompts=["a cat"]))
    assert preview_map_of(read_card("toy-4")) is IDENTITY and weight_params(read_card("toy-4")) == 64


def test_the_toy_step_runs_in_the_graph_runner(toy):
    model = load_model("toy-4")
    assert family_named("toy").compile_regions(model) == []  # defaults: no repeated blocks, the whole step
    inputs, outputs = step_specs(model)
    runner = GraphRunner(family_named("toy").make_step(model), inputs, outputs, max_batch=4, backend="eager",
                         device="cpu")
    g = torch.Generator().manual_seed(0)
    rows = {k: torch.randn((3, *s.shape_per_sample), generator=g) if s.dtype == torch.float32
            else torch.tensor([0, 1, 2]) for k, s in inputs.items()}
    got = runner.run(**rows)  # 3 rows: buckets 2 + 1
    want = family_named("toy").make_step(model)(**rows)
    for k in outputs:
        torch.testing.assert_close(got[k], want[k])
    assert tuple(runner.plan(3)) == (2, 1)


def test_the_engine_serves_the_toy(toy):
    model = load_model("toy-4")
    specs = [ItemSpec(id=str(i), model="toy-4", label=i % CLASSES, seed=i, sampler="ddim", steps=4, guidance=2.0)
             for i in range(5)]
    engine = Engine(model, WorkerConfig(backend="eager", max_batch=4))
    batched = engine.generate(specs)
    alone = Engine(model, WorkerConfig(backend="eager", max_batch=4)).generate(specs[3:4])
    assert [r.image.shape for r in batched] == [(SIDE, SIDE)] * 5
    assert torch.equal(batched[3].latents, alone[0].latents)  # its own seed: the same image in any batch
    assert engine.stats()["real_rows"] == 5 * 4 and engine.attention == {}


def test_a_family_can_keep_its_step_uncompiled_on_a_device_type(toy, monkeypatch):
    from workers.speed import SpeedConfig

    monkeypatch.setattr(Toy, "uncompiled_on", {"cpu": "not yet shown equal to eager on this device"})
    model = load_model("toy-4")
    specs = [ItemSpec(id=str(i), model="toy-4", label=i % CLASSES, seed=i, sampler="ddim", steps=4, guidance=2.0)
             for i in range(3)]
    fast = Engine(model, WorkerConfig(backend="eager", max_batch=4), speed=SpeedConfig(compile="inductor"))
    got = fast.generate(specs)
    want = Engine(model, WorkerConfig(backend="eager", max_batch=4)).generate(specs)
    assert all(torch.equal(g.latents, w.latents) for g, w in zip(got, want))  # the plain step, bit for bit
    (group,) = fast.stats()["groups"].values()
    assert group["compile"]["compiled"] is False and group["compile"]["region_graphs"] == 0
    assert group["compile"]["fallback_reason"] == "not yet shown equal to eager on this device"


def test_a_family_can_compile_its_step_per_batch_size_on_a_device_type(toy, monkeypatch):
    from workers.speed import SpeedConfig

    monkeypatch.setattr(Toy, "static_batch_on", {"cpu": "its dynamic-batch code is wrong on this device"})
    model = load_model("toy-4")
    specs = [ItemSpec(id=str(i), model="toy-4", label=i % CLASSES, seed=i, sampler="ddim", steps=3, guidance=2.0)
             for i in range(7)]
    fast = Engine(model, WorkerConfig(backend="eager", max_batch=4), speed=SpeedConfig(compile="inductor"))
    # four rows, two, then one: a graph for each (a dynamic compile makes one for four and two)
    got = fast.generate(specs[:4]) + fast.generate(specs[4:6]) + fast.generate(specs[6:])
    want = Engine(model, WorkerConfig(backend="eager", max_batch=4)).generate(specs)
    assert all(torch.allclose(g.latents, w.latents, atol=1e-5) for g, w in zip(got, want))
    (group,) = fast.stats()["groups"].values()
    c = group["compile"]
    assert c["compiled"] and c["dynamic"] is False and (c["graphs"], c["one_row_graphs"]) == (2, 1), c
