"""SD3 and FLUX through graphs (GPU).

Tiny random SD3.5 and FLUX.1-dev in the real layouts (workers.models.tiny_sd3 / tiny_flux), float32: the
engine's ``full`` and ``breakable`` graphs give every request the final latents eager gives, within 1e-5
of the largest value (the replay runs the kernels eager runs at the same shapes), with mixed prompts,
negative prompts, guidance scales and step counts in one replay (13 requests: buckets 8 + 4 + 1), and
with several image sizes in one engine capturing into one shared pool on one stream; no step falls back
to eager.

Full size at 1024, random weights, bf16 (``sd35-medium-1024``: buckets 1, 2, 4; ``flux-dev-1024``:
buckets 1, 2), one model resident at a time (loaded in the test, freed before the next): a breakable
GraphRunner over the family's step replays what the same runner computes eagerly, with prompts of
different lengths in one replay. Tolerances, relative to the largest eager value: 1e-3 on ``x_next``
(the sampler's float32 update of the bf16 velocity); 1e-2 on ``hist_next``, the denoised estimate
x - sigma v, where one bf16 rounding step of the velocity's largest values (2^-8 relative) would
show at sigma ~ 0.9. At one shape a replay and eager run the same kernels, so both are bit-identical in
practice (as DiT-XL/2's buckets are, docs/gpu-tests.md).
"""

from __future__ import annotations

import gc

import pytest
import torch

from workers.config import WorkerConfig

from .gpu_stats import fallbacks

pytestmark = pytest.mark.gpu

PROMPTS = ("a red cat", "the big blue house", "a dog", "small green tree drawn", "a photo of a cat")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{"sd3": model, "flux": model}: tiny random directories made offline, float32 on CUDA."""
    from workers.loading import load_model
    from workers.models.tiny_flux import make_tiny_flux
    from workers.models.tiny_sd3 import make_tiny_sd3

    sd3 = make_tiny_sd3(tmp_path_factory.mktemp("sd3") / "tiny-sd3")
    flux = make_tiny_flux(tmp_path_factory.mktemp("flux") / "tiny-flux-dev")
    return {k: load_model(p, device="cuda", dtype=torch.float32) for k, p in (("sd3", sd3), ("flux", flux))}


def _specs(n: int, sizes=((0, 0),)):
    from workers.request.spec import ItemSpec

    return [ItemSpec(id=str(i), seed=i, sampler="flow_euler", steps=6 + i % 5, guidance=1.0 + i % 4,
                     prompt=PROMPTS[i % 5], negative_prompt="small" if i % 2 else "",  # SD3's CFG; FLUX ignores
                     width=sizes[i % len(sizes)][0], height=sizes[i % len(sizes)][1]) for i in range(n)]


def _assert_equal_latents(got, want, tol=1e-5):
    for g, w in zip(got, want):
        assert g.latents.shape == w.latents.shape
        err = ((g.latents - w.latents).abs().max() / w.latents.abs().max()).item()
        assert err <= tol, (g.request.id, err)



@pytest.mark.parametrize("backend", ["full", "breakable"])
@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_tiny_buckets_replay_what_eager_computes(tiny, family, backend):
    from workers.engine import Engine

    model, specs = tiny[family], _specs(13)  # 13 = 8 + 4 + 1 replays while all are active
    graphs = Engine(model, WorkerConfig(backend=backend, max_batch=8))
    graphs.warmup()
    got = graphs.generate(specs)
    want = Engine(model, WorkerConfig(backend="eager", max_batch=8)).generate(specs)
    _assert_equal_latents(got, want)
    stats = next(iter(graphs.stats()["groups"].values()))
    assert stats["backend"] == backend and fallbacks(stats) == 0
    replayed = {b for b, s in stats["buckets"].items() if s["replays"]}
    # 13 = 8 + 4 + 1 while all are active, or padded where the tiny model's timings say a larger bucket costs the
    # same (8 + 4 + 4 was seen): the largest bucket and a smaller one replayed
    assert 8 in replayed and replayed - {8}, replayed


@pytest.mark.parametrize("family,sizes", [("sd3", [(16, 16), (32, 16), (16, 32)]),
                                          ("flux", [(64, 64), (96, 64), (64, 96)])])
def test_tiny_sizes_share_one_pool_and_replay_what_eager_computes(tiny, family, sizes):
    """Three latent shapes in one engine: all graphs capture into the device's one pool on one stream, and
    every shape's replays equal eager."""
    from workers.engine import Engine

    model, specs = tiny[family], _specs(15, sizes)
    graphs = Engine(model, WorkerConfig(backend="breakable", max_batch=8))
    graphs.warmup(sizes=sizes)
    runners = [g.runner for g in graphs.groups.values()]
    assert len(runners) == 3 and len(graphs._pools) == 1
    assert len({id(r._shared_pool) for r in runners}) == 1 and runners[0]._shared_pool is not None
    assert len({id(r._stream) for r in runners}) == 1
    got = graphs.generate(specs)
    want = Engine(model, WorkerConfig(backend="eager", max_batch=8)).generate(specs)
    for g in got:
        assert g.image.shape[:2] == (g.request.height, g.request.width)
    _assert_equal_latents(got, want)
    for group in graphs.stats()["groups"].values():
        assert fallbacks(group) == 0 and sum(s["replays"] for s in group["buckets"].values()) > 0


# -- full size -----------------------------------------------------------------------------------------------
LONG = ("a cat", "a photograph of an astronaut riding a horse on the moon, dramatic light, 35mm",
        "", "a bowl of fruit on a wooden table, oil painting in the style of the old masters")


def _live(model, family, plan, b: int) -> dict[str, torch.Tensor]:
    """The step's inputs for b images at step 5, with b of LONG's prompts (SD3: negatives too)."""
    from samplers import gather_rows
    from workers.request.spec import ItemSpec

    specs = [ItemSpec(id=str(i), seed=i, sampler="flow_euler", steps=28, guidance=3.5 + i,
                      prompt=LONG[i % 4], negative_prompt=LONG[(i + 1) % 4] if i % 2 else "") for i in range(b)]
    enc, dev = family.encode(model, specs), model.device
    t, coeffs = gather_rows([plan] * b, [5] * b)
    x = torch.randn(b, *model.latent_shape, device=dev, generator=torch.Generator(dev).manual_seed(b))
    return dict(x=x, t=t.to(dev), coeffs=coeffs.to(dev), guidance=torch.tensor([s.guidance for s in specs]).to(dev),
                hist=torch.zeros_like(x), noise=torch.zeros_like(x),
                **{k: torch.stack([c[k] for c in enc]).to(dev) for k in enc[0]})


def _breakable_and_eager(model, buckets: tuple[int, ...]) -> tuple[dict, dict]:
    """{(backend, b, output): CPU tensor} and the breakable runner's stats."""
    from graphs import GraphRunner
    from samplers import make_plan
    from workers.engine import step_specs
    from workers.families import family_of

    family, shape = family_of(model), tuple(model.latent_shape)
    extra = family.plan_kwargs(model, shape)  # FLUX-dev's mu
    plan = make_plan("flow_euler", 28, model.schedule, **extra)
    live = {b: _live(model, family, plan, b) for b in buckets}
    outs, stats = {}, {}
    for backend in ("eager", "breakable"):
        inputs, outputs = step_specs(model, shape)
        runner = GraphRunner(family.make_step(model, shape), inputs, outputs, max_batch=max(buckets),
                             backend=backend, device=model.device)
        runner.warmup(example=live[max(buckets)])
        runner.replay_ms = {}  # greedy plans: b rows in bucket b, the shape eager runs
        for b in buckets:
            assert runner.plan(b) == (b,)
            out = runner.run(**live[b])
            outs.update({(backend, b, k): v.float().cpu() for k, v in out.items()})
        stats = runner.stats()
        del runner
    return outs, stats


@pytest.mark.slow
@pytest.mark.parametrize("name,buckets", [("sd35-medium-1024", (1, 2, 4)), ("flux-dev-1024", (1, 2))])
def test_full_size_breakable_buckets_replay_what_eager_computes(name, buckets):
    from workers.loading import load_model

    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    model = load_model(name, device="cuda", dtype=torch.bfloat16)
    try:
        outs, stats = _breakable_and_eager(model, buckets)
    finally:  # one full-size model resident at a time: gone before the next test loads its own
        del model
        gc.collect()
        torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() - before < 2**30, "the model was not freed"
    assert stats["backend"] == "breakable" and stats["totals"]["captures"] == len(buckets)
    assert stats["totals"]["eager_fallbacks"] == 0 and stats["totals"]["replays"] == len(buckets)
    for b in buckets:
        for key, tol in (("x_next", 1e-3), ("hist_next", 1e-2)):
            want, got = outs["eager", b, key], outs["breakable", b, key]
            assert torch.isfinite(got).all()
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err <= tol, (name, b, key, err)
