"""GELU inside the matrix product's epilogue: the feed-forward activation costs no pass of its own.

Every family's feed-forward is ``Linear -> GELU(tanh) -> Linear`` (diffusers' ``FeedForward`` with
``activation_fn="gelu-approximate"``: DiT, PixArt, SD3, FLUX's double blocks), and FLUX's single blocks
run ``proj_out(cat(attention, gelu(proj_mlp(x))))``. Eager, the GELU is a pass over the widest activation
of the block (rows x 4D, read and written); compiled, Inductor fuses it into a pointwise kernel but still
makes that pass, since the products are cuBLAS calls it cannot fuse into. cuBLASLt computes GELU (tanh
form) and the bias in the product's epilogue (``torch._addmm_activation``, which Inductor keeps as an
extern call), so the activation leaves the product already applied. In FLUX's single blocks, the
concatenation goes too: ``proj_out`` over ``[a | m]`` is ``a @ Wa^T + m @ Wm^T + b`` with ``Wa``, ``Wm``
column blocks (views) of its weight, two products and an add the following gate and residual fuse with
(``workers.families.flux.fast``).

Measured on an H200 (bf16, 12288 x 3072 -> 12288): product then GELU 1.57 ms, product with the GELU
epilogue 1.42, product alone 1.37. The epilogue rounds once (GELU of the float32 accumulator) where the
eager path rounds the product to bf16 first: within bf16 rounding of it, not bit-equal.

Only CUDA runs the epilogue, and only after ``epilogue_ok`` checked on the device (float32, against both
GELU forms) that it is the tanh form: on a CPU ``_addmm_activation`` applies the erf form, and a PyTorch
that changed its CUDA epilogue must not change the model silently. Elsewhere the patched modules compute
exactly what diffusers' do. FP8 linears are left alone (``workers.speed.fp8`` folds the GELU into the next
linear's input quantization instead).

A linear that adds a per-row term to its output (wrapped, as ``workers.lora`` wraps an adapter's target, or
handed a term: ``workers.speed.terms``) is called instead: its term goes in before the GELU, which the epilogue
leaves no room for. The same in FLUX's single blocks, whose ``proj_out`` then takes the concatenation.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from workers.speed.terms import row_term

log = logging.getLogger(__name__)
_CHECKED: dict[str, bool] = {}  # device -> the CUDA epilogue computes tanh-GELU there


def epilogue_ok(device: torch.device | str) -> bool:
    """Whether ``torch._addmm_activation(..., use_gelu=True)`` on ``device`` is bias + tanh-GELU: CUDA
    only, checked once per device in float32 (the two GELU forms differ by up to about 5e-4 near |x| = 2,
    far above float32 rounding). Call outside graph capture."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    key = str(device)
    if key not in _CHECKED:
        g = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(*s, generator=g).to(device) for s in ((64, 32), (48, 32), (48,)))
        got = torch._addmm_activation(b, x, w.t(), use_gelu=True)
        pre = F.linear(x, w, b)
        tanh = (got - F.gelu(pre, approximate="tanh")).abs().max().item()
        erf = (got - F.gelu(pre)).abs().max().item()
        _CHECKED[key] = tanh < 1e-4 < erf
        if not _CHECKED[key]:
            log.warning("cuBLASLt GELU epilogue on %s is not the tanh form (error %.2g, erf %.2g): not used",
                        key, tanh, erf)
    return _CHECKED[key]


def linear_gelu(x: torch.Tensor, proj: nn.Linear, epilogue: bool) -> torch.Tensor:
    """gelu_tanh(proj(x)) for (..., K) -> (..., N): with ``epilogue``, on CUDA, one cuBLASLt product that
    applies bias and GELU on the way out; otherwise, or where ``proj`` adds a term (``plain``), as diffusers'
    ``GELU`` module computes it."""
    if epilogue and x.is_cuda and plain(proj) and proj.bias is not None:
        rows = x.reshape(-1, x.shape[-1])                                             # (M, K)
        y = torch._addmm_activation(proj.bias, rows, proj.weight.t(), use_gelu=True)  # (M, N)
        return y.view(*x.shape[:-1], y.shape[-1])
    return F.gelu(proj(x), approximate="tanh")


def plain(linear: nn.Module) -> bool:
    """Whether ``linear`` is an ``nn.Linear`` that adds nothing to its product: not wrapped, no per-row term
    (``workers.speed.terms``). Only then may a rewrite multiply its weights itself instead of calling it."""
    return type(linear) is nn.Linear and row_term(linear) is None


class GeluEpilogue(nn.Module):
    """Stands in for diffusers' ``GELU(approximate="tanh")`` (same ``proj``, same state-dict keys)."""

    def __init__(self, proj: nn.Linear, epilogue: bool) -> None:
        super().__init__()
        self.proj, self.approximate, self.epilogue = proj, "tanh", epilogue

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return linear_gelu(hidden_states, self.proj, self.epilogue)


def fuse_gelu_epilogues(transformer: nn.Module) -> int:
    """Patch ``transformer``'s tanh-GELU feed-forwards as the module docstring says; returns how many were
    patched now (FLUX.1's single blocks: ``workers.families.flux.fast.fuse_gelu_epilogues``). The epilogue is
    used only where ``epilogue_ok`` holds for the transformer's device; patching again changes nothing (a
    second engine on one model)."""
    from diffusers.models.activations import GELU

    device = next(transformer.parameters()).device
    epilogue = epilogue_ok(device)
    count = 0
    for module in list(transformer.modules()):
        for name, child in list(module.named_children()):
            if type(child) is GELU and child.approximate == "tanh" and type(child.proj) is nn.Linear:
                setattr(module, name, GeluEpilogue(child.proj, epilogue))
                count += 1
    return count


