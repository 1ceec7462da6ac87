"""FLUX.1's attention processor routed through the measured kernels (``workers.speed.joint_attention``),
registered with the speed layer's routing (``workers.speed.routing``), which swaps it in for diffusers' under
the graph backends.

A copy of diffusers' ``FluxAttnProcessor`` (0.42) that differs in the attention call: bf16 by the kernel the
chooser measured for the shape (``attention_inline``), q, k and v normed and rotated into the joint layout
by one kernel (``workers.kernels.rope.joint_qkv``: 53.4 us a double block against Inductor's 168.9 on an
H200, ``docs/benchmarks/rope_qkv_bf16.md`` (in git history)); FP8 (``fp8`` set: precision "fp8+attention") by cuDNN's FP8
kernel, q, k and v made into codes straight from the projections (``workers.kernels.rope.joint_codes``), and
its FP8 output handed to FP8 output projections as it is (``project_codes``; the single blocks' output
quantization reads it beside the MLP, ``attention_codes``): turning it into bf16 and quantizing it again
row by row would only add a pass each way and a second rounding.
"""

from __future__ import annotations

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, _get_qkv_projections

from workers.kernels import fp8_attention, rope
from workers.speed.joint_attention import (Fp8Scales, _plain_rms, attend_codes, attention_inline,
                                           fp8_joint_attention_codes, project_codes, takes_codes)
from workers.speed.routing import routes


@routes(FluxAttnProcessor)
class RoutedFluxAttention(FluxAttnProcessor):
    """FLUX.1's attention (as FluxAttnProcessor, diffusers 0.42), its attention by ``attention_inline`` (or
    FP8, ``fp8_joint_attention``, where ``fp8`` holds its scales)."""

    fp8: Fp8Scales | None = None

    # ``projected`` (in the methods below): the six projections ``_get_qkv_projections`` would make (q, k, v of
    # the image's states, then the text's, None for a single block), made by the caller from rows it
    # quantized with its norm (``workers.families.flux.fast``); ``hidden_states`` and ``encoder_hidden_states`` then
    # give only the shapes and the dtype.

    def attention_codes(self, attn, hidden_states, image_rotary_emb=None, projected=None):
        """A single block's FP8 attention as e4m3 codes (B, T, heads * d) and their (1, 1, 1, 1) descale, for an
        output projection that takes them (``workers.speed.fp8.quantize_pair``); None where this processor does not
        run FP8 attention (then call it as usual)."""
        if self.fp8 is None or self._parallel_config is not None or attn.added_kv_proj_dim is not None:
            return None
        codes, descale = self._fp8_attention(attn, hidden_states, None, image_rotary_emb, projected)
        return codes.flatten(2, 3), descale

    def _fp8_attention(self, attn, hidden_states, encoder_hidden_states, image_rotary_emb, projected=None):
        """The FP8 attention's codes (B, L+T, heads, d) and their descale: q, k and v made into codes by
        ``workers.kernels.rope`` straight from the projections where its contract holds, else ``_qkv`` then
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
        ``rope.joint_codes`` where its contract holds (``_kernel_args``) and q and k have fixed scales;
        else None."""
        if self.fp8.q is None or self.fp8.k is None:
            return None
        args = self._kernel_args(attn, hidden_states, encoder_hidden_states, image_rotary_emb, projected)
        if args is None:
            return None
        q, k, v, wq, wk, cos, sin, text, eps = args
        return rope.joint_codes(q, k, v, wq, wk, self.fp8.descale_q, self.fp8.descale_k, cos, sin, text, eps,
                                       output_scales=True)

    def _kernel_args(self, attn, hidden_states, encoder_hidden_states, image_rotary_emb, projected):
        """The arguments of ``workers.kernels.rope``'s passes, (q, k, v (B, T, h, d), q's and k's norm weights, cos, sin,
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
        ``rope.joint_qkv`` in one pass where its contract holds."""
        args = self._kernel_args(attn, hidden_states, encoder_hidden_states, image_rotary_emb, projected)
        if args is not None:
            return rope.joint_qkv(*args)
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
