"""SD3's and FLUX.1's joint attention through the attention kernel measured per shape (``workers.kernels.attention``).

The pieces the routed processors share (SD3's ``workers.families.sd3.fast``, FLUX.1's
``workers.families.flux.attention``; swapped in by ``workers.speed.routing.route_joint_attention``).

diffusers' processors (``JointAttnProcessor2_0`` for SD3/SD3.5, ``FluxAttnProcessor`` for FLUX.1) call
PyTorch's attention with its fixed kernel rule. The processors here are copies of theirs (diffusers 0.42)
that differ in that one call, which goes to ``attention_inline``: the kernel the chooser measured fastest
for the shape on this GPU (FlashAttention-4 among them where installed: 20% faster than cuDNN at SD3.5's
heads of 64, 7-9% at FLUX.1's 128 on an H200, ``docs/benchmarks/row_kernels_fa4.md`` (in git history)), written into a
(B, T, heads, d) buffer that the output projection reads as it is.

Not an eager break: q, k and v are made fresh in every layer (rotary embedding, the text and image tokens
concatenated), so a break, which keeps its inputs for the graph's life (pitfalls 1-2), would pin every
layer's q, k, v and output in every bucket (FLUX.1-dev 1024: about 6 GB a bucket). The kernel is captured
inside the segment instead; the chooser measured its shape during warm-up, before capture. Compiled steps
see ``attention_inline`` as one opaque op (``graphs.compiled.opaque_break``, registered by the engine).

A call with an attention mask (neither pipeline passes one) runs diffusers' own path. On a CPU the chooser
keeps PyTorch's rule, so a routed model computes what diffusers' computes (tested in float32).

FP8 attention (``route_joint_attention(..., fp8=True)``; the engine asks for it for a model loaded in precision
"fp8+attention": Hopper, the cuDNN frontend installed, ``workers.kernels.fp8_attention``): q, k and v become e4m3
codes straight from the projections, FLUX.1's by two kernels of our own (``workers.kernels.rope``: the norms,
the rotary embedding and the codes in one pass over q, k and v, then v's codes; SD3's in the step's own code,
where Inductor writes them from its norm kernel in place of bf16), the kernel is cuDNN's FP8 attention (``attention_fp8_inline``, opaque like ``attention_inline``), and its FP8
output (e4m3 at one per-tensor scale) goes to FLUX.1's FP8 output projections as it is: the double blocks'
``to_out`` and ``to_add_out`` multiply the codes at that scale (``project_codes``), the single blocks' output
quantization reads them beside the MLP (``workers.speed.fp8.quantize_pair``). Elsewhere (SD3, bf16 projections) it is
turned back into bf16 as the output projection's input is made. q's and k's scales are fixed at
load, from a bound: an RMS-normed head of d values is at most sqrt(d) times the norm's largest weight in
magnitude, and the rotary embedding turns pairs of values without changing their length
(``static_scale``); v's comes from its largest magnitude at run time. A model without q and k norms (SD3,
not SD3.5) takes q's and k's from their largest magnitude too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workers.kernels import fp8_attention
from workers.speed.fp8 import plain_fp8
from workers.kernels.attention import attention


def attention_inline(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    """(B, heads, T, d) x3 -> written into out (B, heads, T, d), by the kernel measured for the shape; an
    ordinary call (captured inside the segment), not a break."""
    attention(q, k, v, out)


def attention_fp8_inline(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descale_q: torch.Tensor,
                         descale_k: torch.Tensor, descale_v: torch.Tensor, scale_o: torch.Tensor,
                         out: torch.Tensor) -> None:
    """e4m3 codes (B, heads, T, d) x3 and their (1, 1, 1, 1) descales -> codes written into out (B, heads, T, d),
    at ``fp8_attention.output_descale(descale_v)`` (``scale_o`` its reciprocal, ``output_scale``), by cuDNN's
    FP8 kernel; captured inside the segment."""
    fp8_attention.attention_codes(q, k, v, descale_q, descale_k, descale_v, out, 1.0 / math.sqrt(q.shape[-1]),
                                  scale_o)


@dataclass
class Fp8Scales:
    """FP8 attention's fixed scales for one attention module's q and k (None: from the tensor at run time),
    powers of two, and their descales as (1, 1, 1, 1) float32 tensors on the model's device."""

    q: float | None
    k: float | None
    descale_q: torch.Tensor | None
    descale_k: torch.Tensor | None


def static_scale(*norms) -> float | None:
    """The largest power of two that keeps RMS-normed, rotated values within e4m3's 448, from the norms (the
    joint q is normed by two: the image's and the text's): a norm over n values makes none larger than sqrt(n)
    times its largest weight in magnitude, and a rotation of pairs keeps that bound. None when one is not an
    RMS norm (no bound)."""
    bound = 0.0
    for norm in norms:
        if norm is None or type(norm).__name__ != "RMSNorm":
            return None
        w = getattr(norm, "weight", None)
        shape = getattr(norm, "normalized_shape", None) or getattr(norm, "dim", None)
        n = w.numel() if w is not None else math.prod(shape)
        bound = max(bound, math.sqrt(n) * (1.0 if w is None else float(w.detach().abs().max())))
    if bound == 0.0:
        return None
    return 2.0 ** math.floor(math.log2(fp8_attention.FP8_MAX / bound))


def fp8_scales(attn) -> Fp8Scales:
    """The fixed scales of one diffusers ``Attention`` module's q and k (see ``static_scale``)."""
    joint = attn.added_kv_proj_dim is not None
    sq = static_scale(attn.norm_q, *((attn.norm_added_q,) if joint else ()))
    sk = static_scale(attn.norm_k, *((attn.norm_added_k,) if joint else ()))
    device = next(attn.parameters()).device
    descale = lambda s: None if s is None else torch.full((1, 1, 1, 1), 1.0 / s, dtype=torch.float32, device=device)
    return Fp8Scales(sq, sk, descale(sq), descale(sk))


def _codes(x: torch.Tensor, scale: float | None, descale: torch.Tensor | None):
    if scale is None:
        return fp8_attention.quantize(x)
    return (x.float() * scale).clamp(-fp8_attention.FP8_MAX, fp8_attention.FP8_MAX).to(fp8_attention.FP8), descale


def fp8_joint_attention_codes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              scales: Fp8Scales) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, heads, d) x3 -> the attention's e4m3 codes (B, T, heads, d) and their (1, 1, 1, 1) float32
    descale, through FP8 (see the module docstring; d a multiple of 16, so nothing is padded)."""
    (q8, dq), (k8, dk) = _codes(query, scales.q, scales.descale_q), _codes(key, scales.k, scales.descale_k)
    return attend_codes(q8, k8, *fp8_attention.quantize(value), dq, dk)


def attend_codes(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descale_v: torch.Tensor,
                 descale_q: torch.Tensor, descale_k: torch.Tensor, descale_o: torch.Tensor | None = None,
                 scale_o: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 q, k, v (B, T, heads, d) and their descales -> the attention's codes (B, T, heads, d) and their
    (1, 1, 1, 1) float32 descale. ``descale_o``, ``scale_o``: the output's descale and scale where the codes'
    maker wrote them (``workers.kernels.rope``), else computed from v's here."""
    out = torch.empty_like(q8)                                                              # (B, T, h, d) e4m3
    if scale_o is None:
        descale_o, scale_o = fp8_attention.output_descale(descale_v), fp8_attention.output_scale(descale_v)
    attention_fp8_inline(q8.transpose(1, 2), k8.transpose(1, 2), v8.transpose(1, 2), descale_q, descale_k,
                         descale_v, scale_o, out.transpose(1, 2))
    return out, descale_o


def _plain_rms(norm, d: int) -> bool:
    """Whether ``norm`` is an RMS norm over d values with a weight, a set eps and no bias (``workers.kernels.rope``'s)."""
    if type(norm).__name__ != "RMSNorm" or getattr(norm, "weight", None) is None or getattr(norm, "bias", None) is not None:
        return False
    return getattr(norm, "eps", None) is not None and norm.weight.shape == (d,)


def fp8_joint_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scales: Fp8Scales) -> torch.Tensor:
    """(B, T, heads, d) x3 -> the attention (B, T, heads, d) in query's dtype, through FP8."""
    codes, descale = fp8_joint_attention_codes(query, key, value, scales)
    return fp8_attention.dequantize(codes, descale, query.shape[-1], query.dtype)


def takes_codes(*projections) -> bool:
    """Whether ``projections`` all take codes straight from FP8 attention: FP8 linears applying no activation and
    adding nothing to their product (``plain_fp8``: a LoRA adapter's wrapper is called with the attention's rows)."""
    return all(plain_fp8(p) and p.gelu == "none" for p in projections)


def project_codes(proj, codes: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """``proj`` (an ``Fp8Linear``) of e4m3 codes (..., K) at one (1, 1, 1, 1) descale -> (..., N) in the
    model's dtype: the product's row scales are that descale for every row."""
    lead, rows = codes.shape[:-1], codes.reshape(-1, codes.shape[-1])
    scale = descale.reshape(1, 1).expand(rows.shape[0], 1).contiguous()                   # (M, 1) float32
    return proj.mm_rows(rows, scale).view(*lead, -1)


