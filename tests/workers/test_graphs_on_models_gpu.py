"""Captured steps on real models (GPU): every bucket's replay equals eager, and digits generated
through graphs are the images eager makes, passing the oracle.

Tolerances: DiT-XL/2 in bf16 replays the kernels eager runs at the same shape, so we expect
bit-identical outputs; we assert at most 1e-3 relative (max abs diff over max abs value) and
report exactness. Digits run in float32: replay vs eager at most 1e-5 on the final latents."""

import numpy as np
import pytest
import torch

from workers.config import WorkerConfig
from workers.speed import SpeedConfig

pytestmark = pytest.mark.gpu


def _runner(model, backend, max_batch=64):
    from graphs import GraphRunner
    from workers.engine import step_specs
    from workers.families import family_of

    inputs, outputs = step_specs(model)
    return GraphRunner(family_of(model).make_step(model), inputs, outputs, max_batch=max_batch, backend=backend,
                       device=model.device)


def _inputs(model, b, seed):
    from samplers import gather_rows, make_plan

    g = torch.Generator("cpu").manual_seed(seed)
    plans = [make_plan(s, 50, model.schedule) for s in ("ddim", "euler", "dpmpp_2m", "euler_a")]
    t, coeffs = gather_rows([plans[i % 4] for i in range(b)], [(7 * i) % 50 for i in range(b)])
    x = torch.randn(b, *model.latent_shape, generator=g)
    return {k: v.to(model.device) for k, v in dict(
        x=x, t=t, coeffs=coeffs, labels=torch.randint(0, model.num_classes, (b,), generator=g),
        guidance=torch.rand(b, generator=g) * 4, hist=torch.randn(x.shape, generator=g),
        noise=torch.randn(x.shape, generator=g)).items()}


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.fixture(scope="module")
def dit_xl():
    from workers.loading import load_model
    from workers.speed.patches import break_attention

    model = load_model("dit-xl-2-256", device="cuda", dtype=torch.bfloat16)
    break_attention(model.transformer)  # plain calls unless the backend is breakable
    return model


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_dit_xl_every_bucket_replay_equals_eager(dit_xl, backend):
    graphs, eager = _runner(dit_xl, backend), _runner(dit_xl, "eager")
    graphs.warmup()
    stats = graphs.stats()
    exact = {}
    for b in (1, 2, 4, 8, 16, 32, 64):
        inp = _inputs(dit_xl, b, seed=b)
        got, want = graphs.run(**inp), eager.run(**inp)
        for name in ("x_next", "hist_next"):
            assert _rel(got[name], want[name]) <= 1e-3, (b, name)
        exact[b] = all(torch.equal(got[n], want[n]) for n in got)
    stats = graphs.stats()
    assert all(s["captures"] == 1 and s["eager_fallbacks"] == 0 for s in stats["buckets"].values())
    assert all(stats["buckets"][b]["replays"] >= 1 for b in exact)
    print(f"{backend}: bit-exact per bucket {exact}")


@pytest.fixture(scope="module")
def digits_cuda():
    from workers.loading import load_model

    return load_model("digits", device="cuda", dtype=torch.float32)


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_digits_through_graphs_match_eager_and_pass_the_oracle(digits_cuda, backend):
    from workers.models.digits import oracle_accuracy, sample_digits
    from workers.engine import Engine

    graph_engine = Engine(digits_cuda, WorkerConfig(backend=backend, max_batch=64))
    graph_engine.warmup()
    eager_engine = Engine(digits_cuda, WorkerConfig(backend="eager", max_batch=64))
    guidance = digits_cuda.defaults["guidance"]
    images, labels = sample_digits(graph_engine, 50, "ddim", 50, guidance)
    ref, _ = sample_digits(eager_engine, 50, "ddim", 50, guidance)
    diff = np.abs(images - ref).max() * 127.5  # in uint8 levels
    assert diff <= 1.0, f"graph vs eager differ by {diff} levels"
    assert oracle_accuracy(images, labels) >= 0.90
    stats = next(iter(graph_engine.stats()["groups"].values()))
    assert sum(s["replays"] for s in stats["buckets"].values()) >= 50 * 8  # 500 = 7x64 + 32+16+4 per step
    assert sum(s["eager_fallbacks"] for s in stats["buckets"].values()) == 0


def test_dit_xl_captured_decode_makes_the_plain_decodes_images(dit_xl):
    """``decode_graphs``: the VAE decode replayed from graphs (batches of 1..16 at 256 px) gives the images
    the plain decode gives (bf16: a convolution may pick another algorithm at another batch size, the
    captured bucket being a padded one; on an H200 pixels differed by at most 2 levels), and says how long
    each decode of one image takes."""
    import time

    from workers.engine import Engine
    from workers.request.spec import ItemSpec
    from workers.decode import _vae_pixels, decode

    specs = [ItemSpec(id=str(i), label=i, seed=i, sampler="ddim", steps=5, guidance=4.0) for i in range(3)]
    eng = Engine(dit_xl, WorkerConfig(backend="breakable", max_batch=4), speed=SpeedConfig(decode_graphs=True))
    eng.warmup()
    got = eng.generate(specs)
    # the plain decode of the very latents the engine decoded: only the decode differs (an engine of its own
    # would also step another batch size, whose bf16 GEMMs round differently: a mean of ~0.5 levels on an H200)
    plain = decode(dit_xl, torch.stack([r.latents for r in got]).cuda())
    for a, b in zip(got, plain):  # 3 images through bucket 4 (padded) against a plain batch of 3: on an
        diff = np.abs(a.image.astype(int) - b.astype(int))  # H200 at most 1 level, in 16% of the pixels
        assert diff.max() <= 3 and diff.mean() <= 0.5, (diff.max(), diff.mean())
    (group,) = eng.groups.values()
    # at the bucket's own batch size the replay is the plain decode's arithmetic: within rounding
    four = torch.stack([r.latents for r in got] + [got[0].latents]).cuda()
    replayed = group.decoder.run(latents=four)["pixels"].float()
    assert (replayed - _vae_pixels(dit_xl, four).float()).abs().max().item() <= 1 / 127.5
    assert all(s["captures"] == 1 for s in group.decoder.stats()["buckets"].values())
    latents = torch.stack([r.latents for r in got[:1]]).cuda()
    times = {}
    for name, fn in (("plain", lambda: decode(dit_xl, latents)),
                     ("captured", lambda: decode(dit_xl, latents, pixels=group.decoder.run(latents=latents)["pixels"]))):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        times[name] = (time.perf_counter() - t0) * 100  # ms per decode
    print(f"decode of one 256 px image, ms: {times}")


def test_dit_xl_attention_kernels_are_measured_per_bucket_at_warmup(dit_xl):
    """The breakable warm-up meets each bucket's attention shape eagerly before capturing it: each gets a
    measured kernel (flash, cuDNN or memory-efficient, whichever is fastest and matches math), and the
    captured steps still equal eager."""
    from workers.kernels.attention import CHOOSER

    graphs = _runner(dit_xl, "breakable", max_batch=8)
    graphs.warmup()
    shapes = {key[0][0][0]: c for key, c in CHOOSER.choices.items() if key[0][0][1:] == (16, 256, 72)}
    assert {2, 4, 8, 16} <= set(shapes), CHOOSER.summary()  # rows: 2 per image (CFG), buckets 1..8
    assert all(c.kernel in ("flash", "cudnn", "efficient") and c.kernel in c.ms for c in shapes.values())
    print("\n".join(CHOOSER.summary()))
    inp = _inputs(dit_xl, 3, seed=3)
    assert _rel(graphs.run(**inp)["x_next"], _runner(dit_xl, "eager").run(**inp)["x_next"]) <= 2e-2
