"""Z-Image through graphs (GPU).

Tiny random Z-Image-Turbo in the real layout (workers.models.tiny_zimage), float32: the engine's ``full`` and
``breakable`` graphs give every request the final latents eager gives, within 1e-5 of the largest value (the
replay runs the kernels eager runs at the same shapes), with prompts of both caption paddings (32 and 64
tokens), negative prompts, guidance scales 0 (no CFG) and above, and step counts mixed in one replay (7
requests: buckets 4 + 2 + 1), and with several image sizes in one engine capturing into one shared pool on
one stream; no step falls back to eager.

Full size at 1024, random weights, bf16 (``z-image-turbo-1024``, slow): a breakable GraphRunner over the
family's step replays what the same runner computes eagerly at buckets 1 and 2, with prompts of different
lengths and both guidance rules in one replay. Tolerances, relative to the largest eager value: 1e-3 on
``x_next`` (the sampler's float32 update of the bf16 prediction), 1e-2 on ``hist_next`` (the denoised
estimate, where one bf16 rounding of the prediction's largest values shows at sigma ~ 0.9), as
test_mmdit_gpu's.
"""

from __future__ import annotations

import gc

import pytest
import torch

from workers.config import WorkerConfig

from .gpu_stats import fallbacks, pooled

pytestmark = pytest.mark.gpu

PROMPTS = ("a red cat", "the big blue house on a hill with a small garden and an old tree in front of it",
           "a dog", "", "small green tree drawn with a pencil on white paper")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from workers.loading import load_model
    from workers.models.tiny_zimage import make_tiny_zimage

    # head_dim 16: FP8 and flash attention kernels want a multiple of 16 (dim 64, 4 heads)
    path = make_tiny_zimage(tmp_path_factory.mktemp("zimage") / "tiny-zimage", dim=64, heads=4)
    return load_model(path, device="cuda", dtype=torch.float32)



def _specs(n: int, sizes=((0, 0),)):
    from workers.request.spec import ItemSpec

    return [ItemSpec(id=str(i), seed=i, sampler="flow_euler", steps=4 + i % 5, guidance=(0.0, 2.0, 0.0, 4.5)[i % 4],
                     prompt=PROMPTS[i % 5], negative_prompt="blurry" if i % 3 == 1 else "",
                     width=sizes[i % len(sizes)][0], height=sizes[i % len(sizes)][1]) for i in range(n)]


def _assert_equal_latents(got, want, tol=1e-5):
    for g, w in zip(got, want):
        assert g.latents.shape == w.latents.shape and torch.isfinite(g.latents).all()
        err = ((g.latents - w.latents).abs().max() / w.latents.abs().max()).item()
        assert err <= tol, (g.request.id, err)



@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_tiny_buckets_replay_what_eager_computes(tiny, backend):
    from workers.engine import Engine

    specs = _specs(9)  # at most 4 active (max_batch): buckets of 4 while the queue lasts, smaller ones at its tail
    graphs = Engine(tiny, WorkerConfig(backend=backend, max_batch=4))
    graphs.warmup()
    got = graphs.generate(specs)
    want = Engine(tiny, WorkerConfig(backend="eager", max_batch=4)).generate(specs)
    _assert_equal_latents(got, want)
    stats = pooled(graphs.stats()["groups"].values())
    assert stats["backend"] == backend and fallbacks(stats) == 0
    replayed = {b for b, s in stats["buckets"].items() if s["replays"]}
    # the tail's smaller groups may be padded to 4 where the tiny model's timings say a larger bucket costs the same
    assert 4 in replayed and replayed <= {1, 2, 4}, replayed


def test_tiny_sizes_share_one_pool_and_replay_what_eager_computes(tiny):
    """Three latent shapes in one engine (16 patches and 24: each padded to 32 by x_pad_tokens): all graphs
    capture into one pool on one stream, and every shape's replays equal eager."""
    from workers.engine import Engine

    sizes = [(64, 64), (96, 64), (64, 96)]
    specs = _specs(12, sizes)
    graphs = Engine(tiny, WorkerConfig(backend="breakable", max_batch=4))
    graphs.warmup(sizes=sizes)
    runners = [g.runner for g in graphs.groups.values()]
    assert len({g.shape for g in graphs.groups.values()}) == 3 and len(graphs._pools) == 1
    assert len({id(r._shared_pool) for r in runners}) == 1 and runners[0]._shared_pool is not None
    assert len({id(r._stream) for r in runners}) == 1
    got = graphs.generate(specs)
    want = Engine(tiny, WorkerConfig(backend="eager", max_batch=4)).generate(specs)
    for g in got:
        assert g.image.shape[:2] == (g.request.height, g.request.width)
    _assert_equal_latents(got, want)
    for group in graphs.stats()["groups"].values():
        assert fallbacks(group) == 0 and sum(s["replays"] for s in group["buckets"].values()) > 0


def test_tiny_on_cuda_equals_the_pipeline(tiny):
    """The graph engine on CUDA against ZImagePipeline on the same components (float32, TF32 off)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    from workers.engine import Engine

    specs = _specs(4)
    got = Engine(tiny, WorkerConfig(backend="full", max_batch=4)).generate(specs)
    config = {k: v for k, v in tiny.card.scheduler.items() if k != "flow_grid"}
    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(config), vae=tiny.vae,
                          text_encoder=tiny.text_encoder, tokenizer=tiny.tokenizer, transformer=tiny.transformer)
    for spec, g in zip(specs, got):
        x = torch.randn(tiny.latent_shape, generator=torch.Generator("cpu").manual_seed(spec.seed))
        ref = pipe(spec.prompt, negative_prompt=spec.negative_prompt, num_inference_steps=spec.steps,
                   guidance_scale=spec.guidance, height=64, width=64, latents=x[None].cuda(),
                   max_sequence_length=tiny.card.max_tokens, output_type="latent").images[0].cpu()
        err = ((g.latents.cpu() - ref).abs().max() / max(1.0, ref.abs().max().item())).item()
        assert err <= 1e-4, (spec.id, err)


# -- full size -----------------------------------------------------------------------------------------------
LONG = ("a cat", "a photograph of an astronaut riding a horse on the moon, dramatic light, 35mm",
        "", "a bowl of fruit on a wooden table, oil painting in the style of the old masters")


def _live(model, family, plan, b: int) -> dict[str, torch.Tensor]:
    """The step's inputs for b images at step 3, with b of LONG's prompts, scales 0 and 4 alternating."""
    from samplers import gather_rows
    from workers.request.spec import ItemSpec

    specs = [ItemSpec(id=str(i), seed=i, sampler="flow_euler", steps=8, guidance=4.0 * (i % 2),
                      prompt=LONG[i % 4], negative_prompt=LONG[(i + 1) % 4] if i % 2 else "") for i in range(b)]
    enc, dev = family.encode(model, specs), model.device
    t, coeffs = gather_rows([plan] * b, [3] * b)
    x = torch.randn(b, *model.latent_shape, device=dev, generator=torch.Generator(dev).manual_seed(b))
    return dict(x=x, t=t.to(dev), coeffs=coeffs.to(dev), guidance=torch.tensor([s.guidance for s in specs]).to(dev),
                hist=torch.zeros_like(x), noise=torch.zeros_like(x),
                **{k: torch.stack([c[k] for c in enc]).to(dev) for k in enc[0]})


@pytest.mark.slow
def test_full_size_breakable_buckets_replay_what_eager_computes():
    from graphs import GraphRunner
    from samplers import make_plan
    from workers.engine import step_specs
    from workers.families import family_of
    from workers.loading import load_model

    buckets = (1, 2)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    model = load_model("z-image-turbo-1024", device="cuda", dtype=torch.bfloat16)
    outs, stats = {}, {}
    try:
        family, shape = family_of(model), tuple(model.latent_shape)
        plan = make_plan("flow_euler", 8, model.schedule, **family.plan_kwargs(model, shape))
        live = {b: _live(model, family, plan, b) for b in buckets}
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
    finally:  # one full-size model resident at a time
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
            assert err <= tol, (b, key, err)
