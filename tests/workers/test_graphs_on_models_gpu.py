"""Captured steps on real models (GPU): every bucket's replay equals eager, and digits generated
through graphs are the images eager makes, passing the oracle.

Tolerances: DiT-XL/2 in bf16 replays the kernels eager runs at the same shape, so we expect
bit-identical outputs; we assert at most 1e-3 relative (max abs diff over max abs value) and
report exactness. Digits run in float32: replay vs eager at most 1e-5 on the final latents."""

import numpy as np
import pytest
import torch

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
    from workers.patches import break_attention

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
    from workers.digits import oracle_accuracy, sample_digits
    from workers.engine import Engine, EngineConfig

    graph_engine = Engine(digits_cuda, EngineConfig(backend=backend, max_batch=64))
    graph_engine.warmup()
    eager_engine = Engine(digits_cuda, EngineConfig(backend="eager", max_batch=64))
    guidance = digits_cuda.defaults["guidance"]
    images, labels = sample_digits(graph_engine, 50, "ddim", 50, guidance)
    ref, _ = sample_digits(eager_engine, 50, "ddim", 50, guidance)
    diff = np.abs(images - ref).max() * 127.5  # in uint8 levels
    assert diff <= 1.0, f"graph vs eager differ by {diff} levels"
    assert oracle_accuracy(images, labels) >= 0.90
    stats = next(iter(graph_engine.stats()["groups"].values()))
    assert sum(s["replays"] for s in stats["buckets"].values()) >= 50 * 8  # 500 = 7x64 + 32+16+4 per step
    assert sum(s["eager_fallbacks"] for s in stats["buckets"].values()) == 0
