"""The add + LayerNorm + modulation + FP8 row kernel (``workers.kernels.norm``) on a GPU: what its PyTorch
reference computes, inside a compiled function with a dynamic batch and a CUDA graph, and PixArt's fused
FP8 blocks (``workers.speed.norm_fusion``) on it against diffusers' blocks.

Tolerances. The residual x + gate * y is rounded to bf16 once by both (the kernel may fuse the multiply
and add, so a value on a rounding boundary can land one bf16 step away: at most 0.1% of values here). The
codes: the kernel and the reference compute the same float32 arithmetic in a different order, so a value
next to a code boundary can round either way: at most 2% of codes differ, each by one e4m3 step (at most
1/14 of its row's peak once dequantized)."""

from __future__ import annotations

from workers.speed.apply import to_precision

import pytest
import torch

pytestmark = pytest.mark.gpu

CASES = {"all": ("y", "gate", "shift", "scale"), "norm and modulation": ("shift", "scale"), "add only": ("y",),
         "add and gate": ("y", "gate")}


def _inputs(b, t, k, seed=0):
    g = torch.Generator("cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")
    table = (r(b, 6, k) * 0.3).bfloat16()
    x, y = r(b, t, k).bfloat16(), r(b, t, k).bfloat16()
    gate, shift, scale = table.chunk(6, dim=1)[:3]
    return dict(x=x, y=y, gate=gate, shift=shift, scale=scale)


def _close(got, want, norm_row: bool):
    (go, gq, gs), (wo, wq, ws) = got, want
    assert go.shape == wo.shape and gq.dtype == wq.dtype == torch.float8_e4m3fn
    assert (go != wo).float().mean() <= 1e-3
    assert torch.allclose(go.float(), wo.float(), rtol=2 ** -7, atol=0)
    assert torch.allclose(gs, ws, rtol=1e-2)
    assert (gq.float() != wq.float()).float().mean() <= 0.02
    deq = ((gq.float() * gs - wq.float() * ws).abs().amax(1) / (wq.float() * ws).abs().amax(1)).max()
    assert deq <= 1 / 14 + 1e-3, deq


@pytest.mark.parametrize("shape", [(64, 1024, 1152), (1, 4608, 3072), (3, 7, 100), (2, 4096, 1536)])
@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_computes_what_the_reference_does(shape, case):
    from workers.kernels import norm as norm_kernel

    inp = _inputs(*shape)
    norm = case != "add only" and case != "add and gate"
    kw = {k: inp[k] for k in CASES[case]}
    got = norm_kernel.add_norm_quantize(inp["x"], norm=norm, **kw)
    want = norm_kernel.reference(inp["x"], norm=norm, **kw)
    _close(got, want, norm)


def test_the_kernel_compiles_once_for_a_dynamic_batch_and_replays_from_a_cuda_graph():
    from workers.kernels import norm as norm_kernel

    def block(x, y, gate, shift, scale):
        out, q, s = norm_kernel.add_norm_quantize(x, y, gate, shift, scale)
        return out * 2, q, s

    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    fn = torch.compile(block, fullgraph=True, dynamic=True)
    for b in (2, 4, 8):
        inp = _inputs(b, 256, 1152, seed=b)
        got = fn(**inp)
        eager = block(**inp)
        assert torch.equal(got[0], eager[0]) and torch.equal(got[1].float(), eager[1].float())
    assert counts["stats"]["unique_graphs"] == 1, dict(counts["stats"])
    inp = _inputs(4, 256, 1152, seed=9)
    static = {k: v.clone() for k, v in inp.items()}
    fn(**static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(**static)
    for k, v in _inputs(4, 256, 1152, seed=10).items():
        static[k].copy_(v)
    graph.replay()
    want = block(**static)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1].float(), want[1].float())


@pytest.mark.parametrize("cross", ["varlen", "padded"])
def test_fused_norm_pixart_blocks_on_the_kernel_stay_close_to_diffusers_blocks(tmp_path, cross):
    """bf16 on CUDA: the fused path rounds once where diffusers rounds after each operation, and both
    quantize to FP8, so the outputs differ by FP8 code flips, far below the values."""
    from workers.families import family_named
    from workers.speed import norm_fusion

    pixart = family_named("pixart")
    from workers.loading import load_model
    from workers.models.tiny_pixart import make_tiny_pixart
    from workers.speed.patches import break_attention

    model = to_precision(load_model(make_tiny_pixart(tmp_path / "p"), device="cuda", dtype=torch.bfloat16, precision="fp8"))
    tr = model.transformer
    break_attention(tr)
    pixart.set_cross_attention(model, cross)
    assert norm_fusion.fuse_block_norms(tr) == len(tr.transformer_blocks)
    g = torch.Generator("cuda").manual_seed(0)
    for block in tr.transformer_blocks:
        d = block.norm1.normalized_shape[0]
        mask = torch.zeros(4, 1, 7, device="cuda", dtype=torch.bfloat16)
        mask[1, :, 5:] = -10000.0
        inputs = dict(hidden_states=torch.randn(4, 64, d, device="cuda", generator=g).bfloat16(),
                      timestep=(torch.randn(4, 6 * d, device="cuda", generator=g) * 0.3).bfloat16(),
                      encoder_hidden_states=torch.randn(4, 7, block.attn2.to_k.in_features, device="cuda",
                                                        generator=g).bfloat16(),
                      encoder_attention_mask=mask)
        with torch.no_grad():
            got = block(**inputs)
            block.__class__ = type(block).__mro__[1]
            want = block(**inputs)
            block.__class__ = norm_fusion._block_class()
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        print(f"{cross}: fused block vs diffusers' block, relative error {rel:.4f}")
        assert rel < 2e-2


@pytest.mark.parametrize("shape", [(1, 4096, 512, 3072), (3, 7, 5, 100), (2, 64, 0, 1152)])
def test_text_rows_are_read_before_the_images_as_their_concatenation(shape):
    """FLUX.1's single blocks: the text's rows then the image's, read from where they are (``text=``)."""
    from workers.kernels import norm as norm_kernel

    b, n, l, k = shape
    inp = _inputs(b, n, k)
    text = (torch.randn(b, l, k, device="cuda", generator=torch.Generator("cuda").manual_seed(3)) * 2).bfloat16()
    got = norm_kernel.add_norm_quantize(inp["x"], shift=inp["shift"], scale=inp["scale"], text=text)
    want = norm_kernel.reference(torch.cat([text, inp["x"]], dim=1), shift=inp["shift"], scale=inp["scale"])
    assert got[0] is inp["x"] and got[1].shape == (b * (n + l), k)
    _close((want[0], *got[1:]), want, True)
