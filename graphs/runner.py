"""GraphRunner: serve a row-wise step at any batch size with CUDA graph replays at power-of-two buckets.

Contract
--------
* What is captured: ``fn(**static_inputs) -> {name: tensor}``, one call per bucket b in
  ``bucket_sizes(max_batch)``, with the returned tensors copied (inside the capture) into the static
  outputs. ``fn`` must be row-independent: padding rows must not change real rows (pitfall 9).
* What is static: every input and output named in the specs, carved from ONE ``Arena`` sized for
  ``max_batch`` rows. Bucket b reads and writes the leading b rows, so all buckets share addresses.
* When capture happens: only in ``warmup()``, never while serving. For each bucket, largest first,
  the step runs eagerly a few times at exactly that shape on the runner's side stream (cuBLAS
  workspaces, lazy inits), then is captured on that stream in ``thread_local`` mode. All buckets
  share ONE graph memory pool (``separate_pools=True`` gives one per bucket, to measure the
  difference). Several runners whose replays never overlap (one thread steps them in turn: an engine's
  runners for several latent shapes) may share one pool and one stream (``pool=``, ``stream=``): on one
  stream a later capture reuses the blocks earlier captures freed, so the pool holds the largest
  shape's working memory once. Each bucket's replay is then timed (median of a few, CUDA events) into ``replay_ms``.
  A compiled step (``graphs.compiled.CompiledStep``) compiles in its first warm-up call, at the largest
  bucket, before any capture; under the ``eager`` backend warm-up still calls it once per bucket, so it
  compiles at start-up rather than in the first request.
* What happens on a miss: a bucket whose capture raises (``.item()``, a host copy, an unsupported
  op) is logged with the reason, counted in ``capture_failures`` and served eagerly through the
  same static buffers; the buckets after it are captured into a fresh pool when the failure left
  the shared one unusable (torch <= 2.11). ``run()`` before ``warmup()`` serves eagerly and warns
  once.
* What is copied in/out: ``run(**live)`` with leading dimension n plans replays with
  ``split_batch(n, buckets, replay_ms)``; for each chunk it copies the live rows into the static
  slice (padding rows keep stale values, or take the input's ``TensorSpec.pad``), replays (or calls the
  step eagerly), and copies the real rows out into fresh tensors, so the next replay cannot overwrite a
  result (pitfall 4).
* Concurrency: one lock per runner (its arena and its pool): replays never overlap (pitfall 10).
  GPU work runs on the runner's stream, ordered after the caller's current stream on entry and
  before it on exit, so callers on any stream see finished results.
* Backends: ``full`` (one graph per bucket; ``@eager_on_graph`` functions are captured inline),
  ``breakable`` (segments with eager breaks), ``eager`` (same runner and buffers, no capture: if a
  bug survives eager it is in the model or runner, else suspect capture). Without a CUDA device
  the runner is ``eager`` and says so once in the log.
* Counters per bucket (``stats()``): captures, capture_failures, replays, eager_fallbacks (chunks
  served by an eager call rather than a replay, for any reason), segments, breaks, and the pool
  memory measured around that bucket's capture (``memory_reserved``/``memory_allocated`` deltas).
  Warm-up and timing runs are not counted as served replays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import statistics
import threading
from typing import Callable, Iterator, Mapping

import torch

from .arena import Arena, TensorSpec
from .breakable import BreakableCUDAGraph, require_cuda
from .compiled import CompiledStep
from .splitter import bucket_sizes, check_timings, split_batch

__all__ = ["BACKENDS", "BucketStats", "GraphRunner"]

logger = logging.getLogger(__name__)

BACKENDS = ("breakable", "full", "eager")
_IN, _OUT = "in:", "out:"  # arena name prefixes: an input and an output may share a name


@dataclasses.dataclass
class BucketStats:
    captures: int = 0
    capture_failures: int = 0
    replays: int = 0
    eager_fallbacks: int = 0
    segments: int = 0
    breaks: int = 0
    pool_reserved_bytes: int = 0
    pool_allocated_bytes: int = 0
    fallback_reason: str | None = None


def _memory(device: torch.device) -> tuple[int, int]:
    torch.cuda.synchronize(device)
    return torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)


def _check_specs(kind: str, specs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
    if not isinstance(specs, Mapping) or not specs:
        raise ValueError(f"{kind} must be a non-empty dict of name -> TensorSpec")
    bad = [name for name, spec in specs.items() if not isinstance(spec, TensorSpec)]
    if bad:
        raise ValueError(f"{kind} {bad} must be TensorSpec(shape_per_sample, dtype)")
    return dict(specs)


def event_ms(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median milliseconds of ``fn`` on the current CUDA stream, by CUDA events, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class GraphRunner:
    """Bucketed CUDA-graph replays of a row-wise step (see the module docstring)."""

    def __init__(
        self,
        fn: Callable[..., Mapping[str, torch.Tensor]],
        inputs: Mapping[str, TensorSpec],
        outputs: Mapping[str, TensorSpec],
        max_batch: int = 64,
        backend: str = "breakable",
        device: str | torch.device | None = None,
        *,
        warmup_iters: int = 2,
        timing_reps: int = 5,
        separate_pools: bool = False,
        pool: object | None = None,
        stream: "torch.cuda.Stream | None" = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if warmup_iters < 1 or timing_reps < 1:
            raise ValueError("warmup_iters and timing_reps must be >= 1")
        self._fn = fn
        self._in = _check_specs("inputs", inputs)
        self._out = _check_specs("outputs", outputs)
        self.buckets = bucket_sizes(max_batch)
        self.max_batch = max_batch
        self.device = self._pick_device(device)
        self.requested_backend = backend
        self.backend = self._pick_backend(backend)
        self.separate_pools = separate_pools
        self._warmup_iters, self._timing_reps = warmup_iters, timing_reps
        specs = {_IN + k: v for k, v in self._in.items()} | {_OUT + k: v for k, v in self._out.items()}
        self.arena = Arena(specs, max_batch, self.device)
        self._views = {b: self._bucket_views(b) for b in self.buckets}
        self._graphs: dict[int, BreakableCUDAGraph] = {}
        self._stats = {b: BucketStats() for b in self.buckets}
        self._replay_ms: dict[int, float] = {}
        self._plans: dict[int, tuple[int, ...]] = {}
        self._pool_bytes = (0, 0)
        self._lock = threading.Lock()
        self._shared_pool = pool
        self._stream = stream or (torch.cuda.Stream(self.device) if self.device.type == "cuda" else None)
        self._warmed = False
        self._warned_cold = False

    # ----- construction helpers -------------------------------------------------------------
    @staticmethod
    def _pick_device(device) -> torch.device:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda":
            require_cuda(f"GraphRunner on {device}")
        return device

    def _pick_backend(self, backend: str) -> str:
        if backend == "eager" or self.device.type == "cuda":
            return backend
        logger.info("GraphRunner on %s: CUDA graphs need a CUDA device; backend %r runs as 'eager'",
                    self.device, backend)
        return "eager"

    def _bucket_views(self, b: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        ins = {k: self.arena.slice(_IN + k, b) for k in self._in}
        return ins, {k: self.arena.slice(_OUT + k, b) for k in self._out}

    # ----- the captured unit ----------------------------------------------------------------
    def _step(self, b: int) -> None:
        """fn on bucket b's static inputs, its results copied into the static outputs."""
        ins, outs = self._views[b]
        result = self._fn(**ins)
        if not isinstance(result, Mapping) or set(result) != set(outs):
            got = sorted(result) if isinstance(result, Mapping) else type(result).__name__
            raise ValueError(f"fn must return a dict with keys {sorted(outs)}, got {got}")
        for name, dst in outs.items():
            src = result[name]
            if not isinstance(src, torch.Tensor) or src.shape != dst.shape:
                got = tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__
                raise ValueError(f"fn output {name!r} must have shape {tuple(dst.shape)}, got {got}")
            dst.copy_(src)

    def _program(self, b: int) -> Callable[[], None]:
        graph = self._graphs.get(b)
        return graph.replay if graph is not None else functools.partial(self._step, b)

    # ----- warm-up: the only place that captures --------------------------------------------
    def warmup(self, example: Mapping[str, torch.Tensor] | None = None) -> dict:
        """Warm up, capture and time every bucket (see the module docstring); returns stats().

        example: optional live-like inputs (any leading size >= 1) whose rows are tiled into the
        static inputs first, so warm-up runs on realistic values instead of zeros.
        """
        with self._lock:
            if self._warmed:
                raise RuntimeError("warmup() already ran: capture happens once, never while serving")
            with torch.no_grad():
                if example is not None:
                    self._fill_static(example)
                if self.backend != "eager":
                    with torch.cuda.device(self.device):
                        self._capture_all()
                        self._replay_ms = {b: self._time_bucket(b) for b in self.buckets}
                        self._plans = {}
                elif isinstance(self._fn, CompiledStep):
                    for b in sorted(self.buckets, reverse=True):
                        self._step(b)
            self._warmed = True
        logger.info("GraphRunner warm-up done: %s", self._summary())
        return self.stats()

    def _fill_static(self, example: Mapping[str, torch.Tensor]) -> None:
        m = self._check_live(example)
        if m < 1:
            raise ValueError("example inputs need at least one row")
        for name, t in example.items():
            rows = torch.arange(self.max_batch, device=t.device) % m
            self.arena.tensor(_IN + name).copy_(t[rows])

    @property
    def warmed(self) -> bool:
        return self._warmed

    @property
    def step(self) -> Callable[..., Mapping[str, torch.Tensor]]:
        """The function the runner captures (a ``CompiledStep`` when it is compiled)."""
        return self._fn

    def _capture_all(self) -> None:
        pool = self._shared_pool if self._shared_pool is not None and not self.separate_pools \
            else torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(self.device)  # the arena's zeroing and example copies are done
        for b in sorted(self.buckets, reverse=True):
            with torch.cuda.stream(self._stream):
                for _ in range(self._warmup_iters):
                    self._step(b)
            poisoned = self._capture_bucket(b, pool)
            if poisoned or self.separate_pools:
                pool = torch.cuda.graph_pool_handle()
        # Sum of the per-capture deltas: eager warm-up's cached blocks are not graph memory.
        self._pool_bytes = (sum(s.pool_reserved_bytes for s in self._stats.values()),
                            sum(s.pool_allocated_bytes for s in self._stats.values()))

    def _capture_bucket(self, b: int, pool) -> bool:
        """Capture bucket b into pool; True when a failure left the pool unusable for more."""
        stats = self._stats[b]
        reserved0, allocated0 = _memory(self.device)
        graph = BreakableCUDAGraph()
        try:
            with graph.capture(pool=pool, stream=self._stream, breakable=self.backend == "breakable"):
                self._step(b)
        except Exception as exc:
            stats.capture_failures += 1
            stats.fallback_reason = f"{type(exc).__name__}: {exc}"
            logger.warning("bucket %d: %s capture failed, serving it eagerly: %s",
                           b, self.backend, stats.fallback_reason)
            return graph.pool_poisoned
        reserved1, allocated1 = _memory(self.device)
        stats.captures += 1
        stats.segments, stats.breaks = graph.num_segments, graph.num_breaks
        stats.pool_reserved_bytes = reserved1 - reserved0
        stats.pool_allocated_bytes = allocated1 - allocated0
        self._graphs[b] = graph
        return False

    def _time_bucket(self, b: int) -> float:
        """Median milliseconds of one replay (or eager step) of bucket b, by CUDA events."""
        with torch.cuda.stream(self._stream):  # one untimed run: the first launch of a graph uploads it
            return event_ms(self._program(b), self._timing_reps, warmup=1)

    # ----- serving ----------------------------------------------------------------------------
    def run(self, **live: torch.Tensor) -> dict[str, torch.Tensor]:
        """fn applied to n live rows, as dict name -> (n, *shape) fresh tensors."""
        n = self._check_live(live)
        plan = self.plan(n)
        # Allocated on the caller's stream, which waits for the runner's stream before using them.
        outs = {k: torch.empty((n, *s.shape_per_sample), dtype=s.dtype, device=self.device)
                for k, s in self._out.items()}
        if n == 0:
            return outs
        with self._lock, torch.no_grad(), self._on_runner_stream():
            self._warn_if_cold()
            start = 0
            for b in plan:
                take = min(b, n - start)
                self._serve_chunk(b, live, outs, start, take)
                start += take
        return outs

    def _serve_chunk(self, b: int, live, outs, start: int, take: int) -> None:
        ins, static_outs = self._views[b]
        for name, dst in ins.items():
            dst[:take].copy_(live[name][start : start + take])
            if take < b and (pad := self._in[name].pad) is not None:
                dst[take:].fill_(pad)
        graph = self._graphs.get(b)
        if graph is not None:
            graph.replay()
            self._stats[b].replays += 1
        else:
            self._step(b)
            self._stats[b].eager_fallbacks += 1
        for name, src in static_outs.items():
            outs[name][start : start + take].copy_(src[:take])

    @contextlib.contextmanager
    def _on_runner_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(caller)  # live inputs and output buffers are ready
        try:
            with torch.cuda.stream(self._stream):
                yield
        finally:
            caller.wait_stream(self._stream)  # results are ready before the caller reads them

    def _warn_if_cold(self) -> None:
        if not self._warmed and self.backend != "eager" and not self._warned_cold:
            self._warned_cold = True
            logger.warning("GraphRunner.run() before warmup(): serving eagerly (captures happen "
                           "only in warmup)")

    def _check_live(self, live: Mapping[str, torch.Tensor]) -> int:
        if set(live) != set(self._in):
            raise ValueError(f"inputs must be exactly {sorted(self._in)}, got {sorted(live)}")
        n = None
        for name, spec in self._in.items():
            t = live[name]
            want = spec.shape_per_sample
            if not isinstance(t, torch.Tensor) or t.dim() != 1 + len(want) or tuple(t.shape[1:]) != want:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"input {name!r} must have shape (n, *{want}), got {got}")
            if t.dtype != spec.dtype:
                raise ValueError(f"input {name!r} must be {spec.dtype}, got {t.dtype}")
            if n is not None and t.shape[0] != n:
                raise ValueError(f"inputs disagree on n: {name!r} has {t.shape[0]} rows, not {n}")
            n = t.shape[0]
        return n

    # ----- plans, timings, counters ---------------------------------------------------------
    def plan(self, n: int) -> tuple[int, ...]:
        """The buckets that serve n rows, memoised by n (timings only change in warm-up)."""
        plan = self._plans.get(n)
        if plan is None:
            plan = tuple(split_batch(n, self.buckets, self._replay_ms or None))
            self._plans[n] = plan
        return plan

    @property
    def replay_ms(self) -> dict[int, float]:
        """Median ms per replay of each bucket, measured in warm-up ({} before it, or in eager)."""
        return dict(self._replay_ms)

    @replay_ms.setter
    def replay_ms(self, timings: Mapping[int, float]) -> None:
        """Replace the timings (e.g. with ones measured earlier); {} means greedy plans."""
        checked = check_timings(self.buckets, timings) if timings else {}
        with self._lock:
            self._replay_ms, self._plans = checked, {}

    def stats(self) -> dict:
        with self._lock:
            buckets = {b: dataclasses.asdict(s) for b, s in self._stats.items()}
            return {
                "backend": self.backend,
                "requested_backend": self.requested_backend,
                "device": str(self.device),
                "warmed_up": self._warmed,
                "separate_pools": self.separate_pools,
                "buckets": buckets,
                "totals": {k: sum(s[k] for s in buckets.values())
                           for k in ("captures", "capture_failures", "replays", "eager_fallbacks")},
                "replay_ms": dict(self._replay_ms),
                "arena_bytes": self.arena.nbytes,
                "pool_reserved_bytes": self._pool_bytes[0],
                "pool_allocated_bytes": self._pool_bytes[1],
            }

    def _summary(self) -> str:
        captured = sorted(self._graphs)
        failed = [b for b, s in self._stats.items() if s.capture_failures]
        return (f"backend={self.backend} device={self.device} captured={captured} "
                f"eager_buckets={failed} pool_reserved={self._pool_bytes[0]}B "
                f"arena={self.arena.nbytes}B")
