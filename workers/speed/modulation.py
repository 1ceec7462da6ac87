"""Every adaLN modulation of an MMDiT step in one matrix product: FLUX.1 and SD3 (``hoist_temb_modulation``).

Why
---
In diffusers' FLUX.1 and SD3 transformers each block's norms make their own modulation from the step's
embedding ``temb`` (timestep, guidance and pooled prompt): ``linear(silu(temb))``, a (B, D) x (D, kD) product
per norm (FLUX.1: 2 x 19 double-block norms of 6D, 38 single-block ones of 3D, the output norm's 2D). At the
few rows of a small batch these products read their weights and little else (FLUX.1-dev: 6.5 GB of bf16
weights a step at any batch), 57+ launches of a product, its split-K reduction and the SiLU. Their input is
the same for every norm, so one product of silu(temb) with all those weights side by side gives them all at
once, one read of the weights at the bandwidth a long product reaches.

How
---
``hoist_temb_modulation(transformer)`` fuses the linears into one of (sum kD, D) (``workers.speed.fp8.fuse_linears``,
whose weights the linears' own become views of: no memory added once done; the fusing holds both copies for a
moment, or goes through host memory where the GPU has no room for both). A forward hook on
``time_text_embed`` computes its product from that output, and gives each linear its slice (``_hoisted``: a (B, kD) view); each linear's class becomes ``HoistedLinear``, whose forward
returns that slice instead of multiplying; a hook on the transformer's output takes the slices back, so a
call of a block outside a transformer forward multiplies as before. The same arithmetic as the blocks' own
(one product instead of many: the sums' order may differ, as between two cuBLAS kernels). One class and
views of one shape for every norm of a kind, so a blocks-scope compile still makes one graph per kind of
block (the views' rows marked dynamic as the blocks' arguments are); in a captured step the product is one
kernel of the graph.

Tables
------
The step's embedding depends on the timestep, the guidance scale and the pooled prompt, all known when a
request is admitted. So the engine computes each request's modulation for all of its steps then, one product
of S rows (``TembModulation.table``; ``table_specs`` / ``step_tables`` in ``workers.families.flux`` and
``sd3``), and the step hands its rows of that table to the transformer (``give``): the step runs neither the
product (FLUX.1-dev: 6.5 GB of weights read a step, about 1.55 ms on an H200) nor the embedding's small
kernels. A table row is the product, then the embedding itself (D columns), which ``time_text_embed`` returns
from the row: the hoisted linears return their slices whatever it is, but a wrapper around one (a LoRA
adapter's per-row term of the linear's input, ``workers.lora``) reads the true ``silu(temb)`` through the norm
that calls it, as without tables. One read of the weights a request instead of one a step; the table costs
(S, sum kD + D) in the model's dtype a request (FLUX.1-dev, 28 steps: 59 MB). A step called without the table
computes the product itself, as above.

Adapters
--------
Each norm still calls its linear (``HoistedLinear``, which returns its slice instead of multiplying), so a
``workers.lora.LoraLinear`` wrapped around a hoisted linear adds its rows' term to the slice as it would to the
linear's own product: nothing here knows of adapters. The linears' input is the step's rows ((B, D); SD3's two
CFG halves are 2B rows, whose adapters the wrapper repeats).

Only diffusers' ``AdaLayerNormZero`` (without its own embedding), ``AdaLayerNormZeroSingle``,
``SD35AdaLayerNormZeroX`` and ``AdaLayerNormContinuous`` norms with plain linears of ``temb``'s width and a
SiLU, in a transformer whose ``time_text_embed`` makes the ``temb`` its blocks read (FLUX.1's and SD3's
forward, diffusers 0.42); otherwise nothing changes.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from workers.speed.fp8 import fuse_linears

NORM_TYPES = ("AdaLayerNormZero", "AdaLayerNormZeroSingle", "SD35AdaLayerNormZeroX", "AdaLayerNormContinuous")


class HoistedLinear(nn.Linear):
    """A modulation linear whose product the transformer's ``TembModulation`` made for this forward."""

    _hoisted: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hoisted = self._hoisted
        if hoisted is None or hoisted.shape[0] != x.shape[0]:
            return F.linear(x, self.weight, self.bias)
        return hoisted


class TembModulation:
    """One linear of all ``linears`` side by side (``workers.speed.fp8.fuse_linears``: their weights become its views)
    and the hooks that give each linear its slice of its product."""

    def __init__(self, linears: list[nn.Linear], product: nn.Linear) -> None:
        self.linears = linears
        self.widths = [lin.out_features for lin in linears]
        self.product = product                   # (sum kD, D) weight, (sum kD,) bias
        self.hooks: list = []
        self.active = False  # hooked (the hooks themselves are not read in a forward: dynamo cannot trace them)
        self.given: torch.Tensor | None = None  # this forward's (B, sum kD) product, computed beforehand

    @property
    def weight(self) -> torch.Tensor:
        return self.product.weight

    @property
    def width(self) -> int:
        """sum kD + D: the width of one row of a modulation table (the product, then the embedding)."""
        return sum(self.widths) + self.linears[0].in_features

    def table(self, temb: torch.Tensor) -> torch.Tensor:
        """(S, sum kD + D): the product of S rows of ``temb`` at once (a request's steps, ``workers.families``),
        then ``temb`` itself (the step's embedding, which ``time_text_embed`` returns from the row)."""
        return torch.cat([self.product(F.silu(temb)), temb.to(self.product.weight.dtype)], dim=1)

    def compute(self, temb: torch.Tensor) -> None:
        """Each linear's slice of silu(temb) times the stacked weights, for this forward (of the product
        ``give`` handed over, if any)."""
        given = self.given
        y = given[:, :sum(self.widths)] if given is not None else self.product(F.silu(temb))  # (B, sum kD)
        for lin, view in zip(self.linears, y.split(self.widths, dim=1)):
            if view.shape[0] > 1 and not torch.compiler.is_compiling():  # its rows are the batch's: dynamic
                torch._dynamo.maybe_mark_dynamic(view, 0)  # where a compiled block's arguments are (blocks scope)
            object.__setattr__(lin, "_hoisted", view)

    def clear(self) -> None:
        object.__setattr__(self, "given", None)
        for lin in self.linears:
            object.__setattr__(lin, "_hoisted", None)


@functools.cache
def _given_embed_class(base: type) -> type:
    """``base`` (the transformer's ``time_text_embed`` class) returning ``temb`` from the table rows when the
    forward's modulation was given (``give``): the embedding's dozen small kernels are not run."""

    def forward(self, *args, **kwargs):
        cache = self._temb_modulation
        given = cache.given if cache is not None else None
        if given is None:
            return base.forward(self, *args, **kwargs)
        return given[:, sum(cache.widths):]  # (B, D): the rows' embedding, as the table holds it; no kernel

    return type(f"Given{base.__name__}", (base,), {"forward": forward, "_temb_modulation": None,
                                                    "__module__": __name__})


def give(transformer: nn.Module, product: torch.Tensor) -> None:
    """The next forward of ``transformer`` reads its modulation and embedding from ``product`` (B, width) (rows
    of a ``TembModulation.table``) instead of computing them; taken back after that forward. Nothing where the
    modulation is not hoisted (then its norms compute their own)."""
    cache = temb_modulation(transformer)
    if cache is not None:
        object.__setattr__(cache, "given", product)


def temb_modulation(transformer: nn.Module) -> TembModulation | None:
    """The transformer's hoisted modulation, while hoisted (else None)."""
    cache = getattr(transformer, "_temb_modulation", None)
    return cache if cache is not None and cache.active else None


def modulation_linears(transformer: nn.Module) -> list[nn.Linear] | None:
    """The linears of ``silu(temb)`` in ``transformer``'s norms (module docstring), or None where it does not
    qualify."""
    embed = getattr(transformer, "time_text_embed", None)
    if embed is None or type(transformer).__name__ not in ("FluxTransformer2DModel", "SD3Transformer2DModel"):
        return None
    linears = []
    for module in transformer.modules():
        if type(module).__name__ not in NORM_TYPES:
            continue
        lin, silu = getattr(module, "linear", None), getattr(module, "silu", None)
        if getattr(module, "emb", None) is not None or type(silu) is not nn.SiLU \
                or type(lin) not in (nn.Linear, HoistedLinear) or lin.bias is None:
            return None
        linears.append(lin)
    if not linears or len({(lin.in_features, lin.weight.dtype, lin.weight.device) for lin in linears}) != 1:
        return None
    return linears


def hoist_temb_modulation(transformer: nn.Module) -> bool:
    """Route ``transformer``'s modulation linears through one ``TembModulation`` (module docstring); False, and
    nothing changed, where it does not qualify. Hoisting again reuses the stacked weights (a second engine on
    one model must not move the weights the first one's graphs read)."""
    linears = modulation_linears(transformer)
    if linears is None:
        return False
    restore_temb_modulation(transformer)  # plain linears, no hooks: fuse_linears takes only nn.Linear parts
    product = fuse_linears(linears)       # the same product while the linears' weights are still its views
    cache = getattr(transformer, "_temb_modulation", None)
    if cache is None or cache.product is not product:
        cache = TembModulation(linears, product)
        object.__setattr__(transformer, "_temb_modulation", cache)  # a plain reference, not a submodule
    embed = transformer.time_text_embed
    cache.hooks = [embed.register_forward_hook(lambda mod, args, out: cache.compute(out)),
                   transformer.register_forward_hook(lambda mod, args, out: cache.clear())]
    cache.active = True
    for lin in linears:
        lin.__class__ = HoistedLinear
    embed.__class__ = _given_embed_class(type(embed))
    object.__setattr__(embed, "_temb_modulation", cache)
    return True


def restore_temb_modulation(transformer: nn.Module) -> None:
    """Undo ``hoist_temb_modulation``: each norm multiplies its own again (the stacked weights stay)."""
    cache = getattr(transformer, "_temb_modulation", None)
    if cache is None:
        return
    for hook in cache.hooks:
        hook.remove()
    cache.hooks = []
    cache.active = False
    cache.clear()
    embed = transformer.time_text_embed
    if type(embed).__module__ == __name__:
        embed.__class__ = type(embed).__mro__[1]
        embed.__dict__.pop("_temb_modulation", None)
    for lin in cache.linears:
        if type(lin) is HoistedLinear:
            lin.__class__ = nn.Linear


def hoisted(transformer: nn.Module) -> int:
    """How many modulation linears of ``transformer`` are hoisted now."""
    cache = temb_modulation(transformer)
    return 0 if cache is None else sum(type(lin) is HoistedLinear for lin in cache.linears)
