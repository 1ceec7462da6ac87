"""FLUX.1's q, k, v codes kernels (``workers.kernels.rope``) on a GPU: what their PyTorch reference computes at
FLUX.1-dev 1024's shapes and at odd ones (strided views of a wider projection output, a batch of 3, tokens not
a multiple of a program's), inside a compiled function with a dynamic batch and a CUDA graph.

Tolerances. v's codes and descale are the reference's bit for bit (the same float32 product by a power of
two). q's and k's: the kernel and the reference compute the same float32 arithmetic in another order, so a
value on a code boundary can round either way: at most 1% of codes differ, none by more than one e4m3 step."""

from __future__ import annotations

import pytest
import torch

from workers.kernels import fp8_attention as fa

pytestmark = pytest.mark.gpu


def _inputs(b, n, l, heads, d, seed=0, strided=False):
    g = torch.Generator("cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")

    def qkv(t, spread):
        if strided:  # views of one (B, T, 3 * heads * d) product, as a fused projection lays them out
            whole = (r(b, t, 3 * heads * d) * spread).bfloat16()
            return [y.unflatten(-1, (heads, d)) for y in whole.split(heads * d, dim=-1)]
        return [(r(b, t, heads, d) * spread).bfloat16() for _ in range(3)]

    image = qkv(n, 4.0) + [(1 + 0.3 * r(d)).bfloat16(), (1 + 0.3 * r(d)).bfloat16()]
    text = (qkv(l, 1.0) + [(1 + 0.3 * r(d)).bfloat16(), (1 + 0.3 * r(d)).bfloat16()]) if l else None
    angles = r(n + l, d // 2).repeat_interleave(2, dim=1)
    scale = lambda s: torch.full((1, 1, 1, 1), 1.0 / s, device="cuda")
    return image, text, angles.cos(), angles.sin(), scale(16.0), scale(8.0)


def _step_apart(got, want):
    """Codes of one e4m3 format: the share that differ, and whether any differs by more than one step."""
    a, b = got.view(torch.uint8).to(torch.int16), want.view(torch.uint8).to(torch.int16)
    same_sign = (a >> 7) == (b >> 7)
    apart = torch.where(same_sign, (a - b).abs(), torch.full_like(a, 255))  # codes are ordered within a sign
    zero_cross = ((a & 0x7F) <= 1) & ((b & 0x7F) <= 1)  # +-0 and the smallest codes next to them
    return (a != b).float().mean().item(), bool(((apart > 1) & ~zero_cross).any())


@pytest.mark.parametrize("shape", [(1, 4096, 512, 24, 128), (1, 4608, 0, 24, 128), (3, 37, 5, 3, 64),
                                   (2, 300, 77, 4, 128)])
@pytest.mark.parametrize("rope", [True, False])
def test_the_kernels_compute_what_the_reference_does(shape, rope):
    from workers.kernels import rope as rope_kernel

    b, n, l, heads, d = shape
    image, text, cos, sin, dq, dk = _inputs(*shape, strided=n == 300)
    if not rope:
        cos = sin = None
    got = rope_kernel.joint_codes(*image, dq, dk, cos, sin, text=text, output_scales=True)
    want = rope_kernel.reference(*image, dq, dk, cos, sin, text=text)
    assert torch.equal(got[4], fa.output_descale(want[3])) and torch.equal(got[5], fa.output_scale(want[3]))
    for g, w in zip(got[:3], want[:3]):
        assert g.shape == w.shape == (b, n + l, heads, d) and g.dtype == w.dtype == torch.float8_e4m3fn
    assert torch.equal(got[2].view(torch.uint8), want[2].view(torch.uint8))  # v
    assert torch.equal(got[3], want[3])  # v's descale
    for g, w in zip(got[:2], want[:2]):  # q, k
        share, far = _step_apart(g, w)
        assert share <= 0.01 and not far, (share, far)


def test_the_kernels_compile_once_for_a_dynamic_batch_and_replay_from_a_cuda_graph():
    from workers.kernels import rope as rope_kernel

    def block(image, text, cos, sin, dq, dk):
        q8, k8, v8, dv = rope_kernel.joint_codes(*image, dq, dk, cos, sin, text=text)
        return q8.float() * dq, k8, v8, dv * 2

    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    fn = torch.compile(block, fullgraph=True, dynamic=True)
    for b in (2, 3, 4):  # from 2: a batch of 1 is a size dynamo specialises
        inp = _inputs(b, 256, 64, 4, 128, seed=b)
        got, eager = fn(*inp), block(*inp)
        assert all(torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                               y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y) for x, y in zip(got, eager))
    assert counts["stats"]["unique_graphs"] == 1, dict(counts["stats"])
    static = _inputs(2, 256, 64, 4, 128, seed=9)
    fn(*static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)
    fresh = _inputs(2, 256, 64, 4, 128, seed=10)
    for mine, new in zip(static[0] + static[1], fresh[0] + fresh[1]):
        mine.copy_(new)
    graph.replay()  # the amax starts from zero in every replay: v's scale is this replay's
    want = block(*static)
    assert torch.equal(out[0], want[0]) and torch.equal(out[2].view(torch.uint8), want[2].view(torch.uint8))
    assert torch.equal(out[3], want[3])


@pytest.mark.parametrize("shape", [(1, 4096, 512, 24, 128), (1, 4608, 0, 24, 128), (3, 37, 5, 3, 64)])
def test_the_bf16_pass_computes_what_its_reference_does(shape):
    """``joint_qkv`` (bf16 attention's q, k, v): v copied as it is, q and k within one bf16 step of the float32
    reference rounded once (the sums in another order)."""
    from workers.kernels import rope as rope_kernel

    b, n, l, heads, d = shape
    image, text, cos, sin, _, _ = _inputs(*shape, strided=n == 4096)
    got = rope_kernel.joint_qkv(*image, cos, sin, text=text)
    want = rope_kernel.reference_qkv(*image, cos, sin, text=text)
    assert all(g.shape == w.shape == (b, n + l, heads, d) and g.dtype == torch.bfloat16 for g, w in zip(got, want))
    assert torch.equal(got[2], want[2])
    for g, w in zip(got[:2], want[:2]):
        assert (g != w).float().mean() <= 0.01
        torch.testing.assert_close(g.float(), w.float(), rtol=2 ** -7, atol=1e-6)


def test_the_bf16_pass_compiles_once_for_a_dynamic_batch_and_replays_from_a_cuda_graph():
    from workers.kernels import rope as rope_kernel

    def block(image, text, cos, sin):
        q, k, v = rope_kernel.joint_qkv(*image, cos, sin, text=text)
        return q * 2, k, v

    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    fn = torch.compile(block, fullgraph=True, dynamic=True)
    for b in (2, 3, 4):
        image, text, cos, sin, _, _ = _inputs(b, 256, 64, 4, 128, seed=b)
        assert all(torch.equal(x, y) for x, y in zip(fn(image, text, cos, sin), block(image, text, cos, sin)))
    assert counts["stats"]["unique_graphs"] == 1, dict(counts["stats"])
    image, text, cos, sin, _, _ = _inputs(2, 256, 64, 4, 128, seed=9)
    fn(image, text, cos, sin)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(image, text, cos, sin)
    fresh = _inputs(2, 256, 64, 4, 128, seed=10)
    for mine, new in zip(image + text, fresh[0] + fresh[1]):
        mine.copy_(new)
    graph.replay()
    assert all(torch.equal(x, y) for x, y in zip(out, block(image, text, cos, sin)))
