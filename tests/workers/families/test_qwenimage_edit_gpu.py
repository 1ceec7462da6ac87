"""Qwen-Image-Edit through graphs (GPU).

Tiny random Qwen-Image-Edit directories (``make_tiny_qwenimage_edit``: QwenImageEditPipeline's layout, and the Plus
pipeline's with Qwen-Image-Edit-2511's zero_cond_t transformer; small reference areas), float32 on CUDA. The step's
sequence is [latent tokens, reference tokens] and its text holds the references' vision tokens, so each reference
layout (every reference's size, in order: the Plus pipeline takes several) is its own step variant (``edit-RxC-vlN``,
``edit-R1xC1+R2xC2-vlN`` for two references, and ``-no-cfg`` for rows at guidance <= 1) with its own graphs:

- per reference layout and per bucket (1, 2, 4), a ``full`` GraphRunner over the family's edit step (true CFG)
  replays what an eager runner computes on the same inputs (text and reference tokens from the family's encode),
  within 1e-5 of the largest value; the Plus directory's zero_cond_t modulation index is inside the captured step,
  for one reference and for two of different sizes;
- the engine under ``backend="graphs"`` gives every request (three reference sizes, one of them the square one
  warm-up captured, and on the Plus directory requests of two references of different sizes, rows with and
  without CFG, at two generation sizes, max_batch 4) the final latents ``backend="eager"`` gives, within 1e-5,
  every group in whole-step graphs (no eager fallback), all of them in the device's one pool.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.workers.families import edit_cases
from workers.config import WorkerConfig

from .gpu_stats import fallbacks

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

PROMPTS = ("make it red", "a blue sky", "add a hat", "the big blue house", "a photo of a cat")
# reference images (width, height) -> their variant in each directory: 96 x 96 px of area at the image's ratio,
# sides rounded to 32 px, one token per 16 x 16 px; the encoder's vision tokens (the Plus pipeline's image 64 x 64
# px of area); TWO: a Plus request's two references, their grids joined in order and their vision tokens summed
TWO = ((70, 50), (40, 60))
REFERENCES = {"edit": {(70, 50): "edit-6x8-vl15", (40, 60): "edit-8x4-vl10", (100, 36): "edit-4x10-vl12"},
              "plus": {(70, 50): "edit-6x8-vl4", (40, 60): "edit-8x4-vl4", (100, 36): "edit-4x10-vl8",
                       TWO: "edit-6x8+8x4-vl8"}}
SQUARE = (50, 50)  # 96 x 96: the variant warm-up captures


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from workers.loading import load_model
    from workers.models.tiny_qwenimage_edit import make_tiny_qwenimage_edit

    root = tmp_path_factory.mktemp("qwen-edit")
    return {"edit": load_model(make_tiny_qwenimage_edit(root / "edit", seed=3), device="cuda", dtype=torch.float32),
            "plus": load_model(make_tiny_qwenimage_edit(root / "plus", seed=4, plus=True, zero_cond_t=True),
                               device="cuda", dtype=torch.float32)}


def _specs(n: int, reference: tuple, steps: int | None = None, first: int = 0, guided: bool = True):
    """n requests with a reference of size ``reference`` (width, height), or with several (``TWO``)."""
    from workers.request.spec import ItemSpec

    sizes = reference if isinstance(reference[0], tuple) else (reference,)
    return [ItemSpec(id=f"{reference}-{first + i}", seed=first + i, sampler="flow_euler",
                     steps=steps or 3 + (first + i) % 3, prompt=PROMPTS[(first + i) % 5],
                     guidance=1.5 + (first + i) % 3 if guided else (1.0, 0.0)[(first + i) % 2],
                     negative_prompt="blurry" if (first + i) % 2 else "",
                     image=edit_cases.image_bytes(*sizes[0], seed=first + i),
                     extra_images=tuple(edit_cases.image_bytes(*size, seed=10 * j + first + i)
                                        for j, size in enumerate(sizes[1:], 1))) for i in range(n)]


def _live(model, family, plan, b: int, shape, reference) -> dict[str, torch.Tensor]:
    """The edit step's inputs for b rows at step 1 of ``plan``: b prompts with their negative prompts (guidance 1.5
    to 3.5), b requests' references of one layout encoded by the family (text with the vision tokens, reference
    tokens)."""
    from samplers import gather_rows

    specs = _specs(b, reference, plan.num_steps)
    enc, dev = family.encode(model, specs), model.device
    t, coeffs = gather_rows([plan] * b, [1] * b)
    gen = torch.Generator(dev).manual_seed(b)
    x = torch.randn(b, *shape, device=dev, generator=gen)
    return dict(x=x, t=t.to(dev), coeffs=coeffs.to(dev), hist=torch.randn(x.shape, device=dev, generator=gen),
                guidance=torch.tensor([s.guidance for s in specs]).to(dev), noise=torch.zeros_like(x),
                **{k: torch.stack([c[k] for c in enc]).to(dev) for k in enc[0]})


@pytest.mark.parametrize("kind, reference", [("edit", r) for r in REFERENCES["edit"]] + [("plus", (70, 50)),
                                                                                         ("plus", TWO)])
def test_every_bucket_of_every_reference_layout_replays_what_eager_computes(models, kind, reference):
    from graphs import GraphRunner
    from samplers import make_plan
    from workers.engine import step_specs
    from workers.families import family_of

    model = models[kind]
    family, shape, variant, buckets = family_of(model), tuple(model.latent_shape), REFERENCES[kind][reference], (1, 2, 4)
    assert family.variant_of(model, _specs(1, reference)[0]) == variant
    plan = make_plan("flow_euler", 4, model.schedule, **family.plan_kwargs(model, shape))
    live = {b: _live(model, family, plan, b, shape, reference) for b in buckets}
    outs, stats = {}, {}
    for backend in ("eager", "full"):
        inputs, outputs = step_specs(model, shape, variant)
        assert {"reference", "neg_embeds"} <= set(inputs) and set(live[4]) == set(inputs)
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
            assert torch.isfinite(got).all() and err <= 1e-5, (kind, reference, b, key, err)


@pytest.mark.parametrize("kind", ["edit", "plus"])
def test_the_graph_engine_with_three_reference_sizes_with_and_without_cfg_equals_eager(models, kind):
    from workers.engine import Engine
    from workers.families import family_of

    model = models[kind]
    refs = list(REFERENCES[kind])[:2]
    specs = [*_specs(5, refs[0]), *_specs(4, refs[0], first=5, guided=False), *_specs(6, refs[1], first=9),
             *_specs(5, SQUARE, first=15), *_specs(3, SQUARE, first=20, guided=False)]
    if kind == "plus":  # two references of different sizes, with and without CFG: two more layouts' variants
        specs += [*_specs(4, TWO, first=23), *_specs(3, TWO, first=27, guided=False)]
    # every third at another generation size: a group per (generation size, reference layout, CFG or not)
    specs = [replace(s, width=96, height=64) if i % 3 == 0 else s for i, s in enumerate(specs)]
    graphs = Engine(model, WorkerConfig(backend="graphs", max_batch=4))
    graphs.warmup()
    got = graphs.generate(specs)
    want = Engine(model, WorkerConfig(backend="eager", max_batch=4)).generate(specs)
    for g, w in zip(got, want):
        assert g.request.id == w.request.id and g.latents.shape == w.latents.shape
        err = ((g.latents - w.latents).abs().max() / w.latents.abs().max()).item()
        assert err <= 1e-5, (g.request.id, err)
    family = family_of(model)
    used = {(s.width, family.variant_of(model, s)) for s in specs}
    groups = graphs.stats()["groups"]
    # the square variants' native groups among them; the Plus directory's two-reference variants at both sizes
    assert len(groups) == len(used) == (14 if kind == "plus" else 10), groups.keys()
    for name, group in groups.items():
        assert group["backend"] == "full" and fallbacks(group) == 0, name
        assert sum(s["replays"] for s in group["buckets"].values()) > 0, name
    assert len(graphs._pools) == 1
    assert len({id(g.runner._shared_pool) for g in graphs.groups.values()}) == 1
