"""Qwen-Image through graphs (GPU).

The tiny random Qwen-Image in the real layout (workers.models.tiny_qwenimage) on CUDA:

- float32: the engine's ``graphs`` backend (whole-step graphs: Qwen-Image's step has no eager breaks) gives
  every request the final latents eager gives, within 1e-5 of the largest value (a replay runs the kernels
  eager runs at the same shapes), with mixed prompts, negative prompts (and none), guidance scales above and
  at or below 1 and step counts in one replay: 7 requests replay in buckets 4 + 2 + 1 while all are active; no
  capture fails and no step falls back to eager. The masked joint attention, the true-CFG rescale and the
  per-row choice of guided or plain rows are all inside the captured step.
- float32, three image sizes in one engine (64x64, 96x64, 64x96): every shape captures into the device's one
  pool on one stream, and its replays equal eager.
- bfloat16, buckets 1, 2 and 4 each alone (every row guided: guided and plain rows are different step variants,
  so they fill different buckets): a replay equals eager within 1e-3 of the largest value (in practice
  bit-identical: the same kernels at the same shapes), the text encoder's rotary frequencies still float32.
- bfloat16, the fused path (``compile="inductor"``, the whole step, with the VAE decode captured and compiled
  too): the images and latents eager makes within bf16 rounding, as tests/workers/speed/test_fused_gpu.py
  asserts for the other families (5% of the largest eager value at most, 2% in the median), from one
  compile for every bucket. Slow (a cold Inductor compile).

Full size (``qwen-image-1024``, random weights, bf16, marked slow: the 20.4B MMDiT and Qwen2.5-VL-7B, about 54 GiB):
a ``full`` GraphRunner over the step replays what an eager one computes for buckets 1, 2 and 4, each bucket alone,
rows of scales 1 to 4 (true CFG and the plain prompt's forward, chosen per row) with negative prompts and none in
one batch: 1e-3 on ``x_next`` and 1e-2 on ``hist_next`` (``gpu_steps``), as FLUX.2 [klein], Z-Image and Sana.
"""

from __future__ import annotations

import functools
import statistics

import pytest
import torch

from workers.config import WorkerConfig

from .gpu_stats import fallbacks, pooled
from .gpu_steps import BF16_TOLERANCES, assert_replays_equal_eager, on_full_size, runner_outputs

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

PROMPTS = ("a red cat", "the big blue house", "a dog", "small green tree drawn on a table", "a photo of a cat")
GUIDANCE = (4.0, 1.0, 2.5, 0.0)  # true CFG, then the pipeline without it (<= 1), per row


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from workers.models.tiny_qwenimage import make_tiny_qwenimage

    return make_tiny_qwenimage(tmp_path_factory.mktemp("qwen") / "tiny-qwen-image")


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from workers.loading import load_model

    return load_model(tiny_dir, device="cuda", dtype=torch.float32)



def _specs(n: int, sizes=((0, 0),), steps: int = 6, guidance=GUIDANCE):
    from workers.request.spec import ItemSpec

    return [ItemSpec(id=str(i), seed=i, sampler="flow_euler", steps=steps + i % 3, guidance=guidance[i % len(guidance)],
                     prompt=PROMPTS[i % 5], negative_prompt="blurry" if i % 2 else "",
                     width=sizes[i % len(sizes)][0], height=sizes[i % len(sizes)][1]) for i in range(n)]


def _rel_errors(got, want) -> list[float]:
    out = []
    for g, w in zip(got, want):
        assert g.request.id == w.request.id and g.latents.shape == w.latents.shape
        assert torch.isfinite(g.latents).all()
        out.append(((g.latents - w.latents).abs().max() / w.latents.abs().max()).item())
    return out



def test_tiny_buckets_replay_what_eager_computes(tiny):
    from workers.engine import Engine

    specs = _specs(7)  # 7 = 4 + 2 + 1 while all are active
    graphs = Engine(tiny, WorkerConfig(backend="graphs", max_batch=4))
    graphs.warmup()
    got = graphs.generate(specs)
    want = Engine(tiny, WorkerConfig(backend="eager", max_batch=4)).generate(specs)
    assert max(_rel_errors(got, want)) <= 1e-5
    stats = pooled(graphs.stats()["groups"].values())
    assert stats["backend"] == "full" and fallbacks(stats) == 0, stats
    replayed = {b for b, s in stats["buckets"].items() if s["replays"]}
    assert 4 in replayed and replayed - {4}, replayed


def test_tiny_sizes_share_one_pool_and_replay_what_eager_computes(tiny):
    from workers.engine import Engine

    sizes = [(64, 64), (96, 64), (64, 96)]
    graphs = Engine(tiny, WorkerConfig(backend="graphs", max_batch=4))
    graphs.warmup(sizes=sizes)
    runners = [g.runner for g in graphs.groups.values()]
    assert len({g.shape for g in graphs.groups.values()}) == 3 and len(graphs._pools) == 1
    assert len({id(r._shared_pool) for r in runners}) == 1 and runners[0]._shared_pool is not None
    assert len({id(r._stream) for r in runners}) == 1
    specs = _specs(12, sizes)
    got = graphs.generate(specs)
    want = Engine(tiny, WorkerConfig(backend="eager", max_batch=4)).generate(specs)
    for g in got:
        assert g.image.shape[:2] == (g.request.height, g.request.width)
    assert max(_rel_errors(got, want)) <= 1e-5
    for group in graphs.stats()["groups"].values():
        assert fallbacks(group) == 0 and sum(s["replays"] for s in group["buckets"].values()) > 0


@pytest.mark.parametrize("bucket", [1, 2, 4])
def test_bf16_each_bucket_replays_what_eager_computes(tiny_dir, bucket):
    from workers.engine import Engine
    from workers.loading import load_model

    model = load_model(tiny_dir, device="cuda", dtype=torch.bfloat16)
    assert model.text_encoder.model.language_model.rotary_emb.inv_freq.dtype == torch.float32
    specs = _specs(bucket, steps=4, guidance=(4.0,))  # one step variant (true CFG): the rows fill one bucket
    graphs = Engine(model, WorkerConfig(backend="graphs", max_batch=bucket))
    graphs.warmup()
    got = graphs.generate(specs)
    want = Engine(model, WorkerConfig(backend="eager", max_batch=bucket)).generate(specs)
    assert max(_rel_errors(got, want)) <= 1e-3
    stats = pooled(graphs.stats()["groups"].values())
    assert fallbacks(stats) == 0 and stats["buckets"][bucket]["replays"] > 0, stats


@pytest.mark.slow
def test_bf16_fused_graphs_make_what_eager_makes_from_one_compile(tiny_dir):
    from workers.engine import Engine
    from workers.loading import load_model
    from workers.speed import SpeedConfig

    model = load_model(tiny_dir, device="cuda", dtype=torch.bfloat16)
    specs = _specs(13, steps=2)  # buckets 4 + 4 + 4 + 1 while all are active
    fused = Engine(model, WorkerConfig(backend="graphs", max_batch=4),
                   speed=SpeedConfig(compile="inductor", decode_graphs=True))
    fused.warmup()
    got = fused.generate(specs)
    want = Engine(model, WorkerConfig(backend="eager", max_batch=4)).generate(specs)
    errs = _rel_errors(got, want)
    print(f"qwenimage fused vs eager: max {max(errs):.4f}, median {statistics.median(errs):.4f}")
    assert max(errs) <= 5e-2 and statistics.median(errs) <= 2e-2, errs
    # the captured, compiled decode (LatentDecoder's statistics and time axis inside) makes eager's images, but
    # for the latents' bf16 differences: a few uint8 levels on average
    assert all(g.image.shape == w.image.shape for g, w in zip(got, want))
    assert max(abs(g.image.astype(int) - w.image.astype(int)).mean() for g, w in zip(got, want)) <= 8
    stats = pooled(fused.stats()["groups"].values())
    assert stats["compile"]["compiled"] and stats["compile"]["fallback_reason"] is None, stats["compile"]
    assert stats["compile"]["graphs"] == 1 and stats["compile"]["one_row_graphs"] <= 1, stats["compile"]
    assert fallbacks(stats) == 0, stats


# -- full size -----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_full_size_buckets_replay_what_eager_computes():
    check = functools.partial(runner_outputs, prompts=PROMPTS)
    assert_replays_equal_eager(*on_full_size("qwen-image-1024", check), tolerances=BF16_TOLERANCES)
