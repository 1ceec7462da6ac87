"""The attention breaks that quantize their result for an FP8 output projection (``workers.speed.patches``,
``workers.speed.varlen``) on a GPU: the row kernel writes its codes into the scratch's output slot, the codes are
those the projection made from the copied output before, and engines with the quantized breaks make the
latents they made without them, under graph replay and compiled by blocks."""

from __future__ import annotations

import pytest
import torch

from workers.config import WorkerConfig
from workers.speed.apply import to_precision
from workers.speed import SpeedConfig
from workers.speed import fp8, patches, varlen

pytestmark = pytest.mark.gpu


def _same_codes(got, want):
    (gq, gs), (wq, ws) = got, want
    assert torch.equal(gq.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(gs, ws)


@pytest.mark.parametrize("rows, dim", [(65536, 1152), (8192, 1152), (3, 3072), (4608, 3072)])
def test_the_kernel_writes_the_codes_quantize_rows_makes_into_the_output_slot(rows, dim):
    x = torch.randn(rows, dim, device="cuda").bfloat16() * 4
    scratch = patches.AttentionScratch()
    _, o = scratch.fused_views(rows, dim, x)
    codes, scales = scratch.quantized(o)
    fp8.quantize_rows_into(x, codes, scales)
    _same_codes((codes, scales), fp8.quantize_rows(x))


@pytest.mark.parametrize("b, t, heads, d", [(8, 1024, 16, 72), (2, 256, 16, 72), (1, 4096, 24, 128)])
def test_the_self_attention_break_quantizes_the_rows_the_attention_made(b, t, heads, d):
    from workers.kernels.attention import attention

    inner = heads * d
    scratch = patches.AttentionScratch()
    like = torch.empty(1, device="cuda", dtype=torch.bfloat16)
    qkv, o = scratch.fused_views(b * t, inner, like)
    qkv.copy_(torch.randn(b * t, 3 * inner, device="cuda").bfloat16())
    split = lambda y: y.view(b, t, heads, d).transpose(1, 2)
    q, k, v = (split(y) for y in qkv.split(inner, dim=1))
    codes, scales = scratch.quantized(o)
    patches.attention_quantized_into(q, k, v, codes, scales)
    rows = attention(q, k, v).transpose(1, 2).reshape(b * t, inner)
    _same_codes((codes, scales), fp8.quantize_rows(rows))


def test_the_varlen_break_quantizes_the_rows_of_each_prompts_real_keys():
    b, t, keys, heads, d = 4, 1024, 300, 16, 72
    g = torch.Generator("cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g).bfloat16()
    q, k, v = r(b, t, heads, d), r(b, keys, heads, d), r(b, keys, heads, d)
    used = torch.tensor([300, 17, 1, 120], dtype=torch.int32, device="cuda")
    scratch = patches.AttentionScratch()
    o = scratch.views(b * max(t, keys), heads * d, q)[3][:b * t]
    codes, scales = scratch.quantized(o)
    varlen.varlen_attention_quantized_into(q, k, v, used, codes, scales)
    plain = torch.empty_like(q)
    varlen.varlen_attention_into(q, k, v, used, plain)
    _same_codes((codes, scales), fp8.quantize_rows(plain.view(b * t, heads * d)))


@pytest.mark.parametrize("compile_mode", ["off", "inductor"])
def test_engines_with_quantized_breaks_make_the_latents_they_made_without(tmp_path, compile_mode, monkeypatch):
    from workers.speed import norm_fusion
    from workers.engine import Engine
    from workers.loading import load_model
    from workers.models.tiny_pixart import make_tiny_pixart
    from workers.request.spec import ItemSpec

    folder = make_tiny_pixart(tmp_path / "p")
    specs = [ItemSpec(id=str(i), seed=i, sampler="dpmpp_2m", steps=4, guidance=1.0 + i, prompt=p)
             for i, p in enumerate(["a red cat", "the big blue house", "a dog", "a cat"])]
    calls, runs = [], {}
    real = patches.attention_quantized_into
    for on in (True, False):
        if not on:  # the plain breaks: the output projections quantize the rows themselves
            monkeypatch.setattr(patches, "quantized_output", lambda attn: False)
            monkeypatch.setattr(varlen, "quantized_output", lambda attn: False)
        model = to_precision(load_model(folder, device="cuda", dtype=torch.bfloat16, precision="fp8"))
        monkeypatch.setattr(patches, "attention_quantized_into", lambda *a: calls.append(on) or real(*a))
        engine = Engine(model, WorkerConfig(backend="breakable", max_batch=4), speed=SpeedConfig(cross_attention="varlen", compile=compile_mode, compile_scope="blocks"))
        engine.warmup()
        assert norm_fusion.fused_blocks(model.transformer) == len(model.transformer.transformer_blocks)
        runs[on] = [r.latents for r in engine.generate(specs)]
        stats = next(iter(engine.stats()["groups"].values()))
        assert sum(s["eager_fallbacks"] for s in stats["buckets"].values()) == 0
        if compile_mode != "off":
            assert stats["compile"]["fallback_reason"] is None
    assert True in calls and False not in calls  # only the engine with the quantized breaks took them
    for got, want in zip(runs[True], runs[False]):
        rel = ((got - want).abs().max() / want.abs().max()).item()
        assert rel == 0.0 if compile_mode == "off" else rel < 1e-3, rel
