"""The per-row LoRA term as two Triton kernels that read each row's adapters from the bank in place.

What it computes
----------------
For rows n of ``x`` (N, T, in), the bank's ``a`` (S, R, in) and ``b`` (S, out, R), and each row's adapter slots
``slots[n, j]`` and scales ``scales[n, j]`` (j < P)::

    delta[n] = sum_j scales[n, j] * (x[n] @ a[slots[n, j]].T) @ b[slots[n, j]].T          (N, T, out)

the term ``workers.lora.linear.lora_delta`` computes with gathered batched products (``index_select`` of every
row's P adapters, then two ``bmm`` over P R columns). Slot 0 is the bank's empty slot ("no adapter").

How
---
``shrink``: one program per (row, block of T tokens, adapter place j) multiplies the block of ``x`` by the
row's adapter's ``a`` (R, in), read at its slot's address: ``h`` (N, T, P R). ``expand``: one program per (row,
block of tokens, block of outputs) sums over j the products of ``h``'s block with ``b``'s (out block, R) times
the scale. A place whose slot is 0 is skipped in both (nothing read, nothing multiplied): a row without
adapters costs a launch's programs that return at once, and a row with one adapter of P places reads ``x``
once and multiplies R columns, where the gathered products copy and multiply all P R. Products accumulate in
float32; ``h`` is stored in ``x``'s dtype, as the gathered products' is. Float32 inputs multiply in IEEE
float32 (no TF32), so float32 tests compare exactly enough. Given the linear's own output (``base``), the expand
kernel adds the term to it as it stores (a wrapped linear's output in one pass, not a term and then a sum).

It is a ``torch.library`` custom op (``dit_serve::lora_rows``) with a fake implementation: a compiled step calls
it as one opaque kernel and CUDA graphs capture it (the slots are read on the GPU; nothing on the host).
``available`` says where it runs (CUDA and Triton; with ``TRITON_INTERPRET=1`` also on a CPU, for tests).
"""

from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU builds have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only installs
    triton = None

BLOCK_T = 64   # tokens per program
BLOCK_K = 64   # the input features a shrink step multiplies
BLOCK_O = 64   # outputs per expand program


def runs_on(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the kernels serve tensors of ``dtype`` (float32, bfloat16 or float16) on ``device``: Triton present
    and a CUDA device (or a CPU under Triton's interpreter, ``TRITON_INTERPRET=1``)."""
    if triton is None or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    kind = torch.device(device).type
    return kind == "cuda" or (kind == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def available(x: torch.Tensor) -> bool:
    """Whether the kernels serve ``x`` (``runs_on`` its device and dtype)."""
    return runs_on(x.device, x.dtype)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


if triton is not None:

    @triton.jit
    def _shrink(x_ptr, a_ptr, slots_ptr, h_ptr, T, K, R, P, sx_n, sx_t, sa_s, sa_r, sh_n, sh_t,
                BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        n, tb, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = tl.load(slots_ptr + n * P + j)
        if slot != 0:
            offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
            offs_r = tl.arange(0, BLOCK_R)
            acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                xt = tl.load(x_ptr + n * sx_n + offs_t[:, None] * sx_t + offs_k[None, :],
                             mask=(offs_t[:, None] < T) & (offs_k[None, :] < K), other=0.0)
                at = tl.load(a_ptr + slot * sa_s + offs_r[None, :] * sa_r + offs_k[:, None],
                             mask=(offs_r[None, :] < R) & (offs_k[:, None] < K), other=0.0)   # (K, R)
                if IEEE:
                    acc += tl.dot(xt, at, input_precision="ieee")
                else:
                    acc += tl.dot(xt, at)
            tl.store(h_ptr + n * sh_n + offs_t[:, None] * sh_t + (j * R + offs_r)[None, :],
                     acc.to(h_ptr.dtype.element_ty), mask=(offs_t[:, None] < T) & (offs_r[None, :] < R))

    @triton.jit
    def _expand(h_ptr, b_ptr, slots_ptr, scales_ptr, base_ptr, y_ptr, T, O, R, P, sh_n, sh_t, sb_s, sb_o,
                sbase_n, sbase_t, sy_n, sy_t, BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr,
                IEEE: tl.constexpr, HAS_BASE: tl.constexpr):
        n, tb, ob = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_o = ob * BLOCK_O + tl.arange(0, BLOCK_O)
        offs_r = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_T, BLOCK_O), dtype=tl.float32)
        for j in range(0, P):
            slot = tl.load(slots_ptr + n * P + j)
            if slot != 0:
                scale = tl.load(scales_ptr + n * P + j).to(tl.float32)
                ht = tl.load(h_ptr + n * sh_n + offs_t[:, None] * sh_t + (j * R + offs_r)[None, :],
                             mask=(offs_t[:, None] < T) & (offs_r[None, :] < R), other=0.0)       # (T, R)
                bt = tl.load(b_ptr + slot * sb_s + offs_o[None, :] * sb_o + offs_r[:, None],
                             mask=(offs_o[None, :] < O) & (offs_r[:, None] < R), other=0.0)       # (R, O)
                if IEEE:
                    acc += tl.dot(ht, bt, input_precision="ieee") * scale
                else:
                    acc += tl.dot(ht, bt) * scale
        mask = (offs_t[:, None] < T) & (offs_o[None, :] < O)
        if HAS_BASE:
            acc += tl.load(base_ptr + n * sbase_n + offs_t[:, None] * sbase_t + offs_o[None, :], mask=mask,
                           other=0.0).to(tl.float32)
        tl.store(y_ptr + n * sy_n + offs_t[:, None] * sy_t + offs_o[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mask)


def _launch(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
            scales: torch.Tensor, base: torch.Tensor | None) -> torch.Tensor:
    n, fin = x.shape[0], x.shape[-1]
    rows = x.reshape(n, -1, fin)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    t, (_, r, _), fout, p = rows.shape[1], a.shape, b.shape[1], slots.shape[1]
    a, b = a.to(x.dtype), b.to(x.dtype)  # no copy where the bank is in the activations' dtype (it is made so)
    slots, scales = slots.contiguous(), scales.to(torch.float32).contiguous()
    h = torch.empty((n, t, p * r), dtype=x.dtype, device=x.device)
    if base is not None:
        base = base.reshape(n, t, fout)
        if base.stride(-1) != 1:
            base = base.contiguous()
    y = torch.empty((n, t, fout), dtype=x.dtype if base is None else base.dtype, device=x.device)
    on = base if base is not None else y  # the base's pointer and strides (unread without one)
    block_r, ieee = _pow2(r), x.dtype == torch.float32
    _shrink[(n, triton.cdiv(t, BLOCK_T), p)](
        rows, a, slots, h, t, fin, r, p, rows.stride(0), rows.stride(1), a.stride(0), a.stride(1),
        h.stride(0), h.stride(1), BLOCK_T=BLOCK_T, BLOCK_R=block_r, BLOCK_K=BLOCK_K, IEEE=ieee)
    _expand[(n, triton.cdiv(t, BLOCK_T), triton.cdiv(fout, BLOCK_O))](
        h, b, slots, scales, on, y, t, fout, r, p, h.stride(0), h.stride(1), b.stride(0), b.stride(1),
        on.stride(0), on.stride(1), y.stride(0), y.stride(1), BLOCK_T=BLOCK_T, BLOCK_O=BLOCK_O, BLOCK_R=block_r,
        IEEE=ieee, HAS_BASE=base is not None)
    return y.view(*x.shape[:-1], fout)


@torch.library.custom_op("dit_serve::lora_rows", mutates_args=())
def lora_rows(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor,
              base: torch.Tensor | None = None) -> torch.Tensor:
    """The per-row LoRA term (module docstring) of ``x`` (N, ..., in) -> (N, ..., out), for a bank's ``a``
    (S, R, in) and ``b`` (S, out, R), and the rows' ``slots`` (N, P) int64 (in 0..S-1) and ``scales`` (N, P); with
    ``base`` (N, ..., out), ``base`` plus the term (added in the expand kernel: no pass of its own), in its dtype."""
    return _launch(x, a, b, slots, scales, base)


@lora_rows.register_fake
def _(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor,
      base: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], b.shape[1]), dtype=x.dtype if base is None else base.dtype)
