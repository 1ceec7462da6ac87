"""SD3's own fast path: its joint attention processor routed through the measured kernels
(``workers.speed.joint_attention``), registered with the speed layer's routing (``workers.speed.routing``), which
swaps it in for diffusers' under the graph backends.

A copy of diffusers' ``JointAttnProcessor2_0`` (0.42) that differs in the attention call: bf16 by the kernel
the chooser measured for the shape (``attention_inline``), or FP8 (``fp8`` set: precision "fp8+attention")
by cuDNN's FP8 kernel (``fp8_joint_attention``), its output turned back into bf16 for the output projection.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import JointAttnProcessor2_0

from workers.speed.joint_attention import Fp8Scales, attention_inline, fp8_joint_attention
from workers.speed.routing import routes


@routes(JointAttnProcessor2_0)
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
