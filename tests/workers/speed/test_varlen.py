"""The varlen cross-attention computes what diffusers' padded, masked cross-attention computes, over each
row's real keys only. A tiny PixArt transformer (the config of workers/models/tiny_pixart.py) in float32;
prompts of different real lengths in one batch, padding embeddings random garbage."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.kernels import varlen as varlen_kernels
from workers.kernels.varlen import cu_seqlens
from workers.speed import varlen
from workers.speed.varlen import key_lengths, restore_cross_attention, varlen_cross_attention

L = 16  # max_tokens of the tiny pipeline


def _tiny(head_dim: int = 8):
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(0)
    return PixArtTransformer2DModel(sample_size=8, in_channels=4, out_channels=8, patch_size=2, num_layers=2,
                                    num_attention_heads=2, attention_head_dim=head_dim,
                                    cross_attention_dim=2 * head_dim, caption_channels=32,
                                    norm_type="ada_norm_single").eval()


def _inputs(lengths: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    x, ctx = torch.randn(b, 4, 8, 8, generator=g), torch.randn(b, L, 32, generator=g)  # padding: garbage
    mask = (torch.arange(L) < torch.tensor(lengths)[:, None]).float()                 # (B, L) prefix
    return x, torch.linspace(1, 999, b), ctx, mask


def _forward(tf, x, t, ctx, mask):
    with torch.no_grad():
        return tf(x, encoder_hidden_states=ctx, encoder_attention_mask=mask, timestep=t,
                  added_cond_kwargs={"resolution": None, "aspect_ratio": None}).sample


@pytest.mark.parametrize("head_dim", [8, 72])  # 72: PixArt's
def test_varlen_matches_padded_attention_and_restores(head_dim):
    tf, inputs = _tiny(head_dim), _inputs([16, 5, 1, 9, 5])
    originals = [blk.attn2.processor for blk in tf.transformer_blocks]
    want = _forward(tf, *inputs)
    assert not torch.allclose(_forward(tf, *inputs[:3], None), want, atol=1e-3)  # the mask matters here
    varlen_cross_attention(tf)
    varlen_cross_attention(tf)  # idempotent: the same processors, one scratch
    procs = [blk.attn2.processor for blk in tf.transformer_blocks]
    assert all(isinstance(p, varlen.VarlenCrossAttention) for p in procs)
    assert len({id(p.scratch) for p in procs}) == 1 and [p.original for p in procs] == originals
    assert torch.allclose(_forward(tf, *inputs), want, atol=1e-5, rtol=1e-5)
    restore_cross_attention(tf)
    restore_cross_attention(tf)
    assert [blk.attn2.processor for blk in tf.transformer_blocks] == originals
    assert torch.equal(_forward(tf, *inputs), want)


def test_rows_are_independent():
    # row 1 changes its length (5 -> 12) and its padding garbage; rows 0, 2, 3 must not move
    tf = _tiny()
    varlen_cross_attention(tf)
    x, t, ctx, mask = _inputs([16, 5, 1, 9])
    before = _forward(tf, x, t, ctx, mask)
    ctx2, mask2 = ctx.clone(), mask.clone()
    ctx2[1, 5:] = torch.randn(L - 5, 32)
    mask2[1, :12] = 1.0
    after = _forward(tf, x, t, ctx2, mask2)
    keep = [0, 2, 3]
    assert torch.allclose(after[keep], before[keep], atol=1e-6, rtol=0)
    assert not torch.allclose(after[1], before[1], atol=1e-3)


def test_one_key_and_no_key_rows():
    # one key: the row attends to it alone, as the padded softmax does. No key (unreachable with T5, whose
    # </s> is always kept): the padded softmax over L equal biases is attention over all L keys, and the
    # varlen kernel takes all L. The padded model only approximates that: in float32, score - 10000 keeps
    # ~1e-3 of the score (2e-5 here); in fp16/bf16 it rounds scores to multiples of 8 or 64 (near-uniform).
    tf, inputs = _tiny(), _inputs([1, 0, 16])
    want, unmasked = _forward(tf, *inputs), _forward(tf, *inputs[:3], torch.ones(3, L))
    varlen_cross_attention(tf)
    got = _forward(tf, *inputs)
    assert torch.allclose(got[[0, 2]], want[[0, 2]], atol=1e-5, rtol=1e-5)
    assert torch.allclose(got[1], unmasked[1], atol=1e-5, rtol=1e-5)
    assert torch.allclose(got[1], want[1], atol=1e-4, rtol=0)


def test_key_lengths_from_every_mask_form():
    keep = torch.arange(L) < torch.tensor([3, 16, 0, 1])[:, None]             # (4, L) bool
    bias = ((1 - keep.float()) * -10000.0).unsqueeze(1)                        # (4, 1, L) as diffusers makes
    cpu = torch.device("cpu")
    per_head = bias.repeat_interleave(3, dim=0)                                # (4 * 3, 1, L) as a padded step
    for mask in (keep, keep.float(), bias, per_head):
        assert key_lengths(mask, 4, L, cpu).tolist() == [3, 16, L, 1]          # no key kept -> all L
    assert key_lengths(None, 4, L, cpu).tolist() == [L] * 4
    assert key_lengths(keep, 4, L, cpu).dtype == torch.int32


def test_cu_seqlens_address_queries_and_padded_key_slots():
    # B=3, T=4 queries, L=6 key slots: queries [0,4) [4,8) [8,12); slots start at 0, 6, 12
    cu_q, cu_k = cu_seqlens(3, 4, 6, torch.device("cpu"))
    assert cu_q.tolist() == [0, 4, 8, 12] and cu_k.tolist() == [0, 6, 12, 18]
    assert cu_q.dtype == cu_k.dtype == torch.int32


def _flash_on_cpu(q, k, v, cu_q, cu_k, max_q, max_k, used):
    """flash attention's varlen semantics, one row at a time: (T_total, h, d) queries of row i are
    q[cu_q[i]:cu_q[i+1]]; its keys k[cu_k[i] : cu_k[i] + used[i]]."""
    out = torch.empty_like(q)
    for i, n in enumerate(used.tolist()):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i] + n)
        assert cu_q[i + 1] - cu_q[i] <= max_q and 1 <= n <= min(max_k, cu_k[i + 1] - cu_k[i])  # inside its slot
        qh, kh, vh = (x.transpose(0, 1) for x in (q[qs], k[ks], v[ks]))                      # (h, n, d)
        out[qs] = F.scaled_dot_product_attention(qh, kh, vh).transpose(0, 1)
    return out


def test_flash_path_index_logic_on_cpu(monkeypatch):
    # the CUDA branch's layout (flattened q/k/v, cu_seqlens, seqused_k) with the kernel emulated on the CPU
    calls = []
    monkeypatch.setattr(varlen_kernels, "_flash_usable", lambda q: True)
    monkeypatch.setattr(varlen_kernels, "_flash_varlen", lambda *a: calls.append(a[-1]) or _flash_on_cpu(*a))
    tf, inputs = _tiny(72), _inputs([16, 5, 1, 3, 9])
    want = _forward(tf, *inputs)
    varlen_cross_attention(tf)
    assert torch.allclose(_forward(tf, *inputs), want, atol=1e-5, rtol=1e-5)
    assert [u.tolist() for u in calls] == [[16, 5, 1, 3, 9]] * 2  # seqused_k of each block's attn2


def test_masked_fallback_equals_grouped():
    # the in-capture fallback (boolean mask over all L) and the grouped one (per-length SDPA) agree
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, 8, 2, 72, generator=g)                                  # (B, T, h, d)
    k, v = torch.randn(2, 4, L, 2, 72, generator=g)                            # (B, L, h, d) each
    used = torch.tensor([1, 16, 7, 7], dtype=torch.int32)
    a, b = torch.empty_like(q), torch.empty_like(q)
    varlen_kernels._masked_into(q, k, v, used, a)
    varlen_kernels._grouped_into(q, k, v, used, b)
    assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_kernel_matches_masked_sdpa_gpu(dtype):
    if not varlen_kernels._flash_takes_seqused():
        pytest.skip("this torch's flash attention takes no seqused_k")
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(4, 64, 16, 72, device="cuda", dtype=dtype, generator=g)   # PixArt: 16 heads of 72
    k, v = (torch.randn(4, 300, 16, 72, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    used = torch.tensor([300, 7, 1, 120], dtype=torch.int32, device="cuda")
    assert varlen_kernels._flash_usable(q)
    got, want = torch.empty_like(q), torch.empty_like(q)
    varlen.varlen_attention_into(q, k, v, used, got)
    varlen_kernels._masked_into(q, k, v, used, want)
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=0)


@pytest.mark.gpu
def test_breakable_capture_replays_new_lengths_gpu():
    # capture with one set of lengths, replay with another: the break reads the new mask at replay
    from graphs import BreakableCUDAGraph

    tf = _tiny(72).cuda().half()
    x, t, ctx, mask = (a.cuda() for a in _inputs([16, 5, 1, 9]))
    x, ctx, mask = x.half(), ctx.half(), mask.half()
    out = torch.empty(4, 8, 8, 8, device="cuda", dtype=torch.half)
    body = lambda: out.copy_(_forward(tf, x, t, ctx, mask))
    varlen_cross_attention(tf)
    side = torch.cuda.Stream()  # warm-up on the capture stream: the scratch is allocated here, not in capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.synchronize()
    graph = BreakableCUDAGraph()
    with graph.capture(stream=side):
        body()
    assert graph.num_breaks == 2  # one per block's cross-attention
    mask.copy_((torch.arange(L, device="cuda") < torch.tensor([3, 16, 12, 1], device="cuda")[:, None]).half())
    graph.replay()
    torch.cuda.synchronize()
    restore_cross_attention(tf)
    want = _forward(tf, x, t, ctx, mask)  # diffusers' padded, masked attention on the new mask
    assert torch.allclose(out.float(), want.float(), atol=1e-2, rtol=0)
