"""Which attention kernel each attention shape runs: measured, not guessed.

PyTorch's ``scaled_dot_product_attention`` picks its kernel by fixed rules (flash where it applies, then
memory-efficient; cuDNN's only when asked). For head sizes the fast kernels handle less well (DiT and
PixArt use 72) the rule's pick is not always the fastest, and which one is depends on the GPU and the
shape. ``AttentionChooser`` times the kernels that run a shape (flash, cuDNN, memory-efficient), keeps
those whose output matches the math kernel's (float32, on the first row: math holds every score) within
the dtype's tolerance, and remembers the fastest for that (q, k, v shapes and strides, dtype, device).

When: once per shape, the first time it is met outside graph capture and compilation. The engine's
warm-up runs every bucket eagerly before capturing it, so every bucket's shape is measured then, and
the capture records the chosen kernel. A shape first met inside a capture runs PyTorch's own rule.
Where: CUDA devices (``devices``). On a CPU the rule stands: a choice there could differ between
batch sizes, and an image must not depend on its batch, to the last bit, in float32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from graphs.runner import event_ms

log = logging.getLogger(__name__)

KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
CANDIDATES = ("flash", "cudnn", "efficient")
RULE = "rule"  # a shape that could not be measured: PyTorch's own pick, remembered so it is not tried again
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}  # of the output's largest magnitude


@dataclass
class Choice:
    """What was measured for one shape: the kernel chosen, each runnable kernel's median ms, and why the
    others were left out."""

    kernel: str
    ms: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)


def _cuda_ms(fn: Callable[[], object]) -> float:
    """Median ms of ``fn`` by CUDA events: 7 timed calls after 2 untimed ones."""
    return event_ms(fn, reps=7, warmup=2)


def run(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of (B, heads, T, d) q, k, v by one kernel (RuntimeError if it cannot run them)."""
    with sdpa_kernel([KERNELS[kernel]]):
        return F.scaled_dot_product_attention(q, k, v)


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
            for name in CANDIDATES:
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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v)`` by the kernel ``CHOOSER`` picked for this shape."""
    kernel = CHOOSER.kernel(q, k, v)
    if kernel is None:
        return F.scaled_dot_product_attention(q, k, v)
    return run(kernel, q, k, v)
