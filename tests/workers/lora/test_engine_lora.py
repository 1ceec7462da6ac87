"""Per-request LoRA through the engine (``Engine.generate``), on tiny FLUX.1 and SD3 models on the CPU, float32.

A row with adapters equals the engine without LoRA on the same model with those adapters merged into its weights
(``W + sum_j c_j alpha_j / r_j B_j A_j``: what diffusers' ``fuse_lora`` makes of loaded adapters); a batch mixing
rows with A, B, A + B and none gives each row what it gives alone; a row without adapters is bit-identical to an
engine without LoRA. Under ``backend="graphs"`` (on a CPU the runner's eager path, with the graph backends' speed
rewrites applied as the ``default`` and, in FP8, the ``fastest`` presets apply them, compile aside) adapters reach
the linears those rewrites compute themselves: the norms' hoisted modulation linears (read from each request's
modulation table), FLUX.1's fused FP8 q, k and v, and the step's embedding (``time_text_embed``), computed once per
request for its table with the request's adapters.
"""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import save

from workers.config import WorkerConfig
from workers.engine import Engine
from workers.loading import load_model
from workers.lora.validate import linear_shapes
from workers.request.spec import ItemSpec

TOL = dict(rtol=1e-4, atol=1e-4)
LORA = dict(backend="eager", max_batch=4, lora_slots=2, lora_max_rank=4, lora_per_request=2)


def _make(family: str, path):
    if family == "flux":
        from workers.models.tiny_flux import make_tiny_flux

        return make_tiny_flux(path)
    from workers.models.tiny_sd3 import make_tiny_sd3

    return make_tiny_sd3(path, t5=False)


@pytest.fixture(scope="module", params=["flux", "sd3"])
def model_dir(request, tmp_path_factory):
    return _make(request.param, tmp_path_factory.mktemp(request.param))


def adapter_file(transformer, seed: int, every: int = 3, skip=("norm",), rank: int = 3, only: str = "",
                 names=None) -> bytes:
    """A PEFT adapter (safetensors bytes) on every ``every``-th linear of ``transformer`` under ``only`` and not
    under ``skip`` (or on ``names``), rank ``rank``, alpha 2 r; its {module: (a, b, alpha / r)} too."""
    g = torch.Generator().manual_seed(seed)
    state, weights = {}, {}
    if names is None:
        names = [n for n in linear_shapes(transformer) if n.startswith(only) and not any(s in n for s in skip)][::every]
    for name in names:
        fin, fout = linear_shapes(transformer)[name]
        a, b = torch.randn(rank, fin, generator=g) * 0.5 / fin ** 0.5, torch.randn(fout, rank, generator=g) * 0.5
        state |= {f"transformer.{name}.lora_A.weight": a, f"transformer.{name}.lora_B.weight": b,
                  f"transformer.{name}.alpha": torch.tensor(2.0 * rank)}
        weights[name] = (a, b, 2.0)
    return save(state), weights


def merge(model, loras) -> None:
    """Merge ``loras`` ((weights, scale) pairs) into ``model``'s transformer, in place."""
    with torch.no_grad():
        for weights, scale in loras:
            for name, (a, b, s) in weights.items():
                model.transformer.get_submodule(name).weight += scale * s * (b.double() @ a.double()).float()


def req(i: int, loras=(), **kw) -> ItemSpec:
    return ItemSpec(**{"id": f"r{i}", "seed": 100 + i, "sampler": "flow_euler", "steps": 3, "guidance": 3.5,
                       "prompt": "a red fox", "loras": tuple(loras), **kw})


@pytest.fixture(scope="module")
def served(model_dir):
    """An engine with adapters A and B registered, and their weights."""
    engine = Engine(load_model(model_dir), WorkerConfig(**LORA))
    engine.warmup()
    files = {}
    for name, seed in (("a", 1), ("b", 2)):
        data, weights = adapter_file(engine.models[next(iter(engine.models))].transformer, seed)
        engine.add_lora(name, data)
        files[name] = (data, weights)
    return engine, files


def test_mixed_rows_get_what_they_get_alone_and_equal_merged_weights(model_dir, served):
    engine, files = served
    rows = [[("a", 0.8)], [("b", -0.6)], [("a", 0.5), ("b", 1.2)], []]
    batch = engine.generate([req(i, r) for i, r in enumerate(rows)])
    for i, r in enumerate(rows):
        alone = engine.generate([req(i, r)])[0]
        torch.testing.assert_close(batch[i].latents, alone.latents, **TOL)
    plain = Engine(load_model(model_dir), WorkerConfig(backend="eager", max_batch=4))
    plain.warmup()  # both warmed, as a worker's are: a fresh SD3 model's first forward moves later ones by ~1e-6
    none_alone = engine.generate([req(3)])[0].latents
    assert torch.equal(none_alone, plain.generate([req(3)])[0].latents)  # no adapter: bit for bit
    merged = load_model(model_dir)
    merge(merged, [(files["a"][1], 0.5), (files["b"][1], 1.2)])
    want = Engine(merged, WorkerConfig(backend="eager", max_batch=4)).generate([req(2)])[0].latents
    torch.testing.assert_close(batch[2].latents, want, **TOL)
    assert (batch[2].latents - batch[3].latents).abs().max() > 1e-3  # the adapters change the image
    stats = engine.stats()["lora"]
    assert stats["loads"] == 2 and stats["evictions"] == 0 and stats["rows"]["a"] >= 2
    assert sorted(stats["resident"][next(iter(engine.models))]) == ["a", "b"]


def test_an_unknown_adapter_fails_its_item_naming_it(served):
    engine, _ = served
    with pytest.raises(ValueError, match="'nope'"):
        engine.add(req(9, [("nope", 1.0)]))
    with pytest.raises(ValueError, match="at most 2"):
        engine.add(req(9, [("a", 1.0), ("b", 1.0), ("a", 0.5)]))
    assert engine.num_active == 0


def test_an_item_naming_an_adapter_the_worker_refused_says_why(served):
    engine, _ = served
    with pytest.raises(ValueError, match="rank") as refused:
        engine.add_lora("wide", adapter_file(engine.models[next(iter(engine.models))].transformer, 5, rank=8)[0])
    with pytest.raises(ValueError, match=r"'wide' is not registered here: it was refused \(.*rank"):
        engine.add(req(9, [("wide", 1.0)]))
    assert str(refused.value) in str(engine.lora.refused["wide"]) and engine.num_active == 0


def test_lora_targets_keep_the_bank_to_the_linears_they_name(model_dir):
    """``lora_targets``: the bank holds the matching linears alone (the rest stay plain, their fast paths kept); an
    adapter on them serves as with a bank over every linear; one on a linear left out is refused, saying why."""
    from workers.lora import LoraLinear

    engine = Engine(load_model(model_dir), WorkerConfig(**LORA, lora_targets=(r"attn\.to_(q|k|v)$", "to_out")))
    model = engine.models[next(iter(engine.models))]
    bank = engine.lora.banks[model.name]
    assert bank.targets and all(re.search(r"attn\.to_(q|k|v)$|to_out", t) for t in bank.targets)
    wrapped = {n for n, m in model.transformer.named_modules() if isinstance(m, LoraLinear)}
    assert wrapped == set(bank.targets) and any("ff" in t for t in bank.outside)
    data, _ = adapter_file(model.transformer, 4, names=bank.targets)
    engine.add_lora("attn", data)
    full = Engine(load_model(model_dir), WorkerConfig(**LORA))
    full.add_lora("attn", data)
    got, want = (e.generate([req(0, [("attn", 0.7)]), req(1)]) for e in (engine, full))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.latents, w.latents, **TOL)
    assert (got[0].latents - got[1].latents).abs().max() > 1e-3
    ff = next(t for t in bank.outside if "ff" in t)
    with pytest.raises(ValueError, match=re.escape(f"{ff!r}") + ".*lora_targets leaves it out"):
        engine.add_lora("ff", adapter_file(model.transformer, 5, names=[ff])[0])
    with pytest.raises(ValueError, match="match none"):
        Engine(load_model(model_dir), WorkerConfig(**LORA, lora_targets=("nothing-like-this",)))
    with pytest.raises(ValueError, match="not a regular expression"):
        WorkerConfig(**LORA, lora_targets=("(",))


def test_more_adapters_than_slots_wait_in_the_queue_and_all_finish(model_dir):
    engine = Engine(load_model(model_dir), WorkerConfig(**{**LORA, "lora_slots": 1}))
    transformer = engine.models[next(iter(engine.models))].transformer
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        engine.add_lora(name, adapter_file(transformer, seed)[0])
    reqs = [req(0, [("a", 1.0)]), req(1, [("b", 1.0)]), req(2, [("c", 1.0)]), req(3, [("a", 0.5)])]
    for r in reqs:
        engine.add(r)
    assert engine.num_active == 4 and engine.progress()["r1"] == (0, 3)  # waiting requests count
    done = {}
    while engine.num_active:
        done |= {r.request.id: r for r in engine.step()}
    assert sorted(done) == ["r0", "r1", "r2", "r3"]
    alone = Engine(load_model(model_dir), WorkerConfig(**LORA))
    alone.add_lora("b", adapter_file(transformer, 2)[0])
    torch.testing.assert_close(done["r1"].latents, alone.generate([req(1, [("b", 1.0)])])[0].latents, **TOL)
    stats = engine.stats()["lora"]
    assert stats["loads"] >= 3 and stats["evictions"] >= 2 and stats["waiting"] == 0


def test_loading_between_steps_changes_no_running_row_and_makes_no_group(model_dir):
    engine = Engine(load_model(model_dir), WorkerConfig(**LORA))
    transformer = engine.models[next(iter(engine.models))].transformer
    engine.add_lora("a", adapter_file(transformer, 1)[0])
    engine.add_lora("b", adapter_file(transformer, 2)[0])
    want = engine.generate([req(0, [("a", 0.7)]), req(1)])
    groups = len(engine.groups)
    engine.add_many([req(0, [("a", 0.7)]), req(1)])
    engine.step()
    engine.add(req(2, [("b", 1.0)]))  # waits: b is not resident; loaded at the next step, beside running rows
    assert engine.loras()["b"]["resident"] is False
    done = {}
    while engine.num_active:
        done |= {r.request.id: r for r in engine.step()}
    assert engine.loras()["b"]["resident"] is True
    for i in (0, 1):
        torch.testing.assert_close(done[f"r{i}"].latents, want[i].latents, **TOL)
    assert len(engine.groups) == groups


def test_removing_an_adapter_waits_for_its_requests(served):
    engine, files = served
    engine.add_lora("c", files["a"][0])
    engine.add(req(5, [("c", 1.0)]))
    engine.remove_lora("c")
    assert "c" not in engine.loras()
    with pytest.raises(ValueError, match="'c'"):
        engine.add(req(6, [("c", 1.0)]))
    while engine.num_active:
        engine.step()
    assert "c" not in engine.lora.adapters


def test_without_slots_nothing_changes(model_dir):
    engine = Engine(load_model(model_dir), WorkerConfig(backend="eager", max_batch=4))
    assert engine.lora is None and "lora" not in engine.stats() and engine.loras() == {}
    group = next(iter(engine.groups.values()))
    assert "lora_slots" not in group.runner.stats().get("inputs", {}) and engine.lora is None
    with pytest.raises(ValueError, match="no adapters"):
        engine.add(req(0, [("a", 1.0)]))


@pytest.mark.parametrize("precision", ["", "fp8"])
def test_graph_backends_serve_adapters_on_the_hoisted_and_fused_linears(model_dir, precision):
    """An adapter on every linear of the transformer, the norms' modulation linears, q, k, v and the step's
    embedding (computed at admission for the request's modulation table) among them, is accepted, and a row with
    it gets what the eager engine (no graph rewrites, the embedding in the step) gives it with the same adapter: to
    float32's rounding; in FP8, the adapter's effect within 5% (the fused parts' terms read the rows the norm's FP8
    codes stand for: ``tests/workers/lora/test_reach.py``). A second row with another adapter, and one without,
    beside it in the same admission get theirs."""
    from workers.families.flux import fast
    from workers.speed import SpeedConfig, modulation

    speed = SpeedConfig(precision=precision)
    engine = Engine(load_model(model_dir), WorkerConfig(**{**LORA, "backend": "graphs"}), speed=speed)
    model = engine.models[next(iter(engine.models))]
    tr, bank = model.transformer, engine.lora.banks[model.name]
    assert set(bank.targets) == set(linear_shapes(tr))
    assert modulation.hoisted(tr) > 0 and any(t.endswith("norm1.linear") for t in bank.targets)
    if precision and model.card.family == "flux":
        assert fast.fused_blocks(tr) > 0
    data, weights = adapter_file(tr, 4, every=1, skip=())
    assert any(n.endswith("norm1.linear") for n in weights) and any(n.endswith("attn.to_q") for n in weights)
    embed, on = adapter_file(tr, 5, every=1, skip=(), only="time_text_embed.")
    assert len(on) >= 4  # the timestep's and the pooled prompt's linears (and FLUX.1-dev's guidance's)
    engine.add_lora("a", data)
    engine.add_lora("e", embed)
    eager = Engine(load_model(model_dir), WorkerConfig(**LORA), speed=speed)
    eager.add_lora("a", data)
    eager.add_lora("e", embed)
    specs = [req(0, [("a", 0.9)]), req(1), req(2, [("e", 1.5)])]
    got, want = (e.generate(specs) for e in (engine, eager))
    if not precision:
        plain = eager.generate([req(2)])[0].latents
        assert (want[2].latents - plain).abs().max() > 1e-3  # the embedding's adapter changes the image
        for g, w in zip(got, want):
            torch.testing.assert_close(g.latents, w.latents, **TOL)
        return
    base = eager.generate([req(0)])[0].latents
    effect = (want[0].latents - base).norm()
    assert effect > 1e-2 * base.norm()
    assert (got[0].latents - want[0].latents).norm() <= 0.05 * effect


@pytest.mark.slow
def test_the_fast_preset_compiles_the_steps_with_adapters_on_the_hoisted_linears(model_dir):
    """The ``fast`` preset (each step, or its blocks where the family compiles those, compiled by Inductor inside
    the graphs; on a CPU the runner's eager path): an adapter on the norms' modulation linears and q, k, v is
    accepted (and on the step's embedding, computed with the request's table), the compiled step runs without
    falling back (the rows' slots are dynamic like the blocks' batch), and rows with and without it equal the eager
    engine's."""
    engine = Engine(load_model(model_dir), WorkerConfig(**{**LORA, "backend": "graphs", "speed": "fast"}))
    engine.warmup()
    tr = engine.models[next(iter(engine.models))].transformer
    data, weights = adapter_file(tr, 4, every=1, skip=())
    assert any(n.endswith("norm1.linear") for n in weights) and any(n.startswith("time_text_embed") for n in weights)
    engine.add_lora("a", data)
    eager = Engine(load_model(model_dir), WorkerConfig(**LORA))
    eager.add_lora("a", data)
    specs = [req(0, [("a", 0.9)]), req(1), req(2, [("a", -0.5)])]
    for g, w in zip(engine.generate(specs), eager.generate(specs)):
        torch.testing.assert_close(g.latents, w.latents, **TOL)
    for stats in engine.stats()["groups"].values():
        assert stats["compile"]["compiled"] and stats["compile"]["fallback_reason"] is None, stats["compile"]
