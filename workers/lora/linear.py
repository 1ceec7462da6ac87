"""Per-row LoRA on a transformer's linears: each row of a batch with its own adapters and scales, in one step.

The term
--------
For a wrapped linear and a row n of the batch, with the row's adapter slots ``s[n, j]`` and scales ``c[n, j]``
(j < per_request)::

    y[n] = base(x[n]) + sum_j c[n, j] * B[s[n, j]] @ (A[s[n, j]] @ x[n])        (x[n]: all of the row's tokens)

where ``A`` (slots, R, in) and ``B`` (slots, out, R) are the bank's tensors of that linear (``workers.lora.bank``:
ranks zero-padded to R, each adapter's alpha / r folded into its B, slot 0 always zero: "no adapter").
With the bank's ``kernel`` "triton" (``WorkerConfig.lora_kernel``, the default) the term is
``workers.kernels.lora`` where that runs (CUDA): two kernels that read each row's adapters at their slots'
addresses (no gathered copies) and skip places whose slot holds no adapter of this linear (the bank's ``live``),
adding the term into the linear's output in place (``lora_add``), so a row without adapters leaves it untouched.
Elsewhere ``lora_delta`` / ``lora_add`` compute it as gathered batched products: the rows' A and B are gathered
by slot (``index_select``), the rows' scales multiply their B, and two ``bmm`` make
``(N, T, in) -> (N, T, P R) -> (N, T, out)``, the second adding into the output (``baddbmm_``); there a row
without adapters (slot 0, scale 0) costs what one with adapters costs. Either way every shape is fixed by the
batch and the bank, nothing reads a tensor's value on the host and nothing branches on one: the term captures
into CUDA graphs and compiles like the rest of the step.

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
input.

The speed layer computes some linears without calling them; the term reaches them too, and the speed layer
imports nothing of this package:

* SD3's and FLUX.1's hoisted modulation (``workers.speed.modulation``): every norm's linear is one product of the
  step's embedding, made once (or read from the request's table), and each linear returns its slice. The norms
  still call their linears, so the wrap adds the term of ``silu(temb)`` (B, D) to the slice as it would to the
  linear's own product; a table row carries the embedding, which the step's stand-in for it returns, so the
  term's input is the true one with tables too. CFG's copies of the rows (SD3: 2B) repeat the slots as above.
* Linears a rewrite multiplies itself, holding them from when it was made: parts of one product
  (``workers.speed.fp8.fuse_linears``: the attention breaks' q, k and v; FLUX.1's FP8 blocks' q, k, v, context
  q, k, v and single-block MLP), the attention breaks' unfused projections (PixArt's cross-attention's among
  them), DiT's every-block modulation (``workers.speed.patches.HoistedModulation``). The wrap hands its term to
  its base (``LoraLinear.term``, the base's ``row_term``: ``workers.speed.terms``), and the rewrite adds it to the
  linear's columns of the product, from the linear's input. Where a norm quantized that input to FP8 codes, the
  term's input is the rows the codes stand for: the input the FP8 product multiplies, which differs from the
  unrounded one by e4m3's rounding.
* Linears a rewrite reads from the model at each call and multiplies itself (the GELU epilogue's product,
  FLUX.1's single blocks' ``proj_out``, FP8 products of codes made elsewhere) are called instead where they are
  wrapped (``workers.speed.epilogues.plain``, ``workers.speed.fp8.plain_fp8``): those fast paths give way, for
  that model, while its adapters are served.

Under the graph backends SD3's and FLUX.1's ``time_text_embed`` runs outside the step: once per request at
admission, for its modulation table. There the request's slots and scales are set for the table's rows
(``lora_rows``), so its linears' adapters reach the embedding the table holds (``workers.engine.step_tables``).

What neither a step nor admission reaches stays out of the bank (``workers.lora.reached``, which the engine's bank
is made over), so an adapter targeting it is refused at registration. ``unreached`` finds any wrapped linear a
forward neither calls nor asks for its term: an adapter on it would be silently skipped.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from graphs import TensorSpec
from workers.kernels import lora as lora_kernel
from workers.speed.fp8 import Fp8Linear
from workers.speed.terms import set_row_term


def lora_specs(per_request: int) -> dict[str, TensorSpec]:
    """The step's per-row LoRA inputs: up to ``per_request`` adapter slots per row and their scales; a replay's
    padding rows get slot 0 at scale 0 (no adapter: the Triton kernel skips them)."""
    return {"lora_slots": TensorSpec((per_request,), torch.int64, pad=0),
            "lora_scales": TensorSpec((per_request,), torch.float32, pad=0)}


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
               scales: torch.Tensor, kernel: str = "bmm", live: torch.Tensor | None = None) -> torch.Tensor:
    """The per-row LoRA term (module docstring) of ``x`` (N, ..., in) -> (N, ..., out), for a bank's ``a`` (S, R, in)
    and ``b`` (S, out, R), rows' ``slots`` (M, P) int64 and ``scales`` (M, P), N = k M (k copies of the rows).
    ``kernel`` "triton": ``workers.kernels.lora`` where it runs (it reads the adapters in place and skips places
    whose slot is not ``live`` for this linear, (S,), default every slot but 0), else the gathered batched
    products."""
    slots, scales = _repeat_rows(x, slots, scales)
    if kernel == "triton" and lora_kernel.available(x):
        return lora_kernel.lora_rows(x, a, b, _live(a, live), slots, scales)
    h, up = _gathered(x, a, b, slots, scales)
    return torch.bmm(h, up).view(*x.shape[:-1], up.shape[-1])                          # (N, ..., out)


def lora_add(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor,
             out: torch.Tensor, kernel: str = "bmm", live: torch.Tensor | None = None) -> None:
    """``out`` (N, ..., out) += ``lora_delta``'s term, in place (``out`` may be a view: a part's columns of one
    product). With the Triton kernel a row with no live place leaves ``out`` untouched (no pass over it); with the
    gathered products the sum is in the second product (``baddbmm_``) where ``out`` is contiguous rows."""
    slots, scales = _repeat_rows(x, slots, scales)
    if kernel == "triton" and lora_kernel.available(x):
        lora_kernel.lora_add_(x, a, b, _live(a, live), slots, scales, out)
        return
    h, up = _gathered(x, a, b, slots, scales)
    if out.dtype == x.dtype and out.is_contiguous():
        out.view(h.shape[0], -1, up.shape[-1]).baddbmm_(h, up)                           # out + h up, one product
    else:
        out.add_(torch.bmm(h, up).view(out.shape).to(out.dtype))


def _repeat_rows(x: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's rows' ``slots`` and ``scales`` (M, P) for ``x``'s N = k M rows (k copies: CFG's)."""
    n, m = x.shape[0], slots.shape[0]
    if n == m:
        return slots, scales
    if n % m:
        raise ValueError(f"a LoRA linear's input has {n} rows, not a multiple of the step's {m}")
    return slots.repeat(n // m, 1), scales.repeat(n // m, 1)                            # (N, P)


def _live(a: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
    """``live``, or every slot of ``a``'s but the empty slot 0."""
    if live is not None:
        return live
    live = torch.ones(a.shape[0], dtype=torch.int32, device=a.device)
    live[0] = 0
    return live


def _gathered(x, a, b, slots, scales) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered products' operands: ``x``'s rows times their places' A, (N, T, P R), and their places' scaled B,
    (N, P R, out)."""
    n, p, r = x.shape[0], slots.shape[1], a.shape[1]
    rows = x.reshape(n, -1, x.shape[-1])                                                # (N, T, in)
    index = slots.reshape(-1)                                                           # (N P,)
    down = a.index_select(0, index).view(n, p * r, -1).to(x.dtype)                      # (N, P R, in)
    up = b.index_select(0, index).view(n, p, -1, r).to(x.dtype)                         # (N, P, out, R)
    up = (up * scales.to(x.dtype)[:, :, None, None]).transpose(2, 3).reshape(n, p * r, -1)  # (N, P R, out)
    return torch.bmm(rows, down.transpose(1, 2)), up


class LoraLinear(nn.Module):
    """A linear (``base``: ``nn.Linear`` or ``Fp8Linear``) plus the per-row term of its bank's adapters. The term is
    handed to the base too (its ``row_term``), for speed rewrites that compute the base without calling it."""

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
        set_row_term(base, self.term)

    def extra_repr(self) -> str:
        return f"{self.name}: bank of {self.lora_a.shape[0] - 1} slots, rank {self.lora_a.shape[1]}"

    # the base's parameters, for model code that reads a linear's (diffusers' Z-Image embedder reads its dtype), as
    # PEFT's wrapped layers give them
    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.base, "bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.bank.row_slots is None:
            return y
        if type(self.base) in (nn.Linear, Fp8Linear):  # their output is a new tensor: the term is added into it
            self.term(x, into=y)
            return y
        return y + self.term(x).to(y.dtype)  # a linear whose output may be a view of something kept (a table's)

    def term(self, x: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor | None:
        """The rows' adapters' term (N, ..., out) for the base's input ``x`` (N, ..., in); with ``into`` (the base's
        output for ``x``, or a view of it), added to it in place and ``into`` returned. None outside a LoRA step's
        forward (``row_slots`` None), where the base is alone."""
        bank = self.bank
        slots, scales = bank.row_slots, bank.row_scales
        if slots is None:
            return None
        live = bank.live[self.name]
        if into is None:
            return lora_delta(self._input(x), self.lora_a, self.lora_b, slots, scales, bank.kernel, live)
        lora_add(self._input(x), self.lora_a, self.lora_b, slots, scales, into, bank.kernel, live)
        return into

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        """What the base multiplies: ``x``, or its activation where FP8 folded one into the base
        (``workers.speed.fp8.fold_gelus``)."""
        gelu = getattr(self.base, "gelu", "none") if isinstance(self.base, Fp8Linear) else "none"
        if gelu == "none":
            return x
        return F.gelu(x, approximate="tanh" if gelu == "tanh" else "none")


def apply_lora(model, bank) -> list[str]:
    """Wrap the linears of ``model``'s transformer (a ``LoadedModel`` or the transformer) that ``bank`` holds in
    ``LoraLinear``s, in place; returns the paths wrapped now (already wrapped ones are left as they are). Wrap
    after the speed layer, over the linears a forward reaches (``workers.lora.reached``; module docstring)."""
    transformer = getattr(model, "transformer", model)
    done = []
    for name in bank.targets:
        module = transformer.get_submodule(name)
        if isinstance(module, LoraLinear):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = transformer.get_submodule(parent_name) if parent_name else transformer
        parent._modules[child] = LoraLinear(module, bank, name)
        done.append(name)
    return done


@contextmanager
def lora_rows(bank, lora_slots: torch.Tensor, lora_scales: torch.Tensor) -> Iterator[None]:
    """The bank's wrapped linears read ``lora_slots`` (M, P) and ``lora_scales`` (M, P) as their rows' adapters
    for the length of the block: what ``with_lora`` does for a step, for a computation outside one (a request's
    modulation table at admission, ``workers.engine.step_tables``). Slots outside the bank read as slot 0."""
    bank.row_slots, bank.row_scales = lora_slots.clamp(0, bank.slots), lora_scales
    try:
        yield
    finally:
        bank.row_slots = bank.row_scales = None


def remove_lora(model) -> list[str]:
    """Undo ``apply_lora``: each ``LoraLinear`` of ``model``'s transformer replaced by its base, which loses the term
    handed to it; the paths unwrapped."""
    transformer = getattr(model, "transformer", model)
    done = []
    for name, module in list(transformer.named_modules()):
        if isinstance(module, LoraLinear):
            parent_name, _, child = name.rpartition(".")
            parent = transformer.get_submodule(parent_name) if parent_name else transformer
            parent._modules[child] = module.base
            set_row_term(module.base, None)
            done.append(name)
    return done


def with_lora(step: Callable[..., dict], bank) -> Callable[..., dict]:
    """``step`` taking the rows' ``lora_slots`` (B, P) and ``lora_scales`` (B, P) too (``lora_specs``), which the
    bank's wrapped linears read for the length of the call. Slots outside the bank (-1, a padding row's) read
    as slot 0, no adapter: one clamp per step, so no gather can index outside the bank."""

    def lora_step(lora_slots: torch.Tensor, lora_scales: torch.Tensor, **inputs):
        slots = lora_slots.clamp(0, bank.slots)
        if slots.shape[0] > 1 and not torch.compiler.is_compiling():
            # compiled blocks (graphs.compiled, blocks scope) read these beside their arguments, whose batch is
            # dynamic: unmarked, their fixed rows would pin it (a row count equal to the slots', in lora_delta)
            torch._dynamo.maybe_mark_dynamic(slots, 0)
            torch._dynamo.maybe_mark_dynamic(lora_scales, 0)
        bank.row_slots, bank.row_scales = slots, lora_scales
        try:
            return step(**inputs)
        finally:
            bank.row_slots = bank.row_scales = None

    return lora_step


def unreached(transformer: nn.Module, run: Callable[[], object]) -> list[str]:
    """The ``LoraLinear``s of ``transformer`` that ``run()`` (a forward, eager) neither calls nor asks for their
    term (through their base, module docstring): linears some rewrite computes by itself, which adapters would
    silently miss."""
    called: set[str] = set()
    wraps = [m for m in transformer.modules() if isinstance(m, LoraLinear)]
    hooks = [m.register_forward_pre_hook(lambda mod, args: called.add(mod.name)) for m in wraps]
    for m in wraps:
        set_row_term(m.base, _recording(m.term, m.name, called))
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
        for m in wraps:
            set_row_term(m.base, m.term)
    return [m.name for m in wraps if m.name not in called]


def _recording(term: Callable, name: str, called: set[str]) -> Callable:
    """``term``, noting ``name`` in ``called`` when it is asked for."""

    def recorded(x: torch.Tensor, into: torch.Tensor | None = None):
        called.add(name)
        return term(x, into=into)

    return recorded


