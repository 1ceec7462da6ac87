"""Variable-length cross-attention for PixArt, applied from outside (diffusers' ``PixArtTransformer2DModel``).

Every prompt is padded to ``max_tokens`` (300 for PixArt-Σ) so the step stays graph-stable; the padded
cross-attention then scores all 300 keys and masks most of them away. ``varlen_cross_attention(transformer)``
swaps each block's ``attn2`` processor for one whose q/k/v and output projections stay in the captured
segment while the attention kernel is an ``eager_on_graph`` call that scores each row only against its
real keys. The keys keep their padded (B, L) layout and the result has the query's shape, written in
place: nothing that crosses the break depends on the prompts.

Which rows use which keys. diffusers turns the (B, L) 0/1 prompt mask into an additive bias (B, 1, L)
(0 keep, -10000 drop) before the blocks; ``key_lengths`` counts the kept keys of whatever ``attn2``
receives. The mask must be a prefix mask (T5 pads at the end; not checked, that would need a host read),
so row i attends to keys [0, n_i). This is the padded result: exp(-10000) is 0 in every float type. A row
with no key kept (unreachable with T5, which keeps </s>) attends to all L keys, as the padded softmax over L
equal biases does up to the rounding of score - 10000 (2e-5 in float32, near-uniform in fp16/bf16).

Kernels: ``workers.kernels.varlen``.

Boundary buffers. q (B*T rows), k and v (B*L rows) and the output (B*T rows) live in ONE
``workers.speed.patches.AttentionScratch``, shared by all layers and buckets as the self-attention break's is
(pass that one as ``scratch`` to share it too: attn1 finishes before attn2 starts). Each slot has
B * max(T, L) rows: at 256 px PixArt-Σ has T = 256 image tokens but L = 300 keys. The kernel writes into
the output slot in place. At capture the break runs on counts the preceding segment has only recorded
(garbage), so counts are clamped to [1, L] inside the break: the placeholder run reads no memory
outside k and v.
"""

from __future__ import annotations

import torch

from graphs import eager_on_graph
from workers.kernels.varlen import varlen_attention
from workers.speed.fp8 import linear_into, quantize_rows_into
from workers.speed.terms import add_part_terms, has_terms
from workers.speed.patches import AttentionScratch, project_output, quantized_output


def key_lengths(mask: torch.Tensor | None, rows: int, keys: int, device: torch.device) -> torch.Tensor:
    """(B,) int32 keys each row attends to, from the mask diffusers hands attn2: None (all keys), a (B, L)
    keep-mask (bool, or 0/1 floats), the additive bias (B, 1, L) made from one (0 keep, -10000 drop), or
    that bias repeated per head (B * heads, 1, L; ``workers.families.pixart.head_bias``, which a padded
    step passes: a step made for padded cross-attention still runs right if varlen is switched on under it)."""
    if mask is None:  # made on the device: a host-to-device copy inside capture is illegal
        return torch.full((rows,), keys, dtype=torch.int32, device=device)
    flat = mask.reshape(rows, -1, keys)[:, 0]                                   # (B, L): a row's first head
    keep = flat if flat.dtype == torch.bool else (flat > 0.5 if mask.ndim == 2 else flat > -1.0)
    n = keep.sum(-1, dtype=torch.int32)                                         # (B,)
    return n.masked_fill(n == 0, keys)  # no key kept: the padded softmax, biases all equal, takes all L


@eager_on_graph
def varlen_attention_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, used: torch.Tensor,
                          out: torch.Tensor) -> None:
    """q (B, T, h, d), k and v (B, L, h, d), used (B,) keys per row -> out (B, T, h, d), row i attending
    to k[i, :used[i]]; runs eagerly between segments."""
    varlen_attention(q, k, v, used, out)


@eager_on_graph
def varlen_attention_quantized_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, used: torch.Tensor,
                                    codes: torch.Tensor, scales: torch.Tensor) -> None:
    """As ``varlen_attention_into``, the result's rows (B*T, h*d) written as FP8 codes and row scales for the
    output projection (``workers.speed.patches.attention_quantized_into``): read once, not copied first."""
    b, t, h, d = q.shape
    quantize_rows_into(varlen_attention(q, k, v, used).view(b * t, h * d), codes, scales)


class VarlenCrossAttention:
    """Cross-attention for PixArt blocks, as diffusers' AttnProcessor2_0 with a prefix mask, over each
    row's real keys only; q, k, v and the output live in the shared scratch."""

    def __init__(self, scratch: AttentionScratch, original, attn) -> None:
        self.scratch, self.original = scratch, original  # original: the processor restore puts back
        # the projections ``attn`` had when patched: a wrapper (a LoRA adapter's, workers.lora) replaces them in
        # ``attn`` afterwards, and the products below multiply their weights, then add their per-row terms
        self.to_q, self.to_k, self.to_v = attn.to_q, attn.to_k, attn.to_v

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states=None,
                 attention_mask=None, temb=None, quantized=None, **kwargs) -> torch.Tensor:
        """``quantized``: the FP8 codes and row scales of ``hidden_states`` for the query's projection, made
        by the caller (``workers.speed.norm_fusion``)."""
        ctx = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        b, t, _ = hidden_states.shape                                           # (B, T, D)
        l, inner, heads = ctx.shape[1], attn.to_q.out_features, attn.heads      # ctx (B, L, C)
        q, k, v, o = self.scratch.views((b * t, b * l, b * l, b * t), inner, hidden_states)  # (B*T | B*L, inner)
        linear_into(hidden_states.reshape(b * t, -1), [(self.to_q, q)], quantized)
        linear_into(ctx.reshape(b * l, -1), [(self.to_k, k), (self.to_v, v)])
        if has_terms((self.to_q, self.to_k, self.to_v)):  # (workers.speed.terms), of the rows multiplied
            add_part_terms([self.to_q], hidden_states, q.view(b, t, -1))
            add_part_terms([self.to_k], ctx, k.view(b, l, -1))
            add_part_terms([self.to_v], ctx, v.view(b, l, -1))
        used = key_lengths(attention_mask, b, l, hidden_states.device)         # (B,) int32, in the segment
        split = lambda y, n: y.view(b, n, heads, inner // heads)               # (B, n, h, d)
        codes = self.scratch.quantized(o) if quantized_output(attn) else None  # (B*T, inner), (B*T, 1)
        if codes is not None:
            varlen_attention_quantized_into(split(q, t), split(k, l), split(v, l), used, *codes)
        else:
            varlen_attention_into(split(q, t), split(k, l), split(v, l), used, split(o, t))
        return project_output(attn, o, b, t, codes)


def varlen_cross_attention(transformer: torch.nn.Module, scratch: AttentionScratch | None = None) -> None:
    """Route every block's cross-attention through the varlen break; patched blocks are left as they are."""
    attns = [blk.attn2 for blk in transformer.transformer_blocks if getattr(blk, "attn2", None) is not None]
    for attn in attns:
        extras = ("norm_q", "norm_k", "spatial_norm", "group_norm", "norm_cross", "residual_connection")
        if any(getattr(attn, f, None) not in (None, False) for f in extras):
            raise ValueError("varlen cross-attention supports plain attention only (PixArt's attn2): "
                             f"{type(attn).__name__} has q/k norms, spatial or group norm, or a residual")
    done = [a.processor.scratch for a in attns if isinstance(a.processor, VarlenCrossAttention)]
    if scratch is None:
        scratch = done[0] if done else AttentionScratch()
    for attn in attns:
        if not isinstance(attn.processor, VarlenCrossAttention):
            attn.set_processor(VarlenCrossAttention(scratch, attn.processor, attn))


def restore_cross_attention(transformer: torch.nn.Module) -> None:
    """Undo ``varlen_cross_attention``: each attn2 gets back the processor it had before."""
    for blk in transformer.transformer_blocks:
        attn = getattr(blk, "attn2", None)
        if attn is not None and isinstance(attn.processor, VarlenCrossAttention):
            attn.set_processor(attn.processor.original)
