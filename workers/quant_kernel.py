"""One-pass FP8 row quantization on CUDA (a Triton kernel), optionally with the GELU before it.

Why a kernel of our own
-----------------------
FP8 linears quantize their input rows at run time (``workers.fp8.quantize_rows``): each row's largest
magnitude, then the row scaled and cast. Written in PyTorch that is a reduction and then a pass that
reads the row again; Inductor fuses it into one reduction kernel that still reads each row twice and, on
an H200, ran far below memory bandwidth: at DiT-XL/2 256 px with 128 rows its GELU+quantize kernel took
18.3 of a 62 ms step (``docs/benchmarks/profile_dit-xl-2-256.md``), where the bf16 GELU alone took 5.7.
The least it can cost is one read of the bf16 rows and one write of the FP8 ones.

This kernel loads a row once into registers (a row of the widest model here, FLUX's 15360 features, is
16384 lanes), applies the GELU when asked (the feed-forward's activation folded into the quantization of
its second linear's input), takes the maximum, scales, casts and stores: one read, one write, float32
arithmetic throughout (no bf16 rounding of the GELU's output before it is quantized).

It is a ``torch.library`` custom op (``dit_serve::quantize_rows``) with a fake implementation, so a
compiled step (dynamo, Inductor, a dynamic batch) calls it as one opaque kernel and CUDA graphs capture
it. Off CUDA, or without Triton, ``workers.fp8`` keeps its PyTorch code.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU builds have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only installs
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_CODES = {"none": 0, "tanh": 1, "erf": 2}  # "none": no activation; "tanh" and "erf": F.gelu's two forms
MAX_K = 32768  # a row is held in registers: wider rows (none of the families here) take the PyTorch path


def available(x: torch.Tensor) -> bool:
    """Whether the kernel serves ``x``: a CUDA tensor of two dimensions, rows of at most MAX_K values, and
    Triton present."""
    return triton is not None and x.is_cuda and x.dim() == 2 and x.shape[-1] <= MAX_K


if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q,
                              GELU: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        if GELU == 1:  # tanh form: x * sigmoid(2u) == 0.5 x (1 + tanh u), u = sqrt(2/pi) (x + 0.044715 x^3)
            u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            x = x * tl.sigmoid(2.0 * u)
        elif GELU == 2:  # exact: 0.5 x (1 + erf(x / sqrt 2))
            x = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
        peak = tl.max(tl.abs(x), axis=0)
        scale = tl.maximum(peak / 448.0, 1e-12)
        q = tl.clamp(x * (1.0 / scale), -448.0, 448.0)
        tl.store(q_ptr + row * stride_q + offs, q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + row, scale)


def _warps(block: int) -> int:
    """Warps per row: about 16 values a thread, between 1 and 16 warps."""
    return max(1, min(16, block // 512))


@torch.library.custom_op("dit_serve::quantize_rows", mutates_args=())
def quantize_rows_cuda(x: torch.Tensor, gelu: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) CUDA -> (M, K) float8 e4m3 and (M, 1) float32 scales of ``gelu(x)`` (``gelu`` a key of _CODES)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0),
                                    GELU=_CODES[gelu], BLOCK=block, num_warps=_warps(block))
    return q, scale


@quantize_rows_cuda.register_fake
def _(x: torch.Tensor, gelu: str) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    return x.new_empty((m, k), dtype=FP8), x.new_empty((m, 1), dtype=torch.float32)
