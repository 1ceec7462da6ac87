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

import pytest
import torch

from workers.config import WorkerConfig

from .gpu_stats import fallbacks, pooled
from .gpu_steps import BF16_TOLERANCES, PROMPTS, assert_replays_equal_eager, on_full_size, runner_outputs

pytestmark = pytest.mark.gpu

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


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_every_bucket_replays_what_eager_computes(tiny, variant):
    assert_replays_equal_eager(*runner_outputs(tiny[variant]))


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
    assert_replays_equal_eager(*on_full_size("flux2-klein-1024", runner_outputs), tolerances=BF16_TOLERANCES)
