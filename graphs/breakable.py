"""Breakable CUDA graphs: captured segments with eager breaks between them.

Contract
--------
* ``@eager_on_graph`` marks a function that must run eagerly (an attention kernel that plans from
  sequence lengths, host logic, ``.item()``). With no breakable capture active on this thread it is
  a plain call: in eager code, and also inside a ``full`` capture (``breakable=False``), where its
  kernels are simply captured with the rest.
* ``BreakableCUDAGraph.capture()`` is a context manager. Inside it, each call of a marked function
  ends the current segment (``capture_end``), runs the function eagerly on the capture stream,
  records ``(fn, args, kwargs, out)`` and begins the next segment (``capture_begin``) with the same
  memory pool and capture mode. Segments are plain ``torch.cuda.CUDAGraph`` objects, captured on one
  side stream (never the legacy default stream) in ``thread_local`` mode, so other threads may
  allocate meanwhile (pitfall 11). Nested marked calls inside a break are plain calls.
* What crosses a break is a *boundary buffer* at a fixed address: the tensor (or tuple of tensors)
  the function returned at capture, made contiguous, and strongly referenced by the graph together
  with every argument of the break for the graph's whole life. The next segment has those addresses
  baked in; a weak or dropped reference lets the allocator hand the memory to someone else, and a
  later capture into a shared pool can reuse blocks an earlier graph still reads (pitfalls 1-2).
* ``replay()`` runs segment 0, break 0, segment 1, ... in capture order on the current stream. A
  break calls ``fn(*args, **kwargs)`` on its recorded (fixed-address) inputs and writes the fresh
  result into its boundary buffer in place (``out.copy_(fresh)``): the next segment reads the
  buffer, not whatever new tensor the function returned (pitfall 3). A result of another shape is
  an error, not a silent broadcast.
* At capture, a break runs on data the preceding segment has only *recorded*, not computed: its
  result then is a placeholder, recomputed at every replay. Python values passed to a break are
  baked in at capture, like everything else that is not a tensor (pitfall 5).
* A capture that raises ends any open segment (leaving the stream usable), drops what it recorded
  and re-raises; the caller decides whether to fall back to eager. Global state (the thread-local
  active capture, the current stream) is restored in ``finally``. On torch <= 2.11 a failed
  ``capture_end`` leaves the caching allocators still "recording" to the pool (seen on an H200 with
  torch 2.11: the next ``capture_begin`` into that pool raises "already recording to mempool_id"),
  and their stream filters point at the failed segment. So the device allocator's routing is ended
  where torch exposes it, the failed segment object is kept alive (its address stays valid for
  those filters), and ``pool_poisoned`` tells the caller to capture further graphs into a fresh pool.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

__all__ = ["BreakableCUDAGraph", "eager_on_graph", "require_cuda"]

logger = logging.getLogger(__name__)

_local = threading.local()  # .capture: the _Capture active on this thread, or None
# Segments whose capture_end failed. Kept alive on purpose: on torch <= 2.11 the allocators keep
# stream filters that dereference them (see the module docstring). A few small objects, at warm-up.
_ABANDONED: list[torch.cuda.CUDAGraph] = []


def require_cuda(what: str) -> None:
    """Raise a RuntimeError that names `what` when CUDA is not usable here."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{what} needs CUDA, which is not available (no GPU, or a CPU-only torch build); "
            "use the 'eager' backend on a CPU"
        )


def eager_on_graph(fn: Callable) -> Callable:
    """Mark fn to run eagerly between captured segments (see the module docstring)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        capture = getattr(_local, "capture", None)
        if capture is None:
            return fn(*args, **kwargs)
        return capture.break_on(fn, args, kwargs)

    return wrapper


def _boundary(out: Any, fn: Callable) -> Any:
    """The fixed-address buffer(s) that stand for a break's result at capture."""
    if out is None:  # fn wrote into a buffer it was given: nothing to copy at replay
        return None
    if isinstance(out, torch.Tensor):
        return _boundary_tensor(out, fn)
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
        return type(out)(_boundary_tensor(t, fn) for t in out)
    raise TypeError(
        f"@eager_on_graph function {_name(fn)} returned {type(out).__name__}; a break may return "
        "None, a tensor or a tuple of tensors (a Python value would be baked into the next segment)"
    )


def _boundary_tensor(t: torch.Tensor, fn: Callable) -> torch.Tensor:
    if t.device.type != "cuda":
        raise TypeError(f"@eager_on_graph function {_name(fn)} returned a tensor on {t.device}; "
                        "the next segment can only read CUDA memory")
    # An expanded or strided result cannot take copy_ in place; a dense copy can.
    return t if t.is_contiguous() else t.contiguous()


def _write_boundary(out: Any, fresh: Any, fn: Callable) -> None:
    if out is None:
        return
    if isinstance(out, torch.Tensor):
        _copy_into(out, fresh, fn)
        return
    if not isinstance(fresh, (tuple, list)) or len(fresh) != len(out):
        raise RuntimeError(f"break {_name(fn)} returned {type(fresh).__name__} at replay; "
                           f"it returned {len(out)} tensors at capture")
    for o, f in zip(out, fresh):
        _copy_into(o, f, fn)


def _copy_into(out: torch.Tensor, fresh: Any, fn: Callable) -> None:
    if not isinstance(fresh, torch.Tensor) or fresh.shape != out.shape:
        got = tuple(fresh.shape) if isinstance(fresh, torch.Tensor) else type(fresh).__name__
        raise RuntimeError(f"break {_name(fn)} returned {got} at replay but {tuple(out.shape)} "
                           "at capture; the next segment reads a fixed-shape boundary buffer")
    if fresh is not out:
        out.copy_(fresh)


def _end_pool_routing(device: torch.device, pool) -> None:
    """Stop the caching allocator routing to pool after a failed capture_end (torch <= 2.11).

    Newer torch ends the routing itself and then raises "not currently recording", ignored here.
    Without this, the allocator believes a capture is underway forever and stops processing the
    events of blocks freed after cross-stream use.
    """
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)  # private: used only if present
    if end is None:
        return
    try:
        end(device.index if device.index is not None else torch.cuda.current_device(), pool)
    except RuntimeError:
        pass


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", repr(fn))


@dataclass(frozen=True, eq=False)
class _Break:
    """One eager break: strong references to everything it reads and writes."""

    fn: Callable
    args: tuple
    kwargs: dict
    out: Any  # None, a tensor, or a tuple/list of tensors: the boundary buffer(s)

    def run(self) -> None:
        _write_boundary(self.out, self.fn(*self.args, **self.kwargs), self.fn)


class _Capture:
    """Bookkeeping of one capture in progress on this thread."""

    def __init__(self, graph: BreakableCUDAGraph, stream: torch.cuda.Stream, mode: str) -> None:
        self.graph, self.stream, self.mode = graph, stream, mode
        self.open: torch.cuda.CUDAGraph | None = None

    def begin_segment(self) -> None:
        segment = torch.cuda.CUDAGraph()
        segment.capture_begin(pool=self.graph.pool, capture_error_mode=self.mode)
        self.open = segment

    def end_segment(self) -> None:
        segment, self.open = self.open, None
        try:
            segment.capture_end()  # fails e.g. on a side stream forked and never joined
        except Exception:
            self._abandon(segment)
            raise
        self.graph._segments.append(segment)

    def abort(self) -> None:
        """End an open segment after a failure; the capture may already be invalidated."""
        segment, self.open = self.open, None
        if segment is None:
            return
        try:
            segment.capture_end()
        except Exception as exc:  # expected: the capture was invalidated by the original error
            logger.debug("ending an aborted capture segment raised %s: %s", type(exc).__name__, exc)
            self._abandon(segment)

    def _abandon(self, segment: torch.cuda.CUDAGraph) -> None:
        """A segment whose capture_end failed: keep it alive, unroute the allocator, flag the pool."""
        _ABANDONED.append(segment)
        _end_pool_routing(self.stream.device, self.graph.pool)
        self.graph.pool_poisoned = True

    def break_on(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        if torch.cuda.current_stream(self.stream.device) != self.stream:
            raise RuntimeError(f"break {_name(fn)} called on another stream than the capture "
                               "stream; join side streams before an @eager_on_graph call")
        self.end_segment()
        _local.capture = None  # marked functions called inside this break are plain calls
        try:
            out = _boundary(fn(*args, **kwargs), fn)
        finally:
            _local.capture = self
        self.graph._breaks.append(_Break(fn, args, dict(kwargs), out))
        self.begin_segment()
        return out


class BreakableCUDAGraph:
    """Ordered CUDA graph segments with eager breaks between them (see the module docstring)."""

    def __init__(self) -> None:
        self._segments: list[torch.cuda.CUDAGraph] = []
        self._breaks: list[_Break] = []
        self._ready = False
        self.pool = None  # the memory pool handle all segments share, set by capture()
        self.pool_poisoned = False  # a failed capture may leave the pool unusable for new captures
        self.replays = 0

    @property
    def num_segments(self) -> int:
        return len(self._segments)

    @property
    def num_breaks(self) -> int:
        return len(self._breaks)

    @contextlib.contextmanager
    def capture(
        self,
        pool=None,
        stream: torch.cuda.Stream | None = None,
        breakable: bool = True,
        capture_error_mode: str = "thread_local",
    ) -> Iterator[BreakableCUDAGraph]:
        """Capture the body; pool defaults to a fresh graph_pool_handle(), stream to a new side stream.

        breakable=False is the `full` backend: one segment, marked functions captured inline.
        """
        require_cuda("BreakableCUDAGraph.capture")
        if self._ready or self._segments:
            raise RuntimeError("this BreakableCUDAGraph is already captured; make a new one")
        if getattr(_local, "capture", None) is not None:
            raise RuntimeError("a breakable capture is already active on this thread")
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream = stream if stream is not None else torch.cuda.Stream()
        torch.cuda.synchronize()  # warm-up and input copies on other streams are done
        state = _Capture(self, stream, capture_error_mode)
        with torch.cuda.stream(stream):
            try:
                _local.capture = state if breakable else None
                state.begin_segment()
                yield self
                state.end_segment()
            except BaseException:
                state.abort()  # still on the capture stream: capture_end must be called there
                self._segments.clear()
                self._breaks.clear()
                raise
            finally:
                _local.capture = None
        self._ready = True

    def replay(self) -> None:
        """Segment 0, break 0, segment 1, ... on the current stream."""
        if not self._ready:
            raise RuntimeError("replay() needs a successful capture() first")
        breaks = self._breaks
        for i, segment in enumerate(self._segments):
            segment.replay()
            if i < len(breaks):
                breaks[i].run()
        self.replays += 1
