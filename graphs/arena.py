"""One aligned device allocation for a graph runner's static inputs and outputs.

Contract
--------
* ``ArenaLayout.plan(specs, max_batch)`` is pure arithmetic (no allocation, no CUDA): for each
  named ``TensorSpec`` it reserves ``max_batch`` rows, places the tensor at a byte offset rounded
  up to 256 (so every view is as aligned as a fresh allocation and vectorised kernels see the same
  alignment in every bucket), in the order the specs are given, without overlap.
* ``Arena(specs, max_batch, device)`` makes ONE ``torch.empty(total, dtype=torch.uint8)`` on the
  device, zeroes it once (warm-up then runs on defined values: an index tensor of zeros is valid),
  and carves typed views out of it. ``arena.tensor(name)`` is the (max_batch, *shape) view;
  ``arena.slice(name, b)`` its leading b rows, at the same address. Captured graphs bake these
  addresses in, so the arena must outlive every graph that reads it (the runner holds both).
* Static buffers change content, never address: never key a cache on their data_ptr (pitfall 7).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

__all__ = ["ALIGN", "Arena", "ArenaEntry", "ArenaLayout", "TensorSpec"]

ALIGN = 256  # bytes; cudaMalloc itself returns at least 256-byte aligned pointers


@dataclass(frozen=True)
class TensorSpec:
    """Shape of one sample (no batch dimension) and dtype of a static tensor; for an input, ``pad``: the value
    a replay's padding rows are set to (None: they keep whatever the buffer held, which a row-independent step
    never reads into a real row; a value where stale rows would cost work, e.g. an adapter slot the kernels skip)."""

    shape_per_sample: tuple[int, ...]
    dtype: torch.dtype
    pad: float | int | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.shape_per_sample)
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            raise ValueError(f"shape_per_sample must be ints >= 0, got {self.shape_per_sample!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        object.__setattr__(self, "shape_per_sample", shape)

    def nbytes(self, rows: int) -> int:
        return rows * math.prod(self.shape_per_sample) * self.dtype.itemsize


@dataclass(frozen=True)
class ArenaEntry:
    name: str
    offset: int  # bytes from the start of the arena, a multiple of ALIGN
    nbytes: int  # for max_batch rows
    spec: TensorSpec


def _align_up(x: int) -> int:
    return -(-x // ALIGN) * ALIGN


@dataclass(frozen=True)
class ArenaLayout:
    """Where each named tensor lives for max_batch rows; total_bytes is a multiple of ALIGN."""

    max_batch: int
    entries: tuple[ArenaEntry, ...]
    total_bytes: int

    @classmethod
    def plan(cls, specs: Mapping[str, TensorSpec], max_batch: int) -> ArenaLayout:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        entries, offset = [], 0
        for name, spec in specs.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
            if not isinstance(spec, TensorSpec):
                raise ValueError(f"spec for {name!r} must be a TensorSpec, got {spec!r}")
            entries.append(ArenaEntry(name, offset, spec.nbytes(max_batch), spec))
            offset = _align_up(offset + spec.nbytes(max_batch))
        return cls(max_batch, tuple(entries), offset)

    def entry(self, name: str) -> ArenaEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(f"no tensor {name!r} in the arena; it holds {self.names}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)


class Arena:
    """Static tensors carved from one zeroed uint8 allocation (see the module docstring)."""

    def __init__(self, specs: Mapping[str, TensorSpec], max_batch: int, device) -> None:
        self.layout = ArenaLayout.plan(specs, max_batch)
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"Arena on {self.device} needs CUDA, which is not available")
        self.buffer = torch.empty(self.layout.total_bytes, dtype=torch.uint8, device=self.device)
        self.buffer.zero_()
        self._views = {e.name: self._carve(e) for e in self.layout.entries}

    def _carve(self, e: ArenaEntry) -> torch.Tensor:
        raw = self.buffer[e.offset : e.offset + e.nbytes]
        return raw.view(e.spec.dtype).view(self.layout.max_batch, *e.spec.shape_per_sample)

    @property
    def max_batch(self) -> int:
        return self.layout.max_batch

    @property
    def nbytes(self) -> int:
        return self.layout.total_bytes

    def tensor(self, name: str) -> torch.Tensor:
        """The (max_batch, *shape) view of a static tensor."""
        try:
            return self._views[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in the arena; it holds {self.layout.names}") from None

    def slice(self, name: str, b: int) -> torch.Tensor:
        """The leading b rows of a static tensor (same address as tensor(name))."""
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= self.max_batch:
            raise ValueError(f"rows must be an int in [0, {self.max_batch}], got {b!r}")
        return self.tensor(name)[:b]
