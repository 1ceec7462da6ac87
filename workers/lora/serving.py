"""The engine's adapters: the ones registered (host memory), one ``LoraBank`` per served model, and which request may
be admitted now.

Registration
------------
``register(name, data, model)`` reads an adapter file (safetensors bytes or a path: ``formats.read_adapter``, the
size limit ``lora_max_bytes``) and validates it against the model it is for (``validate``: against that model's bank,
whose targets are the linears its sped-up step calls): ``model`` given; else the file's metadata key
``dit_serve.model``; else every served model that validates it (a ``LoraError`` naming the first model's mismatch
when none does). A registered adapter is on the host only; it goes into a bank slot when a request needs it.

Admission
---------
A request's adapters are checked when it is added (``check``: registered for its model, at most ``per_request``, a
ValueError naming the adapter otherwise). A request whose adapters are all resident is admitted at once, its row of
``lora_slots`` / ``lora_scales`` made by ``row``; another waits in the engine's queue until ``make_resident`` loads
its adapters between steps: into a free slot, else the least recently used one no running row uses (``in_use``),
else it keeps waiting. Loading writes the bank in place (no recapture, no recompile); on CUDA on a side stream that
the steps wait for only where a row reads the slot (``LoraBank.row``).

Removal
-------
``remove(name)`` hides the adapter from new requests at once; it leaves the host and its slot (evicted) once no
running or waiting request names it (``collect``, between steps).
"""

from __future__ import annotations

import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch

from workers.lora.bank import LoraBank
from workers.lora.formats import Adapter, LoraError, read_adapter
from workers.lora.validate import validate

MODEL_KEY = "dit_serve.model"  # an adapter file's metadata key naming the model it is for


@dataclass
class Registered:
    adapter: Adapter
    models: tuple[str, ...]   # the served models it validated against
    staged: dict[str, tuple] = field(default_factory=dict)  # model -> its bank's host copy (LoraBank.stage)


class Loras:
    """Adapters registered with an engine and its models' banks (module docstring)."""

    def __init__(self, slots: int, max_rank: int, per_request: int, max_bytes: int | None = None,
                 kernel: str = "bmm") -> None:
        self.slots, self.max_rank, self.per_request, self.max_bytes = slots, max_rank, per_request, max_bytes
        self.kernel = kernel
        self.banks: dict[str, LoraBank] = {}
        self.transformers: dict[str, object] = {}
        self.adapters: dict[str, Registered] = {}
        self.removing: set[str] = set()
        self.refused: dict[str, str] = {}  # name -> why its last registration failed (a request naming it says so)
        self.rows: Counter[str] = Counter()  # requests admitted per adapter
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    # -- models ---------------------------------------------------------------------------------------------
    def add_model(self, name: str, transformer, targets: Iterable[str],
                  outside: dict[str, str] | None = None) -> LoraBank:
        """A bank for the model ``name`` over its linears ``targets``; ``outside``: linears left out on purpose, and
        why (an adapter targeting one is refused with that reason)."""
        bank = LoraBank(transformer, self.slots, self.max_rank, self.per_request, targets=targets, kernel=self.kernel,
                        outside=outside)
        self.banks[name], self.transformers[name] = bank, transformer
        return bank

    def remove_model(self, name: str) -> None:
        """Forget the model's bank, and the adapters registered for it alone."""
        self.banks.pop(name, None)
        self.transformers.pop(name, None)
        for adapter, reg in list(self.adapters.items()):
            reg.models = tuple(m for m in reg.models if m != name)
            reg.staged.pop(name, None)
            if not reg.models:
                del self.adapters[adapter]

    # -- registration ---------------------------------------------------------------------------------------
    def register(self, name: str, data: bytes | str | Path, model: str | None = None) -> dict:
        """Read and validate an adapter, then register it as ``name`` (replacing one of that name that no
        request uses); ValueError (``LoraError``) naming the mismatch. Returns its ``describe`` entry."""
        if not name or len(name) > 200:
            raise LoraError(f"an adapter needs a name of 1 to 200 characters (got {name!r})")
        if name in self.adapters and name not in self.removing and self._resident_anywhere(name):
            raise LoraError(f"an adapter named {name!r} is registered and loaded already: remove it first")
        try:
            adapter, meta_model = _read(data, self.max_bytes)
            models = self._models_for(adapter, model or meta_model or None)
        except LoraError as e:
            self.refused[name] = str(e)
            raise
        self.refused.pop(name, None)
        self.removing.discard(name)
        # staged now, once: a load between steps then only queues copies (pinned host memory on CUDA)
        self.adapters[name] = Registered(adapter, models, {m: self.banks[m].stage(adapter) for m in models})
        return self.describe()[name]

    def _models_for(self, adapter: Adapter, model: str | None) -> tuple[str, ...]:
        if model is not None:
            if model not in self.banks:
                raise LoraError(f"model {model!r} is not served here with adapters (served: "
                                f"{', '.join(self.banks) or 'none'})")
            self._validate(adapter, model)
            return (model,)
        fits, first = [], None
        for m in self.banks:
            try:
                self._validate(adapter, m)
                fits.append(m)
            except LoraError as e:
                first = first or LoraError(f"model {m!r}: {e}")
        if not fits:
            raise first or LoraError("no model is served here with adapters")
        return tuple(fits)

    def _validate(self, adapter: Adapter, model: str) -> None:
        bank = self.banks[model]
        validate(adapter, self.transformers[model], self.max_rank, targets=bank.targets, outside=bank.outside)

    def remove(self, name: str) -> None:
        """Hide ``name`` from new requests; it goes once no request names it (``collect``). KeyError if unknown."""
        if name not in self.adapters or name in self.removing:
            raise KeyError(f"adapter {name!r} is not registered here")
        self.removing.add(name)

    def collect(self, named: set[str]) -> None:
        """Drop the adapters being removed that no request (``named``: running or waiting) names."""
        for name in [n for n in self.removing if n not in named]:
            self.removing.discard(name)
            for bank in self.banks.values():
                if (slot := bank.slot_of(name)) is not None:
                    bank.evict(slot)
            del self.adapters[name]

    # -- admission ------------------------------------------------------------------------------------------
    def check(self, loras: Sequence[tuple[str, float]], model: str) -> None:
        """ValueError for a request of ``model`` naming an adapter not registered for it, or too many."""
        if len(loras) > self.per_request:
            raise LoraError(f"loras: {len(loras)} adapters asked; at most {self.per_request} per request")
        if len(loras) > self.slots:
            raise LoraError(f"loras: {len(loras)} adapters asked; this worker holds {self.slots} at once")
        if model not in self.banks:
            raise LoraError(f"loras: model {model!r} is served here without adapters")
        for name, _ in loras:
            reg = self.adapters.get(name)
            if reg is None or name in self.removing:
                why = f": it was refused ({self.refused[name]})" if reg is None and name in self.refused else ""
                raise LoraError(f"loras: adapter {name!r} is not registered here{why}")
            if model not in reg.models:
                raise LoraError(f"loras: adapter {name!r} is for {', '.join(reg.models)}, not model {model!r}")

    def missing(self, loras: Sequence[tuple[str, float]], model: str) -> list[str]:
        """The request's adapters not resident in the model's bank."""
        bank = self.banks[model]
        return [name for name, _ in loras if bank.slot_of(name) is None]

    def make_resident(self, loras: Sequence[tuple[str, float]], model: str, in_use: set[int]) -> bool:
        """Load the request's missing adapters into slots outside ``in_use`` (free, else least recently used);
        True once all are resident. The slots it holds join ``in_use``, so later requests of the same round do
        not evict them."""
        bank = self.banks[model]
        in_use.update(s for name, _ in loras if (s := bank.slot_of(name)) is not None)
        for name in self.missing(loras, model):
            slot = bank.choose_slot(in_use)
            if slot is None:
                return False
            if bank.names[slot] is not None:
                bank.evict(slot)
            reg = self.adapters[name]
            bank.load(slot, name, reg.adapter, stream=self._stream(bank), staged=reg.staged.get(model))
            in_use.add(slot)
        return True

    def row(self, loras: Sequence[tuple[str, float]], model: str) -> dict[str, torch.Tensor]:
        """The request's ``lora_slots`` (P,) and ``lora_scales`` (P,) (``LoraBank.row``); counted."""
        slots, scales = self.banks[model].row([(n, float(c)) for n, c in loras])
        self.rows.update(name for name, _ in loras)
        return {"lora_slots": slots, "lora_scales": scales}

    def _stream(self, bank: LoraBank) -> torch.cuda.Stream | None:
        device = bank._device()
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    # -- reporting ------------------------------------------------------------------------------------------
    def _resident_anywhere(self, name: str) -> bool:
        return any(bank.slot_of(name) is not None for bank in self.banks.values())

    def describe(self) -> dict[str, dict]:
        """{name: {"model", "models", "resident", "slot"}}: "model" and "slot" of its first model's bank."""
        out = {}
        for name, reg in self.adapters.items():
            if name in self.removing:
                continue
            slot = self.banks[reg.models[0]].slot_of(name)
            out[name] = {"model": reg.models[0], "models": list(reg.models), "resident": self._resident_anywhere(name),
                         "slot": slot}
        return out

    def stats(self, waiting: int) -> dict:
        banks = self.banks.values()
        return {"slots": self.slots, "max_rank": self.max_rank, "registered": len(self.adapters) - len(self.removing),
                "resident": {m: [n for n in b.names[1:] if n is not None] for m, b in self.banks.items()},
                "loads": sum(b.loads for b in banks), "evictions": sum(b.evictions for b in banks),
                "rows": dict(self.rows), "waiting": waiting,
                "bank_bytes": {m: b.nbytes for m, b in self.banks.items()}}


def _read(data: bytes | str | Path, max_bytes: int | None) -> tuple[Adapter, str]:
    """(the adapter, the model its metadata names or "") of a safetensors file or its bytes."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        if max_bytes is not None and len(data) > max_bytes:
            raise LoraError(f"the adapter is {len(data)} bytes; adapters are limited to {max_bytes}")
        with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
            f.write(bytes(data))
            f.flush()
            return _read(Path(f.name), max_bytes)
    adapter = read_adapter(data, max_bytes)
    from safetensors import safe_open

    with safe_open(str(data), framework="pt", device="cpu") as f:  # read_adapter has read it: it opens
        model = (f.metadata() or {}).get(MODEL_KEY, "")
    return adapter, model
