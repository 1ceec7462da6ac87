"""SD3's and FLUX.1's joint attention through the attention kernel measured per shape (``workers.sdpa``).

diffusers' processors (``JointAttnProcessor2_0`` for SD3/SD3.5, ``FluxAttnProcessor`` for FLUX.1) call
PyTorch's attention with its fixed kernel rule. The processors here are copies of theirs (diffusers 0.42)
that differ in that one call, which goes to ``attention_inline``: the kernel the chooser measured fastest
for the shape on this GPU (FlashAttention-4 among them where installed: 20% faster than cuDNN at SD3.5's
heads of 64, 7-9% at FLUX.1's 128 on an H200, ``docs/benchmarks/row_kernels_fa4.md``), written into a
(B, T, heads, d) buffer that the output projection reads as it is.

Not an eager break: q, k and v are made fresh in every layer (rotary embedding, the text and image tokens
concatenated), so a break, which keeps its inputs for the graph's life (pitfalls 1-2), would pin every
layer's q, k, v and output in every bucket (FLUX.1-dev 1024: about 6 GB a bucket). The kernel is captured
inside the segment instead; the chooser measured its shape during warm-up, before capture. Compiled steps
see ``attention_inline`` as one opaque op (``graphs.compiled.opaque_break``, registered by the engine).

A call with an attention mask (neither pipeline passes one) runs diffusers' own path. On a CPU the chooser
keeps PyTorch's rule, so a routed model computes what diffusers' computes (tested in float32).

FP8 attention (``route_joint_attention(..., fp8=True)``; the engine asks for it for a model loaded in precision
"fp8+attention": Hopper, the cuDNN frontend installed, ``workers.fp8_attention``): q, k and v become e4m3
codes straight from the projections, FLUX.1's by two kernels of our own (``workers.rope_kernel``: the norms,
the rotary embedding and the codes in one pass over q, k and v, then v's codes; SD3's in the step's own code,
where Inductor writes them from its norm kernel in place of bf16), the kernel is cuDNN's FP8 attention (``attention_fp8_inline``, opaque like ``attention_inline``), and its FP8
output (e4m3 at one per-tensor scale) goes to FLUX.1's FP8 output projections as it is: the double blocks'
``to_out`` and ``to_add_out`` multiply the codes at that scale (``project_codes``), the single blocks' output
quantization reads them beside the MLP (``workers.fp8.quantize_pair``). Elsewhere (SD3, bf16 projections) it is
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
from diffusers.models.attention_processor import JointAttnProcessor2_0
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, _get_qkv_projections

from workers import fp8_attention, rope_kernel
from workers.sdpa import attention


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
    maker wrote them (``rope_kernel``), else computed from v's here."""
    out = torch.empty_like(q8)                                                              # (B, T, h, d) e4m3
    if scale_o is None:
        descale_o, scale_o = fp8_attention.output_descale(descale_v), fp8_attention.output_scale(descale_v)
    attention_fp8_inline(q8.transpose(1, 2), k8.transpose(1, 2), v8.transpose(1, 2), descale_q, descale_k,
                         descale_v, scale_o, out.transpose(1, 2))
    return out, descale_o


def _plain_rms(norm, d: int) -> bool:
    """Whether ``norm`` is an RMS norm over d values with a weight, a set eps and no bias (``rope_kernel``'s)."""
    if type(norm).__name__ != "RMSNorm" or getattr(norm, "weight", None) is None or getattr(norm, "bias", None) is not None:
        return False
    return getattr(norm, "eps", None) is not None and norm.weight.shape == (d,)


def fp8_joint_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scales: Fp8Scales) -> torch.Tensor:
    """(B, T, heads, d) x3 -> the attention (B, T, heads, d) in query's dtype, through FP8."""
    codes, descale = fp8_joint_attention_codes(query, key, value, scales)
    return fp8_attention.dequantize(codes, descale, query.shape[-1], query.dtype)


# FP8 output projections take the FP8 attention's codes as they are (``project_codes``): its output is e4m3
# already, so turning it into bf16 and quantizing it again row by row only adds a pass each way and a second
# rounding. Off: dequantized, then quantized by the projection (a benchmark compares the two).
HAND_CODES = True


def takes_codes(*projections) -> bool:
    """Whether ``projections`` all take codes straight from FP8 attention: FP8 linears applying no activation."""
    from workers.fp8 import Fp8Linear

    return HAND_CODES and all(isinstance(p, Fp8Linear) and p.gelu == "none" for p in projections)


def project_codes(proj, codes: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """``proj`` (an ``Fp8Linear``) of e4m3 codes (..., K) at one (1, 1, 1, 1) descale -> (..., N) in the
    model's dtype: the product's row scales are that descale for every row."""
    lead, rows = codes.shape[:-1], codes.reshape(-1, codes.shape[-1])
    scale = descale.reshape(1, 1).expand(rows.shape[0], 1).contiguous()                   # (M, 1) float32
    return proj.mm_rows(rows, scale).view(*lead, -1)


class RoutedJointAttention(JointAttnProcessor2_0):
    """SD3's joint attention (as JointAttnProcessor2_0, diffusers 0.42), its attention by ``attention_inline``
    (or FP8, ``fp8_joint_attention``, where ``fp8`` holds its scales)."""

    fp8: Fp8Scales | None = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        if attention_mask is not None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)
        residual = hidden_states
        batch_size = hidden_states.shape[0]
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads
        split = lambda y: y.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)   # (B, h, T, d)
        query, key, value = split(query), split(key), split(value)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if encoder_hidden_states is not None:
            eq = split(attn.add_q_proj(encoder_hidden_states))                            # (B, h, L, d)
            ek = split(attn.add_k_proj(encoder_hidden_states))
            ev = split(attn.add_v_proj(encoder_hidden_states))
            if attn.norm_added_q is not None:
                eq = attn.norm_added_q(eq)
            if attn.norm_added_k is not None:
                ek = attn.norm_added_k(ek)
            query = torch.cat([query, eq], dim=2)                                           # (B, h, T+L, d)
            key = torch.cat([key, ek], dim=2)
            value = torch.cat([value, ev], dim=2)
        if self.fp8 is not None:
            out = fp8_joint_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), self.fp8)
        else:
            out = query.new_empty(batch_size, query.shape[2], attn.heads, head_dim)         # (B, T+L, h, d)
            attention_inline(query, key, value, out.transpose(1, 2))
        hidden_states = out.flatten(2, 3).to(query.dtype)                                   # (B, T+L, h*d)
        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = (hidden_states[:, : residual.shape[1]],
                                                    hidden_states[:, residual.shape[1]:])
            if not attn.context_pre_only:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))                      # proj + dropout
        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states


class RoutedFluxAttention(FluxAttnProcessor):
    """FLUX.1's attention (as FluxAttnProcessor, diffusers 0.42), its attention by ``attention_inline`` (or
    FP8, ``fp8_joint_attention``, where ``fp8`` holds its scales)."""

    fp8: Fp8Scales | None = None

    # ``projected`` (in the methods below): the six projections ``_get_qkv_projections`` would make (q, k, v of
    # the image's states, then the text's, None for a single block), made by the caller from rows it
    # quantized with its norm (``workers.norm_fusion``); ``hidden_states`` and ``encoder_hidden_states`` then
    # give only the shapes and the dtype.

    def attention_codes(self, attn, hidden_states, image_rotary_emb=None, projected=None):
        """A single block's FP8 attention as e4m3 codes (B, T, heads * d) and their (1, 1, 1, 1) descale, for an
        output projection that takes them (``workers.fp8.quantize_pair``); None where this processor does not
        run FP8 attention (then call it as usual)."""
        if not HAND_CODES or self.fp8 is None or self._parallel_config is not None or attn.added_kv_proj_dim is not None:
            return None
        codes, descale = self._fp8_attention(attn, hidden_states, None, image_rotary_emb, projected)
        return codes.flatten(2, 3), descale

    def _fp8_attention(self, attn, hidden_states, encoder_hidden_states, image_rotary_emb, projected=None):
        """The FP8 attention's codes (B, L+T, heads, d) and their descale: q, k and v made into codes by
        ``rope_kernel`` straight from the projections where its contract holds, else ``_qkv`` then
        ``fp8_joint_attention_codes``."""
        coded = self._qkv_codes(attn, hidden_states, encoder_hidden_states, image_rotary_emb, projected)
        if coded is None:
            return fp8_joint_attention_codes(
                *self._qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb, projected), self.fp8)
        q8, k8, v8, descale_v, descale_o, scale_o = coded
        return attend_codes(q8, k8, v8, descale_v, self.fp8.descale_q, self.fp8.descale_k, descale_o, scale_o)

    @staticmethod
    def _projections(attn, hidden_states, encoder_hidden_states, projected):
        if projected is not None:
            return projected
        return _get_qkv_projections(attn, hidden_states, encoder_hidden_states)

    def _qkv_codes(self, attn, hidden_states, encoder_hidden_states, image_rotary_emb, projected=None):
        """q8, k8, v8 (B, L+T, heads, d) e4m3, v's descale and the attention output's descale and scale, by
        ``rope_kernel.joint_codes`` where its contract holds (``_kernel_args``) and q and k have fixed scales;
        else None."""
        if not rope_kernel.ENABLED or self.fp8.q is None or self.fp8.k is None:
            return None
        args = self._kernel_args(attn, hidden_states, encoder_hidden_states, image_rotary_emb, projected)
        if args is None:
            return None
        q, k, v, wq, wk, cos, sin, text, eps = args
        return rope_kernel.joint_codes(q, k, v, wq, wk, self.fp8.descale_q, self.fp8.descale_k, cos, sin, text, eps,
                                       output_scales=True)

    def _kernel_args(self, attn, hidden_states, encoder_hidden_states, image_rotary_emb, projected):
        """The arguments of ``rope_kernel``'s passes, (q, k, v (B, T, h, d), q's and k's norm weights, cos, sin,
        the text's five or None, eps), where its contract holds: RMS norms with weights and one eps, the rotary
        embedding over all L+T tokens (or none); else None. Projects (or takes ``projected``)."""
        joint = attn.added_kv_proj_dim is not None
        norms = (attn.norm_q, attn.norm_k, *((attn.norm_added_q, attn.norm_added_k) if joint else ()))
        if joint != (encoder_hidden_states is not None) or not all(_plain_rms(n, attn.head_dim) for n in norms) \
                or len({n.eps for n in norms}) != 1:
            return None
        tokens = hidden_states.shape[1] + (encoder_hidden_states.shape[1] if joint else 0)
        cos, sin = image_rotary_emb if image_rotary_emb is not None else (None, None)
        if cos is not None and (cos.shape != (tokens, attn.head_dim) or sin.shape != cos.shape):
            return None
        query, key, value, encoder_query, encoder_key, encoder_value = self._projections(
            attn, hidden_states, encoder_hidden_states, projected)
        heads = lambda y: y.unflatten(-1, (-1, attn.head_dim))                              # (B, T, h, d)
        text = None
        if joint:
            text = (heads(encoder_query), heads(encoder_key), heads(encoder_value), attn.norm_added_q.weight,
                    attn.norm_added_k.weight)
        return (heads(query), heads(key), heads(value), attn.norm_q.weight, attn.norm_k.weight, cos, sin, text,
                norms[0].eps)

    def _qkv(self, attn, hidden_states, encoder_hidden_states, image_rotary_emb, projected=None):
        """q, k and v (B, L+T, heads, d): projected, normed, the text's before the image's, rotated; by
        ``rope_kernel.joint_qkv`` in one pass where ``rope_kernel.BF16`` is on and its contract holds."""
        if rope_kernel.BF16:
            args = self._kernel_args(attn, hidden_states, encoder_hidden_states, image_rotary_emb, projected)
            if args is not None:
                return rope_kernel.joint_qkv(*args)
        query, key, value, encoder_query, encoder_key, encoder_value = self._projections(
            attn, hidden_states, encoder_hidden_states, projected)
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))                       # (B, T, h, d)
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))
        if attn.added_kv_proj_dim is not None:
            encoder_query = attn.norm_added_q(encoder_query.unflatten(-1, (-1, attn.head_dim)))  # (B, L, h, d)
            encoder_key = attn.norm_added_k(encoder_key.unflatten(-1, (-1, attn.head_dim)))
            encoder_value = encoder_value.unflatten(-1, (-1, attn.head_dim))
            query = torch.cat([encoder_query, query], dim=1)                                # (B, L+T, h, d)
            key = torch.cat([encoder_key, key], dim=1)
            value = torch.cat([encoder_value, value], dim=1)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        return query, key, value

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None, projected=None):
        if attention_mask is not None or self._parallel_config is not None:
            if projected is not None:
                raise ValueError("projections made by the caller need the routed path (no mask, no parallelism)")
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        if self.fp8 is not None and encoder_hidden_states is not None and takes_codes(attn.to_out[0], attn.to_add_out):
            codes, descale = self._fp8_attention(attn, hidden_states, encoder_hidden_states, image_rotary_emb,
                                                 projected)
            text, image = codes.flatten(2, 3).split_with_sizes(                               # (B, L+T, h, d) e4m3
                [encoder_hidden_states.shape[1], hidden_states.shape[1]], dim=1)
            return (attn.to_out[1](project_codes(attn.to_out[0], image, descale)),
                    project_codes(attn.to_add_out, text, descale))
        dtype = hidden_states.dtype
        if self.fp8 is not None:
            codes, descale = self._fp8_attention(attn, hidden_states, encoder_hidden_states, image_rotary_emb,
                                                 projected)
            out = fp8_attention.dequantize(codes, descale, codes.shape[-1], dtype)           # (B, L+T, h, d)
        else:
            query, key, value = self._qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb, projected)
            out = torch.empty_like(query)                                                   # (B, L+T, h, d)
            attention_inline(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), out.transpose(1, 2))
        hidden_states = out.flatten(2, 3).to(dtype)                                         # (B, L+T, h*d)
        if encoder_hidden_states is not None:
            encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
                [encoder_hidden_states.shape[1], hidden_states.shape[1] - encoder_hidden_states.shape[1]], dim=1)
            hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())
            return hidden_states, encoder_hidden_states
        return hidden_states


ROUTED = {JointAttnProcessor2_0: RoutedJointAttention, FluxAttnProcessor: RoutedFluxAttention}


def route_joint_attention(transformer: torch.nn.Module, fp8: bool = False) -> int:
    """Swap every SD3 / FLUX.1 attention processor of ``transformer`` for its routed copy (FP8 attention where
    ``fp8``, for heads a multiple of 16 as the kernel wants: FLUX.1's 128, SD3's 64); returns how many. A
    routed processor is made again, with or without FP8 as asked."""
    kinds = {**ROUTED, **{routed: routed for routed in ROUTED.values()}}
    n = 0
    for module in transformer.modules():
        routed = kinds.get(type(getattr(module, "processor", None)))
        if routed is not None:
            processor = routed()
            if fp8 and (module.inner_dim // module.heads) % fp8_attention.ALIGN == 0:
                processor.fp8 = fp8_scales(module)
            module.set_processor(processor)
            n += 1
    return n


def restore_joint_attention(transformer: torch.nn.Module) -> None:
    """Undo ``route_joint_attention``: diffusers' own processors again."""
    back = {routed: plain for plain, routed in ROUTED.items()}
    for module in transformer.modules():
        plain = back.get(type(getattr(module, "processor", None)))
        if plain is not None:
            module.set_processor(plain())

