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

Kernels (``varlen_attention_into``), chosen per call:

* CUDA, fp16/bf16, head dim a multiple of 8 up to 256 (PixArt: 72), sm80+, and a torch whose
  ``aten::_flash_attention_forward`` takes ``seqused_k``: flash attention's varlen path with
  ``cum_seq_q``/``cum_seq_k`` over the padded layout and ``seqused_k`` = the key counts, on the device.
  No host synchronisation; its output has the query's shape. Detected at run time from the op's schema.
* otherwise, eagerly: rows grouped by key count (a host read of the counts) and one
  ``scaled_dot_product_attention`` per group on ``k[:, :n]``; exact and padding-free, but on CUDA (fp32,
  or a torch without the kernel) the host read syncs the stream once per layer.
* otherwise, inside a ``full`` capture (the break is captured inline, so no host read is allowed): SDPA
  over all L keys with a boolean mask built on the device. Exact, not padding-free.

Boundary buffers. q (B*T rows), k and v (B*L rows) and the output (B*T rows) live in ONE
``workers.patches.AttentionScratch``, shared by all layers and buckets as the self-attention break's is
(pass that one as ``scratch`` to share it too: attn1 finishes before attn2 starts). Each slot has
B * max(T, L) rows: at 256 px PixArt-Σ has T = 256 image tokens but L = 300 keys. The kernel writes into
the output slot in place. At capture the break runs on counts the preceding segment has only recorded
(garbage), so counts are clamped to [1, L] inside the break: the placeholder run reads no memory
outside k and v.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from graphs import eager_on_graph
from workers.fp8 import linear_into, quantize_rows_into
from workers.patches import AttentionScratch, project_output, quantized_output


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


def cu_seqlens(rows: int, t: int, keys: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B+1,) int32 offsets of each row's queries in (B*T, h, d) and of its key slot in (B*L, h, d)."""
    step = lambda n: torch.arange(0, (rows + 1) * n, n, dtype=torch.int32, device=device)
    return step(t), step(keys)


@eager_on_graph
def varlen_attention_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, used: torch.Tensor,
                          out: torch.Tensor) -> None:
    """q (B, T, h, d), k and v (B, L, h, d), used (B,) keys per row -> out (B, T, h, d), row i attending
    to k[i, :used[i]]; runs eagerly between segments."""
    _varlen(q, k, v, used, out)


@eager_on_graph
def varlen_attention_quantized_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, used: torch.Tensor,
                                    codes: torch.Tensor, scales: torch.Tensor) -> None:
    """As ``varlen_attention_into``, the result's rows (B*T, h*d) written as FP8 codes and row scales for the
    output projection (``workers.patches.attention_quantized_into``): read once, not copied first."""
    b, t, h, d = q.shape
    quantize_rows_into(_varlen(q, k, v, used).view(b * t, h * d), codes, scales)


def _varlen(q, k, v, used, out=None) -> torch.Tensor:
    """The varlen attention (B, T, h, d) by the kernel the module docstring describes, into ``out`` where
    given (else flash's own result, or a new tensor)."""
    used = used.clamp(1, k.shape[1])  # garbage at capture: keep reads inside k, v
    if _flash_usable(q):
        b, t, h, d = q.shape
        cu_q, cu_k = cu_seqlens(b, t, k.shape[1], q.device)
        flat = lambda x: x.reshape(-1, h, d)                                    # (B*T or B*L, h, d)
        result = _flash_varlen(flat(q), flat(k), flat(v), cu_q, cu_k, t, k.shape[1], used).view(b, t, h, d)
        return result if out is None else out.copy_(result)
    out = torch.empty_like(q) if out is None else out                           # (B, T, h, d)
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        _masked_into(q, k, v, used, out)
    else:
        _grouped_into(q, k, v, used, out)
    return out


def _flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, used) -> torch.Tensor:
    """Flash attention's varlen forward: (B*T, h, d) queries against the first used[i] keys of row i's slot."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False,
                                                   seqused_k=used)[0]


def _grouped_into(q, k, v, used, out) -> None:
    q, k, v, out = (x.transpose(1, 2) for x in (q, k, v, out))                 # (B, h, T or L, d)
    lengths = used.tolist()  # a host read (a sync on CUDA): allowed because this runs eagerly
    for n in sorted(set(lengths)):
        rows = torch.tensor([i for i, m in enumerate(lengths) if m == n], device=q.device)
        out[rows] = F.scaled_dot_product_attention(q[rows], k[rows, :, :n], v[rows, :, :n])


def _masked_into(q, k, v, used, out) -> None:
    keep = torch.arange(k.shape[1], device=k.device) < used[:, None]           # (B, L)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))                           # (B, h, T or L, d)
    out.transpose(1, 2).copy_(F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None]))


def _flash_usable(q: torch.Tensor) -> bool:
    return _flash_ok(q.device, q.dtype, q.shape[-1])


def _flash_ok(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= 256 and _flash_takes_seqused() and torch.cuda.get_device_capability(device)[0] >= 8)


def kernel_name(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> str:
    """Which kernel ``varlen_attention_into`` runs for these queries when served (outside a ``full``
    capture): logged and reported per model at start-up, since the fallback reads the key counts on the
    host, a synchronisation per layer on CUDA."""
    device = torch.device(device)
    if _flash_ok(device, dtype, head_dim):
        return "flash varlen (seqused_k; no host read)"
    why = "" if device.type != "cuda" else (
        "; this torch's flash attention takes no seqused_k" if not _flash_takes_seqused() else
        f"; flash needs fp16/bf16, a head dim that is a multiple of 8 up to 256, sm80+")
    return f"SDPA per key length (one host read per layer{why})"


@functools.cache
def _flash_takes_seqused() -> bool:
    """Whether this torch's flash attention is built and its aten op takes ``seqused_k`` (2.13 does)."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None or not torch.backends.cuda.is_flash_attention_available():
        return False
    return any(a.name == "seqused_k" for a in op.default._schema.arguments)


class VarlenCrossAttention:
    """Cross-attention for PixArt blocks, as diffusers' AttnProcessor2_0 with a prefix mask, over each
    row's real keys only; q, k, v and the output live in the shared scratch."""

    def __init__(self, scratch: AttentionScratch, original) -> None:
        self.scratch, self.original = scratch, original  # original: the processor restore puts back

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states=None,
                 attention_mask=None, temb=None, quantized=None, **kwargs) -> torch.Tensor:
        """``quantized``: the FP8 codes and row scales of ``hidden_states`` for the query's projection, made
        by the caller (``workers.norm_fusion``)."""
        ctx = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        b, t, _ = hidden_states.shape                                           # (B, T, D)
        l, inner, heads = ctx.shape[1], attn.to_q.out_features, attn.heads      # ctx (B, L, C)
        q, k, v, o = self.scratch.views((b * t, b * l, b * l, b * t), inner, hidden_states)  # (B*T | B*L, inner)
        linear_into(hidden_states.reshape(b * t, -1), [(attn.to_q, q)], quantized)
        linear_into(ctx.reshape(b * l, -1), [(attn.to_k, k), (attn.to_v, v)])
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
            attn.set_processor(VarlenCrossAttention(scratch, attn.processor))


def restore_cross_attention(transformer: torch.nn.Module) -> None:
    """Undo ``varlen_cross_attention``: each attn2 gets back the processor it had before."""
    for blk in transformer.transformer_blocks:
        attn = getattr(blk, "attn2", None)
        if attn is not None and isinstance(attn.processor, VarlenCrossAttention):
            attn.set_processor(attn.processor.original)
