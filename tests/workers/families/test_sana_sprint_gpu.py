"""Sana Sprint through graphs (GPU).

The tiny random Sana Sprint directory (``tiny_sana.make_tiny_sana_sprint``), float32 on CUDA. Its step takes
every per-request quantity as a row (the TrigFlow angle, turned into the flow time and the input and output scales
inside the step; the embedded guidance; the scm coefficients; the fresh noise), so one captured step serves rows at
different steps of different step counts and scales. Held here: each bucket (1, 2, 4) of the captured step replays
what the same step computes eagerly, within 1e-5 of the largest value (a replay runs the kernels eager runs at the
same shape); the engine's graphs give every request of a mixed batch (1, 2 and 4 steps, five scales) the final
latents eager gives, within 1e-5, with no eager fallback, and diffusers' SanaSprintPipeline on the same GPU from the
same latents and noise gives the same, within 1e-4 of the largest (as the CPU tests).
"""

from __future__ import annotations

import pytest
import torch

from workers.config import WorkerConfig

from .gpu_stats import fallbacks, pooled

pytestmark = [pytest.mark.gpu]  # skipped without CUDA (tests/conftest.py)

PROMPTS = ("a red cat", "the big blue house", "a dog", "small green tree drawn",
           "a photo of a cat sitting on a wooden table at sunset with a small dog near the house")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from workers.loading import load_model
    from workers.models.tiny_sana import make_tiny_sana_sprint

    return load_model(make_tiny_sana_sprint(tmp_path_factory.mktemp("sprint") / "sana-sprint-tiny"), device="cuda",
                      dtype=torch.float32)


def _specs(n: int):
    from workers.request.spec import ItemSpec

    return [ItemSpec(id=str(i), seed=i, sampler="scm", steps=(1, 2, 4)[i % 3],
                     guidance=(4.5, 0.0, 7.0, 1.0, 2.5)[i % 5], prompt=PROMPTS[i % 5]) for i in range(n)]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _live(model, b: int) -> dict[str, torch.Tensor]:
    """The step's inputs for b rows at mixed steps of 2- and 4-step plans, mixed scales, fresh noise."""
    from samplers import gather_rows, make_plan
    from workers.families import family_of

    specs = _specs(b)
    enc, dev = family_of(model).encode(model, specs), model.device
    plans = [make_plan("scm", (2, 4)[i % 2], model.schedule) for i in range(b)]
    t, coeffs = gather_rows(plans, [i % p.num_steps for i, p in enumerate(plans)])
    gen = torch.Generator(dev).manual_seed(b)
    x = torch.randn(b, *model.latent_shape, device=dev, generator=gen)
    return dict(x=x, t=t.to(dev), coeffs=coeffs.to(dev), guidance=torch.tensor([s.guidance for s in specs], device=dev),
                hist=torch.zeros_like(x), noise=torch.randn(x.shape, device=dev, generator=gen),
                **{k: torch.stack([c[k] for c in enc]).to(dev) for k in enc[0]})


def test_every_bucket_replays_what_the_step_computes_eagerly(tiny):
    from graphs import GraphRunner
    from workers.engine import step_specs
    from workers.families import family_of

    shape = tuple(tiny.latent_shape)
    live = {b: _live(tiny, b) for b in (1, 2, 4)}
    outs, stats = {}, {}
    for kind in ("eager", "full"):
        inputs, outputs = step_specs(tiny, shape)
        runner = GraphRunner(family_of(tiny).make_step(tiny, shape), inputs, outputs, max_batch=4, backend=kind,
                             device=tiny.device)
        runner.warmup(example=live[4])
        for b in (1, 2, 4):
            assert runner.plan(b) == (b,)
            outs.update({(kind, b, k): v.float().cpu() for k, v in runner.run(**live[b]).items()})
        stats = runner.stats()
        del runner
    assert stats["totals"]["captures"] == 3 and stats["totals"]["eager_fallbacks"] == 0
    for b in (1, 2, 4):
        for key in ("x_next", "hist_next"):
            assert _rel(outs["full", b, key], outs["eager", b, key]) <= 1e-5, (b, key)


def test_graphs_replay_what_eager_computes_and_what_the_pipeline_makes(tiny):
    from workers.engine import Engine

    from .test_sana_sprint import _pipe

    specs = _specs(7)  # 7 = 4 + 2 + 1 while all are active; rows leave after 1, 2 and 4 steps
    graphs = Engine(tiny, WorkerConfig(backend="graphs", max_batch=4))
    graphs.warmup()
    got = graphs.generate(specs)
    want = Engine(tiny, WorkerConfig(backend="eager", max_batch=4)).generate(specs)
    for spec, g, w in zip(specs, got, want):
        assert _rel(g.latents, w.latents) <= 1e-5, spec.id
        gen = torch.Generator("cpu").manual_seed(spec.seed)
        x = torch.randn(tiny.latent_shape, generator=gen)
        ref = _pipe(tiny)(spec.prompt, num_inference_steps=spec.steps, guidance_scale=spec.guidance, latents=x[None],
                          generator=gen, intermediate_timesteps=1.3 if spec.steps == 2 else None, height=128,
                          width=128, max_sequence_length=tiny.card.max_tokens, use_resolution_binning=False,
                          output_type="latent").images[0].cpu()
        assert (g.latents - ref).abs().max() <= 1e-4 * max(1.0, ref.abs().max().item()), spec.id
    stats = pooled(graphs.stats()["groups"].values())
    assert stats["backend"] == "full" and fallbacks(stats) == 0
    replayed = {b for b, s in stats["buckets"].items() if s["replays"]}
    assert 4 in replayed and replayed <= {1, 2, 4}, replayed
