"""Which attention kernel each attention shape runs: measured, not guessed.

PyTorch's ``scaled_dot_product_attention`` picks its kernel by fixed rules (flash where it applies, then
memory-efficient; cuDNN's only when asked). For head sizes the fast kernels handle less well (DiT and
PixArt use 72) the rule's pick is not always the fastest, and which one is depends on the GPU and the
shape. ``AttentionChooser`` times the kernels that run a shape (flash, cuDNN, memory-efficient, and
FlashAttention-4 where the optional ``flash-attn-4`` package is installed), keeps
those whose output matches the math kernel's (float32, on the first row: math holds every score) within
the dtype's tolerance, and remembers the fastest for that (q, k, v shapes and strides, dtype, device).

When: once per shape, the first time it is met outside graph capture and compilation. The engine's
warm-up runs every bucket eagerly before capturing it, so every bucket's shape is measured then, and
the capture records the chosen kernel. A shape first met inside a capture runs PyTorch's own rule.
FlashAttention-4 (``fa4``; ``pip install 'dit-serve[fa4]'``): Tri Dao's CuTe DSL kernels, which on Hopper
run a head of 72 as it is (PyTorch's kernels run it in a 96- or 128-wide one) with FlashAttention-3's
warp-specialised pipeline. Its kernels are compiled (just in time, seconds each) the first time a
configuration is met, which the measurement does, outside capture. It writes its output straight into
the caller's buffer (``attention(..., out=)``), where the others' results are copied in. It is a
candidate like the others: measured, checked against the math kernel, and chosen only where fastest.
Where: CUDA devices (``devices``). On a CPU the rule stands: a choice there could differ between
batch sizes, and an image must not depend on its batch, to the last bit, in float32.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from graphs.runner import event_ms

log = logging.getLogger(__name__)

KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
CANDIDATES = ("flash", "cudnn", "efficient")  # PyTorch's; "fa4" joins them where it is installed (candidates)
RULE = "rule"  # a shape that could not be measured: PyTorch's own pick, remembered so it is not tried again
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}  # of the output's largest magnitude


@dataclass
class Choice:
    """What was measured for one shape: the kernel chosen, each runnable kernel's median ms, and why the
    others were left out."""

    kernel: str
    ms: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)


def _cuda_ms(fn: Callable[[], object], calls: int = 4, reps: int = 7) -> float:
    """Median ms of one ``fn()`` as the steps run it (``replay_ms``)."""
    return replay_ms(fn, calls, reps)[0]


def replay_ms(fn: Callable[[], object], calls: int = 4, reps: int = 7) -> tuple[float, bool]:
    """Median ms of one ``fn()``: ``calls`` calls captured in one CUDA graph, replayed ``reps`` times, timed
    by CUDA events; and whether it captured. A plain call's time holds its host work too (FlashAttention-4's
    Python launch path costs about 0.1 ms on a fast host), which a replay does not run. Where a kernel
    cannot be captured, its plain calls are timed instead."""
    for _ in range(2):  # compiles what compiles just in time, outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError as e:
        log.debug("attention kernel not capturable (%s): timing plain calls", str(e).splitlines()[0][:120])
        return event_ms(fn, reps=reps, warmup=0), False
    try:
        return event_ms(graph.replay, reps=reps, warmup=1) / calls, True
    finally:
        del graph


_UNSET = object()
_fa4_forward = _UNSET


def fa4_forward() -> Callable | None:
    """FlashAttention-4's forward (``flash_attn.cute``), or None where the package is not installed or does
    not import (it needs a CUDA build of PyTorch and the CuTe DSL)."""
    global _fa4_forward
    if _fa4_forward is _UNSET:
        try:
            from flash_attn.cute.interface import _flash_attn_fwd  # writes into ``out=``, which the public call lacks
        except Exception as e:  # noqa: BLE001 - an optional kernel: any import failure means "not there"
            log.debug("FlashAttention-4 not available: %s", e)
            _fa4_forward = None
        else:
            _fa4_forward = _flash_attn_fwd
    return _fa4_forward


# FlashAttention-4 keeps its compiled kernels on disk when these are set as it is first imported (it reads them once,
# at import): a worker that restarts, or another on the same node, reads its kernels back instead of compiling them.
FA4_CACHE_ENABLED, FA4_CACHE_DIR = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"


def use_cache_dir(path: str | os.PathLike) -> bool:
    """FlashAttention-4's compiled kernels kept under ``path``/flash-attention-4 (the engine's kernel cache
    directory, Inductor's beside it), across restarts. A variable the environment sets already is kept.
    Only before the package's first import, which reads them: returns whether the setting was made."""
    if "flash_attn.cute.cache_utils" in sys.modules:
        log.debug("FlashAttention-4 is imported already: its kernel cache stays as it was")
        return False
    os.environ.setdefault(FA4_CACHE_ENABLED, "1")
    os.environ.setdefault(FA4_CACHE_DIR, os.path.join(os.path.abspath(path), "flash-attention-4"))
    return True


# FlashAttention-4's tilings measured per shape (queries x keys per tile, P from registers, overlap of the two
# warp groups' softmax and products): its own pick for the head size, and the two others FlashAttention-3
# uses for heads of up to 128. Each is one kernel compiled the first time it is measured (about 1.5 s).
FA4_TILES = {"fa4": {}, "fa4/128x128": {"tile_mn": (128, 128), "mma_pv_is_rs": True, "intra_wg_overlap": True},
             "fa4/192x128": {"tile_mn": (192, 128), "mma_pv_is_rs": False, "intra_wg_overlap": True}}
# Shorter sequences are left to PyTorch's kernels: on an H200 FlashAttention-4 lost at DiT-XL/2's 256 tokens
# (bench/kernel_times.py: 261 against 149 us at 128 rows), and measuring it there would only add its compile
# to every worker's start.
FA4_MIN_TOKENS = 1024


def candidates(q: torch.Tensor, k: torch.Tensor | None = None) -> tuple[str, ...]:
    """The kernels to measure for these tensors: PyTorch's three, and FlashAttention-4's tilings on a CUDA GPU
    of compute capability 9.0 or newer (Hopper, Blackwell) where it is installed and the sequences are long."""
    k = q if k is None else k
    if (q.is_cuda and min(q.shape[-2], k.shape[-2]) >= FA4_MIN_TOKENS
            and torch.cuda.get_device_capability(q.device)[0] >= 9 and fa4_forward() is not None):
        return (*CANDIDATES, *FA4_TILES)
    return CANDIDATES


def run(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of (B, heads, T, d) q, k, v by one kernel (RuntimeError if it cannot run them), written
    into ``out`` (B, heads, T, d) where given, and returned."""
    if kernel in FA4_TILES:
        return _run_fa4(q, k, v, out, FA4_TILES[kernel])
    with sdpa_kernel([KERNELS[kernel]]):
        result = F.scaled_dot_product_attention(q, k, v)
    return result if out is None else out.copy_(result)


def _run_fa4(q, k, v, out, tiles: dict):
    """FlashAttention-4 takes (B, T, heads, d): the transposes are views of the projections' own layout.
    Its output goes into ``out`` where that is (B, T, heads, d)-contiguous underneath (the attention scratch
    is), else into a buffer of its own that is copied."""
    forward = fa4_forward()
    if forward is None:
        raise RuntimeError("FlashAttention-4 is not installed")
    dst = None if out is None else out.transpose(1, 2)
    if dst is None or not dst.is_contiguous():
        dst = torch.empty(q.shape[0], q.shape[2], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    try:
        forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out=dst, **tiles)
    except RuntimeError:
        raise
    except Exception as e:  # noqa: BLE001 - its limits (dtypes, head sizes, strides) are asserts, its compiler's
        # failures its own exception types: either way this shape does not run here, which the chooser records
        raise RuntimeError(f"FlashAttention-4: {type(e).__name__}: {e}") from e
    result = dst.transpose(1, 2)  # (B, heads, T, d)
    if out is not None and result.data_ptr() != out.data_ptr():
        out.copy_(result)
        return out
    return result


class AttentionChooser:
    """The fastest correct kernel per attention shape (see the module docstring)."""

    def __init__(self, timer: Callable[[Callable[[], object]], float] = _cuda_ms, devices: tuple[str, ...] = ("cuda",)):
        self.timer, self.devices = timer, devices
        self.choices: dict[tuple, Choice] = {}

    @staticmethod
    def key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        return (*((tuple(t.shape), t.stride()) for t in (q, k, v)), q.dtype, str(q.device))

    def kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
        """The chosen kernel's name for these tensors, measuring it now if it is new and this is a good
        moment; None: PyTorch's own rule (another device, or a shape first met inside capture)."""
        if q.device.type not in self.devices:
            return None
        key = self.key(q, k, v)
        if key not in self.choices:
            if not _may_measure(q):
                return None
            try:
                choice = self.measure(q, k, v)
            except (RuntimeError, torch.OutOfMemoryError) as e:  # e.g. no memory for the reference: the rule
                log.warning("attention %s: not measured (%s); PyTorch's rule picks the kernel",
                            "x".join(map(str, q.shape)), str(e).splitlines()[0][:200])
                choice = Choice(RULE, rejected={"all": f"not measured: {type(e).__name__}"})
            self.choices[key] = choice
            log.info("attention %s %s: %s (ms %s%s)", "x".join(map(str, q.shape)), str(q.dtype).removeprefix("torch."),
                     choice.kernel, choice.ms, f"; not {choice.rejected}" if choice.rejected else "")
        kernel = self.choices[key].kernel
        return None if kernel == RULE else kernel

    def measure(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Choice:
        with torch.no_grad():  # the reference on the first row only: math attention holds every score
            ref = run("math", q[:1].float(), k[:1].float(), v[:1].float())
            scale, tol = ref.abs().max().clamp_min(1e-12), TOLERANCE.get(q.dtype, 2e-2)
            choice = Choice("math")
            for name in candidates(q, k):
                try:
                    err = ((run(name, q, k, v)[:1].float() - ref).abs().max() / scale).item()
                except RuntimeError:
                    choice.rejected[name] = "does not run this shape"
                    continue
                if err > tol:
                    choice.rejected[name] = f"differs from the math kernel by {err:.1e}"
                    continue
                choice.ms[name] = round(self.timer(lambda: run(name, q, k, v)), 4)
        if choice.ms:
            choice.kernel = min(choice.ms, key=choice.ms.get)
        return choice

    def summary(self) -> list[str]:
        """One line per measured shape: 'BxHxTxd dtype: kernel (ms per kernel)'."""
        return [f"{'x'.join(map(str, key[0][0]))} {str(key[3]).removeprefix('torch.')}: {c.kernel} {c.ms}"
                for key, c in self.choices.items()]


def _may_measure(q: torch.Tensor) -> bool:
    """Not while a CUDA graph captures or dynamo traces (timing synchronises), nor inside a breakable
    capture's break (its segments are being recorded)."""
    from graphs.breakable import _local

    if torch.compiler.is_compiling() or getattr(_local, "capture", None) is not None:
        return False
    return not (q.is_cuda and torch.cuda.is_current_stream_capturing())


CHOOSER = AttentionChooser()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v)`` by the kernel ``CHOOSER`` picked for this shape, written into
    ``out`` where given (FlashAttention-4 writes there directly; the others' results are copied)."""
    kernel = CHOOSER.kernel(q, k, v)
    if kernel is None:
        result = F.scaled_dot_product_attention(q, k, v)
        return result if out is None else out.copy_(result)
    return run(kernel, q, k, v, out)
