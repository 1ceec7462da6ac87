"""The fused path on a GPU, every family: steps compiled by Inductor (``compile="inductor"``) inside the
workers' default graphs ("graphs": whole-step graphs, breakable ones where the family breaks its step)
make the images the eager engine makes, from one compile for every bucket.

Models: tiny random ones in the real layouts (DiT, PixArt-Σ with padded and with varlen cross-attention,
SD3.5, FLUX.1-dev), bf16, on CUDA. 13 requests of mixed prompts, negative prompts, guidance and samplers
(buckets 8 + 4 + 1 while all are active), 2 steps each. Tolerance, bf16: Inductor computes a fused
region's pointwise chain in float32 and rounds once, eager rounds after every operation, so the two
differ by bf16 rounding (2^-8 relative) compounded through two steps and the sampler's update. On a CPU
the same comparison reads 1.5-2.3% of the largest eager value at most and below 1% in the median, for
every family; asserted here: at most 5% for every request and 2% in the median. A wrong fused kernel
(a dropped modulation, a mask ignored, another request's row) is off by the size of the values.

Recompiles are counted: one dynamic-batch compile serves every bucket (``graphs == 1``), plus at most the
one-row one, and the compile did not fall back to the uncompiled step. Both compile scopes: the whole
step, and the transformer's blocks (``compile_scope="blocks"``; DiT keeps its whole step).

The digits oracle through the fused path: 500 digits (DDIM 50) read as asked on >= 90%, as the plain
graphs' test asserts (the text oracle through it is in test_fp8_gpu.py).
"""

from __future__ import annotations

from workers.config import WorkerConfig
from workers.speed import SpeedConfig

import statistics

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

PROMPTS = ("a red cat", "the big blue house", "a dog", "small green tree drawn", "a photo of a cat")
FAMILIES = [("dit", "auto"), ("pixart", "padded"), ("pixart", "varlen"), ("sd3", "auto"), ("flux", "auto")]
SCOPES = ["step", "blocks"]  # SpeedConfig.compile_scope: the whole step, or the transformer's blocks


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    """family -> tiny random model directory (made offline)."""
    from workers.models.tiny_dit import write_tiny_dit
    from workers.models.tiny_flux import make_tiny_flux
    from workers.models.tiny_pixart import make_tiny_pixart
    from workers.models.tiny_sd3 import make_tiny_sd3

    root = tmp_path_factory.mktemp("fused")
    write_tiny_dit(root / "dit")
    return {"dit": root / "dit", "pixart": make_tiny_pixart(root / "pixart"),
            "sd3": make_tiny_sd3(root / "sd3"), "flux": make_tiny_flux(root / "flux")}


def _specs(model, family: str, n: int = 13):
    from workers.request.spec import ItemSpec

    if family == "dit":
        return [ItemSpec(id=str(i), seed=i, label=i % model.num_classes, sampler=("ddim", "euler", "dpmpp_2m")[i % 3],
                         steps=2, guidance=1.0 + i % 4) for i in range(n)]
    sampler = "dpmpp_2m" if family == "pixart" else "flow_euler"
    return [ItemSpec(id=str(i), seed=i, sampler=sampler, steps=2, guidance=1.0 + i % 4, prompt=PROMPTS[i % 5],
                     negative_prompt="small" if i % 2 else "") for i in range(n)]


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("family,cross", FAMILIES)
def test_fused_graphs_make_what_eager_makes_from_one_compile(tiny_bf16, family, cross, scope):
    from workers.engine import Engine
    from workers.loading import load_model

    model = load_model(tiny_bf16[family], device="cuda", dtype=torch.bfloat16)
    specs = _specs(model, family)
    config = WorkerConfig(backend="graphs", max_batch=8)
    fused = Engine(model, config, speed=SpeedConfig(compile="inductor", cross_attention=cross, compile_scope=scope))
    fused.warmup()
    got = fused.generate(specs)
    want = Engine(model, WorkerConfig(backend="eager", max_batch=8), speed=SpeedConfig(cross_attention=cross)).generate(specs)
    errs = [((g.latents - w.latents).abs().max() / w.latents.abs().max()).item() for g, w in zip(got, want)]
    print(f"{family}/{cross}/{scope}: fused vs eager, max {max(errs):.4f}, median {statistics.median(errs):.4f}")
    assert max(errs) <= 5e-2 and statistics.median(errs) <= 2e-2, errs
    (stats,) = fused.stats()["groups"].values()
    assert stats["backend"] == fused.backend_for(model)
    assert stats["compile"]["compiled"] and stats["compile"]["fallback_reason"] is None, stats["compile"]
    assert stats["compile"]["graphs"] == 1 and stats["compile"]["one_row_graphs"] <= 1, stats["compile"]
    assert stats["compile"]["scope"] == ("blocks" if scope == "blocks" and family != "dit" else "step")
    buckets = stats["buckets"]
    assert all(s["eager_fallbacks"] == 0 and s["capture_failures"] == 0 for s in buckets.values())
    replayed = {b for b, s in buckets.items() if s["replays"]}
    assert 8 in replayed and replayed <= {1, 2, 4, 8}


def test_digits_through_fused_graphs_pass_the_oracle():
    from workers.models.digits import oracle_accuracy, sample_digits
    from workers.engine import Engine
    from workers.loading import load_model

    model = load_model("digits", device="cuda", dtype=torch.float32)
    engine = Engine(model, WorkerConfig(backend="graphs", max_batch=64), speed=SpeedConfig(compile="inductor"))
    engine.warmup()
    images, labels = sample_digits(engine, 50, "ddim", 50, model.defaults["guidance"])
    acc = oracle_accuracy(images, labels)
    print(f"digits oracle through fused graphs: {acc:.3f}")
    assert acc >= 0.90
    (stats,) = engine.stats()["groups"].values()
    assert stats["backend"] == "full" and stats["compile"]["graphs"] == 1
    assert sum(s["eager_fallbacks"] for s in stats["buckets"].values()) == 0
