"""FLUX.1's FP8 attention inputs in two passes (Triton kernels): q's and k's RMS norm, rotary embedding and
e4m3 codes at once, and v's codes at the power of two of its largest magnitude.

Why a kernel of our own
-----------------------
With FP8 attention (``workers.families.flux.attention``) every FLUX.1 block turns its projections' bf16 q, k and v
into e4m3 codes: q and k RMS-normed per head (the text's and the image's by their own weights in a double
block), concatenated text first, rotated by the rotary embedding, times their fixed power-of-two scales; v at
the scale of its largest magnitude, which no kernel knows before it has read all of v. Inductor makes one
reduction kernel of the norm, rotation and codes that also takes v's largest magnitude, and more kernels for
v's codes and the text/image concatenation: on an H200, FLUX.1-dev 1024's FP8 step spent 7.4 ms in them
(``docs/benchmarks/profile_flux-dev-1024_fp8codes.md`` (in git history)) where their reads and writes cost about 2.5; these two take 3.8
(``profile_flux-dev-1024_fp8rope.md``).

Here:

* ``_qk_kernel``: a program takes ``BT`` tokens of one head of one image, reads their q, k and v once,
  normalises q and k over the head (float32; times the norm's weight), rotates each pair (x[2i], x[2i+1])
  by the token's cos and sin (the partner read from the same cache lines), writes both as codes at their
  fixed scales into the concatenated (B, L+N, heads, d) layout, and takes v's largest magnitude into one
  float (an atomic maximum). A double block launches it twice, for the text's tokens and the image's.
* ``_v_kernel``: v's codes at 2^floor(log2(448 / amax)), as ``workers.kernels.fp8_attention.quantize`` (the
  exponent taken from the float's bits, exact), into the same layout; one program writes the descale.

* ``joint_qkv``: the same pass for bf16 attention, q and k normed and rotated into the joint
  layout in the model's dtype and v copied beside them, one kernel (no codes, so no largest magnitude to wait
  for); what FLUX.1's routed processor hands its bf16 attention kernel, by ``BF16_PLAN`` (one head of 16
  tokens a program: 53.4 us a double block against Inductor's 168.9 on an H200,
  ``docs/benchmarks/rope_qkv_bf16.md`` (in git history); FLUX.1-dev 1024's bf16 step 124.36 ms against 128.49).

Arithmetic: float32 throughout, rounded once to e4m3 (diffusers' eager path rounds to bf16 after the norm
and after the rotation first); v's codes are what ``fp8_attention.quantize`` writes. ``joint_codes`` is a
``torch.library`` custom op (``dit_serve::joint_qkv_codes``) with a fake implementation, so a compiled block
calls it as one opaque kernel and CUDA graphs capture it. Off CUDA, or without Triton, ``reference``
computes the same with PyTorch operations (the CPU tests' path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.kernels import fp8_attention
from workers.kernels.quant import FP8, FP8_MAX, triton

if triton is not None:
    import triton.language as tl


def available(x: torch.Tensor) -> bool:
    """Whether the kernels serve heads like ``x``'s (..., d): CUDA, Triton present, d a power of two."""
    d = x.shape[-1]
    return triton is not None and x.is_cuda and d >= 16 and d & (d - 1) == 0


def joint_codes(q, k, v, weight_q, weight_k, descale_q, descale_k, cos=None, sin=None, text=None, eps=1e-6,
                output_scales: bool = False):
    """q, k, v (B, N, heads, d) -> e4m3 codes q8, k8, v8 (B, L+N, heads, d) and v's descale (1, 1, 1, 1)
    float32, the text's L tokens first (``text``: its (q, k, v, weight_q, weight_k), L tokens; None: L = 0).
    ``output_scales``: the attention output's descale and scale from v's too (``fp8_attention.output_descale``,
    ``output_scale``; written by the kernel that writes v's, so they cost no kernels of their own): six tensors.

    q and k are RMS-normed over d (``eps``) times ``weight_q`` / ``weight_k`` (d,), rotated by ``cos``, ``sin``
    (L+N, d) as diffusers' ``apply_rotary_emb`` (pairs 2i, 2i+1; None: not rotated), and coded at
    1 / ``descale_q`` / ``descale_k`` (one-element float32 tensors, powers of two); v at the power of two of its
    largest magnitude (``fp8_attention.quantize``)."""
    tq, tk, tv, twq, twk = text if text is not None else (None,) * 5
    if available(q):
        codes = torch.ops.dit_serve.joint_qkv_codes(q, k, v, weight_q, weight_k, descale_q, descale_k, tq, tk, tv,
                                                    twq, twk, cos, sin, eps)
    else:
        codes = reference(q, k, v, weight_q, weight_k, descale_q, descale_k, cos, sin, text, eps)
        codes = (*codes, fp8_attention.output_descale(codes[3]), fp8_attention.output_scale(codes[3]))
    return tuple(codes) if output_scales else tuple(codes[:4])


def joint_qkv(q, k, v, weight_q, weight_k, cos=None, sin=None, text=None, eps=1e-6):
    """``joint_codes`` for bf16 attention: q, k (normed, rotated) and v (B, L+N, heads, d) in q's dtype, the
    text's tokens first; float32 arithmetic, rounded once."""
    tq, tk, tv, twq, twk = text if text is not None else (None,) * 5
    if available(q):
        return tuple(torch.ops.dit_serve.joint_qkv(q, k, v, weight_q, weight_k, tq, tk, tv, twq, twk, cos, sin, eps))
    return reference_qkv(q, k, v, weight_q, weight_k, cos, sin, text, eps)


def _normed(x, w, eps):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, heads, d) float32 rotated by cos, sin (T, d): diffusers' ``apply_rotary_emb`` (sequence_dim
    1, pairs 2i, 2i+1) without its rounding."""
    c, s = cos.float()[None, :, None, :], sin.float()[None, :, None, :]
    re, im = x.unflatten(-1, (-1, 2)).unbind(-1)
    return x * c + torch.stack([-im, re], dim=-1).flatten(-2) * s


def _joint_float(q, k, v, weight_q, weight_k, cos, sin, text, eps):
    """q, k normed and rotated (float32) and v, each (B, L+N, heads, d), the text's first."""
    qs, ks, vs = [_normed(q, weight_q, eps)], [_normed(k, weight_k, eps)], [v]
    if text is not None:
        tq, tk, tv, twq, twk = text
        qs.insert(0, _normed(tq, twq, eps))
        ks.insert(0, _normed(tk, twk, eps))
        vs.insert(0, tv)
    qf, kf = torch.cat(qs, dim=1), torch.cat(ks, dim=1)
    if cos is not None:
        qf, kf = rotate(qf, cos, sin), rotate(kf, cos, sin)
    return qf, kf, torch.cat(vs, dim=1)


def reference(q, k, v, weight_q, weight_k, descale_q, descale_k, cos=None, sin=None, text=None, eps=1e-6):
    """``joint_codes`` in PyTorch operations, float32 throughout."""
    qf, kf, vj = _joint_float(q, k, v, weight_q, weight_k, cos, sin, text, eps)
    code = lambda x, descale: (x / descale.reshape(())).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    v8, descale_v = fp8_attention.quantize(vj)
    return code(qf, descale_q), code(kf, descale_k), v8, descale_v


def reference_qkv(q, k, v, weight_q, weight_k, cos=None, sin=None, text=None, eps=1e-6):
    """``joint_qkv`` in PyTorch operations, float32 throughout, rounded once to q's dtype."""
    qf, kf, vj = _joint_float(q, k, v, weight_q, weight_k, cos, sin, text, eps)
    return qf.to(q.dtype), kf.to(q.dtype), vj.to(q.dtype)


@dataclass(frozen=True)
class Plan:
    """How ``_qk_kernel`` covers the tokens: a program takes ``tokens`` tokens of ``heads`` heads of one image
    (the rotary embedding's cos and sin loaded once for all of them), in ``warps`` warps; ``split``: a pair's
    partner taken by splitting the normed values in registers, else read again (from the cache)."""

    tokens: int = 8
    heads: int = 4
    warps: int = 4
    split: bool = True
    v_tokens: int = 32  # tokens of one head a program of ``_v_kernel`` takes


PLAN = Plan()
BF16_PLAN = Plan(tokens=16, heads=1)  # the fastest for ``joint_qkv`` at FLUX.1's shapes (rope_qkv_bf16.md)


if triton is not None:

    @triton.jit
    def _norm_rope_store(x_ptr, sb, st, sh, w, wp, o_ptr, c, s, inv, eps, b, h, t, m, t0, ob, ot, oh,
                         D: tl.constexpr, BT: tl.constexpr, ROPE: tl.constexpr, SPLIT: tl.constexpr,
                         CODES: tl.constexpr):
        """Tokens ``t`` (BT,) of head ``h`` of image ``b``: normed, rotated, coded at ``inv`` (or, not ``CODES``,
        rounded to the output's dtype), stored at t0 + t."""
        d = tl.arange(0, D)
        base = x_ptr + b * sb + t[:, None] * st + h * sh
        x = tl.load(base + d[None, :], mask=m, other=0.0).to(tl.float32)                 # (BT, D)
        r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)                                    # (BT,)
        y = x * r[:, None] * w[None, :]
        if ROPE:  # pairs (2i, 2i+1): out = y * cos + (y[2i+1], y[2i]) * (-sin, sin)
            if SPLIT:
                ye, yo = tl.split(tl.reshape(y, [BT, D // 2, 2]))
                yp = tl.reshape(tl.join(yo, ye), [BT, D])
            else:
                xp = tl.load(base + (d ^ 1)[None, :], mask=m, other=0.0).to(tl.float32)
                yp = xp * r[:, None] * wp[None, :]
            y = y * c + yp * s
        out = o_ptr + b * ob + (t0 + t)[:, None] * ot + h * oh + d[None, :]
        if CODES:
            tl.store(out, tl.clamp(y * inv, -448.0, 448.0).to(tl.float8e4nv), mask=m)
        else:
            tl.store(out, y.to(o_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=m)

    @triton.jit
    def _qk_kernel(q_ptr, k_ptr, v_ptr, wq_ptr, wk_ptr, dq_ptr, dk_ptr, oq_ptr, ok_ptr, amax_ptr, cos_ptr, sin_ptr,
                   ov_ptr, T, t0, H, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, ob, ot, oh, scs, eps,
                   D: tl.constexpr, BT: tl.constexpr, HB: tl.constexpr, ROPE: tl.constexpr, SPLIT: tl.constexpr,
                   CODES: tl.constexpr = True):
        # CODES: q's and k's e4m3 codes and v's largest magnitude; else q and k in the outputs' dtype and v
        # copied into ``ov_ptr`` beside them (bf16 attention)
        tb, hg, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        t = (tb * BT + tl.arange(0, BT)).to(tl.int64)
        tmask = (t < T)[:, None]
        d = tl.arange(0, D)
        c = 0.0
        s = 0.0
        if ROPE:  # one load of the tokens' cos and sin for all the heads; the rotation's sign folded into sin
            rows = (t0 + t)[:, None] * scs + d[None, :]
            c = tl.load(cos_ptr + rows, mask=tmask, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + rows, mask=tmask, other=0.0).to(tl.float32) * tl.where((d & 1) == 0, -1.0, 1.0)[None, :]
        wq, wk = tl.load(wq_ptr + d).to(tl.float32), tl.load(wk_ptr + d).to(tl.float32)
        wqp, wkp = tl.load(wq_ptr + (d ^ 1)).to(tl.float32), tl.load(wk_ptr + (d ^ 1)).to(tl.float32)
        inv_q = 1.0
        inv_k = 1.0
        if CODES:
            inv_q, inv_k = tl.math.div_rn(1.0, tl.load(dq_ptr)), tl.math.div_rn(1.0, tl.load(dk_ptr))
        peak = 0.0
        for i in tl.static_range(HB):
            h = hg * HB + i
            m = tmask & (h < H)
            _norm_rope_store(q_ptr, sqb, sqt, sqh, wq, wqp, oq_ptr, c, s, inv_q, eps, b, h, t, m, t0, ob, ot, oh,
                             D, BT, ROPE, SPLIT, CODES)
            _norm_rope_store(k_ptr, skb, skt, skh, wk, wkp, ok_ptr, c, s, inv_k, eps, b, h, t, m, t0, ob, ot, oh,
                             D, BT, ROPE, SPLIT, CODES)
            v = tl.load(v_ptr + b * svb + t[:, None] * svt + h * svh + d[None, :], mask=m, other=0.0)
            if CODES:
                peak = tl.maximum(peak, tl.max(tl.max(tl.abs(v.to(tl.float32)), axis=1), axis=0))
            else:
                tl.store(ov_ptr + b * ob + (t0 + t)[:, None] * ot + h * oh + d[None, :], v, mask=m)
        if CODES:
            tl.atomic_max(amax_ptr, peak)

    @triton.jit
    def _v_kernel(v_ptr, o_ptr, amax_ptr, descale_ptr, descale_o_ptr, scale_o_ptr, headroom, T, t0, svb, svt, svh,
                  ob, ot, oh, D: tl.constexpr, BT: tl.constexpr, WRITE_DESCALE: tl.constexpr):
        tb, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        t = (tb * BT + tl.arange(0, BT)).to(tl.int64)
        tmask = t < T
        amax = tl.maximum(tl.load(amax_ptr), 1e-12)
        # 2^floor(log2(448 / amax)), the exponent from the float's bits (exact, unlike an approximate log2)
        bits = tl.math.div_rn(448.0, amax).to(tl.int32, bitcast=True)
        scale = (bits & 0x7F800000).to(tl.float32, bitcast=True)
        d = tl.arange(0, D)
        v = tl.load(v_ptr + b * svb + t[:, None] * svt + h * svh + d[None, :], mask=tmask[:, None], other=0.0)
        codes = tl.clamp(v.to(tl.float32) * scale, -448.0, 448.0)
        tl.store(o_ptr + b * ob + (t0 + t)[:, None] * ot + h * oh + d[None, :], codes.to(tl.float8e4nv),
                 mask=tmask[:, None])
        if WRITE_DESCALE:
            if (tb == 0) & (h == 0) & (b == 0):  # the output's too: powers of two, so exact
                tl.store(descale_ptr, tl.math.div_rn(1.0, scale))
                tl.store(descale_o_ptr, tl.math.div_rn(1.0, scale * headroom))
                tl.store(scale_o_ptr, scale * headroom)


def _parts(q, k, v, weight_q, weight_k, text) -> list[tuple]:
    """The text's (q, k, v, weights) then the image's: the order of the joint layout's tokens."""
    return ([text[:5]] if text is not None else []) + [(q, k, v, weight_q, weight_k)]


def _joint_outputs(q, parts, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three (B, L+N, heads, d) tensors of ``dtype`` for the parts' tokens side by side."""
    b, _, heads, d = q.shape
    total = sum(p[0].shape[1] for p in parts)
    return tuple(torch.empty((b, total, heads, d), dtype=dtype, device=q.device) for _ in range(3))


def _qk_launches(parts, cos, sin, eps, plan: Plan, oq, ok, ov, descale_q, descale_k, amax, codes: bool) -> list:
    """``_qk_kernel`` over each part into ``oq``, ``ok`` (and ``ov``: v's copy without ``codes``), the parts' tokens
    one after another; returns each part's (v, tokens, first token) for the v kernel. ``amax`` also stands in for
    cos and sin without a rotary embedding."""
    b, _, heads, d = parts[-1][0].shape
    rope = cos is not None
    if rope and (cos.stride(-1) != 1 or sin.stride() != cos.stride()):
        cos, sin = cos.contiguous(), sin.contiguous()
    cs, ss = (cos, sin) if rope else (amax, amax)
    scs = cos.stride(0) if rope else 0
    ob, ot, oh = oq.stride(0), oq.stride(1), oq.stride(2)
    t0, spans = 0, []
    for pq, pk, pv, wq, wk in parts:
        pq, pk, pv = (x if x.stride(-1) == 1 else x.contiguous() for x in (pq, pk, pv))
        t = pq.shape[1]
        if t and b:
            grid = (triton.cdiv(t, plan.tokens), triton.cdiv(heads, plan.heads), b)
            _qk_kernel[grid](pq, pk, pv, wq, wk, descale_q, descale_k, oq, ok, amax, cs, ss, ov, t, t0, heads,
                             *pq.stride()[:3], *pk.stride()[:3], *pv.stride()[:3], ob, ot, oh, scs, eps,
                             D=d, BT=plan.tokens, HB=plan.heads, ROPE=rope, SPLIT=plan.split, CODES=codes,
                             num_warps=plan.warps)
        spans.append((pv, t, t0))
        t0 += t
    return spans


def launch(q, k, v, weight_q, weight_k, descale_q, descale_k, text=None, cos=None, sin=None, eps=1e-6,
           plan: Plan | None = None):
    """The two kernels (see the module docstring), ``_qk_kernel`` by ``plan`` (default ``PLAN``): returns q8, k8,
    v8 (B, L+N, heads, d) e4m3, v's descale and the attention output's descale and scale (1, 1, 1, 1) float32."""
    plan = plan or PLAN
    parts = _parts(q, k, v, weight_q, weight_k, text)
    b, _, heads, d = q.shape
    q8, k8, v8 = _joint_outputs(q, parts, FP8)
    amax = torch.zeros(1, dtype=torch.float32, device=q.device)
    descale_v, descale_o, scale_o = (torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device) for _ in range(3))
    spans = _qk_launches(parts, cos, sin, eps, plan, q8, k8, q8, descale_q, descale_k, amax, codes=True)
    t0 = sum(t for _, t, _ in spans)
    ob, ot, oh = q8.stride(0), q8.stride(1), q8.stride(2)
    for i, (pv, t, start) in enumerate(spans):
        if t and b:
            _v_kernel[(triton.cdiv(t, plan.v_tokens), heads, b)](pv, v8, amax, descale_v, descale_o, scale_o,
                                                                 fp8_attention.O_HEADROOM, t, start,
                                                                 *pv.stride()[:3], ob, ot, oh, D=d,
                                                                 BT=plan.v_tokens, WRITE_DESCALE=i == 0, num_warps=4)
    if not (t0 and b):
        descale_v.fill_(1.0)
        descale_o.copy_(fp8_attention.output_descale(descale_v))
        scale_o.copy_(fp8_attention.output_scale(descale_v))
    return q8, k8, v8, descale_v, descale_o, scale_o


def launch_qkv(q, k, v, weight_q, weight_k, text=None, cos=None, sin=None, eps=1e-6, plan: Plan | None = None):
    """``_qk_kernel`` without codes (``joint_qkv``): q, k normed and rotated and v copied, each (B, L+N, heads, d)
    in q's dtype; one launch a part (the text's, the image's), nothing to wait for between them."""
    plan = plan or BF16_PLAN
    parts = _parts(q, k, v, weight_q, weight_k, text)
    oq, ok, ov = _joint_outputs(q, parts, q.dtype)
    unused = torch.empty(1, dtype=torch.float32, device=q.device)  # the codes' scales and largest magnitude
    _qk_launches(parts, cos, sin, eps, plan, oq, ok, ov, unused, unused, unused, codes=False)
    return oq, ok, ov


@torch.library.custom_op("dit_serve::joint_qkv", mutates_args=())
def joint_qkv_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight_q: torch.Tensor, weight_k: torch.Tensor,
                   text_q: torch.Tensor | None, text_k: torch.Tensor | None, text_v: torch.Tensor | None,
                   text_weight_q: torch.Tensor | None, text_weight_k: torch.Tensor | None,
                   cos: torch.Tensor | None, sin: torch.Tensor | None,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``joint_qkv`` on CUDA (the text's five tensors all given or all None)."""
    text = None if text_q is None else (text_q, text_k, text_v, text_weight_q, text_weight_k)
    return launch_qkv(q, k, v, weight_q, weight_k, text, cos, sin, eps)


@joint_qkv_cuda.register_fake
def _(q, k, v, weight_q, weight_k, text_q, text_k, text_v, text_weight_q, text_weight_k, cos, sin, eps):
    b, n, heads, d = q.shape
    total = n + (0 if text_q is None else text_q.shape[1])
    return tuple(q.new_empty((b, total, heads, d)) for _ in range(3))


@torch.library.custom_op("dit_serve::joint_qkv_codes", mutates_args=())
def joint_qkv_codes_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight_q: torch.Tensor,
                         weight_k: torch.Tensor, descale_q: torch.Tensor, descale_k: torch.Tensor,
                         text_q: torch.Tensor | None, text_k: torch.Tensor | None, text_v: torch.Tensor | None,
                         text_weight_q: torch.Tensor | None, text_weight_k: torch.Tensor | None,
                         cos: torch.Tensor | None, sin: torch.Tensor | None,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                              torch.Tensor]:
    """``joint_codes(..., output_scales=True)`` on CUDA (the text's five tensors all given or all None)."""
    text = None if text_q is None else (text_q, text_k, text_v, text_weight_q, text_weight_k)
    return launch(q, k, v, weight_q, weight_k, descale_q, descale_k, text, cos, sin, eps)


@joint_qkv_codes_cuda.register_fake
def _(q, k, v, weight_q, weight_k, descale_q, descale_k, text_q, text_k, text_v, text_weight_q, text_weight_k,
      cos, sin, eps):
    b, n, heads, d = q.shape
    total = n + (0 if text_q is None else text_q.shape[1])
    new = lambda: q.new_empty((b, total, heads, d), dtype=FP8)
    scalar = lambda: q.new_empty((1, 1, 1, 1), dtype=torch.float32)
    return new(), new(), new(), scalar(), scalar(), scalar()
