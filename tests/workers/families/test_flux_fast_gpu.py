"""FLUX.1's fused-norm blocks (``workers.families.flux.fast``) on a GPU, on the norm kernel
(``workers.kernels.norm``) in the engine's compiled graphs."""

from __future__ import annotations

import pytest
import torch

from workers.families.flux import fast
from workers.speed import SpeedConfig
from workers.speed.apply import to_precision

pytestmark = pytest.mark.gpu


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp8", "fp8+attention"])
def test_fused_norm_flux_blocks_in_compiled_graphs_stay_close_to_their_own_forward(tmp_path, precision):
    """The tiny FLUX.1 in FP8 through the engine's compiled graphs (blocks scope, three buckets): with its blocks'
    norms fused (and one product for each stream's q, k, v) against the same model without, one compiled graph
    for all buckets, every block fused."""
    from unittest import mock

    from workers.kernels import fp8_attention
    from workers.config import WorkerConfig
    from workers.engine import Engine
    from workers.loading import load_model
    from workers.models.tiny_flux import make_tiny_flux
    from workers.request.spec import ItemSpec

    if precision == "fp8+attention" and (why := fp8_attention.unavailable_reason("cuda")) is not None:
        pytest.skip(why)
    model = to_precision(load_model(make_tiny_flux(tmp_path / "flux", head_dim=16), device="cuda", dtype=torch.bfloat16,
                       precision=precision))
    specs = [ItemSpec(id=str(i), seed=i, sampler="flow_euler", steps=2, guidance=1.0 + i % 4,
                      prompt=("a red cat", "the big blue house", "a dog")[i % 3]) for i in range(13)]
    config = WorkerConfig(backend="graphs", max_batch=8)
    speed = SpeedConfig(compile="inductor", compile_scope="blocks")
    with mock.patch.object(fast, "fuse_block_norms", lambda tr: 0):  # the same model without
        plain = Engine(model, config, speed=speed)
    tr = model.transformer
    assert fast.fused_blocks(tr) == 0
    want = plain.generate(specs)
    del plain
    engine = Engine(model, config, speed=speed)
    assert fast.fused_blocks(tr) == len(tr.transformer_blocks) + len(tr.single_transformer_blocks)
    got = engine.generate(specs)
    (stats,) = engine.stats()["groups"].values()
    assert stats["compile"]["compiled"] and stats["compile"]["fallback_reason"] is None, stats["compile"]
    assert stats["compile"]["graphs"] == 1 and stats["compile"]["one_row_graphs"] <= 1, stats["compile"]
    errs = [((g.latents - w.latents).float().norm() / w.latents.float().norm()).item() for g, w in zip(got, want)]
    print(f"FLUX.1 tiny {precision}, fused norms against Inductor's: latents rel. diff max {max(errs):.4f}")
    assert max(errs) < 0.05, errs
    fast.restore_block_norms(tr)
