"""FLUX.1's q, k, v codes for FP8 attention in one pass (``workers.kernels.rope``), on a CPU through its PyTorch
reference: what diffusers' norms, concatenation and rotary embedding make, coded; and the routed FLUX.1
processor in FP8 taking that path in its double and single blocks. The Triton kernels against the reference,
compiled and in CUDA graphs: tests/workers/test_rope_kernel_gpu.py."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.embeddings import apply_rotary_emb

from workers.kernels import fp8_attention as fa
from workers.kernels import rope as rope_kernel
from workers.families.flux.attention import RoutedFluxAttention
from workers.speed.routing import route_joint_attention

from .test_fp8_attention import _rel_rms, _tiny_flux
from tests.workers.speed.test_joint_attention import _flux_inputs, _run


def _parts(b=2, n=12, l=5, heads=3, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    image = [r(b, n, heads, d) * 3 for _ in range(3)] + [1 + 0.3 * r(d), 1 + 0.3 * r(d)]
    text = [r(b, l, heads, d) for _ in range(3)] + [1 + 0.3 * r(d), 1 + 0.3 * r(d)]
    angles = r(n + l, d // 2).repeat_interleave(2, dim=1)
    return image, text, angles.cos(), angles.sin()


def _diffusers(image, text, cos, sin, eps=1e-6):
    """What FLUX.1's processor computes before the attention, in float32: per-head RMS norms with the text's and
    the image's weights, the text first, the rotary embedding (diffusers' own functions)."""
    def normed(x, w):
        norm = torch.nn.RMSNorm(x.shape[-1], eps=eps)
        norm.weight.data.copy_(w)
        return norm(x)

    q = torch.cat([normed(text[0], text[3]), normed(image[0], image[3])], dim=1)
    k = torch.cat([normed(text[1], text[4]), normed(image[1], image[4])], dim=1)
    v = torch.cat([text[2], image[2]], dim=1)
    return apply_rotary_emb(q, (cos, sin), sequence_dim=1), apply_rotary_emb(k, (cos, sin), sequence_dim=1), v


def _descale(s):
    return torch.full((1, 1, 1, 1), 1.0 / s)


def test_the_reference_codes_what_diffusers_norms_and_rotates():
    image, text, cos, sin = _parts()
    dq, dk = _descale(64.0), _descale(32.0)
    q8, k8, v8, dv = rope_kernel.joint_codes(*image, dq, dk, cos, sin, text=text)
    q, k, v = _diffusers(image, text, cos, sin)
    assert q8.shape == k8.shape == v8.shape == (2, 17, 3, 16) and q8.dtype == fa.FP8
    for codes, want, descale in ((q8, q, dq), (k8, k, dk)):
        expect = (want * (1 / descale.item())).clamp(-448, 448).to(fa.FP8)
        differ = (codes.float() != expect.float()).float().mean().item()
        assert differ <= 0.01, differ  # float32 in another order: a value on a code boundary may round the other way
        assert torch.allclose(codes.float() * descale.item(), want, rtol=2 ** -3, atol=2 ** -9 * 448 * descale.item())
    v8_want, dv_want = fa.quantize(v)  # v exactly as the attention's own quantization
    assert torch.equal(v8.view(torch.uint8), v8_want.view(torch.uint8)) and torch.equal(dv, dv_want)
    *codes, descale_o, scale_o = rope_kernel.joint_codes(*image, dq, dk, cos, sin, text=text, output_scales=True)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(codes, (q8, k8, v8)))
    assert torch.equal(descale_o, dv / fa.O_HEADROOM) and torch.equal(scale_o * descale_o, torch.ones_like(dv))


def test_each_part_is_normed_by_its_own_weights_and_rotation_is_optional():
    image, text, cos, sin = _parts(seed=3)
    dq = dk = _descale(16.0)
    plain = rope_kernel.reference(*image, dq, dk)  # one part (a single block), no rotary embedding
    normed = image[0] * torch.rsqrt(image[0].pow(2).mean(-1, keepdim=True) + 1e-6) * image[3]
    assert torch.equal(plain[0], (normed * 16).clamp(-448, 448).to(fa.FP8))
    swapped = rope_kernel.reference(*image, dq, dk, cos, sin, text=[*text[:3], text[4], text[3]])
    q8 = rope_kernel.reference(*image, dq, dk, cos, sin, text=text)[0]
    assert not torch.equal(q8[:, :5].float(), swapped[0][:, :5].float())  # the text's q took its k's weight
    assert torch.equal(q8[:, 5:].float(), swapped[0][:, 5:].float())  # the image's did not move


def test_the_kernels_are_not_offered_off_cuda():
    assert not rope_kernel.available(torch.zeros(1, 2, 3, 16))


def test_routed_flux_in_fp8_makes_its_codes_in_one_pass_per_block(monkeypatch):
    """The double block (text and image parts) and both single blocks go through ``joint_codes``; the model
    computes what the path before (the norms and rotation, then the codes) does, and stays within FP8 attention's
    error of float32."""
    model, x = _tiny_flux(), _flux_inputs()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.RMSNorm):
                m.weight.normal_(1.0, 0.2)
    ref = _run(model, x)
    assert route_joint_attention(model, fp8=True) == 3
    calls = []
    real = rope_kernel.joint_codes
    monkeypatch.setattr(rope_kernel, "joint_codes",
                        lambda *a, **kw: calls.append(kw.get("text") is not None or a[9] is not None) or real(*a, **kw))
    out = _run(model, x)
    assert sorted(calls) == [False, False, True]  # 2 single blocks, 1 double block with its text
    monkeypatch.setattr(RoutedFluxAttention, "_qkv_codes", lambda *a, **kw: None)  # the path without the kernel
    calls.clear()
    before = _run(model, x)
    assert calls == []
    assert _rel_rms(out, before) < 1e-3, _rel_rms(out, before)  # float32 here: the same values but for rounding order
    assert 1e-4 < _rel_rms(out, ref) < 0.05, _rel_rms(out, ref)


@pytest.mark.parametrize("change", ["bias", "eps", "no rotary"])
def test_norms_or_rotations_the_kernel_does_not_cover_keep_the_path_before(change, monkeypatch):
    model = _tiny_flux()
    route_joint_attention(model, fp8=True)
    block = model.transformer_blocks[0]
    attn, processor = block.attn, block.attn.processor
    assert isinstance(processor, RoutedFluxAttention)
    h, e = torch.randn(1, 16, 32), torch.randn(1, 5, 32)
    rot = (torch.ones(21, 16), torch.zeros(21, 16))
    if change == "bias":
        attn.norm_q.bias = torch.nn.Parameter(torch.zeros(16))
    elif change == "eps":
        attn.norm_added_k.eps = 1e-5
    else:
        rot = (torch.ones(20, 16), torch.zeros(20, 16))  # not one row per token: not this kernel's contract
    assert processor._qkv_codes(attn, h, e, rot) is None
    if change == "bias":
        del attn.norm_q.bias
    assert (processor._qkv_codes(attn, h, e, (torch.ones(21, 16), torch.zeros(21, 16))) is None) == (change == "eps")


def test_the_bf16_pass_is_what_diffusers_norms_rotates_and_concatenates():
    image, text, cos, sin = _parts(seed=5)
    q, k, v = rope_kernel.joint_qkv(*image, cos, sin, text=text)
    want = _diffusers(image, text, cos, sin)
    for got, w in zip((q, k, v), want):
        assert got.shape == (2, 17, 3, 16) and got.dtype == image[0].dtype
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
    single = rope_kernel.joint_qkv(*image)  # one part, no rotary embedding: the norms and v as they are
    torch.testing.assert_close(single[2], image[2], rtol=0, atol=0)
    torch.testing.assert_close(single[0], rope_kernel._normed(image[0], image[3], 1e-6))
    half = rope_kernel.reference_qkv(*(x.bfloat16() for x in image[:3]), *image[3:], cos[5:], sin[5:])
    assert all(x.dtype == torch.bfloat16 for x in half)  # rounded once, to the projections' dtype


def test_routed_flux_in_bf16_takes_the_one_pass(monkeypatch):
    """bf16 attention (no FP8): the double block and both single blocks take q, k, v from ``joint_qkv``; the
    model computes what diffusers' norms and rotation give (float32 on a CPU), the path a norm the kernel does
    not cover takes (``_kernel_args`` None)."""
    model, x = _tiny_flux(), _flux_inputs()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.RMSNorm):
                m.weight.normal_(1.0, 0.2)
    assert route_joint_attention(model) == 3
    calls = []
    real = rope_kernel.joint_qkv
    monkeypatch.setattr(rope_kernel, "joint_qkv", lambda *a, **kw: calls.append(a[7] is not None) or real(*a, **kw))
    with monkeypatch.context() as m:
        m.setattr(RoutedFluxAttention, "_kernel_args", lambda *a, **kw: None)
        before = _run(model, x)
    assert calls == []
    out = _run(model, x)
    assert sorted(calls) == [False, False, True]  # 2 single blocks, 1 double block with its text
    assert _rel_rms(out, before) < 1e-5, _rel_rms(out, before)
