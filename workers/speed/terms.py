"""Per-row terms added to the output of linears that a speed rewrite computes without calling them.

Why
---
A wrapper may add something to a linear's output, row by row: ``workers.lora.LoraLinear`` adds the rows' adapters.
Some rewrites compute a linear's output without calling the linear: q, k and v as one product of their weights
side by side (``workers.speed.fp8.fuse_linears``: the attention breaks' ``BreakableSelfAttention``, FLUX.1's FP8
blocks), and DiT's every-block modulation at once (``workers.speed.patches.HoistedModulation``). A wrapper's
addition would be skipped there. (SD3's and FLUX.1's hoisted modulation is not among them: each norm still calls
its linear, which returns its slice of the one product, so a wrapper around it adds its term as anywhere else.)

The contract
------------
A wrapper hands its addition to the linear it wraps (``set_row_term``): a function of the linear's input, whose
first dimension is the step's rows ((N, ..., in); classifier-free guidance's k copies of them are k N), that returns
what to add to the linear's output ((N, ..., out)), or None when there is nothing to add now. Called with
``into=`` (the linear's output for that input, or a view of its columns), it adds itself there in place and
returns ``into`` (or None): no term made and summed in passes of their own, and rows with nothing to add left
untouched. A rewrite that computes the linear itself adds that term from the input the linear would have been
called with: ``add_part_terms`` for the parts of one product (into each part's columns, in place), ``plus_term``
for one linear. The rewrite holds the linears from when it was made (the fused product's ``parts``, the hoisted
stacks' linears), not the modules the model holds at each call: a wrapper replaces those. The speed layer knows
nothing of what a term is, and a linear without one costs nothing (an attribute read while a step is traced or
captured, none at replay).

Rewrites that read a linear from the model at each call and multiply its weights themselves, or hand it codes
made elsewhere, give way where it adds something (wrapped, or handed a term) and call it: the GELU epilogue's
product and FLUX.1's bf16 single blocks' ``proj_out`` split over its weight (``workers.speed.epilogues.plain``);
an FP8 feed-forward's first linear or FLUX.1's single blocks' ``proj_out`` fed a norm's or a pair's codes, an
attention output projection fed the attention's codes (``workers.speed.fp8.plain_fp8``, ``codes_product``: called
with the rows the codes stand for). ``workers.lora.reached`` finds the linears a forward reaches either way (the
engine's adapter banks hold those: an adapter on another is refused), and ``unreached`` finds any wrapped linear
a forward misses.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

Term = Callable[..., "torch.Tensor | None"]  # term(x) -> what to add; term(x, into=y) adds it to y in place


def set_row_term(linear: nn.Module, term: Term | None) -> None:
    """``linear``'s per-row term from now on (None: none). A plain attribute, not a submodule or a hook."""
    if term is None:
        linear.__dict__.pop("row_term", None)
    else:
        object.__setattr__(linear, "row_term", term)


def row_term(linear: nn.Module) -> Term | None:
    """The term handed to ``linear`` (``set_row_term``), or None."""
    return linear.__dict__.get("row_term")


def has_terms(linears: Sequence[nn.Module]) -> bool:
    """Whether any of ``linears`` has a term (a rewrite then makes their input where it has only codes of it)."""
    return any(row_term(lin) is not None for lin in linears)


def plus_term(linear: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y`` (N, ..., out), ``linear``'s output for ``x`` (N, ..., in), plus its term of ``x`` where it has one."""
    term = row_term(linear)
    delta = term(x) if term is not None else None
    return y if delta is None else y + delta.to(y.dtype)


def add_part_terms(parts: Sequence[nn.Module], x: torch.Tensor, y: torch.Tensor) -> None:
    """``y`` (N, ..., sum out_i), one product of ``parts`` side by side for ``x`` (N, ..., in): each part's term of
    ``x`` added to its columns, in place."""
    start = 0
    for part in parts:
        width = part.out_features
        term = row_term(part)
        if term is not None:
            term(x, into=y[..., start:start + width])
        start += width
