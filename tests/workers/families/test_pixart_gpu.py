"""PixArt through graphs (GPU): with mixed prompts in one replay, every bucket's replay equals eager
(tiny random PixArt-Σ in the real layout, float32: at most 1e-5 relative on the final latents; the
graph replays the kernels eager runs at the same shape), and no step falls back to eager."""

import pytest
import torch

from workers.config import WorkerConfig
from workers.speed import SpeedConfig

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def pixart_cuda(tmp_path_factory):
    from workers.loading import load_model
    from workers.models.tiny_pixart import make_tiny_pixart

    return load_model(make_tiny_pixart(tmp_path_factory.mktemp("pixart")), device="cuda", dtype=torch.float32)


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_pixart_buckets_replay_what_eager_computes(pixart_cuda, backend):
    from workers.engine import Engine
    from workers.request.spec import ItemSpec

    prompts = ["a red cat", "the big blue house", "a dog", "small green tree drawn", "a photo of a cat"]
    specs = [ItemSpec(id=str(i), seed=i, sampler=("dpmpp_2m", "ddim", "euler")[i % 3], steps=8 + i % 5,
                      guidance=1.0 + i % 4, prompt=prompts[i % 5], negative_prompt="small" if i % 2 else "")
             for i in range(13)]  # 13 = 8 + 4 + 1 replays while all are active
    graphs = Engine(pixart_cuda, WorkerConfig(backend=backend, max_batch=8))
    graphs.warmup()
    got = graphs.generate(specs)
    want = Engine(pixart_cuda, WorkerConfig(backend="eager", max_batch=8)).generate(specs)
    for g, w in zip(got, want):
        err = ((g.latents - w.latents).abs().max() / w.latents.abs().max()).item()
        assert err <= 1e-5, (g.request.id, err)
    stats = next(iter(graphs.stats()["groups"].values()))
    assert sum(s["eager_fallbacks"] for s in stats["buckets"].values()) == 0
    replayed = {b for b, s in stats["buckets"].items() if s["replays"]}
    # 13 active = 8 + 4 + 1, or 8 + 8 padded when the splitter's timings say that is faster; as requests of
    # fewer steps end, smaller buckets may replay or be padded into 8 again: which, the timings decide
    assert 8 in replayed and replayed <= {1, 2, 4, 8}


def test_mixed_sizes_share_one_pool_and_replay_what_eager_computes(pixart_cuda):
    """Three latent shapes in one engine: every shape's replays equal eager, all graphs capture into one
    pool on one stream, and later shapes reuse the pool memory the first one reserved."""
    from workers.engine import Engine
    from workers.request.spec import ItemSpec

    sizes = [(16, 16), (32, 16), (16, 32)]
    specs = [ItemSpec(id=str(i), seed=i, sampler="dpmpp_2m", steps=6, guidance=2.0 + i % 3,
                      prompt=("a red cat", "the big blue house", "a dog drawn")[i % 3],
                      width=sizes[i % 3][0], height=sizes[i % 3][1]) for i in range(15)]
    graphs = Engine(pixart_cuda, WorkerConfig(backend="breakable", max_batch=8))
    graphs.warmup(sizes=sizes)
    runners = [g.runner for g in graphs.groups.values()]
    assert len(runners) == 3 and len({id(r._shared_pool) for r in runners}) == 1
    assert len({id(r._stream) for r in runners}) == 1
    got = graphs.generate(specs)
    want = Engine(pixart_cuda, WorkerConfig(backend="eager", max_batch=8)).generate(specs)
    for g, w in zip(got, want):
        assert g.image.shape[:2] == (g.request.height, g.request.width)
        err = ((g.latents - w.latents).abs().max() / w.latents.abs().max()).item()
        assert err <= 1e-5, (g.request.id, err)
    for group in graphs.stats()["groups"].values():
        assert sum(s["eager_fallbacks"] for s in group["buckets"].values()) == 0
        assert sum(s["replays"] for s in group["buckets"].values()) > 0


@pytest.fixture(scope="module")
def sigma_512():
    from workers.loading import load_model

    return load_model("pixart-sigma-512", device="cuda", dtype=torch.bfloat16)


def test_full_size_pixart_sigma_buckets_replay_what_eager_computes(sigma_512):
    """PixArt-Σ-XL/2 at 512 (random weights, bf16): every bucket of the breakable and of the whole-step
    graphs replays what the same runner computes eagerly, with prompts of different lengths in one replay,
    under both cross-attention variants (varlen inside a whole-step graph: flash attention's varlen path
    reads the key counts on the device, or the masked fallback); padded and varlen agree with each other
    to bf16 rounding."""
    from graphs import GraphRunner
    from samplers import gather_rows, make_plan
    from workers.engine import step_specs
    from workers.families import family_named

    pixart = family_named("pixart")
    from workers.request.spec import ItemSpec

    prompts = ["a cat", "a photograph of an astronaut riding a horse on the moon, dramatic light, 35mm",
               "", "a bowl of fruit on a wooden table, oil painting in the style of the old masters"]
    plan = make_plan("dpmpp_2m", 20, sigma_512.schedule)
    outs = {}
    for cross in ("padded", "varlen"):
        pixart.set_cross_attention(sigma_512, cross)
        for backend in ("eager", "breakable", "full"):
            inputs, outputs = step_specs(sigma_512)
            runner = GraphRunner(pixart.make_step(sigma_512), inputs, outputs, max_batch=8, backend=backend,
                                 device="cuda")
            runner.warmup()
            for b in (1, 2, 3, 4, 8):
                specs = [ItemSpec(id=str(i), seed=i, sampler="dpmpp_2m", steps=20, guidance=4.5,
                                  prompt=prompts[i % 4]) for i in range(b)]
                enc = pixart.encode(sigma_512, specs)
                cond = {k: torch.stack([c[k] for c in enc]).cuda() for k in enc[0]}
                t, coeffs = gather_rows([plan] * b, [5] * b)
                x = torch.randn(b, *sigma_512.latent_shape, device="cuda",
                                generator=torch.Generator("cuda").manual_seed(b))
                live = dict(x=x, t=t.cuda(), coeffs=coeffs.cuda(), guidance=torch.full((b,), 4.5, device="cuda"),
                            hist=torch.zeros_like(x), noise=torch.zeros_like(x), **cond)
                outs[cross, backend, b] = runner.run(**live)["x_next"].float()
            if backend != "eager":
                assert sum(s["eager_fallbacks"] for s in runner.stats()["buckets"].values()) == 0
                assert sum(s["replays"] for s in runner.stats()["buckets"].values()) >= 5
    pixart.set_cross_attention(sigma_512, "padded")
    for b in (1, 2, 3, 4, 8):
        scale = outs["padded", "eager", b].abs().max().item()
        for cross in ("padded", "varlen"):
            for backend in ("breakable", "full"):
                err = (outs[cross, backend, b] - outs[cross, "eager", b]).abs().max().item()
                assert err <= 1e-3 * scale, (cross, backend, b, err)
        err = (outs["varlen", "eager", b] - outs["padded", "eager", b]).abs().max().item()
        assert err <= 5e-2 * scale, ("varlen vs padded", b, err)


def test_an_offloaded_text_encoder_gives_the_same_images(tmp_path):
    """The T5 encoder on the host CPU, the transformer on the GPU: the same latents as all on the GPU."""
    from workers.families import encoders
    from workers.engine import Engine
    from workers.loading import load_model
    from workers.models.tiny_pixart import make_tiny_pixart
    from workers.request.spec import ItemSpec

    path = make_tiny_pixart(tmp_path / "p")
    encoders.clear()
    here = load_model(path, device="cuda", dtype=torch.float32)
    away = load_model(path, device="cuda", dtype=torch.float32, encoder_device="cpu")
    assert next(away.text_encoder.parameters()).device.type == "cpu"
    specs = [ItemSpec(id=str(i), seed=i, sampler="dpmpp_2m", steps=4, guidance=3.0, prompt=p)
             for i, p in enumerate(["a red cat", "the big blue house drawn"])]
    got = Engine(away, WorkerConfig(backend="breakable", max_batch=2)).generate(specs)
    want = Engine(here, WorkerConfig(backend="breakable", max_batch=2)).generate(specs)
    for g, w in zip(got, want):
        assert ((g.latents - w.latents).abs().max() / w.latents.abs().max()).item() <= 1e-4
    encoders.clear()


def test_previews_on_the_gpu_do_not_change_the_images(pixart_cuda):
    """Previews copied to the host without waiting (pinned memory, an event) arrive at the asked steps,
    and the images are bit-equal to a run without them."""
    from dataclasses import replace

    from workers.engine import Engine
    from workers.request.spec import ItemSpec

    specs = [ItemSpec(id=str(i), seed=i, sampler="dpmpp_2m", steps=7, guidance=2.0, prompt="a red cat",
                      preview_every=2) for i in range(3)]
    engine = Engine(pixart_cuda, WorkerConfig(backend="breakable", max_batch=4))
    engine.warmup()
    got = engine.generate(specs)
    previews = engine.take_previews(wait=True)
    assert sorted((p.request_id, p.step) for p in previews) == [(str(i), s) for i in range(3) for s in (2, 4, 6)]
    assert all(p.image.dtype.name == "uint8" and p.image.shape[-1] == 3 for p in previews)
    want = engine.generate([replace(s, id=s.id + "b", preview_every=0) for s in specs])
    for g, w in zip(got, want):
        assert torch.equal(g.latents, w.latents)


def test_previews_add_no_host_wait_to_a_step(pixart_cuda):
    """Steps that take previews (taken after each step without waiting, as the worker does) make no more
    synchronising CUDA calls than steps that do not, counted by PyTorch's sync debug mode, but for at most
    one: the caching host allocator's first pinned block of a new size. The host keeps queueing steps
    ahead of the GPU. Before, the map's factors were built per call and a subset was gathered with a host
    index: three pageable copies, each waiting for the GPU, every previewed step (+15 here)."""
    import warnings

    from workers.engine import Engine
    from workers.request.spec import ItemSpec

    def syncs(preview_every: int) -> int:
        engine = Engine(pixart_cuda, WorkerConfig(backend="breakable", max_batch=4))
        engine.warmup()
        engine.add_many([ItemSpec(id=str(i), seed=i, sampler="dpmpp_2m", steps=12, guidance=2.0, prompt="a cat",
                                  preview_every=preview_every if i != 1 else 0) for i in range(3)])
        for _ in range(3):  # admission, and the first previews' pinned blocks, outside the count
            engine.step()
            engine.take_previews()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(5):
                    engine.step()
                    engine.take_previews()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        engine.take_previews(wait=True)
        return sum("synchroniz" in str(w.message) for w in seen)

    assert syncs(1) <= syncs(0) + 1


def test_the_text_encoder_replays_from_graphs_and_encodes_what_it_computes_eagerly(pixart_cuda):
    """Under a graph backend the engine captures T5 (``EncoderGraphs``): the shortest padded length at
    warm-up, others on first use; every batch replays (no eager fallback), and each embedding equals the
    plain encoder's (float32: the same kernels at the same shapes). An eager engine leaves the encoder plain."""
    from workers.families.encoders import padded_length
    from workers.engine import Engine
    from workers.families.pixart.runtime import real_length_encode
    from workers.request.spec import ItemSpec

    pixart_cuda.cache.clear()
    engine = Engine(pixart_cuda, WorkerConfig(backend="breakable", max_batch=4))
    engine.warmup()
    graphs = pixart_cuda.text_graphs
    shortest = padded_length(1, pixart_cuda.card.max_tokens)
    assert graphs is not None and list(graphs.runners) == [shortest]  # warm-up captured the shortest length
    long = " ".join(["a very long prompt about a cat"] * 3)
    texts = ["a red cat", "a dog", "the big blue house", long, "seven"]
    engine.generate([ItemSpec(id=str(i), seed=i, sampler="ddim", steps=2, guidance=2.0, prompt=t)
                     for i, t in enumerate(texts)])
    lengths = sorted(graphs.runners)
    assert len(lengths) >= 1 and all(r.warmed for r in graphs.runners.values())
    served = [s for r in graphs.runners.values() for s in r.stats()["buckets"].values()]
    assert sum(s["replays"] for s in served) >= 1 and sum(s["eager_fallbacks"] for s in served) == 0
    with torch.no_grad():
        graphed = real_length_encode(pixart_cuda, texts)
        pixart_cuda.text_graphs = None
        plain = real_length_encode(pixart_cuda, texts)
    for a, b in zip(graphed, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    Engine(pixart_cuda, WorkerConfig(backend="eager", max_batch=4))
    assert pixart_cuda.text_graphs is None


def test_a_compiled_captured_decode_makes_the_plain_decodes_images(pixart_cuda):
    """With the step compiled and ``decode_graphs`` on, the decode is compiled by Inductor once and replayed
    from graphs; its images equal the plain decode's within one level (float32)."""
    import numpy as np

    from workers.engine import Engine
    from workers.request.spec import ItemSpec

    specs = [ItemSpec(id=str(i), seed=i, sampler="dpmpp_2m", steps=3, guidance=2.0, prompt=f"a cat number {i}")
             for i in range(3)]
    plain = Engine(pixart_cuda, WorkerConfig(backend="eager", max_batch=4)).generate(specs)
    engine = Engine(pixart_cuda, WorkerConfig(backend="breakable", max_batch=4), speed=SpeedConfig(compile="inductor", decode_graphs=True))
    engine.warmup()
    got = engine.generate(specs)
    (stats,) = engine.stats()["groups"].values()
    decode = stats["decode_compile"]
    assert decode["compiled"] and decode["fallback_reason"] is None and decode["graphs"] <= 2, decode
    replays = sum(s["replays"] for s in engine.groups[next(iter(engine.groups))].decoder.stats()["buckets"].values())
    assert replays >= 1
    for a, b in zip(got, plain):
        assert np.abs(a.image.astype(int) - b.image.astype(int)).max() <= 1
    conv = next(m for m in pixart_cuda.vae.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)  # the compiled decode's layout


