"""An adapter against the transformer it is for: every module it targets exists, is a linear layer the bank holds,
and its weights fit (``validate``); a ``LoraError`` naming the first mismatch otherwise.

The linears adapters reach are ``nn.Linear``, the speed layer's ``Fp8Linear`` (its base weights in FP8, the adapter
in the activations' dtype) and a linear already wrapped by ``apply_lora`` (its base), so a worker validates
against the model it serves, before or after the wrap.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from workers.lora.formats import Adapter, LoraError
from workers.lora.linear import LoraLinear
from workers.speed.fp8 import Fp8Linear
from workers.speed.terms import row_term, set_row_term

LINEARS = (nn.Linear, Fp8Linear)


def base_linear(module: nn.Module) -> nn.Module:
    """The linear under a ``LoraLinear`` wrap, else ``module`` itself."""
    return module.base if isinstance(module, LoraLinear) else module


def linear_shapes(transformer: nn.Module) -> dict[str, tuple[int, int]]:
    """Every linear of ``transformer`` adapters can reach, in module order: path -> (in_features, out_features).
    A wrapped linear is listed under the wrap's path (its base's own path is not a target)."""
    out: dict[str, tuple[int, int]] = {}
    wrapped: set[str] = set()
    for name, module in transformer.named_modules():
        if name.rpartition(".")[0] in wrapped:
            continue
        if isinstance(module, LoraLinear):
            wrapped.add(name)
        module = base_linear(module)
        if isinstance(module, LINEARS):
            out[name] = (module.in_features, module.out_features)
    return out


def validate(adapter: Adapter, transformer: nn.Module, max_rank: int, targets: Iterable[str] | None = None,
             outside: dict[str, str] | None = None) -> None:
    """Raise ``LoraError`` naming the first module of ``adapter`` (in its order) that ``transformer`` lacks, that is
    not a linear, that ``targets`` (the bank's; None: every linear) leaves out (``outside``: why, where told),
    whose shapes differ from the linear's, whose rank exceeds ``max_rank``, or whose weights are not finite (a
    row's NaN would be its image's)."""
    shapes = linear_shapes(transformer)
    kind = type(transformer).__name__
    for module in adapter.weights:
        if module in shapes:
            continue
        try:
            found = transformer.get_submodule(module)
        except AttributeError:
            raise LoraError(f"the adapter targets {module!r}, which {kind} has not") from None
        raise LoraError(f"the adapter targets {module!r}, a {type(base_linear(found)).__name__} of {kind}, "
                        "not a linear layer")
    held = shapes if targets is None else {t: shapes[t] for t in targets}
    check_shapes(adapter, held, max_rank, kind, outside)


def check_shapes(adapter: Adapter, shapes: dict[str, tuple[int, int]], max_rank: int, kind: str,
                 outside: dict[str, str] | None = None) -> None:
    """``validate`` against the (in, out) of the linears a bank holds (``shapes``), of a model ``kind``; ``outside``:
    linears the bank leaves out on purpose, and why."""
    if not adapter.weights:
        raise LoraError("the adapter targets no module")
    for module, w in adapter.weights.items():
        if module not in shapes:
            why = (outside or {}).get(module, "its served step does not reach it (a fast path multiplies its weights "
                                              "itself)")
            raise LoraError(f"the adapter targets {module!r}, a linear this model's adapter bank does not hold: {why}")
        fan_in, fan_out = shapes[module]
        if tuple(w.a.shape[1:]) != (fan_in,) or tuple(w.b.shape[:1]) != (fan_out,):
            raise LoraError(f"the adapter's {module!r} maps {w.a.shape[1]} -> {w.b.shape[0]} features (lora_A "
                            f"{tuple(w.a.shape)}, lora_B {tuple(w.b.shape)}); {kind}'s maps {fan_in} -> {fan_out}")
        if w.rank > max_rank:
            raise LoraError(f"the adapter's {module!r} has rank {w.rank}; this model's adapters are of rank at most "
                            f"{max_rank}")
        if not (torch.isfinite(w.a).all() and torch.isfinite(w.b).all()):
            raise LoraError(f"the adapter's {module!r} holds infinite or NaN values")


def reached(transformer: nn.Module, run: Callable[[], object]) -> list[str]:
    """The linears of ``transformer`` (``validate.linear_shapes``) that ``run()`` (a forward, eager, before
    ``apply_lora``) reaches: calls, or asks for their per-row term where a speed rewrite computes them itself
    (``workers.speed.terms``: a fused product's parts, DiT's hoisted modulation). The targets a bank of a sped-up
    model can serve; a linear some rewrite multiplies without either (an epilogue's product, one of FP8 codes read
    from the model at each call) is left out, so an adapter targeting it is refused at registration instead of
    being silently half applied."""
    names = list(linear_shapes(transformer))
    called: set[str] = set()
    bases = {n: base_linear(transformer.get_submodule(n)) for n in names}
    hooks = [transformer.get_submodule(n).register_forward_pre_hook(lambda mod, args, n=n: called.add(n))
             for n in names]
    kept = {n: row_term(base) for n, base in bases.items()}
    for n, base in bases.items():  # a probe: notes the ask, adds nothing
        set_row_term(base, lambda x, into=None, n=n: called.add(n))
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
        for n, base in bases.items():
            set_row_term(base, kept[n])
    return [n for n in names if n in called]
