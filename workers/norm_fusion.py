"""FP8 blocks with each norm, its modulation and the next linear's quantization as one kernel: PixArt, DiT, FLUX.1.

A PixArt block (diffusers' ``BasicTransformerBlock``, ``norm_type="ada_norm_single"``) runs, per step:

    n1 = LN(h) * (1 + scale_msa) + shift_msa          -> self-attention's q, k, v (FP8: quantized rows)
    h  = h + gate_msa * attn1(n1)                     -> cross-attention's query (quantized rows)
    h  = h + attn2(h, prompt)
    n2 = LN(h) * (1 + scale_mlp) + shift_mlp          -> the feed-forward's first linear (quantized rows)
    h  = h + gate_mlp * ff(n2)

and a class-conditional DiT block (``norm_type="ada_norm_zero"``, no cross-attention) the same without the
cross-attention, its six modulation vectors from ``norm1``'s adaLN-Zero (or the hoisted modulation,
``workers.patches.HoistedModulation``), its second norm ``norm3``.

With the linears in FP8, each arrow is a pass that makes the rows an FP8 product reads. Here each is one
``workers.norm_kernel.add_norm_quantize`` call that reads its inputs once and writes the FP8 codes (and the
new residual) once, and the projections take those codes (``linear_into(..., quantized=...)``,
``Fp8Linear.mm_rows``) instead of quantizing again. The arithmetic is the block's, in float32 with one
rounding to FP8 where eager rounds to bf16 after each operation first.

``fuse_block_norms(transformer)`` gives the blocks that qualify (whose attention, cross-attention query and
feed-forward linears are FP8, norms without affine parameters, no chunked feed-forward) a class whose
``forward`` does this; one class for all, so a blocks-scope compile still makes one graph. At each call it
checks that the self-attention is the engine's (``BreakableSelfAttention``) and otherwise runs diffusers'
forward unchanged; a padded cross-attention (diffusers' processor) quantizes its own query.

FLUX.1's blocks (diffusers' ``FluxTransformerBlock`` and ``FluxSingleTransformerBlock``, FP8 with the GELUs
folded, ``workers.fp8``) run the same way, their attention routed (``workers.joint_attention``):

    double:  n = LN(x) * (1 + scale_msa) + shift_msa for the image's and the text's states (two calls) -> each
             stream's q, k and v as one product of those codes (``fuse_linears``), handed to the processor
             (``projected``); x = x + gate_msa * attn, LN, the feed-forward's modulation and its codes (one
             call a stream); x = x + gate_mlp * ff(x)
    single:  the text's and the image's tokens normed together, read from where they are (``text=``: the
             concatenation is never written for the norm) -> q, k, v and the MLP's product as one product;
             proj_out's input quantized from the attention and the MLP's product (``quantize_pair``); the
             residual add reads the text's and the image's states where they are

and fall back to their own forward when the processor is not the routed one or the call has attention kwargs.
"""

from __future__ import annotations

import functools

from torch import nn

import torch

from workers.fp8 import Fp8Linear, Projection, fuse_linears, quantize_pair
from workers.norm_kernel import add_norm_quantize
from workers.patches import BreakableSelfAttention
from workers.varlen import VarlenCrossAttention

ENABLED = True  # the engine patches PixArt's and DiT's FP8 blocks (a benchmark turns it off to compare)


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


def _fused_classes() -> tuple[type, ...]:
    return _block_class(), _flux_double_class(), _flux_single_class()


def fuse_block_norms(transformer: nn.Module) -> int:
    """Patch ``transformer``'s qualifying blocks (module docstring); returns how many are patched (again:
    the same count, nothing changes)."""
    if not ENABLED:
        return 0
    count = 0
    for block in getattr(transformer, "transformer_blocks", []):
        if type(block) in _fused_classes():
            count += 1
        elif _qualifies(block):
            block.__class__ = _block_class()
            count += 1
        elif _flux_double_qualifies(block):
            object.__setattr__(block, "_rows_projections", (  # not submodules: their weights stay the parts'
                _fused([block.attn.to_q, block.attn.to_k, block.attn.to_v]),
                _fused([block.attn.add_q_proj, block.attn.add_k_proj, block.attn.add_v_proj])))
            block.__class__ = _flux_double_class()
            count += 1
    for block in getattr(transformer, "single_transformer_blocks", []):
        if type(block) is _flux_single_class():
            count += 1
        elif _flux_single_qualifies(block):
            object.__setattr__(block, "_rows_projections", _fused(
                [block.attn.to_q, block.attn.to_k, block.attn.to_v, block.proj_mlp]))
            block.__class__ = _flux_single_class()
            count += 1
    return count


def fused_blocks(transformer: nn.Module) -> int:
    """How many of ``transformer``'s blocks run the fused forward now."""
    blocks = [*getattr(transformer, "transformer_blocks", []), *getattr(transformer, "single_transformer_blocks", [])]
    return sum(type(b) in _fused_classes() for b in blocks)


def restore_block_norms(transformer: nn.Module) -> None:
    """Undo ``fuse_block_norms``."""
    from diffusers.models.attention import BasicTransformerBlock

    for block in getattr(transformer, "transformer_blocks", []):
        if type(block) is _block_class():
            block.__class__ = BasicTransformerBlock
        elif type(block) is _flux_double_class():
            block.__class__ = _flux_double_class().__bases__[0]
    for block in getattr(transformer, "single_transformer_blocks", []):
        if type(block) is _flux_single_class():
            block.__class__ = _flux_single_class().__bases__[0]


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
    y = net[0].proj.mm_rows(*rows).view(b, t, -1)                                 # (B, T, inner)
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


def _ada_zero_plain(norm) -> bool:
    """A diffusers ``AdaLayerNormZero`` / ``AdaLayerNormZeroSingle`` of ``linear(silu(temb))`` and a plain LayerNorm."""
    return getattr(norm, "emb", None) is None and isinstance(getattr(norm, "linear", None), nn.Linear) \
        and _plain_norm(getattr(norm, "norm", None))


def _fp8_plain(*linears) -> bool:
    return all(isinstance(m, Fp8Linear) and m.gelu == "none" for m in linears)


def _folded_ff(ff) -> bool:
    from diffusers.models.attention import FeedForward

    return type(ff) is FeedForward and isinstance(ff.net[0], Projection) and _fp8_plain(ff.net[0].proj) \
        and isinstance(ff.net[-1], Fp8Linear)


def _flux_double_qualifies(block: nn.Module) -> bool:
    from diffusers.models.normalization import AdaLayerNormZero
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

    if type(block) is not FluxTransformerBlock:
        return False
    a = block.attn
    return all(type(n) is AdaLayerNormZero and _ada_zero_plain(n) for n in (block.norm1, block.norm1_context)) \
        and _plain_norm(block.norm2) and _plain_norm(block.norm2_context) \
        and _fp8_plain(a.to_q, a.to_k, a.to_v, a.add_q_proj, a.add_k_proj, a.add_v_proj) \
        and _folded_ff(block.ff) and _folded_ff(block.ff_context)


def _flux_single_qualifies(block: nn.Module) -> bool:
    from diffusers.models.normalization import AdaLayerNormZeroSingle

    from workers.fp8 import _fp8_single_block_class

    a = block.attn
    return type(block) is _fp8_single_block_class() and type(block.norm) is AdaLayerNormZeroSingle \
        and _ada_zero_plain(block.norm) and _fp8_plain(a.to_q, a.to_k, a.to_v, block.proj_mlp) \
        and isinstance(block.proj_out, Fp8Linear)


def _routed(block) -> bool:
    from workers.joint_attention import RoutedFluxAttention

    return isinstance(block.attn.processor, RoutedFluxAttention) and block.attn.processor._parallel_config is None


def _fused(parts: list[nn.Module]) -> tuple[nn.Module, tuple[int, ...]]:
    """One FP8 linear of ``parts`` (``fuse_linears``: their weights become its views) and the parts' widths."""
    return fuse_linears(parts), tuple(p.out_features for p in parts)


def _project(fused, rows, b: int, t: int) -> tuple[torch.Tensor, ...]:
    """The parts' products (B, T, N_i) of one product of the codes (views of its (B, T, sum N_i) output);
    ``fused`` as ``_fused`` makes it."""
    linear, widths = fused
    return linear.mm_rows(*rows).view(b, t, -1).split(widths, dim=-1)


def _feed_forward(ff, rows, b: int, t: int) -> torch.Tensor:
    """A folded feed-forward (``_folded_ff``) of rows its caller quantized: (B, T, D)."""
    y = ff.net[0].proj.mm_rows(*rows).view(b, t, -1)
    for module in ff.net[1:]:
        y = module(y)
    return y


def _flux_double_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                         joint_attention_kwargs=None):
    """``FluxTransformerBlock.forward`` (diffusers 0.42) with the fused norms (module docstring)."""
    if joint_attention_kwargs or not _routed(self):
        return self._diffusers_forward(hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                       joint_attention_kwargs)
    (b, n, _), l = hidden_states.shape, encoder_hidden_states.shape[1]                   # (B, N, D), L text tokens
    emb = self.norm1.linear(self.norm1.silu(temb))                                        # (B, 6D)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)  # (B, D) each
    c_emb = self.norm1_context.linear(self.norm1_context.silu(temb))
    c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = c_emb.chunk(6, dim=1)
    _, *image_rows = add_norm_quantize(hidden_states, shift=shift_msa, scale=scale_msa, eps=self.norm1.norm.eps)
    _, *text_rows = add_norm_quantize(encoder_hidden_states, shift=c_shift_msa, scale=c_scale_msa,
                                      eps=self.norm1_context.norm.eps)
    image_qkv, text_qkv = self._rows_projections
    projected = (*_project(image_qkv, image_rows, b, n), *_project(text_qkv, text_rows, b, l))
    attn_output, context_attn_output = self.attn.processor(
        self.attn, hidden_states, encoder_hidden_states, image_rotary_emb=image_rotary_emb, projected=projected)
    hidden_states, *rows = add_norm_quantize(hidden_states, attn_output, gate_msa, shift_mlp, scale_mlp,
                                             eps=self.norm2.eps)
    hidden_states = hidden_states + gate_mlp.unsqueeze(1) * _feed_forward(self.ff, rows, b, n)
    encoder_hidden_states, *rows = add_norm_quantize(encoder_hidden_states, context_attn_output, c_gate_msa,
                                                     c_shift_mlp, c_scale_mlp, eps=self.norm2_context.eps)
    encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * _feed_forward(self.ff_context, rows,
                                                                                            b, l)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def _flux_single_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                         joint_attention_kwargs=None):
    """``FluxSingleTransformerBlock.forward`` (diffusers 0.42; the GELU folded as ``workers.fp8``'s) with the
    fused norm (module docstring)."""
    if joint_attention_kwargs or not _routed(self):
        return self._diffusers_forward(hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                       joint_attention_kwargs)
    (b, n, d), l = hidden_states.shape, encoder_hidden_states.shape[1]                  # (B, N, D), L text tokens
    emb = self.norm.linear(self.norm.silu(temb))                                         # (B, 3D)
    shift, scale, gate = emb.chunk(3, dim=1)                                             # (B, D) each
    _, *rows = add_norm_quantize(hidden_states, shift=shift, scale=scale, eps=self.norm.norm.eps,
                                 text=encoder_hidden_states)                             # rows of cat([text, image])
    query, key, value, mlp = _project(self._rows_projections, rows, b, l + n)            # (B, L+N, D) x 3, (B, L+N, 4D)
    projected = (query, key, value, None, None, None)
    proc = self.attn.processor
    coded = proc.attention_codes(self.attn, query, image_rotary_emb, projected=projected)
    if coded is None:
        attn_output, descale = proc(self.attn, query, image_rotary_emb=image_rotary_emb, projected=projected), None
    else:
        attn_output, descale = coded                                                     # (B, L+N, D) e4m3, (1, 1, 1, 1)
    codes, scales = quantize_pair(attn_output.reshape(-1, d), mlp.reshape(-1, mlp.shape[-1]), self._mlp_gelu,
                                  descale)                                               # (B*(L+N), 5D)
    out = self.proj_out.mm_rows(codes, scales).view(b, l + n, d)
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1) + gate.unsqueeze(1) * out
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states[:, :l], hidden_states[:, l:]


@functools.cache
def _flux_double_class() -> type:
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

    return type("FusedNormFluxBlock", (FluxTransformerBlock,), {
        "forward": _flux_double_forward, "_diffusers_forward": FluxTransformerBlock.forward, "__module__": __name__})


@functools.cache
def _flux_single_class() -> type:
    from workers.fp8 import _fp8_single_block_class

    base = _fp8_single_block_class()
    return type("FusedNormFluxSingleBlock", (base,), {
        "forward": _flux_single_forward, "_diffusers_forward": base.forward, "__module__": __name__})
