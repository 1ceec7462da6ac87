"""FP8 blocks with each norm, its modulation and the next linear's quantization as one kernel: PixArt, DiT.

A PixArt block (diffusers' ``BasicTransformerBlock``, ``norm_type="ada_norm_single"``) runs, per step:

    n1 = LN(h) * (1 + scale_msa) + shift_msa          -> self-attention's q, k, v (FP8: quantized rows)
    h  = h + gate_msa * attn1(n1)                     -> cross-attention's query (quantized rows)
    h  = h + attn2(h, prompt)
    n2 = LN(h) * (1 + scale_mlp) + shift_mlp          -> the feed-forward's first linear (quantized rows)
    h  = h + gate_mlp * ff(n2)

and a class-conditional DiT block (``norm_type="ada_norm_zero"``, no cross-attention) the same without the
cross-attention, its six modulation vectors from ``norm1``'s adaLN-Zero (or the hoisted modulation,
``workers.speed.patches.HoistedModulation``), its second norm ``norm3``.

With the linears in FP8, each arrow is a pass that makes the rows an FP8 product reads. Here each is one
``workers.kernels.norm.add_norm_quantize`` call that reads its inputs once and writes the FP8 codes (and the
new residual) once, and the projections take those codes (``linear_into(..., quantized=...)``,
``Fp8Linear.mm_rows``) instead of quantizing again. The arithmetic is the block's, in float32 with one
rounding to FP8 where eager rounds to bf16 after each operation first.

``fuse_block_norms(transformer)`` gives the blocks that qualify (whose attention, cross-attention query and
feed-forward linears are FP8, norms without affine parameters, no chunked feed-forward) a class whose
``forward`` does this; one class for all, so a blocks-scope compile still makes one graph. At each call it
checks that the self-attention is the engine's (``BreakableSelfAttention``) and otherwise runs diffusers'
forward unchanged; a padded cross-attention (diffusers' processor) quantizes its own query.
"""

from __future__ import annotations

import functools

from torch import nn

from workers.kernels.norm import add_norm_quantize
from workers.speed.fp8 import Fp8Linear, Projection, codes_product
from workers.speed.patches import BreakableSelfAttention
from workers.speed.varlen import VarlenCrossAttention

def _plain_norm(n) -> bool:
    return type(n) is nn.LayerNorm and not n.elementwise_affine


def _qualifies(block: nn.Module) -> bool:
    from diffusers.models.attention import BasicTransformerBlock, FeedForward
    from diffusers.models.normalization import AdaLayerNormZero

    if type(block) is not BasicTransformerBlock or block.pos_embed is not None or block.only_cross_attention \
            or block._chunk_size is not None:
        return False
    if block.norm_type == "ada_norm_single":
        norms_ok = _plain_norm(block.norm1) and _plain_norm(block.norm2)
    elif block.norm_type == "ada_norm_zero":
        norms_ok = (type(block.norm1) is AdaLayerNormZero and block.norm1.emb is not None
                    and _plain_norm(block.norm1.norm) and _plain_norm(block.norm3) and block.attn2 is None)
    else:
        return False
    ff = block.ff
    if not norms_ok or type(ff) is not FeedForward or not isinstance(ff.net[0], Projection) \
            or not isinstance(ff.net[0].proj, Fp8Linear):
        return False
    attns = [block.attn1] + ([block.attn2] if block.attn2 is not None else [])
    return all(isinstance(a.to_q, Fp8Linear) for a in attns) and all(
        isinstance(block.attn1.get_submodule(p), Fp8Linear) for p in ("to_k", "to_v"))


def fuse_block_norms(transformer: nn.Module) -> int:
    """Patch ``transformer``'s qualifying PixArt and DiT blocks (module docstring); returns how many are patched
    (again: the same count, nothing changes). FLUX.1's: ``workers.families.flux.fast.fuse_block_norms``."""
    count = 0
    for block in getattr(transformer, "transformer_blocks", []):
        if type(block) is _block_class():
            count += 1
        elif _qualifies(block):
            block.__class__ = _block_class()
            count += 1
    return count


def fused_blocks(transformer: nn.Module) -> int:
    """How many of ``transformer``'s PixArt and DiT blocks run the fused forward now."""
    return sum(type(b) is _block_class() for b in getattr(transformer, "transformer_blocks", []))


def restore_block_norms(transformer: nn.Module) -> None:
    """Undo ``fuse_block_norms``."""
    from diffusers.models.attention import BasicTransformerBlock

    for block in getattr(transformer, "transformer_blocks", []):
        if type(block) is _block_class():
            block.__class__ = BasicTransformerBlock


def _forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
             timestep=None, cross_attention_kwargs=None, class_labels=None, added_cond_kwargs=None):
    """``BasicTransformerBlock.forward`` for ``ada_norm_single`` and ``ada_norm_zero`` with the fused norms
    (module docstring)."""
    proc = self.attn1.processor
    if not isinstance(proc, BreakableSelfAttention) or not isinstance(proc.qkv, (Fp8Linear, type(None))) \
            or cross_attention_kwargs:
        return self._diffusers_forward(hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
                                       timestep, cross_attention_kwargs, class_labels, added_cond_kwargs)
    b, t, d = hidden_states.shape                                                # (B, T, D)
    if self.norm_type == "ada_norm_zero":
        emb = _ada_zero_modulation(self.norm1, timestep, class_labels, hidden_states.dtype)  # (B, 6D)
        first_eps, second_eps = self.norm1.norm.eps, self.norm3.eps
    else:
        emb = self.scale_shift_table[None] + timestep.reshape(b, 6, -1)          # (B, 6, D)
        first_eps, second_eps = self.norm1.eps, self.norm2.eps
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)  # (B, D) or (B, 1, D)
    _, *rows = add_norm_quantize(hidden_states, shift=shift_msa, scale=scale_msa, eps=first_eps)
    attn = proc(self.attn1, hidden_states, attention_mask=attention_mask, quantized=tuple(rows))
    if self.attn2 is not None:
        if isinstance(self.attn2.processor, VarlenCrossAttention):
            hidden_states, *rows = add_norm_quantize(hidden_states, attn, gate_msa, norm=False)
            attn = self.attn2.processor(self.attn2, hidden_states, encoder_hidden_states=encoder_hidden_states,
                                        attention_mask=encoder_attention_mask, quantized=tuple(rows))
        else:
            hidden_states = gate_msa * attn + hidden_states
            attn = self.attn2(hidden_states, encoder_hidden_states=encoder_hidden_states,
                              attention_mask=encoder_attention_mask)
        hidden_states, *rows = add_norm_quantize(hidden_states, attn, shift=shift_mlp, scale=scale_mlp,
                                                 eps=second_eps)
    else:
        hidden_states, *rows = add_norm_quantize(hidden_states, attn, gate_msa, shift_mlp, scale_mlp, eps=second_eps)
    net = self.ff.net
    y = codes_product(net[0].proj, rows, (b, t), hidden_states.dtype)            # (B, T, inner)
    for module in net[1:]:
        y = module(y)
    return gate_mlp.view(b, 1, d) * y + hidden_states


def _ada_zero_modulation(norm, timestep, class_labels, dtype):
    """(B, 6D): what diffusers' ``AdaLayerNormZero`` computes before its norm, ``linear(silu(emb(t, y)))``;
    from the hoisted modulation where the engine hoisted it (the first block computes every block's)."""
    hoisted = getattr(norm, "_hoisted", None)
    if hoisted is None:
        return norm.linear(norm.silu(norm.emb(timestep, class_labels, hidden_dtype=dtype)))
    cache, index = hoisted
    return cache.block_value(index, timestep, class_labels, dtype)


@functools.cache
def _block_class() -> type:
    """``BasicTransformerBlock`` with ``_forward``, made once (diffusers is imported only where a model is loaded)."""
    from diffusers.models.attention import BasicTransformerBlock

    return type("FusedNormBlock", (BasicTransformerBlock,),
                {"forward": _forward, "_diffusers_forward": BasicTransformerBlock.forward, "__module__": __name__})



