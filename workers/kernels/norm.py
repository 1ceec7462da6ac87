"""A block's residual add, LayerNorm, adaLN modulation and FP8 row quantization as one pass (a Triton kernel).

Why a kernel of our own
-----------------------
An FP8 linear fed by a block's norm quantizes the norm's output rows before its product. Inductor fuses
the add, the norm, the modulation and the quantization into one kernel (``workers.speed.fp8.quantize_rows``'s ``fuse``), but
it reduces a row wider than 1024 values in a loop and reads it from memory once per reduction (the mean and
variance, then the largest magnitude, then the codes): in PixArt-Σ 512's compiled FP8 step at 32 images
those kernels took 27.8 of 146 ms (``docs/benchmarks/profile_pixart-sigma-512_fp8_32.md`` (in git history)), about three
times what their reads and writes cost at the H200's memory bandwidth.

This kernel holds a row in registers (PixArt's 1152 values in 2048 lanes, one warp, as the row
quantization's measured plan) and makes one read of each input and one write of each output:

    x' = x + gate * y                      (when ``y`` is given: the residual add; x' is written, rounded
                                            to x's dtype, and the norm reads the rounded value, as eager)
    n  = LayerNorm(x')                     (when ``norm``: no affine, ``eps``)
    n  = n * (1 + scale) + shift           (when given: one (K,) vector per image, rows of image i being
                                            i*T .. (i+1)*T - 1, T the tokens an image has)
    q, s = e4m3 codes of n and its row scales (largest magnitude / 448), as ``workers.speed.fp8.quantize_rows``

With ``text`` (B, L, K) and no ``y``, the rows are cat([text, x], dim=1), read from where they are: FLUX.1's
single blocks normalise the text's and the image's tokens together (``workers.speed.norm_fusion``), and the
concatenation is never written.

in float32 throughout, rounded once to FP8 (the eager path rounds to bf16 after the norm and after each
modulation operation first). ``dit_serve::add_norm_quantize`` is a ``torch.library`` custom op with a fake
implementation, so a compiled block calls it as one opaque kernel and CUDA graphs capture it. Off CUDA, or
without Triton, ``add_norm_quantize`` computes the same float32 arithmetic with PyTorch operations
(``reference``), which is what the CPU tests compare against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.kernels.quant import FP8, FP8_MAX, _next_pow2, _warps, triton

if triton is not None:
    import triton.language as tl

MAX_K = 16384  # a row is held in registers: wider rows take the PyTorch path


def available(x: torch.Tensor) -> bool:
    """Whether the kernel serves ``x``: a CUDA tensor of rows of at most MAX_K values, and Triton present."""
    return triton is not None and x.is_cuda and x.shape[-1] <= MAX_K


def add_norm_quantize(x: torch.Tensor, y: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                      shift: torch.Tensor | None = None, scale: torch.Tensor | None = None, norm: bool = True,
                      eps: float = 1e-6, text: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x', codes, scales) for x, y of (B, T, K) and gate, shift, scale of B * K values each ((B, 1, K) or
    (B, K), any batch stride), as the module docstring says: x' (B, T, K) is x itself when ``y`` is None;
    codes (B*T, K) float8 e4m3 and scales (B*T, 1) float32, so that n ~ codes * scales row by row. With
    ``text`` (B, L, K) (and no ``y``) the rows are cat([text, x], dim=1): codes (B*(L+T), K), and x' is x."""
    if text is not None and (y is not None or text.shape[0] != x.shape[0] or text.shape[2] != x.shape[2]):
        raise ValueError(f"text rows {tuple(text.shape)} go with image rows {tuple(x.shape)} and no residual add")
    if available(x):
        out, q, s = torch.ops.dit_serve.add_norm_quantize(x, y, gate, shift, scale, norm, eps, text)
        return (x if y is None else out), q, s
    return reference(x, y, gate, shift, scale, norm, eps, text)


def reference(x, y=None, gate=None, shift=None, scale=None, norm: bool = True, eps: float = 1e-6, text=None):
    """``add_norm_quantize`` in PyTorch operations, float32 throughout."""
    if text is not None:
        _, q, s = reference(torch.cat([text, x], dim=1), None, gate, shift, scale, norm, eps)
        return x, q, s
    b, t, k = x.shape
    per_image = lambda v: v.reshape(b, 1, k).float()
    out = x
    if y is not None:
        out = (x.float() + (y.float() if gate is None else per_image(gate) * y.float())).to(x.dtype)
    n = out.float()
    if norm:
        n = F.layer_norm(n, (k,), eps=eps)
    if scale is not None:
        n = n * (1 + per_image(scale))
    if shift is not None:
        n = n + per_image(shift)
    rows = n.reshape(b * t, k)
    s = (torch.linalg.vector_norm(rows, ord=float("inf"), dim=1, keepdim=True) / FP8_MAX).clamp_(min=1e-12)
    return out, (rows * s.reciprocal()).clamp_(-FP8_MAX, FP8_MAX).to(FP8), s


if triton is not None:

    @triton.jit
    def _add_norm_quant_kernel(x_ptr, y_ptr, g_ptr, sh_ptr, sc_ptr, xo_ptr, q_ptr, s_ptr, t_ptr, K, T, L,
                               stride_g, stride_sh, stride_sc, eps,
                               ADD: tl.constexpr, GATE: tl.constexpr, NORM: tl.constexpr, SHIFT: tl.constexpr,
                               SCALE: tl.constexpr, TEXT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        image = row // T
        offs = tl.arange(0, BLOCK)
        mask = offs < K
        if TEXT:  # rows of cat([text, x]): T = L + x's tokens, the first L of an image's rows the text's
            t = row - image * T
            lead = t < L  # one of the two loads runs, the other is masked off
            x = tl.load(t_ptr + (image * L + t) * K + offs, mask=mask & lead, other=0.0).to(tl.float32) \
                + tl.load(x_ptr + (image * (T - L) + t - L) * K + offs, mask=mask & (t >= L), other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptr + row * K + offs, mask=mask, other=0.0).to(tl.float32)
        if ADD:  # constexpr: the parts a call has are compiled in, the others are not
            y = tl.load(y_ptr + row * K + offs, mask=mask, other=0.0).to(tl.float32)
            if GATE:
                y = y * tl.load(g_ptr + image * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
            xs = (x + y).to(xo_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            tl.store(xo_ptr + row * K + offs, xs, mask=mask)
            x = xs.to(tl.float32)
        if NORM:
            mean = tl.sum(x, axis=0) / K
            d = tl.where(mask, x - mean, 0.0)
            x = d * tl.rsqrt(tl.sum(d * d, axis=0) / K + eps)
        if SCALE:
            x = x * (1.0 + tl.load(sc_ptr + image * stride_sc + offs, mask=mask, other=0.0).to(tl.float32))
        if SHIFT:
            x = x + tl.load(sh_ptr + image * stride_sh + offs, mask=mask, other=0.0).to(tl.float32)
        peak = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=0)
        s = tl.maximum(peak / 448.0, 1e-12)
        q = tl.clamp(x * (1.0 / s), -448.0, 448.0)
        tl.store(q_ptr + row * K + offs, q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + row, s)


def _vector(v: torch.Tensor | None, b: int, k: int, like: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A per-image vector as (B, K) with unit column stride, and its batch stride (a placeholder when None)."""
    if v is None:
        return like, 0
    v = v.reshape(b, k)
    if v.stride(-1) != 1:
        v = v.contiguous()
    return v, v.stride(0)


THREADS_WANTED = 1 << 20  # about four waves of the H200's 132 x 2048 resident threads


def base_warps(k: int) -> int:
    """One warp per 2048 lanes of a row of ``k`` values (64 values a thread): ``warps_for`` with rows to spare."""
    return _warps(_next_pow2(k), 64)


def warps_for(rows: int, block: int) -> int:
    """Warps a row's program gets: one per 2048 lanes (64 values a thread, the row quantization's
    measured plan) while the rows alone fill the GPU; for fewer rows, more warps a row (down to 8 values a
    thread, up to 16 warps), so that about THREADS_WANTED threads run. On an H200 one warp a row ran
    65536 rows of 1152 at 3 TB/s (``docs/benchmarks/norm_quant_kernel.md`` (in git history)); the split for fewer rows (a
    1024 px image's 8192) is a choice its graph-replay timing has yet to confirm."""
    base = base_warps(block)
    wanted = _next_pow2(-(-THREADS_WANTED // (32 * max(rows, 1))))
    return max(base, min(16, block // 256, wanted))


def launch(x, y, gate, shift, scale, norm: bool, eps: float, warps: int | None = None, text=None):
    """The kernel on CUDA tensors: (x' or an empty tensor when ``y`` is None, codes, scales); ``warps`` a
    row, by default ``warps_for``'s (a benchmark compares others); ``text``: rows before x's (no ``y``)."""
    b, t, k = x.shape
    x = x.contiguous()
    y = None if y is None else y.contiguous()
    lead = 0 if text is None else text.shape[1]
    if text is not None:
        text = text.contiguous()
    t += lead
    m = b * t
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    out = torch.empty_like(x) if y is not None else x.new_empty(0)
    if not m:
        return out, q, s
    (g, sg), (sh, ssh), (sc, ssc) = (_vector(v, b, k, x) for v in (gate, shift, scale))
    block = _next_pow2(k)
    _add_norm_quant_kernel[(m,)](x, x if y is None else y, g, sh, sc, out if y is not None else x, q, s,
                                 x if text is None else text, k, t, lead, sg, ssh, ssc, eps, ADD=y is not None,
                                 GATE=gate is not None, NORM=norm, SHIFT=shift is not None,
                                 SCALE=scale is not None, TEXT=text is not None, BLOCK=block,
                                 num_warps=warps or warps_for(m, block))
    return out, q, s


@torch.library.custom_op("dit_serve::add_norm_quantize", mutates_args=())
def add_norm_quantize_cuda(x: torch.Tensor, y: torch.Tensor | None, gate: torch.Tensor | None,
                           shift: torch.Tensor | None, scale: torch.Tensor | None, norm: bool,
                           eps: float, text: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T, K) CUDA rows -> (x + gate * y, or an empty tensor without y; (B*T, K) e4m3 codes; (B*T, 1) scales);
    with ``text`` (B, L, K) the codes and scales are those of cat([text, x]), B*(L+T) rows."""
    if triton is None:  # pragma: no cover - ``available`` keeps such calls on the PyTorch path
        out, q, s = reference(x, y, gate, shift, scale, norm, eps, text)
        return (out.clone() if y is not None else x.new_empty(0)), q, s
    return launch(x, y, gate, shift, scale, norm, eps, text=text)


@add_norm_quantize_cuda.register_fake
def _(x, y, gate, shift, scale, norm, eps, text=None):
    b, t, k = x.shape
    t += 0 if text is None else text.shape[1]
    out = x.new_empty((b, t, k)) if y is not None else x.new_empty(0)
    return out, x.new_empty((b * t, k), dtype=FP8), x.new_empty((b * t, 1), dtype=torch.float32)
