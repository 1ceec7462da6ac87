"""FLUX.2 through graphs (GPU).

Tiny random FLUX.2 [klein] (step-distilled), [klein] base (CFG: both halves in one forward) and [dev] (embedded
guidance) in the real layouts (``workers.models.tiny_flux2``), float32 on CUDA:

- the engine under ``backend="graphs"`` (whole-step graphs: FLUX.2's step has no eager breaks) gives every
  request the final latents ``backend="eager"`` gives, within 1e-5 of the largest value (a replay runs the
  kernels eager runs at the same shape), with mixed prompts, negative prompts, guidance scales and step counts
  in one replay (7 requests, max_batch 4: buckets 4 + 2 + 1), no step falling back to eager;
- each bucket alone (1, 2, 4), a ``full`` GraphRunner over the family's step replays what an eager runner
  computes on the same inputs, within 1e-5;
- three image sizes in one engine capture into one shared pool on one stream, and equal eager.

Full size, random weights, bf16 (``flux2-klein-1024``, marked slow: 3.9B transformer and Qwen3-4B, about 16 GiB):
a ``full`` GraphRunner over the step replays what the same runner computes eagerly for buckets 1, 2 and 4.
Tolerances, relative to the largest eager value: 1e-3 on ``x_next`` (the sampler's float32 update of the bf16
velocity), 1e-2 on ``hist_next`` (x - sigma v, where one bf16 rounding of the velocity shows at sigma ~ 0.9).
"""

from __future__ import annotations

import gc

import pytest
import torch

from workers.config import WorkerConfig

from .gpu_stats import fallbacks, pooled

pytestmark = pytest.mark.gpu

PROMPTS = ("a red cat", "the big blue house", "a dog", "small green tree drawn", "a photo of a cat")
VARIANTS = ("klein", "base", "dev")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{"klein": model, "base": model, "dev": model}: tiny random directories made offline, float32 on CUDA."""
    import json
    import shutil

    from workers.loading import load_model
    from workers.models.tiny_flux2 import make_tiny_flux2

    root = tmp_path_factory.mktemp("flux2")
    klein = make_tiny_flux2(root / "klein")
    base = shutil.copytree(klein, root / "klein-base")
    index = json.loads((base / "model_index.json").read_text())
    index.pop("is_distilled")  # Flux2KleinPipeline's default: a base model, CFG
    (base / "model_index.json").write_text(json.dumps(index))
    dev = make_tiny_flux2(root / "dev", seed=1, dev=True)
    return {k: load_model(p, device="cuda", dtype=torch.float32) for k, p in (("klein", klein), ("base", base),
                                                                              ("dev", dev))}



def _specs(n: int, sizes=((0, 0),)):
    from workers.request.spec import ItemSpec

    # guidance 1.0 + i % 4: [klein] base runs CFG on rows above 1 only; the others ignore it or embed it
    return [ItemSpec(id=str(i), seed=i, sampler="flow_euler", steps=3 + i % 4, guidance=1.0 + i % 4,
                     prompt=PROMPTS[i % 5], negative_prompt="small" if i % 2 else "",
                     width=sizes[i % len(sizes)][0], height=sizes[i % len(sizes)][1]) for i in range(n)]


def _assert_equal_latents(got, want, tol=1e-5):
    for g, w in zip(got, want):
        assert g.latents.shape == w.latents.shape
        err = ((g.latents - w.latents).abs().max() / w.latents.abs().max()).item()
        assert err <= tol, (g.request.id, err)



@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_graphs_engine_replays_what_eager_computes(tiny, variant):
    from workers.engine import Engine

    model, specs = tiny[variant], _specs(7)  # 7 = 4 + 2 + 1 replays while all are active
    graphs = Engine(model, WorkerConfig(backend="graphs", max_batch=4))
    graphs.warmup()
    got = graphs.generate(specs)
    want = Engine(model, WorkerConfig(backend="eager", max_batch=4)).generate(specs)
    _assert_equal_latents(got, want)
    stats = pooled(graphs.stats()["groups"].values())
    assert stats["backend"] == "full" and fallbacks(stats) == 0  # no eager breaks: whole-step graphs
    replayed = {b for b, s in stats["buckets"].items() if s["replays"]}
    assert 4 in replayed and replayed - {4}, replayed


def _live(model, family, plan, b: int, shape) -> dict[str, torch.Tensor]:
    """The step's inputs for b rows at step 1 of ``plan``: b of PROMPTS (negative prompts too under CFG), guidance
    scales 1 to 4 (so a CFG batch holds rows with and without guidance)."""
    from samplers import gather_rows
    from workers.request.spec import ItemSpec

    specs = [ItemSpec(id=str(i), seed=i, sampler="flow_euler", steps=plan.num_steps, guidance=1.0 + i % 4,
                      prompt=PROMPTS[i % 5], negative_prompt=PROMPTS[(i + 2) % 5] if i % 2 else "") for i in range(b)]
    enc, dev = family.encode(model, specs), model.device
    t, coeffs = gather_rows([plan] * b, [1] * b)
    gen = torch.Generator(dev).manual_seed(b)
    x = torch.randn(b, *shape, device=dev, generator=gen)
    return dict(x=x, t=t.to(dev), coeffs=coeffs.to(dev), guidance=torch.tensor([s.guidance for s in specs]).to(dev),
                hist=torch.randn(x.shape, device=dev, generator=gen), noise=torch.zeros_like(x),
                **{k: torch.stack([c[k] for c in enc]).to(dev) for k in enc[0]})


def _runner_outputs(model, buckets=(1, 2, 4), steps: int = 4) -> tuple[dict, dict]:
    """{(backend, b, output): CPU tensor} for an eager and a full GraphRunner over the family's step at the
    model's native shape, each bucket run alone (greedy plans: b rows in bucket b), and the full runner's stats."""
    from graphs import GraphRunner
    from samplers import make_plan
    from workers.engine import step_specs
    from workers.families import family_of

    family, shape = family_of(model), tuple(model.latent_shape)
    plan = make_plan("flow_euler", steps, model.schedule, **family.plan_kwargs(model, shape))
    live = {b: _live(model, family, plan, b, shape) for b in buckets}
    outs, stats = {}, {}
    for backend in ("eager", "full"):
        inputs, outputs = step_specs(model, shape)
        runner = GraphRunner(family.make_step(model, shape), inputs, outputs, max_batch=max(buckets),
                             backend=backend, device=model.device)
        runner.warmup(example=live[max(buckets)])
        runner.replay_ms = {}
        for b in buckets:
            assert runner.plan(b) == (b,)
            out = runner.run(**live[b])
            outs.update({(backend, b, k): v.float().cpu() for k, v in out.items()})
        stats = runner.stats()
        del runner
    return outs, stats


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_every_bucket_replays_what_eager_computes(tiny, variant):
    outs, stats = _runner_outputs(tiny[variant])
    assert stats["backend"] == "full" and stats["totals"]["captures"] == 3
    assert stats["totals"]["eager_fallbacks"] == 0 and stats["totals"]["replays"] == 3
    for b in (1, 2, 4):
        for key in ("x_next", "hist_next"):
            want, got = outs["eager", b, key], outs["full", b, key]
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert torch.isfinite(got).all() and err <= 1e-5, (variant, b, key, err)


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_sizes_share_one_pool_and_replay_what_eager_computes(tiny, variant):
    """Three latent shapes in one engine (each with its own position ids and rotary tables): all graphs capture
    into the device's one pool on one stream, and every shape's replays equal eager."""
    from workers.engine import Engine

    sizes = [(64, 64), (96, 64), (64, 96)]
    model, specs = tiny[variant], _specs(9, sizes)
    graphs = Engine(model, WorkerConfig(backend="graphs", max_batch=4))
    graphs.warmup(sizes=sizes)
    runners = [g.runner for g in graphs.groups.values()]
    assert len({g.shape for g in graphs.groups.values()}) == 3 and len(graphs._pools) == 1
    assert len({id(r._shared_pool) for r in runners}) == 1 and runners[0]._shared_pool is not None
    assert len({id(r._stream) for r in runners}) == 1
    got = graphs.generate(specs)
    want = Engine(model, WorkerConfig(backend="eager", max_batch=4)).generate(specs)
    for g in got:
        assert g.image.shape[:2] == (g.request.height, g.request.width)
    _assert_equal_latents(got, want)
    for group in graphs.stats()["groups"].values():
        assert fallbacks(group) == 0 and sum(s["replays"] for s in group["buckets"].values()) > 0


# -- full size -----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_full_size_klein_buckets_replay_what_eager_computes():
    from workers.loading import load_model

    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    model = load_model("flux2-klein-1024", device="cuda", dtype=torch.bfloat16)
    try:
        outs, stats = _runner_outputs(model)
    finally:  # one full-size model resident at a time
        del model
        gc.collect()
        torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() - before < 2**30, "the model was not freed"
    assert stats["backend"] == "full" and stats["totals"]["captures"] == 3
    assert stats["totals"]["eager_fallbacks"] == 0 and stats["totals"]["replays"] == 3
    for b in (1, 2, 4):
        for key, tol in (("x_next", 1e-3), ("hist_next", 1e-2)):
            want, got = outs["eager", b, key], outs["full", b, key]
            assert torch.isfinite(got).all()
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err <= tol, (b, key, err)
