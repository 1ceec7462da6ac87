"""PixArt through graphs (GPU): with mixed prompts in one replay, every bucket's replay equals eager
(tiny random PixArt-Σ in the real layout, float32: at most 1e-5 relative on the final latents; the
graph replays the kernels eager runs at the same shape), and no step falls back to eager."""

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def pixart_cuda(tmp_path_factory):
    from workers.loading import load_model
    from workers.models.tiny_pixart import make_tiny_pixart

    return load_model(make_tiny_pixart(tmp_path_factory.mktemp("pixart")), device="cuda", dtype=torch.float32)


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_pixart_buckets_replay_what_eager_computes(pixart_cuda, backend):
    from workers.engine import Engine, EngineConfig
    from workers.spec import ItemSpec

    prompts = ["a red cat", "the big blue house", "a dog", "small green tree drawn", "a photo of a cat"]
    specs = [ItemSpec(id=str(i), seed=i, sampler=("dpmpp_2m", "ddim", "euler")[i % 3], steps=8 + i % 5,
                      guidance=1.0 + i % 4, prompt=prompts[i % 5], negative_prompt="small" if i % 2 else "")
             for i in range(13)]  # 13 = 8 + 4 + 1 replays while all are active
    graphs = Engine(pixart_cuda, EngineConfig(backend=backend, max_batch=8))
    graphs.warmup()
    got = graphs.generate(specs)
    want = Engine(pixart_cuda, EngineConfig(backend="eager", max_batch=8)).generate(specs)
    for g, w in zip(got, want):
        err = ((g.latents - w.latents).abs().max() / w.latents.abs().max()).item()
        assert err <= 1e-5, (g.request.id, err)
    stats = next(iter(graphs.stats()["groups"].values()))
    assert sum(s["eager_fallbacks"] for s in stats["buckets"].values()) == 0
    assert {b for b, s in stats["buckets"].items() if s["replays"]} >= {1, 4, 8}
