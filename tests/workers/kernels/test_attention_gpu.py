"""FlashAttention-4 as an attention candidate on a GPU (workers/sdpa.py): each tiling computes what the math
kernel computes, on the projections' strided layout, written into the scratch in place, and replays from a
CUDA graph with fresh inputs; the chooser measures it on long sequences and keeps a correct pick. Skipped
where the optional ``flash-attn-4`` package is not installed or the GPU is older than Hopper."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.kernels import attention as sdpa

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9
                       or sdpa.fa4_forward() is None, reason="needs FlashAttention-4 on a Hopper-class GPU"),
]


def _projections(b: int, t: int, heads: int, d: int, seed: int):
    """q, k, v as (B, heads, T, d) column views of one fused (B*T, 3 x inner) projection, and the output slot
    of the attention scratch viewed the same way."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(b * t, 3 * heads * d, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = (x.view(b, t, heads, d).transpose(1, 2) for x in qkv.split(heads * d, dim=1))
    return qkv, (q, k, v)


@pytest.mark.parametrize("b, t, heads, d", [(2, 1024, 16, 72), (1, 1536, 24, 128), (2, 1024, 24, 64)])
@pytest.mark.parametrize("kernel", list(sdpa.FA4_TILES))
def test_each_fa4_tiling_matches_math_in_place_and_from_a_graph(kernel, b, t, heads, d):
    qkv, (q, k, v) = _projections(b, t, heads, d, seed=t + d)
    scratch = torch.full((b * t, heads * d), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = scratch.view(b, t, heads, d).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert sdpa.run(kernel, q, k, v, out).data_ptr() == out.data_ptr()
    assert not out.isnan().any()  # every element written
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sdpa.run(kernel, q, k, v, out)
    qkv.copy_(torch.randn_like(qkv))  # fresh inputs at the captured addresses
    scratch.fill_(float("nan"))
    graph.replay()
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 2e-2


def test_the_chooser_measures_fa4_on_long_sequences_and_keeps_a_correct_pick():
    chooser = sdpa.AttentionChooser()
    _, (q, k, v) = _projections(2, 4096, 16, 72, seed=1)
    kernel = chooser.kernel(q, k, v)
    choice = next(iter(chooser.choices.values()))
    assert set(sdpa.FA4_TILES) <= set(choice.ms) | set(choice.rejected)  # every tiling measured or refused
    assert kernel in choice.ms and choice.ms[kernel] == min(choice.ms.values())
    _, (q, k, v) = _projections(2, 256, 16, 72, seed=2)  # DiT-XL/2's 256 tokens: PyTorch's kernels only
    chooser.kernel(q, k, v)
    assert not set(sdpa.FA4_TILES) & set(chooser.choices[chooser.key(q, k, v)].ms)
