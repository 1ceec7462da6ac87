"""A model's adapter bank: fixed-shape device tensors that adapters are loaded into in place.

Shape
-----
Made once per model (a worker's ``lora_slots``, ``lora_max_rank``, ``lora_per_request``) for the linears it
``targets`` (every linear of the transformer unless told): for each, ``a[name]`` (slots + 1, max_rank, in) and
``b[name]`` (slots + 1, out, max_rank), zeros, in the activations' dtype (bf16 on a GPU, also over an FP8 base).
Entry 0 is the empty slot, zero forever: a row's unused adapter places point at it with scale 0. Adapters live in
slots 1..slots, a rank r below max_rank in the first r rows of ``a`` and columns of ``b`` (the rest zero, so the
padded product is the adapter's exactly), each module's ``alpha / r`` folded into its ``b``. ``live[name]``
(slots + 1,) int32 says which slots hold an adapter of that linear (nonzero; never slot 0): the Triton kernel of
the rows' terms skips the others (an adapter on the attention leaves the feed-forwards' terms unrun).

Loading without recapture
-------------------------
``load(slot, name, adapter)`` writes the slot's part of every tensor in place (``copy_`` and ``zero_``, never a
new tensor): the addresses that captured graphs and compiled steps read stay, so loading needs no capture and
no compile. On CUDA it may run on a side ``stream`` while steps replay on another: the host tensors are pinned and
copied without waiting, and kept until the copy's event has passed (``ready``); a request's ``row`` naming the
slot before then makes the current stream (the steps') wait for that event. A slot that running rows use must
not be loaded or evicted: ``choose_slot`` picks a free slot, else the least recently used resident one outside
``in_use``, else none (the request waits in the queue).

Per-row inputs
--------------
``row(loras)`` turns a request's adapters and scales into its row of the step's ``lora_slots`` / ``lora_scales``
(``workers.lora.linear.lora_specs``). During a step's forward ``row_slots`` / ``row_scales`` are the step's
inputs themselves (``workers.lora.linear.with_lora``), which the wrapped linears read; None otherwise. One
thread steps a bank's model (the engine's), so one forward at a time sets them.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Iterable, Sequence

import torch
from torch import nn

from workers.lora.formats import Adapter, LoraError
from workers.lora.validate import check_shapes, linear_shapes


class LoraBank:
    """Fixed-shape adapter tensors for the linears of one transformer (module docstring)."""

    def __init__(self, transformer: nn.Module, slots: int, max_rank: int, per_request: int,
                 targets: Iterable[str] | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, kernel: str = "bmm",
                 outside: dict[str, str] | None = None) -> None:
        if slots < 1 or max_rank < 1 or per_request < 1:
            raise ValueError(f"a bank needs slots, max_rank and per_request >= 1 (got {slots}, {max_rank}, "
                             f"{per_request})")
        shapes = linear_shapes(transformer)
        targets = list(shapes) if targets is None else list(targets)
        if unknown := [t for t in targets if t not in shapes]:
            raise ValueError(f"{type(transformer).__name__} has no linear {unknown[0]!r} for an adapter bank")
        self.kind = type(transformer).__name__
        self.shapes = {t: shapes[t] for t in targets}  # path -> (in, out)
        self.targets = tuple(self.shapes)
        self.outside = dict(outside or {})  # linears left out on purpose -> why (``check``'s refusal says it)
        self.slots, self.max_rank, self.per_request = slots, max_rank, per_request
        self.kernel = kernel  # how the wrapped linears compute their term (workers.lora.linear.lora_delta)
        dtype, device = dtype or _activation_dtype(transformer), device or _device(transformer)
        self.a = {t: torch.zeros(slots + 1, max_rank, fin, dtype=dtype, device=device)
                  for t, (fin, _) in self.shapes.items()}
        self.b = {t: torch.zeros(slots + 1, fout, max_rank, dtype=dtype, device=device)
                  for t, (_, fout) in self.shapes.items()}
        self._live = torch.zeros(len(self.targets), slots + 1, dtype=torch.int32, device=device)
        self.live = {t: self._live[i] for i, t in enumerate(self.targets)}  # views: fixed addresses
        self.row_slots: torch.Tensor | None = None   # (B, P) int64 during a LoRA step's forward
        self.row_scales: torch.Tensor | None = None  # (B, P) float32
        self.names: list[str | None] = [None] * (slots + 1)  # the adapter resident in each slot (0: none ever)
        self._used = [0] * (slots + 1)  # the clock when each slot was last used (LRU)
        self._clock = 0
        self._pending: dict[int, tuple[torch.cuda.Event, list[torch.Tensor]]] = {}  # slot -> copy's event, staging
        self.loads = self.evictions = 0

    @property
    def nbytes(self) -> int:
        """Device memory the bank holds."""
        return sum(t.numel() * t.element_size() for d in (self.a, self.b) for t in d.values()) + self._live.nbytes

    # -- residency ------------------------------------------------------------------------------------------
    def slot_of(self, name: str) -> int | None:
        """The slot ``name`` is resident in, or None."""
        return self.names.index(name) if name in self.names else None

    def touch(self, slot: int) -> None:
        """Mark ``slot`` used now (a request naming its adapter was admitted)."""
        self._clock += 1
        self._used[slot] = self._clock

    def choose_slot(self, in_use: Iterable[int] = ()) -> int | None:
        """A slot to load an adapter into: a free one (the lowest), else the least recently used resident one that
        no running row uses (``in_use``) and no load is filling, else None."""
        for slot in range(1, self.slots + 1):
            if self.names[slot] is None and slot not in self._pending:
                return slot
        busy = set(in_use) | set(self._pending)
        idle = [(self._used[s], s) for s in range(1, self.slots + 1) if s not in busy]
        return min(idle)[1] if idle else None

    def check(self, adapter: Adapter) -> None:
        """LoraError naming the first module of ``adapter`` this bank cannot hold (``validate.check_shapes``)."""
        check_shapes(adapter, self.shapes, self.max_rank, self.kind, self.outside)

    # -- loading --------------------------------------------------------------------------------------------
    def stage(self, adapter: Adapter) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor] | None]]:
        """``adapter`` as this bank holds it, on the host: which targets it has ((targets,) int32), and each target's
        A (R, in) and B (out, R), zero-padded to the bank's rank with alpha / r folded into B (in float32, then the
        bank's dtype), None where it has none; pinned where the bank is on CUDA, so that a ``load`` of it only queues
        copies. ``workers.lora.serving`` makes it once, when the adapter is registered."""
        self.check(adapter)
        cuda = self._device().type == "cuda"
        pin = (lambda t: t.pin_memory()) if cuda else (lambda t: t)
        present = pin(torch.tensor([t in adapter.weights for t in self.targets], dtype=torch.int32))
        factors = {}
        for target in self.targets:
            w = adapter.weights.get(target)
            if w is None:
                factors[target] = None
                continue
            a, b = self.a[target], self.b[target]                                   # (S+1, R, in), (S+1, out, R)
            host_a, host_b = torch.zeros(a.shape[1:], dtype=a.dtype), torch.zeros(b.shape[1:], dtype=b.dtype)
            host_a[: w.rank] = w.a
            host_b[:, : w.rank] = w.b.float() * w.scale
            factors[target] = (pin(host_a), pin(host_b))
        return present, factors

    def load(self, slot: int, name: str, adapter: Adapter, stream: torch.cuda.Stream | None = None,
             staged: tuple | None = None) -> None:
        """Write ``adapter`` into ``slot`` in place (module docstring), on ``stream`` when given (CUDA), from its
        ``stage`` (made here when not given)."""
        self._check_slot(slot)
        present, factors = staged if staged is not None else self.stage(adapter)
        self._settle(slot)
        self.names[slot] = None  # until written: no row may name it (slot_of)
        cuda = self._device().type == "cuda"
        if stream is not None:  # after the steps queued so far: the last step of a request that used the slot
            stream.wait_stream(torch.cuda.current_stream(self._device()))  # may still be reading it
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            self._live[:, slot].copy_(present, non_blocking=cuda)
            for target in self.targets:
                a, b = self.a[target][slot], self.b[target][slot]                      # (R, in), (out, R)
                if factors[target] is None:
                    a.zero_()
                    b.zero_()
                else:
                    a.copy_(factors[target][0], non_blocking=cuda)
                    b.copy_(factors[target][1], non_blocking=cuda)
            if cuda:
                event = torch.cuda.Event()
                event.record()
                self._pending[slot] = (event, [present, *(t for f in factors.values() if f for t in f)])
        self.names[slot] = name
        self.touch(slot)
        self.loads += 1

    def ready(self, slot: int) -> bool:
        """Whether ``slot``'s last load has finished copying (always on a CPU)."""
        pending = self._pending.get(slot)
        if pending is None or pending[0].query():
            self._pending.pop(slot, None)
            return True
        return False

    def evict(self, slot: int) -> str | None:
        """Empty ``slot`` (zeroed in place; its adapter forgotten); the name it held. No running row may use it."""
        self._check_slot(slot)
        self._settle(slot)
        name, self.names[slot] = self.names[slot], None
        self._live[:, slot].zero_()
        for target in self.targets:
            self.a[target][slot].zero_()
            self.b[target][slot].zero_()
        self.evictions += name is not None
        return name

    # -- per-row inputs -------------------------------------------------------------------------------------
    def row(self, loras: Sequence[tuple[str, float]]) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's (name, scale) adapters -> its ``lora_slots`` (P,) int64 and ``lora_scales`` (P,) float32
        rows, on the host, unused places slot 0 at scale 0; LoraError for more than ``per_request`` or an adapter
        not loaded here. Marks its slots used. Where a slot's load is still copying on a side stream, the stream
        current now (the engine's, which its steps follow) waits for that copy: no host wait."""
        if len(loras) > self.per_request:
            raise LoraError(f"{len(loras)} adapters asked; at most {self.per_request} per request")
        slots, scales = torch.zeros(self.per_request, dtype=torch.int64), torch.zeros(self.per_request)
        for j, (name, scale) in enumerate(loras):
            slot = self.slot_of(name)
            if slot is None:
                raise LoraError(f"adapter {name!r} is not loaded")
            if not self.ready(slot):
                torch.cuda.current_stream(self._device()).wait_event(self._pending[slot][0])
            slots[j], scales[j] = slot, float(scale)
            self.touch(slot)
        return slots, scales

    def _check_slot(self, slot: int) -> None:
        if not 1 <= slot <= self.slots:
            raise ValueError(f"slot {slot} is not one of the bank's 1..{self.slots}")

    def _settle(self, slot: int) -> None:
        """Wait for a load still copying into ``slot`` before writing it again."""
        pending = self._pending.pop(slot, None)
        if pending is not None:
            pending[0].synchronize()

    def _device(self) -> torch.device:
        return next(iter(self.a.values())).device


def _activation_dtype(transformer: nn.Module) -> torch.dtype:
    """The dtype the transformer computes in: its first floating-point tensor wider than a byte (an FP8 linear's
    codes are not)."""
    for t in (*transformer.parameters(), *transformer.buffers()):
        if t.is_floating_point() and t.element_size() > 1:
            return t.dtype
    return torch.float32


def _device(transformer: nn.Module) -> torch.device:
    return next(iter((*transformer.parameters(), *transformer.buffers()))).device
