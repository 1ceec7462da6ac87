"""PixArt's FP8 blocks with each norm, its modulation and the next linear's quantization as one kernel.

A PixArt block (diffusers' ``BasicTransformerBlock``, ``norm_type="ada_norm_single"``) runs, per step:

    n1 = LN(h) * (1 + scale_msa) + shift_msa          -> self-attention's q, k, v (FP8: quantized rows)
    h  = h + gate_msa * attn1(n1)                     -> cross-attention's query (quantized rows)
    h  = h + attn2(h, prompt)
    n2 = LN(h) * (1 + scale_mlp) + shift_mlp          -> the feed-forward's first linear (quantized rows)
    h  = h + gate_mlp * ff(n2)

With its linears in FP8, each arrow is a pass that makes the rows an FP8 product reads. Here each is one
``workers.norm_kernel.add_norm_quantize`` call that reads its inputs once and writes the FP8 codes (and the
new residual) once, and the projections take those codes (``linear_into(..., quantized=...)``,
``Fp8Linear.mm_rows``) instead of quantizing again. The arithmetic is the block's, in float32 with one
rounding to FP8 where eager rounds to bf16 after each operation first.

``fuse_block_norms(transformer)`` gives the blocks that qualify (PixArt blocks whose attention, cross-attention
query and feed-forward linears are FP8, no chunked feed-forward) a class whose ``forward`` does this; one class
for all, so a blocks-scope compile still makes one graph. At each call it checks that the self-attention is
the engine's (``BreakableSelfAttention``) and otherwise runs diffusers' forward unchanged; a padded
cross-attention (diffusers' processor) quantizes its own query.
"""

from __future__ import annotations

import functools

from torch import nn

from workers.fp8 import Fp8Linear, Projection
from workers.norm_kernel import add_norm_quantize
from workers.patches import BreakableSelfAttention
from workers.varlen import VarlenCrossAttention

ENABLED = True  # the engine patches PixArt FP8 blocks (a benchmark turns it off to compare)


def _qualifies(block: nn.Module) -> bool:
    from diffusers.models.attention import BasicTransformerBlock, FeedForward

    if type(block) is not BasicTransformerBlock or block.norm_type != "ada_norm_single":
        return False
    if block.pos_embed is not None or block.only_cross_attention or block._chunk_size is not None:
        return False
    norms = (block.norm1, block.norm2)
    if any(type(n) is not nn.LayerNorm or n.elementwise_affine for n in norms):
        return False
    ff = block.ff
    if type(ff) is not FeedForward or not isinstance(ff.net[0], Projection) or not isinstance(ff.net[0].proj, Fp8Linear):
        return False
    attns = [block.attn1] + ([block.attn2] if block.attn2 is not None else [])
    return all(isinstance(a.to_q, Fp8Linear) for a in attns) and all(
        isinstance(block.attn1.get_submodule(p), Fp8Linear) for p in ("to_k", "to_v"))


def fuse_block_norms(transformer: nn.Module) -> int:
    """Patch ``transformer``'s qualifying blocks (module docstring); returns how many are patched (again:
    the same count, nothing changes)."""
    if not ENABLED:
        return 0
    count = 0
    for block in getattr(transformer, "transformer_blocks", []):
        if type(block) is _block_class():
            count += 1
        elif _qualifies(block):
            block.__class__ = _block_class()
            count += 1
    return count


def restore_block_norms(transformer: nn.Module) -> None:
    """Undo ``fuse_block_norms``."""
    from diffusers.models.attention import BasicTransformerBlock

    for block in getattr(transformer, "transformer_blocks", []):
        if type(block) is _block_class():
            block.__class__ = BasicTransformerBlock


def _forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
             timestep=None, cross_attention_kwargs=None, class_labels=None, added_cond_kwargs=None):
    """``BasicTransformerBlock.forward`` for ``ada_norm_single`` with the fused norms (module docstring)."""
    proc = self.attn1.processor
    if not isinstance(proc, BreakableSelfAttention) or not isinstance(proc.qkv, (Fp8Linear, type(None))) \
            or cross_attention_kwargs:
        return self._diffusers_forward(hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
                                       timestep, cross_attention_kwargs, class_labels, added_cond_kwargs)
    b, t, d = hidden_states.shape                                                # (B, T, D)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
        self.scale_shift_table[None] + timestep.reshape(b, 6, -1)).chunk(6, dim=1)  # (B, 1, D) each
    _, *rows = add_norm_quantize(hidden_states, shift=shift_msa, scale=scale_msa, eps=self.norm1.eps)
    attn = proc(self.attn1, hidden_states, attention_mask=attention_mask, quantized=tuple(rows))
    if self.attn2 is not None:
        varlen = isinstance(self.attn2.processor, VarlenCrossAttention)
        if varlen:
            hidden_states, *rows = add_norm_quantize(hidden_states, attn, gate_msa, norm=False)
            attn = self.attn2.processor(self.attn2, hidden_states, encoder_hidden_states=encoder_hidden_states,
                                        attention_mask=encoder_attention_mask, quantized=tuple(rows))
        else:
            hidden_states = gate_msa * attn + hidden_states
            attn = self.attn2(hidden_states, encoder_hidden_states=encoder_hidden_states,
                              attention_mask=encoder_attention_mask)
        hidden_states, *rows = add_norm_quantize(hidden_states, attn, shift=shift_mlp, scale=scale_mlp,
                                                 eps=self.norm2.eps)
    else:
        hidden_states, *rows = add_norm_quantize(hidden_states, attn, gate_msa, shift_mlp, scale_mlp,
                                                 eps=self.norm2.eps)
    net = self.ff.net
    y = net[0].proj.mm_rows(*rows).view(b, t, -1)                                 # (B, T, inner)
    for module in net[1:]:
        y = module(y)
    return gate_mlp * y + hidden_states


@functools.cache
def _block_class() -> type:
    """``BasicTransformerBlock`` with ``_forward``, made once (diffusers is imported only where a model is loaded)."""
    from diffusers.models.attention import BasicTransformerBlock

    return type("FusedNormPixArtBlock", (BasicTransformerBlock,),
                {"forward": _forward, "_diffusers_forward": BasicTransformerBlock.forward, "__module__": __name__})
