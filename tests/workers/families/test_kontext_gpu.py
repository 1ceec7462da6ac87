"""FLUX.1 Kontext through graphs (GPU).

A tiny random FLUX.1 Kontext directory (``make_tiny_flux(kontext=True)``: references kept at their own size),
float32 on CUDA. The step's sequence is [latent tokens, reference tokens], so each reference size is its own step
variant (``kontext-RxC``) with its own graphs:

- per reference size and per bucket (1, 2, 4), a ``full`` GraphRunner over the family's Kontext step replays what
  an eager runner computes on the same inputs (reference tokens from the family's encode), within 1e-5 of the
  largest value;
- the engine under ``backend="graphs"`` gives every request (two reference sizes and text-only rows, at two
  generation sizes: six groups, max_batch 4, several buckets each) the final latents ``backend="eager"`` gives,
  within 1e-5, every group in whole-step graphs (no eager fallback), all of them in the device's one pool.
"""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from workers.config import WorkerConfig

pytestmark = pytest.mark.gpu

PROMPTS = ("make it red", "a blue sky", "add a hat", "the big blue house", "a photo of a cat")
# reference images (width, height) -> their variant: sides down to 16 px, one token per 16 x 16 px
REFERENCES = {(70, 50): "kontext-3x4", (40, 60): "kontext-3x2", (100, 36): "kontext-2x6"}


def _png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB").save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from workers.loading import load_model
    from workers.models.tiny_flux import make_tiny_flux

    path = make_tiny_flux(tmp_path_factory.mktemp("kontext"), seed=2, kontext=True)
    return load_model(path, device="cuda", dtype=torch.float32)


def _specs(n: int, reference: tuple[int, int] | None, steps: int | None = None, first: int = 0):
    from workers.request.spec import ItemSpec

    return [ItemSpec(id=f"{reference}-{first + i}", seed=first + i, sampler="flow_euler",
                     steps=steps or 3 + (first + i) % 3, guidance=1.0 + (first + i) % 4, prompt=PROMPTS[(first + i) % 5],
                     image=_png(*reference, seed=first + i) if reference else b"") for i in range(n)]


def _live(model, family, plan, b: int, shape, reference) -> dict[str, torch.Tensor]:
    """The Kontext step's inputs for b rows at step 1 of ``plan``: b prompts, guidance 1 to 4, b reference images
    of one size encoded by the family (its ``reference`` tokens), the modulation rows where the step takes them."""
    from samplers import gather_rows
    from workers.engine import table_inputs

    specs = _specs(b, reference, plan.num_steps)
    enc, dev = family.encode(model, specs), model.device
    t, coeffs = gather_rows([plan] * b, [1] * b)
    gen = torch.Generator(dev).manual_seed(b)
    x = torch.randn(b, *shape, device=dev, generator=gen)
    live = dict(x=x, t=t.to(dev), coeffs=coeffs.to(dev), hist=torch.randn(x.shape, device=dev, generator=gen),
                guidance=torch.tensor([s.guidance for s in specs]).to(dev), noise=torch.zeros_like(x),
                **{k: torch.stack([c[k] for c in enc]).to(dev) for k in enc[0]})
    assert live["reference"].shape[1] == int(np.prod([int(v) for v in REFERENCES[reference][8:].split("x")]))
    return table_inputs(model, live)


@pytest.mark.parametrize("reference", list(REFERENCES))
def test_every_bucket_of_every_reference_size_replays_what_eager_computes(model, reference):
    from graphs import GraphRunner
    from samplers import make_plan
    from workers.engine import step_specs
    from workers.families import family_of

    family, shape, variant, buckets = family_of(model), tuple(model.latent_shape), REFERENCES[reference], (1, 2, 4)
    assert family.variant_of(model, _specs(1, reference)[0]) == variant
    plan = make_plan("flow_euler", 4, model.schedule, **family.plan_kwargs(model, shape))
    live = {b: _live(model, family, plan, b, shape, reference) for b in buckets}
    outs, stats = {}, {}
    for backend in ("eager", "full"):
        inputs, outputs = step_specs(model, shape, variant)
        assert "reference" in inputs and set(live[4]) == set(inputs)
        runner = GraphRunner(family.make_step(model, shape, variant=variant), inputs, outputs,
                             max_batch=max(buckets), backend=backend, device=model.device)
        runner.warmup(example=live[max(buckets)])
        runner.replay_ms = {}  # greedy plans: b rows in bucket b, the shape eager runs
        for b in buckets:
            assert runner.plan(b) == (b,)
            out = runner.run(**live[b])
            outs.update({(backend, b, k): v.float().cpu() for k, v in out.items()})
        stats = runner.stats()
        del runner
    assert stats["backend"] == "full" and stats["totals"]["eager_fallbacks"] == 0
    assert stats["totals"]["replays"] == len(buckets)
    for b in buckets:
        for key in ("x_next", "hist_next"):
            want, got = outs["eager", b, key], outs["full", b, key]
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert torch.isfinite(got).all() and err <= 1e-5, (reference, b, key, err)


def test_the_graph_engine_with_two_reference_sizes_and_text_rows_equals_eager(model):
    from workers.engine import Engine

    refs = list(REFERENCES)[:2]
    specs = [*_specs(7, refs[0]), *_specs(7, refs[1], first=7), *_specs(7, None, first=14)]
    # every third at another generation size: a group per (generation size, reference size)
    specs = [replace(s, width=96, height=64) if i % 3 == 0 else s for i, s in enumerate(specs)]
    graphs = Engine(model, WorkerConfig(backend="graphs", max_batch=4))
    graphs.warmup()
    got = graphs.generate(specs)
    want = Engine(model, WorkerConfig(backend="eager", max_batch=4)).generate(specs)
    for g, w in zip(got, want):
        assert g.request.id == w.request.id and g.latents.shape == w.latents.shape
        err = ((g.latents - w.latents).abs().max() / w.latents.abs().max()).item()
        assert err <= 1e-5, (g.request.id, err)
    groups = graphs.stats()["groups"]
    variants = {k.split(":")[4] if k.count(":") == 4 else "" for k in groups}
    assert variants == {"", REFERENCES[refs[0]], REFERENCES[refs[1]]}, groups.keys()
    assert len({tuple(k.split(":")[1:2] + k.split(":")[4:]) for k in groups}) == 6  # 2 sizes x 3 variants
    for name, group in groups.items():
        assert group["backend"] == "full", name
        assert sum(s["eager_fallbacks"] + s["capture_failures"] for s in group["buckets"].values()) == 0, name
        assert sum(s["replays"] for s in group["buckets"].values()) > 0, name
    assert len(graphs._pools) == 1
    assert len({id(g.runner._shared_pool) for g in graphs.groups.values()}) == 1
