"""An FP8 attention kernel (Triton), measured against PyTorch's kernels by ``bench/row_kernels.py``.

Not used by the engine: a candidate, kept with its measurements. The engine's FP8 attention (precision
"fp8+attention") is cuDNN's kernel (``workers/fp8_attention.py``), which on an H200 ran FLUX.1 1024's attention
in 290 us where this one took 374 and bf16 cuDNN 408-433 (``docs/benchmarks/fp8_sdpa.md``).

What it computes: softmax(q k^T / sqrt(d)) v without a mask, for (B, heads, T, d) inputs. q, k and v are
scaled per (batch, head) by their largest magnitude into float8 e4m3 (``quantize_qkv``; v stored
transposed, as the FP8 tensor-core product wants its second operand), the scores accumulate in float32,
the online softmax is float32, and the probabilities enter the second product as FP8 codes of P * 256
(probabilities lie in [0, 1]; scaled up, small ones keep a code instead of flushing to zero). A head of
72 (DiT, PixArt) is held as tiles of 64 + 32 (FP8 products take 32 values at a time): 33% padding where
PyTorch's kernels run it as 128 (78%). FLUX's and SD3's heads (128, 64) are one tile.

Measured on an H200 (``docs/benchmarks/row_kernels_fp8_attention.md``): the kernel alone is 8-14% faster
than cuDNN's bf16 kernel at PixArt-Σ 1024 and FLUX.1 1024, and slower at SD3.5's head of 64; its error is
that of e4m3 (about 5% rms of the output on random inputs). ``quantize_qkv`` in PyTorch operations costs
more than the kernel saves, so what it lacks to be worth wiring in: the quantization fused into the
projections' epilogue (or one pass of its own), and Hopper's bulk copies and warp specialisation in the
main loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU builds have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only installs
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LOG2E = 1.4426950408889634


def head_parts(d: int) -> tuple[int, int]:
    """The head size as a power-of-two tile and a second, smaller one (0: none), each at least 32 values:
    72 -> (64, 32); 128 -> (128, 0); 100 -> (128, 0)."""
    first = max(32, 1 << (d.bit_length() - 1))
    rest = d - first
    if rest <= 0:
        return first, 0
    second = max(32, 1 << (rest - 1).bit_length())
    return (2 * first, 0) if second >= first else (first, second)


@dataclass(frozen=True)
class Tiles:
    """A launch's tiling: queries per program, keys per iteration, warps, pipeline stages."""

    block_m: int = 128
    block_n: int = 64
    warps: int = 4
    stages: int = 3


def available(q: torch.Tensor) -> bool:
    """Whether the kernel serves q: CUDA with FP8 tensor cores (8.9+), Triton present, (B, heads, T, d)."""
    return (triton is not None and q.is_cuda and q.dim() == 4 and 16 <= q.shape[-1] <= 256
            and torch.cuda.get_device_capability(q.device) >= (8, 9))


if triton is not None:

    @triton.jit
    def _attn_fwd(Q, K, V, O, S, qk_scale, H, TQ, TK,
                  sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, svd, sob, soh, sot,
                  D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        d0 = tl.arange(0, D0)
        rows = offs_m[:, None] < TQ
        qb, kb, vb = Q + b * sqb + h * sqh, K + b * skb + h * skh, V + b * svb + h * svh
        q0 = tl.load(qb + offs_m[:, None] * sqt + d0[None, :], mask=rows & (d0[None, :] < D), other=0.0)
        if D1 > 0:
            d1 = D0 + tl.arange(0, D1)
            q1 = tl.load(qb + offs_m[:, None] * sqt + d1[None, :], mask=rows & (d1[None, :] < D), other=0.0)
        scale = qk_scale * tl.load(S + bh * 3) * tl.load(S + bh * 3 + 1)  # q's and k's (batch, head) scales
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc0 = tl.zeros([BLOCK_M, D0], dtype=tl.float32)
        if D1 > 0:
            acc1 = tl.zeros([BLOCK_M, D1], dtype=tl.float32)
        for start in tl.range(0, TK, BLOCK_N):
            n = start + offs_n
            keys = n[:, None] < TK
            if EVEN_N:
                k0 = tl.load(kb + n[:, None] * skt + d0[None, :], mask=d0[None, :] < D, other=0.0)
            else:
                k0 = tl.load(kb + n[:, None] * skt + d0[None, :], mask=keys & (d0[None, :] < D), other=0.0)
            s = tl.dot(q0, tl.trans(k0))
            if D1 > 0:
                if EVEN_N:
                    k1 = tl.load(kb + n[:, None] * skt + d1[None, :], mask=d1[None, :] < D, other=0.0)
                else:
                    k1 = tl.load(kb + n[:, None] * skt + d1[None, :], mask=keys & (d1[None, :] < D), other=0.0)
                s = tl.dot(q1, tl.trans(k1), s)
            s = s * scale
            if not EVEN_N:
                s = tl.where(n[None, :] < TK, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            pv = (p * 256.0).to(tl.float8e4nv)
            if EVEN_N:
                v0 = tl.load(vb + n[:, None] * svt + d0[None, :] * svd, mask=d0[None, :] < D, other=0.0)
            else:
                v0 = tl.load(vb + n[:, None] * svt + d0[None, :] * svd, mask=keys & (d0[None, :] < D), other=0.0)
            acc0 = tl.dot(pv, v0, acc0 * alpha[:, None])
            if D1 > 0:
                if EVEN_N:
                    v1 = tl.load(vb + n[:, None] * svt + d1[None, :] * svd, mask=d1[None, :] < D, other=0.0)
                else:
                    v1 = tl.load(vb + n[:, None] * svt + d1[None, :] * svd, mask=keys & (d1[None, :] < D),
                                 other=0.0)
                acc1 = tl.dot(pv, v1, acc1 * alpha[:, None])
            m_i = m_new
        norm = tl.load(S + bh * 3 + 2) / 256.0 / l_i  # v's scale, and P's
        ob = O + b * sob + h * soh
        tl.store(ob + offs_m[:, None] * sot + d0[None, :], (acc0 * norm[:, None]).to(O.dtype.element_ty),
                 mask=rows & (d0[None, :] < D))
        if D1 > 0:
            tl.store(ob + offs_m[:, None] * sot + d1[None, :], (acc1 * norm[:, None]).to(O.dtype.element_ty),
                     mask=rows & (d1[None, :] < D))


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (B, heads, T, d) -> FP8 q and k (B, heads, T, width), v transposed (B, heads, width, T), each
    scaled per (batch, head) by its largest magnitude and zero-padded past d to the tiles' width; and the
    (B * heads, 3) float32 scales."""
    b, h, _, d = q.shape
    width = sum(head_parts(d))
    scales, out = [], []
    for i, t in enumerate((q, k, v)):
        s = (t.abs().amax(dim=(-2, -1), keepdim=True).float() / FP8_MAX).clamp_min(1e-12)   # (B, h, 1, 1)
        c = (t.float() / s).to(FP8)
        if width > d:
            c = torch.nn.functional.pad(c.view(torch.uint8), (0, width - d)).view(FP8)
        out.append(c.transpose(-1, -2).contiguous() if i == 2 else c.contiguous())
        scales.append(s.view(b * h))
    return (*out, torch.stack(scales, dim=1).contiguous())


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None,
              tiles: Tiles = Tiles()) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v of bf16 (B, heads, T, d) CUDA tensors, quantized here, into ``out``."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return launch(*quantize_qkv(q, k, v), out, tiles)


def launch(q8: torch.Tensor, k8: torch.Tensor, v8t: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
           tiles: Tiles = Tiles()) -> torch.Tensor:
    """The kernel on ``quantize_qkv``'s outputs, written into ``out`` (B, heads, T, d)."""
    b, h, tq, d = out.shape
    tk = k8.shape[2]
    d0, d1 = head_parts(d)
    grid = (triton.cdiv(tq, tiles.block_m), b * h)
    _attn_fwd[grid](q8, k8, v8t, out, scales, LOG2E / math.sqrt(d), h, tq, tk,
                    q8.stride(0), q8.stride(1), q8.stride(2), k8.stride(0), k8.stride(1), k8.stride(2),
                    v8t.stride(0), v8t.stride(1), 1, v8t.stride(2),  # v8t: keys along the last stride
                    out.stride(0), out.stride(1), out.stride(2),
                    D=d, D0=d0, D1=d1, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                    EVEN_N=tk % tiles.block_n == 0, num_warps=tiles.warps, num_stages=tiles.stages)
    return out
