"""One-pass FP8 row quantization on CUDA (a Triton kernel), optionally with the GELU before it.

Why a kernel of our own
-----------------------
FP8 linears quantize their input rows at run time (``workers.speed.fp8.quantize_rows``): each row's largest
magnitude, then the row scaled and cast. Written in PyTorch that is a reduction and then a pass that
reads the row again; Inductor fuses it into one reduction kernel that still reads each row twice and, on
an H200, ran far below memory bandwidth: at DiT-XL/2 256 px with 128 rows its GELU+quantize kernel took
18.3 of a 62 ms step (``docs/benchmarks/profile_dit-xl-2-256.md`` (in git history)), where the bf16 GELU alone took 5.7.
The least it can cost is one read of the bf16 rows and one write of the FP8 ones.

This kernel loads a row once into registers (a row of the widest model here, FLUX's 15360 features, is
16384 lanes), applies the GELU when asked (the feed-forward's activation folded into the quantization of
its second linear's input), takes the maximum, scales, casts and stores: one read, one write, float32
arithmetic throughout (no bf16 rounding of the GELU's output before it is quantized).

How a row is laid out (``Plan``, chosen per row width K from measurements, ``PLANS``): first, every row
was the next power of two of lanes, and the lanes past K computed the GELU too. The feed-forward rows
(K = 4608: 8192 lanes, 44% of them masked) ran at 2 TB/s, bound by the GELU's exponential and division on
the masked lanes. Now such a row is held as two powers of two side by side (4096 + 512) and the GELU's
tanh is the GPU's one approximate instruction: on an H200 that row's quantization went from 63.6 to
32.6 us at PixArt-Σ 1024's 8192 rows, at the bandwidth of a plain bf16 -> FP8 cast; the approximate tanh
moved 0.01% of the codes, each by one step (``docs/benchmarks/row_kernels.md``).

It is a ``torch.library`` custom op (``dit_serve::quantize_rows``) with a fake implementation, so a
compiled step (dynamo, Inductor, a dynamic batch) calls it as one opaque kernel and CUDA graphs capture
it. Off CUDA, or without Triton, ``workers.speed.fp8`` keeps its PyTorch code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU builds have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only installs
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_CODES = {"none": 0, "tanh": 1, "erf": 2}  # "none": no activation; "tanh" and "erf": F.gelu's two forms
FAST_TANH = 3  # the tanh form by tanh.approx.f32 (Plan.fast)
MAX_K = 32768  # a row is held in registers: wider rows (none of the families here) take the PyTorch path


def available(x: torch.Tensor) -> bool:
    """Whether the kernel serves ``x``: a CUDA tensor of two dimensions, rows of at most MAX_K values, and
    Triton present."""
    return triton is not None and x.is_cuda and x.dim() == 2 and x.shape[-1] <= MAX_K


@dataclass(frozen=True)
class Plan:
    """How the kernel covers a row (``warps`` per program):

    * ``whole``: ``rows`` rows per program, each held in registers as ``block`` lanes (the next power of
      two of K, the lanes past K masked: a K of 4608 computes 8192 lanes);
    * ``split``: one row per program held as ``parts``, powers of two side by side (4608 = 4096 + 512):
      few lanes past K, still one read and one write;
    * ``chunked``: one row per program read in ``block``-wide chunks twice (the maximum, then the codes;
      the second read from the cache).

    ``fast``: the tanh GELU's tanh by the GPU's approximate instruction (``tanh.approx.f32``, relative
    error about 2^-11, against e4m3's code spacing of 2^-3) instead of an exponential and a division."""

    kind: str
    block: int
    rows: int = 1
    warps: int = 4
    parts: tuple[int, ...] = ()
    fast: bool = False


MAX_PARTS = 4


def _warps(lanes: int, per_thread: int) -> int:
    """Warps (a power of two, 1 to 16) giving each thread about ``per_thread`` of a program's lanes."""
    return max(1, min(16, _next_pow2(-(-lanes // (32 * per_thread)))))


def whole_plan(k: int, per_thread: int = 16, fast: bool = False) -> Plan:
    """One row per program held whole; at 16 values a thread, the first kernel's layout."""
    block = _next_pow2(k)
    return Plan("whole", block, 1, _warps(block, per_thread), fast=fast)


def split_parts(k: int, granule: int = 128) -> tuple[int, ...]:
    """K as at most MAX_PARTS powers of two, largest first, none below ``granule`` but the last, which is
    rounded up (its lanes past K masked): 1152 -> (1024, 128), 15360 -> (8192, 4096, 2048, 1024)."""
    parts, left = [], k
    while left > 0 and len(parts) < MAX_PARTS - 1 and (top := 1 << (left.bit_length() - 1)) >= granule:
        parts.append(top)
        left -= top
    if left > 0:
        parts.append(max(_next_pow2(left), 16))
    return tuple(parts)


def split_plan(k: int, fast: bool = True) -> Plan:
    """A split row at about 64 values a thread (what the whole-row plans measured best at on an H200)."""
    parts = split_parts(k)
    return Plan("split", parts[0], 1, _warps(sum(parts), 64), parts, fast)


# K -> the plan measured fastest for the rows of that width the families run (bench/kernel_times.py on an
# H200, docs/benchmarks/row_kernels.md); "fast" matters only where the GELU is folded in (4608, 6144, 12288)
PLANS: dict[int, Plan] = {
    1152: Plan("whole", 2048, 1, 1),                         # DiT-XL/2, PixArt: hidden
    1536: Plan("split", 1024, 1, 1, (1024, 512)),            # SD3.5-medium: hidden
    3072: Plan("split", 2048, 1, 1, (2048, 1024)),           # FLUX.1: hidden
    4608: Plan("split", 4096, 1, 4, (4096, 512), True),      # DiT-XL/2, PixArt: feed-forward
    6144: Plan("split", 4096, 1, 4, (4096, 2048), True),     # SD3.5-medium: feed-forward
    12288: Plan("split", 8192, 1, 8, (8192, 4096), True),    # FLUX.1: feed-forward
    15360: Plan("whole", 16384, 1, 8),                       # FLUX.1: a single block's output projection
}


def plan_for(k: int) -> Plan:
    """The measured plan for K, else a split row of at most two parts, else a whole one (the four-part split
    of 15360 measured 40% slower than the whole row)."""
    if k in PLANS:
        return PLANS[k]
    plan = split_plan(k)
    return plan if len(plan.parts) <= 2 else whole_plan(k, per_thread=64, fast=True)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


if triton is not None:

    @triton.jit
    def _act(x, GELU: tl.constexpr):
        """F.gelu of float32 ``x`` in its tanh (1) or exact (2) form; 0: x itself."""
        if GELU == 1:  # tanh form: x * sigmoid(2u) == 0.5 x (1 + tanh u), u = sqrt(2/pi) (x + 0.044715 x^3)
            u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            x = x * tl.sigmoid(2.0 * u)
        elif GELU == 2:  # exact: 0.5 x (1 + erf(x / sqrt 2))
            x = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
        elif GELU == 3:  # tanh form, one approximate instruction for the tanh
            u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [u], dtype=tl.float32,
                                          is_pure=True, pack=1)
            x = 0.5 * x * (1.0 + t)
        return x

    @triton.jit
    def _part(row_ptr, start, K, B: tl.constexpr, GELU: tl.constexpr):
        """Lanes start .. start + B of a row, activated, in float32; and their offsets."""
        offs = start + tl.arange(0, B)
        x = tl.load(row_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)
        return _act(x, GELU), offs

    @triton.jit
    def _put(row_ptr, offs, x, inv, K):
        q = tl.clamp(x * inv, -448.0, 448.0)
        tl.store(row_ptr + offs, q.to(tl.float8e4nv), mask=offs < K)

    @triton.jit
    def _split_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, GELU: tl.constexpr,
                      B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        xr, qr = x_ptr + row * stride_x, q_ptr + row * stride_q
        x0, o0 = _part(xr, 0, K, B0, GELU)
        peak = tl.max(tl.abs(x0), axis=0)
        if B1 > 0:  # constexpr: the parts a plan has are compiled in, the others are not
            x1, o1 = _part(xr, B0, K, B1, GELU)
            peak = tl.maximum(peak, tl.max(tl.abs(x1), axis=0))
        if B2 > 0:
            x2, o2 = _part(xr, B0 + B1, K, B2, GELU)
            peak = tl.maximum(peak, tl.max(tl.abs(x2), axis=0))
        if B3 > 0:
            x3, o3 = _part(xr, B0 + B1 + B2, K, B3, GELU)
            peak = tl.maximum(peak, tl.max(tl.abs(x3), axis=0))
        scale = tl.maximum(peak / 448.0, 1e-12)
        inv = 1.0 / scale
        _put(qr, o0, x0, inv, K)
        if B1 > 0:
            _put(qr, o1, x1, inv, K)
        if B2 > 0:
            _put(qr, o2, x2, inv, K)
        if B3 > 0:
            _put(qr, o3, x3, inv, K)
        tl.store(s_ptr + row, scale)

    @triton.jit
    def _whole_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q,
                      GELU: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
        offs = tl.arange(0, BLOCK)                                          # (BLOCK,)
        mask = (rows[:, None] < M) & (offs[None, :] < K)                    # (ROWS, BLOCK)
        x = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        x = _act(x, GELU)
        peak = tl.max(tl.abs(x), axis=1)                                    # (ROWS,)
        scale = tl.maximum(peak / 448.0, 1e-12)
        q = tl.clamp(x * (1.0 / scale)[:, None], -448.0, 448.0)
        tl.store(q_ptr + rows[:, None] * stride_q + offs[None, :], q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + rows, scale, mask=rows < M)

    @triton.jit
    def _chunked_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q,
                        GELU: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        top = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, K, BLOCK):  # the row's largest magnitude, a chunk at a time
            mask = start + offs < K
            x = tl.load(x_ptr + row * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
            top = tl.maximum(top, tl.abs(_act(x, GELU)))
        scale = tl.maximum(tl.max(top, axis=0) / 448.0, 1e-12)
        inv = 1.0 / scale
        for start in range(0, K, BLOCK):  # again (from the cache): the codes
            mask = start + offs < K
            x = tl.load(x_ptr + row * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
            q = tl.clamp(_act(x, GELU) * inv, -448.0, 448.0)
            tl.store(q_ptr + row * stride_q + start + offs, q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + row, scale)


    @triton.jit
    def _pair_kernel(a_ptr, b_ptr, q_ptr, s_ptr, a_scale_ptr, KA, KB, stride_a, stride_b, stride_q,
                     GELU: tl.constexpr, A_SCALED: tl.constexpr,
                     A0: tl.constexpr, A1: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr):
        """One row of cat([a, gelu(b)]) quantized, ``a`` and ``b`` read from their own tensors, each held as
        one or two powers of two (A0 + A1 >= KA, B0 + B1 >= KB); ``A_SCALED``: a is read times *a_scale_ptr."""
        row = tl.program_id(0).to(tl.int64)
        ar, br, qr = a_ptr + row * stride_a, b_ptr + row * stride_b, q_ptr + row * stride_q
        a0, oa0 = _part(ar, 0, KA, A0, 0)
        if A_SCALED:
            a_scale = tl.load(a_scale_ptr)
            a0 = a0 * a_scale
        peak = tl.max(tl.abs(a0), axis=0)
        if A1 > 0:
            a1, oa1 = _part(ar, A0, KA, A1, 0)
            if A_SCALED:
                a1 = a1 * a_scale
            peak = tl.maximum(peak, tl.max(tl.abs(a1), axis=0))
        b0, ob0 = _part(br, 0, KB, B0, GELU)
        peak = tl.maximum(peak, tl.max(tl.abs(b0), axis=0))
        if B1 > 0:
            b1, ob1 = _part(br, B0, KB, B1, GELU)
            peak = tl.maximum(peak, tl.max(tl.abs(b1), axis=0))
        scale = tl.maximum(peak / 448.0, 1e-12)
        inv = 1.0 / scale
        _put(qr, oa0, a0, inv, KA)
        if A1 > 0:
            _put(qr, oa1, a1, inv, KA)
        _put(qr + KA, ob0, b0, inv, KB)
        if B1 > 0:
            _put(qr + KA, ob1, b1, inv, KB)
        tl.store(s_ptr + row, scale)


def pair_parts(k: int) -> tuple[int, int]:
    """K as two powers of two (the second 0 when one holds it): split_parts's first two parts when they hold
    K, else one power of two with lanes past K masked (3072 -> (2048, 1024), 12288 -> (8192, 4096))."""
    parts = split_parts(k)
    if len(parts) == 1:
        return parts[0], 0
    if len(parts) == 2:
        return parts
    return _next_pow2(k), 0


def pair_available(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``launch_pair`` serves the rows ``a`` and ``b``: both served by the row kernel, one row count."""
    return available(a) and available(b) and a.shape[0] == b.shape[0] and a.shape[-1] + b.shape[-1] <= MAX_K


def launch_pair(a: torch.Tensor, b: torch.Tensor, gelu: str,
                a_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes (M, KA + KB) and (M, 1) scales of ``cat([a, gelu(b)], -1)`` row by row, without the
    concatenation or the activation ever written: FLUX.1's single blocks, whose output projection reads the
    attention beside the MLP's activation (``workers.speed.fp8.quantize_pair``). One read of each, one write of the
    codes; the tanh GELU by the approximate instruction, as the feed-forwards' folded GELU. ``a_scale``: a
    one-element float32 tensor ``a`` is multiplied by as it is read (``a`` FP8 attention's e4m3 output)."""
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    (m, ka), kb = a.shape, b.shape[-1]
    q = torch.empty((m, ka + kb), dtype=FP8, device=a.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=a.device)
    if not m:
        return q, scale
    (a0, a1), (b0, b1) = pair_parts(ka), pair_parts(kb)
    code = FAST_TANH if gelu == "tanh" else _CODES[gelu]
    scaled = a_scale is not None
    _pair_kernel[(m,)](a, b, q, scale, a_scale if scaled else scale, ka, kb, a.stride(0), b.stride(0), q.stride(0),
                       GELU=code, A_SCALED=scaled, A0=a0, A1=a1, B0=b0, B1=b1,
                       num_warps=_warps(a0 + a1 + b0 + b1, 64))
    return q, scale


def launch(x: torch.Tensor, gelu: str, plan: Plan,
           out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_cuda`` by an explicit plan (the benchmark compares plans). Plans of one ``fast``
    compute the same float32 arithmetic, so their outputs are bit-identical. ``out``: the (M, K) codes,
    rows of unit column stride, and the (M, 1) contiguous float32 scales to write (an attention break's
    fixed buffers, ``workers.speed.patches.attention_quantized_into``); else new tensors."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if out is None:
        q = torch.empty((m, k), dtype=FP8, device=x.device)
        scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    else:
        q, scale = out
        if q.shape != (m, k) or q.dtype != FP8 or q.stride(-1) != 1 or scale.shape != (m, 1) \
                or scale.dtype != torch.float32 or not scale.is_contiguous():
            raise ValueError(f"out must be ({m}, {k}) float8 e4m3 rows and ({m}, 1) contiguous float32 scales")
    if not m:
        return q, scale
    code = FAST_TANH if plan.fast and gelu == "tanh" else _CODES[gelu]
    if plan.kind == "split":
        if sum(plan.parts) < k or len(plan.parts) > MAX_PARTS:
            raise ValueError(f"a split plan of parts {plan.parts} cannot hold rows of {k}")
        b = (*plan.parts, 0, 0, 0)[:MAX_PARTS]
        _split_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), GELU=code,
                            B0=b[0], B1=b[1], B2=b[2], B3=b[3], num_warps=plan.warps)
    elif plan.kind == "whole":
        if plan.block < k:
            raise ValueError(f"a whole-row plan of {plan.block} lanes cannot hold rows of {k}")
        _whole_kernel[(triton.cdiv(m, plan.rows),)](x, q, scale, m, k, x.stride(0), q.stride(0), GELU=code,
                                                     ROWS=plan.rows, BLOCK=plan.block, num_warps=plan.warps)
    elif plan.kind == "chunked":
        _chunked_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), GELU=code,
                              BLOCK=plan.block, num_warps=plan.warps)
    else:
        raise ValueError(f"unknown plan kind {plan.kind!r}")
    return q, scale


@torch.library.custom_op("dit_serve::quantize_rows", mutates_args=())
def quantize_rows_cuda(x: torch.Tensor, gelu: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) CUDA -> (M, K) float8 e4m3 and (M, 1) float32 scales of ``gelu(x)`` (``gelu`` a key of _CODES)."""
    return launch(x, gelu, plan_for(x.shape[-1]))


@quantize_rows_cuda.register_fake
def _(x: torch.Tensor, gelu: str) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    return x.new_empty((m, k), dtype=FP8), x.new_empty((m, 1), dtype=torch.float32)


@torch.library.custom_op("dit_serve::quantize_pair", mutates_args=())
def quantize_pair_cuda(a: torch.Tensor, b: torch.Tensor, gelu: str,
                       a_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, KA), (M, KB) CUDA -> (M, KA + KB) float8 e4m3 and (M, 1) float32 scales of cat([a * a_scale, gelu(b)])
    (``a_scale`` None: a itself)."""
    return launch_pair(a, b, gelu, a_scale)


@quantize_pair_cuda.register_fake
def _(a: torch.Tensor, b: torch.Tensor, gelu: str, a_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    m = a.shape[0]
    return a.new_empty((m, a.shape[-1] + b.shape[-1]), dtype=FP8), a.new_empty((m, 1), dtype=torch.float32)
