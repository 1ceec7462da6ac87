"""FP8 attention on Hopper: cuDNN's FP8 fused attention, through the cuDNN frontend (optional).

Asked for per model with precision "fp8+attention" (FP8 linears too, ``workers.speed.fp8``); SD3's and FLUX.1's
joint attention run through it (``workers.speed.joint_attention``). ``pip install 'dit-serve[fp8-attention]'`` brings
``nvidia-cudnn-frontend``; without it, or on another GPU, ``unavailable_reason`` says why not and loading the
model in that precision is refused with it.

What it computes: softmax(q k^T / sqrt(d)) v, as ``scaled_dot_product_attention`` without a mask, with q, k,
v and the probabilities in float8 e4m3 and every accumulation in float32:

* q, k, v are scaled per tensor by a power of two, ``2^floor(log2(448 / amax))`` (exact to undo), from each
  tensor's own largest magnitude, on the device (``quantize``): no host synchronisation, so the whole of it
  captures into CUDA graphs and compiles. (The joint attention gives q and k fixed scales from their norms
  instead, ``workers.speed.joint_attention.static_scale``.)
* The probabilities (in [0, 1] before the row sum divides them) enter the second product as codes of
  P * 256 (``P_SCALE``): scaled up, a small probability keeps a code instead of flushing to zero.
* The output is FP8 too on Hopper (cuDNN's FP8 kernel there writes no bf16): a convex combination of v's
  rows, so no larger than v's largest magnitude, and written at v's scale halved (headroom for the rounding
  of P) before ``dequantize`` turns it back into the model's dtype.

Heads whose size is not a multiple of 16 (DiT's and PixArt's 72) are padded with zero columns to the next one
(80): zeros change neither q k^T nor, in v, the real columns of the output; the softmax scale stays
1/sqrt(72). The kernel itself is measured against the bf16 kernels by ``bench/kernel_times.py``.

Off CUDA, ``attention_codes`` runs the same arithmetic as PyTorch operations (``reference_codes``: float32,
the unnormalised probabilities rounded to their codes, the row sums from the float32 ones): the CPU tests'
path, and the GPU tests' reference for the kernel. It is not fast there, and ``unavailable_reason`` keeps
the engine from choosing it.

Plans: one cuDNN graph per (q, k, v, output) shapes and strides on a device, built on first use (about 0.1 s
each on an H200, the first 1-2 s with cuDNN's own start; outside capture: the engine's warm-up meets every
bucket's shape first) and kept for the process, with its workspace.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
P_SCALE = 256.0  # probabilities' codes: P * 256 (a power of two: exact to undo)
O_HEADROOM = 0.5  # the output's codes at half v's scale
ALIGN = 16  # cuDNN's FP8 attention wants the head size a multiple of this


@functools.cache
def _frontend():
    """The cuDNN frontend's Python package, or None where it is not installed or does not import."""
    try:
        import cudnn
    except Exception as e:  # noqa: BLE001 - an optional kernel: any import failure means "not there"
        log.debug("cuDNN frontend not available: %s", e)
        return None
    return cudnn


def unavailable_reason(device: str | torch.device) -> str | None:
    """Why FP8 attention cannot run on ``device``, or None when it can."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "FP8 attention runs on CUDA GPUs only"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"FP8 attention is built for Hopper (compute capability 9.0); this GPU is {major}.{minor}"
    if _frontend() is None:
        return "the cuDNN frontend is not installed: pip install 'dit-serve[fp8-attention]'"
    return None


def padded_head(d: int) -> int:
    """The head size the kernel runs: ``d`` rounded up to a multiple of 16 (72 -> 80, 128 -> 128)."""
    return -(-d // ALIGN) * ALIGN


def quantize(x: torch.Tensor, d: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., d0) -> e4m3 codes (..., d) (zero columns appended where d > d0) and the descale, a (1, 1, 1, 1)
    float32 tensor with x ~= codes * descale. The scale is a power of two from x's largest magnitude."""
    amax = x.abs().amax().float().clamp_min(1e-12)
    scale = torch.exp2(torch.floor(torch.log2(FP8_MAX / amax)))
    codes = (x.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    if d is not None and d > x.shape[-1]:
        codes = torch.nn.functional.pad(codes.view(torch.uint8), (0, d - x.shape[-1])).view(FP8)
    return codes, scale.reciprocal().reshape(1, 1, 1, 1)


def output_descale(descale_v: torch.Tensor) -> torch.Tensor:
    """The output codes' descale, from v's: the output is written at v's scale times ``O_HEADROOM``."""
    return descale_v / O_HEADROOM


def output_scale(descale_v: torch.Tensor) -> torch.Tensor:
    """The output's scale (what the kernel multiplies by: ``1 / output_descale``), from v's descale; exact, both
    being powers of two."""
    return O_HEADROOM / descale_v


def dequantize(codes: torch.Tensor, descale: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
    """The output's codes (..., padded d) -> (..., d) in ``dtype``."""
    return (codes[..., :d].float() * descale.reshape(())).to(dtype)


@dataclass
class _Plan:
    graph: object
    tensors: tuple  # the graph's q, k, v, descale_q/k/v, descale_s, scale_s, scale_o, o, amax_s, amax_o
    workspace: torch.Tensor


_PLANS: dict[tuple, _Plan] = {}
_HANDLES: dict[int, object] = {}
_CONSTANTS: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


@atexit.register
def _release() -> None:
    """The plans and handles let go before the interpreter's teardown, which otherwise finds the frontend's
    graph objects still held here and reports each as a leak on stderr."""
    _PLANS.clear()
    _HANDLES.clear()


def _key(q, k, v, o) -> tuple:
    return (*((tuple(t.shape), t.stride()) for t in (q, k, v, o)), str(q.device))


def _handle(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _HANDLES:
        with torch.cuda.device(index):
            _HANDLES[index] = _frontend().create_handle()
    return _HANDLES[index]


def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """descale_s, scale_s and a scratch float for the amaxes, on ``device``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CONSTANTS:
        s = torch.full((1, 1, 1, 1), P_SCALE, dtype=torch.float32, device=device)
        _CONSTANTS[index] = (s.reciprocal(), s, torch.empty(2, 1, 1, 1, dtype=torch.float32, device=device))
    return _CONSTANTS[index]


def _build(q, k, v, o, softmax_scale: float) -> _Plan:
    cudnn = _frontend()
    graph, tensors = operation_graph(q, k, v, o, softmax_scale)
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    workspace = torch.empty(max(1, graph.get_workspace_size()), dtype=torch.uint8, device=q.device)
    return _Plan(graph, tensors, workspace)


def operation_graph(q, k, v, o, softmax_scale: float) -> tuple[object, tuple]:
    """The frontend's graph of the attention for these layouts, built up to its plans (``_build`` asks for
    heuristics mode A's; ``bench/fp8_sdpa_plans.py`` (in git history) for every mode's), and its tensors as ``_Plan`` keeps them."""
    cudnn = _frontend()
    e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32,
                          handle=_handle(q.device))
    tq, tk, tv = (graph.tensor(name=n, dim=list(t.shape), stride=list(t.stride()), data_type=e4m3)
                  for n, t in (("q", q), ("k", k), ("v", v)))
    scalar = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32)
    dq, dk, dv, ds, ss, so = (graph.tensor(name=n, **scalar) for n in ("dq", "dk", "dv", "ds", "ss", "so"))
    to, _, amax_s, amax_o = graph.sdpa_fp8(q=tq, k=tk, v=tv, descale_q=dq, descale_k=dk, descale_v=dv,
                                           descale_s=ds, scale_s=ss, scale_o=so, attn_scale=softmax_scale,
                                           use_causal_mask=False, generate_stats=False, name="attention")
    to.set_output(True).set_dim(list(o.shape)).set_stride(list(o.stride())).set_data_type(e4m3)
    for amax in (amax_s, amax_o):
        amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
    graph.validate()
    graph.build_operation_graph()
    return graph, (tq, tk, tv, dq, dk, dv, ds, ss, so, to, amax_s, amax_o)


def reference_codes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descale_q: torch.Tensor,
                    descale_k: torch.Tensor, descale_v: torch.Tensor, out: torch.Tensor,
                    softmax_scale: float) -> torch.Tensor:
    """``attention_codes``'s contract in PyTorch operations, on any device (see the module docstring)."""
    qf, kf, vf = (t.float() * s.reshape(()) for t, s in ((q, descale_q), (k, descale_k), (v, descale_v)))
    s = qf @ kf.transpose(-1, -2) * softmax_scale                               # (B, heads, Tq, Tk)
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))                             # unnormalised, in (0, 1]
    codes = (p * P_SCALE).to(FP8).float() / P_SCALE                             # the probabilities' codes
    o = (codes @ vf) / p.sum(dim=-1, keepdim=True)                              # the row sums from float32
    descale_o = output_descale(descale_v)
    out.copy_((o / descale_o.reshape(())).clamp(-FP8_MAX, FP8_MAX).to(FP8))
    return descale_o


def attention_codes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descale_q: torch.Tensor,
                    descale_k: torch.Tensor, descale_v: torch.Tensor, out: torch.Tensor,
                    softmax_scale: float, scale_o: torch.Tensor | None = None) -> torch.Tensor | None:
    """The kernel on codes: (B, heads, T, d) e4m3 q, k, v (any strides with d contiguous) and their
    (1, 1, 1, 1) descales -> ``out`` (B, heads, Tq, d) e4m3 codes; returns the output's descale (a tensor, on
    the device). ``scale_o``: ``output_scale(descale_v)`` made by the caller (``workers.kernels.rope`` writes it
    beside v's descale), then nothing is computed here and None is returned. A plan is built the first time a
    layout is met; off CUDA, ``reference_codes``."""
    if not q.is_cuda:
        descale_o = reference_codes(q, k, v, descale_q, descale_k, descale_v, out, softmax_scale)
        return None if scale_o is not None else descale_o
    key = _key(q, k, v, out) + (softmax_scale,)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _build(q, k, v, out, softmax_scale)
        log.info("FP8 attention plan for %s (workspace %d bytes)", "x".join(map(str, q.shape)), plan.workspace.numel())
    descale_s, scale_s, amax = _constants(q.device)
    tq, tk, tv, dq, dk, dv, ds, ss, so, to, amax_s, amax_o = plan.tensors
    pack = {tq: q, tk: k, tv: v, dq: descale_q, dk: descale_k, dv: descale_v, ds: descale_s, ss: scale_s,
            so: output_scale(descale_v) if scale_o is None else scale_o, to: out, amax_s: amax[0:1],
            amax_o: amax[1:2]}
    handle = _handle(q.device)
    _frontend().set_stream(handle, torch.cuda.current_stream(q.device).cuda_stream)
    plan.graph.execute(pack, plan.workspace, handle=handle)
    return None if scale_o is not None else output_descale(descale_v)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v)`` for (B, heads, T, d) tensors of the model's dtype, through
    FP8: quantized here, the kernel, and the output back in q's dtype (written into ``out`` where given)."""
    d = q.shape[-1]
    dp = padded_head(d)
    # codes in (B, T, heads, d) underneath, as the projections lay q, k, v out; the kernel reads them as
    # (B, heads, T, d) views
    (q8, dq), (k8, dk), (v8, dv) = (quantize(t.transpose(1, 2), dp) for t in (q, k, v))
    o8 = torch.empty_like(q8)
    descale_o = attention_codes(q8.transpose(1, 2), k8.transpose(1, 2), v8.transpose(1, 2), dq, dk, dv,
                                o8.transpose(1, 2), 1.0 / math.sqrt(d))
    result = dequantize(o8, descale_o, d, q.dtype).transpose(1, 2)
    return result if out is None else out.copy_(result)
