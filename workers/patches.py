"""Optimisations applied to a plain diffusers DiT from outside (the model file does not know).

``break_attention(transformer)`` swaps each block's self-attention processor for one whose
attention kernel is an ``eager_on_graph`` call: under the ``breakable`` backend each layer's
attention runs eagerly between captured segments (projections, norms, MLP), the pattern SGLang
uses to keep kernels that plan from sequence lengths out of the graph. Under ``full`` or without
capture the marked call is an ordinary call, so the patched model computes exactly what it did.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphs import eager_on_graph


@eager_on_graph
def attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(B, heads, T, d) x3 -> (B, heads, T, d); runs eagerly between graph segments."""
    return F.scaled_dot_product_attention(q, k, v)


class BreakableSelfAttention:
    """Self-attention for DiT blocks (no mask, no cross-attention), as diffusers' AttnProcessor2_0."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states=None,
                 attention_mask=None, temb=None, **kwargs) -> torch.Tensor:
        b, t, _ = hidden_states.shape                                           # (B, T, D)
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        head_dim = k.shape[-1] // attn.heads
        q, k, v = (y.view(b, t, attn.heads, head_dim).transpose(1, 2) for y in (q, k, v))  # (B, h, T, d)
        out = attention_kernel(q, k, v)                                         # (B, h, T, d)
        out = out.transpose(1, 2).reshape(b, t, attn.heads * head_dim).to(q.dtype)  # (B, T, D)
        out = attn.to_out[1](attn.to_out[0](out))                               # proj + dropout
        return out / attn.rescale_output_factor


def break_attention(transformer: torch.nn.Module) -> int:
    """Route every self-attention of ``transformer`` through the eager break; returns how many."""
    n = 0
    for block in transformer.transformer_blocks:
        block.attn1.set_processor(BreakableSelfAttention())
        n += 1
    return n
