"""Variable-length attention: each row's queries against only the first ``used[i]`` of its keys.

The keys keep their padded (B, L) layout and the result has the query's shape (PixArt's cross-attention over
each prompt's real tokens, ``workers.speed.varlen``).

Kernels (``varlen_attention``), chosen per call:

* CUDA, fp16/bf16, head dim a multiple of 8 up to 256 (PixArt: 72), sm80+, and a torch whose
  ``aten::_flash_attention_forward`` takes ``seqused_k``: flash attention's varlen path with
  ``cum_seq_q``/``cum_seq_k`` over the padded layout and ``seqused_k`` = the key counts, on the device.
  No host synchronisation; its output has the query's shape. Detected at run time from the op's schema.
* otherwise, eagerly: rows grouped by key count (a host read of the counts) and one
  ``scaled_dot_product_attention`` per group on ``k[:, :n]``; exact and padding-free, but on CUDA (fp32,
  or a torch without the kernel) the host read syncs the stream once per layer.
* otherwise, inside a ``full`` capture (the break is captured inline, so no host read is allowed): SDPA
  over all L keys with a boolean mask built on the device. Exact, not padding-free.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def cu_seqlens(rows: int, t: int, keys: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B+1,) int32 offsets of each row's queries in (B*T, h, d) and of its key slot in (B*L, h, d)."""
    step = lambda n: torch.arange(0, (rows + 1) * n, n, dtype=torch.int32, device=device)
    return step(t), step(keys)


def varlen_attention(q, k, v, used, out=None) -> torch.Tensor:
    """q (B, T, h, d), k and v (B, L, h, d), used (B,) keys per row -> the attention (B, T, h, d), row i
    attending to k[i, :used[i]], by the kernel the module docstring describes, into ``out`` where
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
        "; flash needs fp16/bf16, a head dim that is a multiple of 8 up to 256, sm80+")
    return f"SDPA per key length (one host read per layer{why})"


@functools.cache
def _flash_takes_seqused() -> bool:
    """Whether this torch's flash attention is built and its aten op takes ``seqused_k`` (2.13 does)."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None or not torch.backends.cuda.is_flash_attention_available():
        return False
    return any(a.name == "seqused_k" for a in op.default._schema.arguments)
