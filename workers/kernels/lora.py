"""The per-row LoRA term as two Triton kernels that read each row's adapters from the bank in place.

What it computes
----------------
For rows n of ``x`` (N, T, in), the bank's ``a`` (S, R, in) and ``b`` (S, out, R) of one linear, each row's adapter
slots ``slots[n, j]`` and scales ``scales[n, j]`` (j < P), and ``live`` (S,): which slots hold an adapter of this
linear (slot 0, the bank's empty slot, never does)::

    delta[n] = sum_j scales[n, j] * (x[n] @ a[slots[n, j]].T) @ b[slots[n, j]].T          (N, T, out)

the term ``workers.lora.linear.lora_delta`` computes with gathered batched products (``index_select`` of every
row's P adapters, then two ``bmm`` over P R columns). ``lora_rows`` returns the term; ``lora_add_`` adds it to the
linear's output in place.

How
---
``shrink``: one program per (row, block of T tokens, adapter place j) multiplies the block of ``x`` by the
row's adapter's ``a`` (R, in), read at its slot's address: ``h`` (N, T, P R). ``expand``: one program per (row,
block of tokens, block of outputs) sums over j the products of ``h``'s block with ``b``'s (out block, R) times
the scale. A place whose slot is not live for this linear (slot 0, or an adapter that does not target it) is
skipped in both: nothing read, nothing multiplied. Adding in place (``lora_add_``), a program whose row has no
live place returns without touching the output: a row without adapters costs two launches' programs that return
at once, where a term and a sum would read and write the whole output; and a row with one adapter of P places
reads ``x`` once and multiplies R columns, where the gathered products copy and multiply all P R. The output may
be a strided view (a part's columns of one fused product), its last dimension contiguous. Products accumulate in
float32; ``h`` is stored in ``x``'s dtype, as the gathered products' is. Float32 inputs multiply in IEEE float32
(no TF32), so float32 tests compare exactly enough.

They are ``torch.library`` custom ops (``dit_serve::lora_rows``, ``dit_serve::lora_add_``, the latter mutating its
``out``) with fake implementations: a compiled step calls them as opaque kernels and CUDA graphs capture them (the
slots are read on the GPU; nothing on the host). ``available`` says where they run (CUDA and Triton; with
``TRITON_INTERPRET=1`` also on a CPU, for tests).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU builds have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only installs
    triton = None

@dataclass(frozen=True)
class Tiles:
    """The kernels' blocking: tokens per program (``t``), the input features a shrink step multiplies (``k``),
    outputs per expand program (``o``), and Triton's ``warps`` and pipeline ``stages`` per program.
    ``bench/kernel_times.py --sections lora`` times candidates at the families' shapes."""

    t: int = 64
    k: int = 64
    o: int = 64
    warps: int = 4
    stages: int = 3


TILES = Tiles()


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
    def _shrink(x_ptr, a_ptr, live_ptr, slots_ptr, h_ptr, T, K, R, P, sx_n, sx_t, sa_s, sa_r, sh_n, sh_t,
                BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        n, tb, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = tl.load(slots_ptr + n * P + j)
        if tl.load(live_ptr + slot) != 0:
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
    def _expand(h_ptr, b_ptr, live_ptr, slots_ptr, scales_ptr, y_ptr, T, O, R, P, sh_n, sh_t, sb_s, sb_o,
                sy_n, sy_t, BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr,
                IEEE: tl.constexpr, ADD: tl.constexpr):
        n, tb, ob = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_o = ob * BLOCK_O + tl.arange(0, BLOCK_O)
        offs_r = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_T, BLOCK_O), dtype=tl.float32)
        used = tl.full((), 0, tl.int32)
        for j in range(0, P):
            slot = tl.load(slots_ptr + n * P + j)
            if tl.load(live_ptr + slot) != 0:
                used += 1
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
        ptrs = y_ptr + n * sy_n + offs_t[:, None] * sy_t + offs_o[None, :]
        if ADD:  # in place: a row with no live place leaves its output as it is
            if used > 0:
                acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
                tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _rows3(t: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """``t`` (N, ..., width) as (N, T, width), a view where its strides allow, its last dimension contiguous."""
    rows = t.reshape(n, -1, width)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, live: torch.Tensor, slots: torch.Tensor,
            scales: torch.Tensor, y: torch.Tensor, add: bool, tiles: Tiles = TILES) -> None:
    """The kernels over ``x`` (N, T, in) into ``y`` (N, T, out): the term stored, or added (``add``)."""
    n, t, fin = x.shape
    (_, r, _), fout, p = a.shape, b.shape[1], slots.shape[1]
    a, b = a.to(x.dtype), b.to(x.dtype)  # no copy where the bank is in the activations' dtype (it is made so)
    slots, scales = slots.contiguous(), scales.to(torch.float32).contiguous()
    live = live.to(torch.int32).contiguous()
    h = torch.empty((n, t, p * r), dtype=x.dtype, device=x.device)
    block_r, ieee = _pow2(r), x.dtype == torch.float32
    run = {"num_warps": tiles.warps, "num_stages": tiles.stages}
    _shrink[(n, triton.cdiv(t, tiles.t), p)](
        x, a, live, slots, h, t, fin, r, p, x.stride(0), x.stride(1), a.stride(0), a.stride(1),
        h.stride(0), h.stride(1), BLOCK_T=tiles.t, BLOCK_R=block_r, BLOCK_K=tiles.k, IEEE=ieee, **run)
    _expand[(n, triton.cdiv(t, tiles.t), triton.cdiv(fout, tiles.o))](
        h, b, live, slots, scales, y, t, fout, r, p, h.stride(0), h.stride(1), b.stride(0), b.stride(1),
        y.stride(0), y.stride(1), BLOCK_T=tiles.t, BLOCK_O=tiles.o, BLOCK_R=block_r, IEEE=ieee, ADD=add, **run)


def add_rows_(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, live: torch.Tensor, slots: torch.Tensor,
              scales: torch.Tensor, out: torch.Tensor, tiles: Tiles = TILES) -> None:
    """``lora_add_`` on (N, T, in) rows into a contiguous (N, T, out) ``out`` with the given ``tiles``, outside
    the custom op: for timing candidates of the blocking."""
    _launch(x, a, b, live, slots, scales, out, add=True, tiles=tiles)


@torch.library.custom_op("dit_serve::lora_rows", mutates_args=())
def lora_rows(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, live: torch.Tensor, slots: torch.Tensor,
              scales: torch.Tensor) -> torch.Tensor:
    """The per-row LoRA term (module docstring) of ``x`` (N, ..., in) -> (N, ..., out), for a bank's ``a``
    (S, R, in) and ``b`` (S, out, R), ``live`` (S,) (nonzero: the slot holds this linear's adapter), and the rows'
    ``slots`` (N, P) int64 (in 0..S-1) and ``scales`` (N, P)."""
    n, fout = x.shape[0], b.shape[1]
    rows = _rows3(x, n, x.shape[-1])
    y = torch.empty((n, rows.shape[1], fout), dtype=x.dtype, device=x.device)
    _launch(rows, a, b, live, slots, scales, y, add=False)
    return y.view(*x.shape[:-1], fout)


@lora_rows.register_fake
def _(x, a, b, live, slots, scales):
    return x.new_empty((*x.shape[:-1], b.shape[1]))


@torch.library.custom_op("dit_serve::lora_add_", mutates_args=("out",))
def lora_add_(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, live: torch.Tensor, slots: torch.Tensor,
              scales: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (N, ..., out) += the term ``lora_rows`` returns, in place: the rows with no live place untouched,
    nothing allocated but the rank's columns. ``out`` may be strided (its last dimension contiguous) and of
    another dtype than ``x`` (the sum rounded to its dtype)."""
    n, fout = x.shape[0], b.shape[1]
    rows = _rows3(x, n, x.shape[-1])
    view = out.view(n, rows.shape[1], fout) if _viewable(out, n, fout) else None
    if view is None or view.stride(-1) != 1:  # not addressable as (N, T, out) rows: the term, then a sum
        y = torch.empty((n, rows.shape[1], fout), dtype=x.dtype, device=x.device)
        _launch(rows, a, b, live, slots, scales, y, add=False)
        out.add_(y.view(out.shape).to(out.dtype))
        return
    _launch(rows, a, b, live, slots, scales, view, add=True)


@lora_add_.register_fake
def _(x, a, b, live, slots, scales, out):
    return None


def _viewable(out: torch.Tensor, n: int, width: int) -> bool:
    try:
        out.view(n, -1, width)
    except RuntimeError:
        return False
    return True
