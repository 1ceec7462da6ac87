"""An FP8 output projection's rows quantized inside the attention break (``workers.speed.patches``,
``workers.speed.varlen``): the codes and scales live in the output slot of the shared scratch, and the model
computes exactly what it computed when the break wrote the attention's output and the projection
quantized it."""

from __future__ import annotations

import pytest
import torch

from workers.speed.apply import to_precision
from workers.speed import fp8, patches, varlen


def test_the_codes_and_scales_lie_in_the_output_slot_one_after_the_other():
    scratch = patches.AttentionScratch()
    qkv, o = scratch.fused_views(6, 32, torch.empty(1, dtype=torch.bfloat16))
    qkv.zero_()
    codes, scales = scratch.quantized(o)
    assert codes.shape == (6, 32) and codes.dtype == fp8.FP8 and scales.shape == (6, 1) and scales.dtype == torch.float32
    start, end = o.data_ptr(), o.data_ptr() + o.numel() * o.element_size()
    assert codes.data_ptr() == start and scales.data_ptr() == start + 6 * 32
    assert scales.data_ptr() + 6 * 4 <= end and scales.data_ptr() % 16 == 0
    codes.fill_(1.0), scales.fill_(2.0)  # writing them leaves q, k and v as they were
    assert qkv.eq(0).all() and scratch.buffer.numel() == 4 * 6 * 32
    with pytest.raises(ValueError, match="holds no FP8 codes"):
        scratch.quantized(scratch.views(4, 24, o)[3])  # 24 features: the scales would lose their alignment


def test_quantize_rows_into_writes_the_codes_quantize_rows_makes():
    x = torch.randn(5, 48) * 3
    codes, scales = torch.empty(5, 48, dtype=fp8.FP8), torch.empty(5, 1)
    fp8.quantize_rows_into(x, codes, scales)
    q, s = fp8.quantize_rows(x)
    assert torch.equal(codes.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scales, s)


@pytest.fixture(scope="module")
def tiny_pixart_fp8(tmp_path_factory):
    from workers.loading import load_model
    from workers.models.tiny_pixart import make_tiny_pixart

    return to_precision(load_model(make_tiny_pixart(tmp_path_factory.mktemp("p") / "pixart"), precision="fp8"))


def _inputs(tr, b=3, keys=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = tr.config
    mask = torch.ones(b, keys)
    mask[1, 4:] = 0  # the second prompt has 4 real tokens
    return dict(hidden_states=torch.randn(b, cfg.in_channels, cfg.sample_size, cfg.sample_size, generator=g),
                encoder_hidden_states=torch.randn(b, keys, cfg.caption_channels, generator=g),
                encoder_attention_mask=mask, timestep=torch.tensor([10, 500, 999][:b]),
                added_cond_kwargs={"resolution": None, "aspect_ratio": None})


@pytest.mark.parametrize("fused_norms", [True, False])
def test_pixart_fp8_with_quantized_breaks_is_bit_identical_to_the_plain_breaks(tiny_pixart_fp8, fused_norms,
                                                                                monkeypatch):
    from workers.speed import norm_fusion
    from workers.families import family_named

    pixart = family_named("pixart")

    tr = tiny_pixart_fp8.transformer
    patches.break_attention(tr)
    pixart.set_cross_attention(tiny_pixart_fp8, "varlen")
    calls = {"self": 0, "cross": 0}
    self_fn, cross_fn = patches.attention_quantized_into, varlen.varlen_attention_quantized_into

    def counted(fn, key):
        def call(*a, **k):
            calls[key] += 1
            return fn(*a, **k)
        return call

    monkeypatch.setattr(patches, "attention_quantized_into", counted(self_fn, "self"))
    monkeypatch.setattr(varlen, "varlen_attention_quantized_into", counted(cross_fn, "cross"))
    if fused_norms:
        norm_fusion.fuse_block_norms(tr)
    try:
        inputs = _inputs(tr)
        with torch.no_grad():
            got = tr(**inputs).sample
            layers = len(tr.transformer_blocks)
            assert calls == {"self": layers, "cross": layers}
            monkeypatch.setattr(patches, "quantized_output", lambda attn: False)  # the plain breaks
            monkeypatch.setattr(varlen, "quantized_output", lambda attn: False)
            want = tr(**inputs).sample
            assert calls == {"self": layers, "cross": layers}  # the plain breaks ran the second time
        assert torch.equal(got, want)
    finally:
        norm_fusion.restore_block_norms(tr)
        patches.restore_attention(tr)
        pixart.set_cross_attention(tiny_pixart_fp8, "padded")


def test_a_bf16_or_gelu_output_projection_keeps_the_plain_break(tmp_path):
    from torch import nn

    lin = nn.Linear(32, 32)
    attn = nn.Module()
    attn.to_out = nn.ModuleList([lin, nn.Identity()])
    assert not patches.quantized_output(attn)
    attn.to_out[0] = fp8.Fp8Linear(lin)
    assert patches.quantized_output(attn)
    attn.to_out[0].gelu = "tanh"
    assert not patches.quantized_output(attn)
    attn.to_out[0] = fp8.Fp8Linear(nn.Linear(24, 32))  # rows of 24: no aligned room for the scales
    assert not patches.quantized_output(attn)
