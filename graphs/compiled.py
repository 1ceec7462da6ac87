"""Compiled regions inside captured graphs: a step compiled by Inductor, then captured as any step is.

Contract
--------
* What is compiled: the whole step callable the runner receives (CFG, transformer, sampler update),
  by ``torch.compile`` with Inductor in its default mode: fused Triton (or C++) kernels, and no CUDA
  graphs of Inductor's own (never ``reduce-overhead``): ``GraphRunner`` captures the compiled code into
  its breakable graphs as it captures eager code, so buckets, pool and replays work as before.
* One compile per step (a model at one latent shape), for every bucket: the batch dimension (dim 0 of
  every input) is marked dynamic, strictly, with ``fullgraph=True``: a model that specialises the
  batch, or that dynamo cannot trace in one graph, fails to compile instead of recompiling per bucket.
  dynamo specialises sizes 0 and 1, so the one-row bucket has a graph of its own, compiled for one row
  (``one_row_graphs``; not a recompile). It used to run as two rows, the second dropped, to save that
  compile; but a one-row call is the single image a user waits for, and on an H200 the padded row cost
  DiT-XL/2 at 256 px every matrix product and attention twice over (its compiled step's products took
  2.2 ms of a 3.3 ms step at one image, 1.5 ms at the real rows). The second compile happens in warm-up
  with the first (and is cached on disk as it is).
* Breaks stay breaks: dynamo would trace into an ``@eager_on_graph`` function, whose code reads the
  thread's capture state: the compiled step would hold for "no capture" only, and a capture would make
  dynamo compile again inside it, tracing the capture's own CUDA graph calls. ``opaque_break(fn)`` makes
  fn a custom op that dynamo keeps as one opaque call: the step is traced once, and at run time the op
  calls fn, so under a breakable capture the segment ends there as before (the same segments and
  breaks as the uncompiled step). fn takes tensors only and writes its result into one of them.
* Under a breakable capture the op hands fn *non-owning aliases* of its tensors: same address, shape and strides, but the storage does not hold the
  memory, so Inductor's buffers go back to the pool after their last use in the compiled code, as the
  uncompiled ones would. A break keeps its arguments alive for the graph's life (pitfalls 1-2): handed
  Inductor's own tensors, every layer's q, k, v and output would stay allocated in every bucket's
  graph (16.2 GB of graph pool for DiT-XL/2 at 256 px on an H200, against 1.3 GB uncompiled). Why the
  aliases are safe: graphs of one pool never replay concurrently (one runner lock, pitfall 10), and a
  graph's segments and breaks replay in capture order; a break's inputs are read by the break and by
  nothing after it that does not hold them (the compiled code keeps a reference until their last use),
  and its output keeps its owner until the next segment's last read. Memory that a later segment or
  capture reuses is therefore only written after the break has read it. This is the reasoning
  PyTorch's own CUDA-graph trees rely on for their non-owning outputs. On an H200 (DiT-XL/2 256,
  ``bench/step.py``) aliased breaks step 128 rows in 62.8 ms with a 0.68 GB pool, as fast as
  whole-step graphs.
* When compilation happens: on the first call (the runner's warm-up runs every bucket eagerly before
  capturing it, largest first, so the compile sees the largest batch and every later bucket reuses
  it). A compile or run that raises logs a warning, and the step is the plain one from then on:
  serving never depends on the compiler.
* A static compile (``dynamic=False``, for a model whose dynamic-batch code is wrong on some device:
  ``Family.static_batch_on``): nothing is marked dynamic and dynamo never makes a size dynamic, so each
  bucket compiles a graph of its own (``graphs`` counts them; longer warm-up, same replays).
* The artefacts are cached on disk (``use_cache_dir``): a restarted worker, or a new one on a node
  with the cache, traces the step again (dynamo is not cached) but loads Inductor's kernels.
* Counters (``stats()``): graphs compiled (recompiles are graphs after the first), seconds spent in
  calls that compiled, Inductor's FX-graph cache hits and misses, and the fallback reason.

Regions (``CompiledStep(fn, name, regions=modules)``)
-----------------------------------------------------
A diffusion transformer is a stack of identical blocks (FLUX.1: 19 + 38, SD3.5: 24, PixArt: 28), and
Inductor's time grows with the graph it lowers: the whole step of FLUX.1-dev took 105-113 s to compile
on an H200 host, per latent shape and once more for one row. With ``regions`` the step itself runs as
written and each region module's ``forward`` is compiled instead: one compiled function per module
class, which every instance of the class calls with itself as an argument (dynamo lifts a module's
parameters as inputs and guards on its type and attributes, not its identity), so a stack of 57 blocks
compiles two graphs. The code between the blocks (embeddings, the final norm, guidance, the sampler
update: a few dozen small kernels) runs uncompiled inside the same captured graphs. What the blocks
lose is fusion across a block boundary (a residual add with the next block's norm).

* Dispatch: a region module's ``forward`` becomes a wrapper that runs the compiled function only while
  its ``CompiledStep`` is being called on this thread; any other caller (an uncompiled engine on the same
  model, a baseline pipeline over the same modules) runs the module's own forward.
* The batch: a region's tensor arguments whose first size equals the first one's (the rows: images, or
  twice that with CFG) are marked dynamic, and those whose first size is a multiple of it (rows x heads)
  may be dynamic (dynamo relates them to the rows); one row is left static (its own graph, as above).
* Strides: a region's tensor arguments are made contiguous (the first block's input has the patch
  embedding's strides), and one row's leading stride is the one a fresh tensor has (``_standard``): FLUX.1's
  single blocks hand on views of the text's and the image's halves of one buffer, contiguous at one row but
  with the buffer's stride, which dynamo's guards compare (a second single-block graph, measured slower).
* Counting: ``graphs`` (and ``one_row_graphs``) count the calls that compiled, so one compile for every
  bucket reads 1 in both scopes; ``region_graphs`` counts the graphs Inductor made (a block class whose
  instances differ, such as SD3's last block without a text output, makes more than one).
* A region that fails to compile or run falls back as a step does: the step's regions run their own
  forward from then on, and ``fallback_reason`` says why.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re
import threading
import time
from typing import Callable, Mapping, Sequence

import torch

__all__ = ["CompiledStep", "opaque_break", "use_cache_dir"]

logger = logging.getLogger(__name__)

_OPAQUE: dict[Callable, str] = {}  # marked function -> its op's name


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor on ``t``'s memory (same address, shape, strides) whose storage does not own it."""
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty((), dtype=t.dtype, device=t.device).set_(alias, t.storage_offset(), t.shape, t.stride())


@functools.cache
def _lib() -> torch.library.Library:
    """The opaque breaks' ops, graphs::<name>: made on first use, kept for the process."""
    return torch.library.Library("graphs", "FRAGMENT")


def use_cache_dir(path: str | os.PathLike) -> None:
    """Keep Inductor's compiled graphs, kernels and autotuning results under ``path``.

    Inductor reads its cache root from TORCHINDUCTOR_CACHE_DIR at each lookup (Triton's kernel cache
    sits under it unless TRITON_CACHE_DIR says otherwise), so the variable is the switch; the
    in-memory caches keyed by the old root are cleared.
    """
    from torch._inductor.utils import clear_caches

    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(path)
    torch._inductor.config.fx_graph_cache = True        # compiled FX graphs (the wrapper code)
    torch._inductor.config.autotune_local_cache = True  # autotuning choices, next to the kernels
    torch._functorch.config.enable_autograd_cache = True  # AOTAutograd's graphs: the warm path
    clear_caches()


def opaque_break(fn: Callable, out: str | tuple[str, ...] = "out") -> None:
    """Keep the ``@eager_on_graph`` function ``fn`` as one opaque call in compiled graphs.

    fn's parameters are tensors; it writes its result into the one named ``out`` (or each of the ones
    named, e.g. FP8 codes and their scales) and returns None (the breaks in ``workers`` do). Registered
    once per function, for the life of the process.
    """
    if fn in _OPAQUE:
        return
    outs = (out,) if isinstance(out, str) else tuple(out)
    params = list(inspect.signature(fn).parameters)
    missing = [o for o in outs if o not in params]
    if missing or not outs:
        raise ValueError(f"{fn.__qualname__} has no parameter {missing[0] if missing else out!r} to write its result into")
    name = re.sub(r"\W", "_", f"{fn.__module__}_{fn.__qualname__}")
    alias = {o: chr(ord("a") + i) for i, o in enumerate(outs)}
    args = ", ".join(f"Tensor({alias[p]}!) {p}" if p in alias else f"Tensor {p}" for p in params)
    _lib().define(f"{name}({args}) -> ()")
    _lib().impl(name, _aliased(fn), "CompositeExplicitAutograd")
    torch.library.register_fake(f"graphs::{name}", lambda *args, **kwargs: None, lib=_lib())
    op = getattr(torch.ops.graphs, name)
    # dynamo calls the op where it would have inlined fn; eager callers still call fn itself
    torch.compiler.substitute_in_graph(fn, skip_signature_check=True)(lambda *a, **kw: op(*a, **kw))
    _OPAQUE[fn] = name


def _aliased(fn: Callable) -> Callable:
    """The op's body: fn itself, or under a breakable capture fn on non-owning aliases of its tensors (see
    above)."""
    from .breakable import _local

    def body(*args):
        if getattr(_local, "capture", None) is None:
            return fn(*args)
        return fn(*[_alias(a) if isinstance(a, torch.Tensor) else a for a in args])

    return body


_active = threading.local()  # .step: the CompiledStep being called on this thread (regions dispatch on it)


def _region_forward(module: torch.nn.Module) -> Callable:
    """``module``'s forward while a CompiledStep with regions is called: its compiled function if that step
    holds ``module``'s class, else the class's own forward (see "Regions" above)."""
    plain = type(module).forward

    def forward(*args, **kwargs):
        if torch.compiler.is_compiling():  # traced into by a whole-step compile of the same model
            return plain(module, *args, **kwargs)
        step = getattr(_active, "step", None)
        compiled = step._regions.get(type(module)) if step is not None and step.compiled else None
        if compiled is None:
            return plain(module, *args, **kwargs)
        return step._region_call(compiled, plain, module, args, kwargs)

    forward._region_of = module  # marks the wrapper (installed once per module)
    return forward


class CompiledStep:
    """``fn`` compiled by Inductor with a dynamic batch, or ``fn`` itself after a failure (see above); with
    ``regions``, ``fn`` runs as it is and those modules' forwards are compiled, one per class."""

    def __init__(self, fn: Callable[..., Mapping[str, torch.Tensor]], name: str,
                 regions: Sequence[torch.nn.Module] = (), dynamic: bool = True) -> None:
        self.fn, self.name, self.dynamic = fn, name, dynamic
        # static (``dynamic`` False): every batch size its own graph, and dynamo never makes a size dynamic
        compile_ = functools.partial(torch.compile, backend=self._inductor, fullgraph=True,
                                     dynamic=None if dynamic else False)
        self._regions: dict[type, Callable] = {}
        for m in regions:
            if "forward" in m.__dict__ and getattr(m.forward, "_region_of", None) is not m:
                raise ValueError(f"{type(m).__name__} has a forward of its own: it cannot be a region")
            self._regions.setdefault(type(m), compile_(type(m).forward))
        for m in regions:
            if "forward" not in m.__dict__:
                m.forward = _region_forward(m)
        self._compiled = None if self._regions else compile_(fn)
        self.graphs = 0           # calls with more than one row that compiled; > 1 means recompiles
        self.one_row_graphs = 0   # one-row calls that compiled (dynamo specialises size 1): 0 or 1
        self.region_graphs = 0    # graphs Inductor made (the whole step: one per compiling call)
        self._one_row = False     # the call being compiled is a one-row call
        self.compile_s = 0.0      # wall time of the calls that compiled (tracing, Inductor, first run)
        self.cache_hits = 0       # of Inductor's FX-graph cache during those calls
        self.cache_misses = 0
        self.fallback_reason: str | None = None

    def _inductor(self, gm: torch.fx.GraphModule, example_inputs) -> Callable:
        """The backend: Inductor, counted (torch.compile's "inductor" backend in mode "default")."""
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(gm, example_inputs)
        self.region_graphs += 1
        return compiled

    @property
    def scope(self) -> str:
        """"blocks" (regions compiled) or "step" (the whole step)."""
        return "blocks" if self._regions else "step"

    @property
    def compiled(self) -> bool:
        return self.fallback_reason is None

    def __call__(self, **inputs: torch.Tensor) -> Mapping[str, torch.Tensor]:
        if not self.compiled:
            return self.fn(**inputs)
        self._one_row = next(iter(inputs.values())).shape[0] == 1
        if self.dynamic and not self._one_row and not self._regions:  # one row: its own graph (see above)
            for t in inputs.values():
                torch._dynamo.mark_dynamic(t, 0)
        try:
            return self._timed(inputs)
        except Exception as exc:  # the compiler's failure must not become the request's
            self._fail(exc)
            return self.fn(**inputs)

    def decline(self, reason: str) -> None:
        """Run the step uncompiled from now on, ``reason`` in the stats (the caller knows it must not compile)."""
        self.fallback_reason = reason
        logger.info("%s: running uncompiled: %s", self.name, reason)

    def _fail(self, exc: Exception) -> None:
        self.fallback_reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        logger.warning("%s: compiled step failed, running it uncompiled: %s", self.name, self.fallback_reason)

    def _region_call(self, compiled: Callable, plain: Callable, module: torch.nn.Module, args: tuple,
                     kwargs: dict):
        """One region's call inside this step: its batch marked dynamic (unless one row), compiled."""
        # contiguous: the first block's input comes from the patch embedding with other strides than the
        # blocks' outputs, and strides are guarded (a copy there, nothing for the others)
        args = tuple(_standard(a) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: _standard(a) if isinstance(a, torch.Tensor) else a for k, a in kwargs.items()}
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        rows = tensors[0].shape[0] if tensors and tensors[0].dim() else 1
        if rows > 1 and self.dynamic:
            for t in tensors:
                if t.dim() and t.shape[0] == rows:
                    torch._dynamo.mark_dynamic(t, 0)
                elif t.dim() and t.shape[0] % rows == 0:  # rows x heads (PixArt's padded key bias): dynamo
                    torch._dynamo.maybe_mark_dynamic(t, 0)  # relates it to the rows, unmarked it would pin them
        try:
            return compiled(module, *args, **kwargs)
        except Exception as exc:  # as the whole step's: the step's regions run their own forward from now on
            self._fail(exc)
            return plain(module, *args, **kwargs)

    def _timed(self, inputs: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        from torch._dynamo.utils import counters

        graphs, t0 = self.region_graphs, time.perf_counter()
        hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        # dynamo's per-code recompile limit (8) counts every model and shape whose step shares this code
        with torch._dynamo.config.patch(recompile_limit=1024, accumulated_recompile_limit=4096):
            if self._compiled is not None:
                out = self._compiled(**inputs)
            else:
                outer, _active.step = getattr(_active, "step", None), self
                try:
                    out = self.fn(**inputs)
                finally:
                    _active.step = outer
        if self.region_graphs != graphs:
            if self._one_row:
                self.one_row_graphs += 1
            else:
                self.graphs += 1
            self.compile_s += time.perf_counter() - t0
            self.cache_hits += counters["inductor"]["fxgraph_cache_hit"] - hits
            self.cache_misses += counters["inductor"]["fxgraph_cache_miss"] - misses
            if self.dynamic and (self.graphs > 1 or self.one_row_graphs > 1):
                logger.warning("%s: recompiled (%d graphs, %d for one row); the batch should be the only "
                               "dynamic size", self.name, self.graphs, self.one_row_graphs)
        return out

    def stats(self) -> dict:
        return {"compiled": self.compiled, "scope": self.scope, "dynamic": self.dynamic, "graphs": self.graphs,
                "one_row_graphs": self.one_row_graphs, "region_graphs": self.region_graphs,
                "compile_s": round(self.compile_s, 3),
                "fx_cache_hits": self.cache_hits, "fx_cache_misses": self.cache_misses,
                "fallback_reason": self.fallback_reason}


def _standard(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous, with a leading dimension of one given the stride a fresh tensor has: a view of one
    image's rows out of a wider buffer (FLUX.1's single blocks hand on the text's and the image's halves of
    one) is contiguous already but keeps the buffer's stride there, which dynamo's guards compare, so one
    row would compile once per stride (measured: a second single-block graph, slower)."""
    t = t.contiguous()
    if t.dim() > 1 and t.shape[0] == 1 and t.stride(0) != t.shape[1] * t.stride(1):
        t = t[0].unsqueeze(0)
    return t
