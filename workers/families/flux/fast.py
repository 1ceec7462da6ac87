"""FLUX.1's own fast paths: its blocks made fast (diffusers' ``FluxTransformerBlock`` and
``FluxSingleTransformerBlock``, 0.42), applied by the speed layer through the family's ``speed_rewrites``
(``workers.families.flux.runtime``; its routed attention is ``workers.families.flux.attention``).

Three rewrites of FLUX.1's block classes, each one class for all blocks of a kind (a blocks-scope compile
still makes one graph per kind):

* FP8 single blocks (``fold_single_block_gelus``): with FP8 ``proj_mlp`` and ``proj_out``, the MLP's GELU
  moves into ``proj_out``'s input quantization, which reads the attention and the MLP's product from where
  they are (``workers.speed.fp8.quantize_pair``): the activation and the concatenation are never written (on
  an H200, FLUX.1-dev 1024's FP8 step 2.2-3.9 ms faster, ``docs/benchmarks/kernels_flux1024_fp8_pair.md`` (in git history)).
* bf16 single blocks (``fuse_gelu_epilogues``): the MLP's GELU in its product's epilogue and ``proj_out``
  split over the concatenation's two parts (``workers.speed.epilogues``).
* FP8 blocks with fused norms (``fuse_block_norms``), as ``workers.speed.norm_fusion`` does PixArt's and
  DiT's. FLUX.1's blocks (diffusers' ``FluxTransformerBlock`` and ``FluxSingleTransformerBlock``, FP8 with the GELUs
folded, ``workers.speed.fp8``) run the same way, their attention routed (``workers.families.flux.attention``):

    double:  n = LN(x) * (1 + scale_msa) + shift_msa for the image's and the text's states (two calls) -> each
             stream's q, k and v as one product of those codes (``fuse_linears``), handed to the processor
             (``projected``); x = x + gate_msa * attn, LN, the feed-forward's modulation and its codes (one
             call a stream); x = x + gate_mlp * ff(x)
    single:  the text's and the image's tokens normed together, read from where they are (``text=``: the
             concatenation is never written for the norm) -> q, k, v and the MLP's product as one product;
             proj_out's input quantized from the attention and the MLP's product (``quantize_pair``); the
             residual add reads the text's and the image's states where they are

and fall back to their own forward when the processor is not the routed one or the call has attention kwargs.

Per-row terms (``workers.speed.terms``: a LoRA adapter's, ``workers.lora``): the fused products add their parts'
terms to the parts' columns, of the rows the norm's codes stand for (the input the FP8 product multiplies); the
norms' linears are called (hoisted or not), so their wrappers add theirs. A feed-forward's first linear or a single
block's ``proj_out`` that adds something (wrapped) is called with the rows its codes stand for
(``workers.speed.fp8.codes_product``), and the bf16 single blocks call such a ``proj_out`` with the concatenation.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from workers.families.flux.attention import RoutedFluxAttention
from workers.kernels.norm import add_norm_quantize
from workers.speed.epilogues import epilogue_ok, linear_gelu, plain
from workers.speed.fp8 import Fp8Linear, Projection, codes_product, dequantize_rows, fuse_linears, quantize_pair
from workers.speed.terms import add_part_terms, has_terms
from workers.speed.norm_fusion import _plain_norm


# -- FP8 single blocks: the GELU in proj_out's quantization ----------------------------------------------
def _fp8_single_block_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                              joint_attention_kwargs=None):
    """diffusers' ``FluxSingleTransformerBlock.forward`` (0.42) with FP8 ``proj_mlp`` and ``proj_out``: the
    MLP's product is left without its GELU, and ``proj_out``'s input, cat([attention, gelu(mlp)]), is quantized
    by ``quantize_pair`` straight from the two (the activation and the concatenation never written)."""
    text_seq_len = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)        # (B, L+N, D)
    residual = hidden_states
    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)                   # (B, L+N, D), (B, D)
    mlp = self.proj_mlp(norm_hidden_states)                                         # (B, L+N, 4D), before GELU
    coded = None  # FP8 attention's output codes, read as they are (workers.speed.joint_attention.HAND_CODES)
    if not joint_attention_kwargs and hasattr(self.attn.processor, "attention_codes"):
        coded = self.attn.processor.attention_codes(self.attn, norm_hidden_states, image_rotary_emb)
    if coded is None:
        attn_output, descale = self.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                                         **(joint_attention_kwargs or {})), None     # (B, L+N, D)
    else:
        attn_output, descale = coded                                                 # (B, L+N, D) e4m3, (1, 1, 1, 1)
    lead = attn_output.shape[:-1]
    codes, scales = quantize_pair(attn_output.reshape(-1, attn_output.shape[-1]), mlp.reshape(-1, mlp.shape[-1]),
                                  self._mlp_gelu, descale)                           # (B*(L+N), 5D)
    out = codes_product(self.proj_out, (codes, scales), tuple(lead), hidden_states.dtype)  # (B, L+N, D)
    hidden_states = residual + gate.unsqueeze(1) * out
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]


def fold_single_block_gelus(transformer: nn.Module) -> int:
    """FLUX.1's single blocks with FP8 ``proj_mlp`` and ``proj_out``: the MLP's GELU moves into ``proj_out``'s
    input quantization (``_fp8_single_block_forward``, by the blocks' class: one class for all, so a
    blocks-scope compile makes one graph of them); the same function. Returns how many were folded."""
    try:
        from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock
    except ImportError:  # pragma: no cover - diffusers is a dependency
        return 0
    folded = 0
    for block in getattr(transformer, "single_transformer_blocks", []):
        if type(block) is not FluxSingleTransformerBlock or not isinstance(block.proj_mlp, Fp8Linear) \
                or not isinstance(block.proj_out, Fp8Linear) or block.proj_out.gelu != "none" \
                or not isinstance(block.act_mlp, nn.GELU):
            continue
        block.__class__ = _fp8_single_block_class()
        block._mlp_gelu = "tanh" if block.act_mlp.approximate == "tanh" else "erf"
        folded += 1
    return folded


def unfold_single_block_gelus(transformer: nn.Module) -> int:
    """Undo ``fold_single_block_gelus`` (diffusers' forward again: a benchmark compares the two); returns how
    many blocks."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    blocks = [b for b in getattr(transformer, "single_transformer_blocks", []) if type(b) is _fp8_single_block_class()]
    for block in blocks:
        block.__class__ = FluxSingleTransformerBlock
    return len(blocks)


@functools.cache
def _fp8_single_block_class() -> type:
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    return type("Fp8FluxSingleBlock", (FluxSingleTransformerBlock,),
                {"forward": _fp8_single_block_forward, "__module__": __name__})


# -- bf16 single blocks: the GELU in the product's epilogue -----------------------------------------------
def fuse_gelu_epilogues(transformer: nn.Module) -> int:
    """FLUX.1's bf16 single blocks with their MLP's GELU in its product's epilogue where ``epilogue_ok`` holds
    for the transformer's device (``workers.speed.epilogues``); returns how many blocks."""
    return _epilogue_single_blocks(transformer, epilogue_ok(next(transformer.parameters()).device))


def _epilogue_single_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                         joint_attention_kwargs=None):
    """diffusers' ``FluxSingleTransformerBlock.forward`` with the MLP's GELU in its product's epilogue and
    ``proj_out`` split over the concatenation's two parts (no concatenated copy); a ``proj_out`` that adds a term
    (``workers.speed.epilogues.plain``: a LoRA adapter's) is called with the concatenation."""
    text_seq_len = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)        # (B, L+N, D)
    residual = hidden_states
    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)                   # (B, L+N, D), (B, D)
    mlp = linear_gelu(norm_hidden_states, self.proj_mlp, self._gelu_epilogue)        # (B, L+N, 4D)
    attn_output = self.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                            **(joint_attention_kwargs or {}))                        # (B, L+N, D)
    if plain(self.proj_out):
        d, w = attn_output.shape[-1], self.proj_out.weight                           # w: (D, D + 4D)
        out = F.linear(attn_output, w[:, :d], self.proj_out.bias) + F.linear(mlp, w[:, d:])  # (B, L+N, D)
    else:
        out = self.proj_out(torch.cat([attn_output, mlp], dim=-1))                   # (B, L+N, D)
    hidden_states = residual + gate.unsqueeze(1) * out
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]


def _epilogue_single_blocks(transformer: nn.Module, epilogue: bool) -> int:
    """FLUX's single blocks (bf16 ``proj_mlp`` and ``proj_out``) get ``_flux_single_forward`` by their class:
    one class for all of them, so a blocks-scope compile still makes one graph for the single blocks."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    count = 0
    for block in getattr(transformer, "single_transformer_blocks", []):
        if type(block) is not FluxSingleTransformerBlock or type(block.proj_mlp) is not nn.Linear \
                or type(block.proj_out) is not nn.Linear or block.act_mlp.approximate != "tanh":
            continue
        block.__class__ = _epilogue_single_block_class()
        block._gelu_epilogue = epilogue
        count += 1
    return count


@functools.cache
def _epilogue_single_block_class() -> type:
    """``FluxSingleTransformerBlock`` with ``_flux_single_forward``, made once (diffusers is imported only
    where a model is loaded)."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    return type("EpilogueFluxSingleBlock", (FluxSingleTransformerBlock,),
                {"forward": _epilogue_single_forward, "__module__": __name__})


# -- FP8 blocks with fused norms ------------------------------------------------------------------------
def _fused_classes() -> tuple[type, ...]:
    return _flux_double_class(), _flux_single_class()


def fuse_block_norms(transformer: nn.Module) -> int:
    """Patch ``transformer``'s qualifying FLUX.1 blocks (module docstring); returns how many are patched (again:
    the same count, nothing changes)."""
    count = 0
    for block in getattr(transformer, "transformer_blocks", []):
        if type(block) is _flux_double_class():
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
    """How many of ``transformer``'s FLUX.1 blocks run the fused forward now."""
    blocks = [*getattr(transformer, "transformer_blocks", []), *getattr(transformer, "single_transformer_blocks", [])]
    return sum(type(b) in _fused_classes() for b in blocks)


def restore_block_norms(transformer: nn.Module) -> None:
    """Undo ``fuse_block_norms``."""
    for block in getattr(transformer, "transformer_blocks", []):
        if type(block) is _flux_double_class():
            block.__class__ = _flux_double_class().__bases__[0]
    for block in getattr(transformer, "single_transformer_blocks", []):
        if type(block) is _flux_single_class():
            block.__class__ = _flux_single_class().__bases__[0]


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

    a = block.attn
    return type(block) is _fp8_single_block_class() and type(block.norm) is AdaLayerNormZeroSingle \
        and _ada_zero_plain(block.norm) and _fp8_plain(a.to_q, a.to_k, a.to_v, block.proj_mlp) \
        and isinstance(block.proj_out, Fp8Linear)


def _routed(block) -> bool:
    return isinstance(block.attn.processor, RoutedFluxAttention) and block.attn.processor._parallel_config is None


def _fused(parts: list[nn.Module]) -> tuple[nn.Module, tuple[int, ...]]:
    """One FP8 linear of ``parts`` (``fuse_linears``: their weights become its views) and the parts' widths."""
    return fuse_linears(parts), tuple(p.out_features for p in parts)


def _project(fused, rows, b: int, t: int) -> tuple[torch.Tensor, ...]:
    """The parts' products (B, T, N_i) of one product of the codes (views of its (B, T, sum N_i) output), with
    the parts' per-row terms (``workers.speed.terms``: a LoRA adapter's) of the rows the codes stand for;
    ``fused`` as ``_fused`` makes it."""
    linear, widths = fused
    y = linear.mm_rows(*rows).view(b, t, -1)                                             # (B, T, sum N_i)
    if has_terms(linear.parts):
        add_part_terms(linear.parts, dequantize_rows(*rows, y.dtype).view(b, t, -1), y)
    return y.split(widths, dim=-1)


def _feed_forward(ff, rows, b: int, t: int, dtype: torch.dtype) -> torch.Tensor:
    """A folded feed-forward (``_folded_ff``) of rows its caller quantized: (B, T, D) in ``dtype``."""
    y = codes_product(ff.net[0].proj, rows, (b, t), dtype)
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
    ff = _feed_forward(self.ff, rows, b, n, hidden_states.dtype)                           # (B, N, D)
    hidden_states = hidden_states + gate_mlp.unsqueeze(1) * ff
    encoder_hidden_states, *rows = add_norm_quantize(encoder_hidden_states, context_attn_output, c_gate_msa,
                                                     c_shift_mlp, c_scale_mlp, eps=self.norm2_context.eps)
    ff = _feed_forward(self.ff_context, rows, b, l, hidden_states.dtype)                   # (B, L, D)
    encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * ff
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def _flux_single_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                         joint_attention_kwargs=None):
    """``FluxSingleTransformerBlock.forward`` (diffusers 0.42; the GELU folded as ``workers.speed.fp8``'s) with the
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
    out = codes_product(self.proj_out, (codes, scales), (b, l + n), hidden_states.dtype)  # (B, L+N, D)
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
    base = _fp8_single_block_class()
    return type("FusedNormFluxSingleBlock", (base,), {
        "forward": _flux_single_forward, "_diffusers_forward": base.forward, "__module__": __name__})
