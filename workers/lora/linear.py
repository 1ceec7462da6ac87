"""Per-row LoRA on a transformer's linears: each row of a batch with its own adapters and scales, in one step.

The term
--------
For a wrapped linear and a row n of the batch, with the row's adapter slots ``s[n, j]`` and scales ``c[n, j]``
(j < per_request)::

    y[n] = base(x[n]) + sum_j c[n, j] * B[s[n, j]] @ (A[s[n, j]] @ x[n])        (x[n]: all of the row's tokens)

where ``A`` (slots, R, in) and ``B`` (slots, out, R) are the bank's tensors of that linear (``workers.lora.bank``:
ranks zero-padded to R, each adapter's alpha / r folded into its B, slot 0 always zero: "no adapter").
``lora_delta`` computes it as gathered batched products: the rows' A and B are gathered by slot (``index_select``),
the rows' scales multiply their B, and two ``bmm`` make ``(N, T, in) -> (N, T, P R) -> (N, T, out)``. Every shape
is fixed by the batch and the bank, nothing reads a tensor's value on the host and nothing branches on one: the
term captures into CUDA graphs and compiles like the rest of the step. A row without adapters (slot 0, scale 0)
costs what one with adapters costs: the products run over its zero slot.

The per-row inputs
------------------
The diffusers forward signatures stay as they are: a wrapped linear reads the rows' slots and scales from its
bank (``LoraBank.row_slots`` / ``row_scales``), which the step sets for the length of one forward
(``with_lora``): the step's own static inputs ``lora_slots`` (B, P) int64 and ``lora_scales`` (B, P) float32
(``lora_specs``), the tensors the graph runner copies each replay's rows into. Nothing is copied for the
linears: in a captured step they read those static inputs' addresses, in a compiled one they are graph inputs.
Outside such a forward (``row_slots`` None) a wrapped linear is its base alone.

The transformer may see the step's rows more than once: classifier-free guidance runs the batch twice, as
``cat([rows, rows])`` (each family's step concatenates whole copies). A linear whose input has k times the
step's rows repeats the slots and scales k times, so both halves of a row get its adapters, as they do in a
pipeline with the adapter loaded. A linear's input must lead with the batch (diffusers' modules do: (B, T, C)
or (B, C)).

Wrapping and the speed layer
----------------------------
``apply_lora`` replaces each target (an ``nn.Linear`` or the speed layer's ``Fp8Linear``) by a ``LoraLinear``
around it: an FP8 base stays FP8, and the term is computed in the activations' dtype (the bank's, bf16 on a GPU);
a base whose input activation was folded into it (``Fp8Linear.gelu``) gets the activation applied to the term's
input. Speed rewrites that compute a linear without calling it (q, k, v fused into one product, hoisted
modulation, a norm's codes fed to the product) would skip the term: ``apply_lora`` refuses the targets it can
recognise as such (a fused part, a hoisted modulation linear), and ``unreached`` finds any other by running a
forward.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from graphs import TensorSpec
from workers.speed.fp8 import Fp8Linear


def lora_specs(per_request: int) -> dict[str, TensorSpec]:
    """The step's per-row LoRA inputs: up to ``per_request`` adapter slots per row and their scales."""
    return {"lora_slots": TensorSpec((per_request,), torch.int64),
            "lora_scales": TensorSpec((per_request,), torch.float32)}


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
               scales: torch.Tensor) -> torch.Tensor:
    """The per-row LoRA term (module docstring) of ``x`` (N, ..., in) -> (N, ..., out), for a bank's ``a`` (S, R, in)
    and ``b`` (S, out, R), rows' ``slots`` (M, P) int64 and ``scales`` (M, P), N = k M (k copies of the rows)."""
    n, m = x.shape[0], slots.shape[0]
    if n != m:
        if n % m:
            raise ValueError(f"a LoRA linear's input has {n} rows, not a multiple of the step's {m}")
        slots, scales = slots.repeat(n // m, 1), scales.repeat(n // m, 1)              # (N, P)
    p, r = slots.shape[1], a.shape[1]
    rows = x.reshape(n, -1, x.shape[-1])                                                # (N, T, in)
    index = slots.reshape(-1)                                                           # (N P,)
    down = a.index_select(0, index).view(n, p * r, -1).to(x.dtype)                      # (N, P R, in)
    up = b.index_select(0, index).view(n, p, -1, r).to(x.dtype)                         # (N, P, out, R)
    up = (up * scales.to(x.dtype)[:, :, None, None]).transpose(2, 3).reshape(n, p * r, -1)  # (N, P R, out)
    h = torch.bmm(rows, down.transpose(1, 2))                                           # (N, T, P R)
    return torch.bmm(h, up).view(*x.shape[:-1], up.shape[-1])                           # (N, ..., out)


class LoraLinear(nn.Module):
    """A linear (``base``: ``nn.Linear`` or ``Fp8Linear``) plus the per-row term of its bank's adapters."""

    def __init__(self, base: nn.Module, bank, name: str) -> None:
        super().__init__()
        self.base = base
        self.name = name
        self.in_features, self.out_features = base.in_features, base.out_features
        # the bank and its tensors are plain references, not buffers: ``module.to()`` must not move (reallocate)
        # what the bank loads adapters into
        object.__setattr__(self, "bank", bank)
        object.__setattr__(self, "lora_a", bank.a[name])   # (S, R, in)
        object.__setattr__(self, "lora_b", bank.b[name])   # (S, out, R)

    def extra_repr(self) -> str:
        return f"{self.name}: bank of {self.lora_a.shape[0] - 1} slots, rank {self.lora_a.shape[1]}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        slots, scales = self.bank.row_slots, self.bank.row_scales
        if slots is None:  # a forward outside a LoRA step: the base alone
            return y
        return y + lora_delta(self._input(x), self.lora_a, self.lora_b, slots, scales).to(y.dtype)

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        """What the base multiplies: ``x``, or its activation where FP8 folded one into the base
        (``workers.speed.fp8.fold_gelus``)."""
        gelu = getattr(self.base, "gelu", "none") if isinstance(self.base, Fp8Linear) else "none"
        if gelu == "none":
            return x
        return F.gelu(x, approximate="tanh" if gelu == "tanh" else "none")


def apply_lora(model, bank) -> list[str]:
    """Wrap the linears of ``model``'s transformer (a ``LoadedModel`` or the transformer) that ``bank`` holds in
    ``LoraLinear``s, in place; returns the paths wrapped now (already wrapped ones are left as they are).
    ValueError for a target the speed layer computes without calling it (module docstring)."""
    transformer = getattr(model, "transformer", model)
    done = []
    for name in bank.targets:
        module = transformer.get_submodule(name)
        if isinstance(module, LoraLinear):
            continue
        if (why := _bypassed(module)) is not None:
            raise ValueError(f"{name}: {why}; adapters cannot reach it (leave it out of the bank's targets, or "
                             "out of that speed rewrite)")
        parent_name, _, child = name.rpartition(".")
        parent = transformer.get_submodule(parent_name) if parent_name else transformer
        parent._modules[child] = LoraLinear(module, bank, name)
        done.append(name)
    return done


def _bypassed(module: nn.Module) -> str | None:
    """Why the speed layer computes ``module`` without calling its forward, where that can be told from it."""
    if type(module).__name__ == "HoistedLinear":
        return "its product is hoisted with every modulation's (workers.speed.modulation)"
    if getattr(module, "_fused_into", None) is not None:
        return "it is fused with other linears into one product (workers.speed.fp8.fuse_linears)"
    return None


def with_lora(step: Callable[..., dict], bank) -> Callable[..., dict]:
    """``step`` taking the rows' ``lora_slots`` (B, P) and ``lora_scales`` (B, P) too (``lora_specs``), which the
    bank's wrapped linears read for the length of the call. Slots outside the bank (-1, a padding row's) read
    as slot 0, no adapter: one clamp per step, so no gather can index outside the bank."""

    def lora_step(lora_slots: torch.Tensor, lora_scales: torch.Tensor, **inputs):
        bank.row_slots, bank.row_scales = lora_slots.clamp(0, bank.slots), lora_scales
        try:
            return step(**inputs)
        finally:
            bank.row_slots = bank.row_scales = None

    return lora_step


def unreached(transformer: nn.Module, run: Callable[[], object]) -> list[str]:
    """The ``LoraLinear``s of ``transformer`` that ``run()`` (a forward, eager) does not call: linears some rewrite
    computes without their forward, which adapters would silently miss."""
    called: set[str] = set()
    wraps = [m for m in transformer.modules() if isinstance(m, LoraLinear)]
    hooks = [m.register_forward_pre_hook(lambda mod, args: called.add(mod.name)) for m in wraps]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return [m.name for m in wraps if m.name not in called]


