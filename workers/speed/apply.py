"""The speed layer's entry point: a loaded model in, the fast one out (``apply``).

Every rewrite the graph backends, compile and FP8 make on a model happens here, from outside the model and
the engine (gpt-fast's ``apply_tp(model)`` habit): FP8 linears (``precision``), the attention breaks and routed
joint attention, the hoisted modulation, the GELU epilogues, the fused norms, the cross-attention mode, and
the process-wide preparation a compiled step needs. The engine calls ``apply`` once per model and runs what it
gets. Which rewrites a model takes is read from its family's flags (``break_attention``, ``joint_attention``)
and hooks (``set_cross_attention``, ``attention_kernel``) on ``workers.families.base.Family``; the family is
passed in, so the speed layer imports no family. A family's own fast paths (FLUX.1's blocks) live in its
folder: ``apply`` calls its ``speed_rewrites`` hook at three points of the order below ("precision",
"epilogues", "norms"), and its routed joint attention processors register with ``workers.speed.routing``.

The order matters (a later rewrite wraps or replaces what an earlier one made): FP8 linears, then the family's
"precision" rewrites; compile preparation; the attention breaks and hoisted modulation; the joint-attention
modulation; the routed joint attention; the GELU epilogues, then the family's "epilogues"; the
cross-attention mode; the fused norms, then the family's "norms".

Rewrites made for the graph backends (``graphs``) are left out for eager steps, which run diffusers' modules;
applying again to the same model (a second engine) changes nothing it already did.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from graphs.compiled import opaque_break, use_cache_dir
from workers.kernels import fp8_attention
from workers.kernels.attention import use_cache_dir as use_attention_cache
from workers.speed import epilogues, fp8, norm_fusion
from workers.speed.config import SpeedConfig
from workers.speed.joint_attention import attention_fp8_inline, attention_inline
from workers.speed.modulation import hoist_temb_modulation, restore_temb_modulation
from workers.speed.patches import attention_into, attention_quantized_into, break_attention, hoist_modulation
from workers.speed.routing import route_joint_attention
from workers.speed.varlen import varlen_attention_into, varlen_attention_quantized_into

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Applied:
    """What ``apply`` made: the model (changed in place) and the attention kernel its steps run, in words,
    where its family or its precision says (None elsewhere)."""

    model: object  # workers.loading.LoadedModel
    attention: str | None = None


def apply(model, family, config: SpeedConfig = SpeedConfig(), graphs: bool = True) -> Applied:
    """Make ``model`` (a ``LoadedModel`` of ``family``, a ``workers.families.base.Family``) fast as ``config`` says;
    ``graphs``: its steps run under a graph backend (``full``, ``breakable``), not eagerly."""
    precision = config.precision or model.precision
    to_precision(model, precision)
    if model.fp8_linears:
        family.speed_rewrites(model, "precision", config, graphs)
    if config.compile != "off":
        prepare_compile(config.compile_cache)
    if config.compile_cache:  # FlashAttention-4 compiles its kernels whether or not the steps are compiled
        use_attention_cache(config.compile_cache)
    t, attention = model.transformer, None
    breaks, joint = family.break_attention, family.joint_attention
    if graphs and breaks:
        if config.attention_patch:
            break_attention(t)
        if config.hoist_modulation:
            hoist_modulation(t)
    if joint:  # SD3's and FLUX.1's norms' modulation: one product a step
        if graphs and config.hoist_modulation:
            hoist_temb_modulation(t)
        else:
            restore_temb_modulation(t)
    if graphs and config.attention_patch and joint:
        fp8_attn = precision == "fp8+attention"
        if route_joint_attention(t, fp8=fp8_attn) and fp8_attn:
            attention = "fp8 (cuDNN)"
    if graphs and config.gelu_epilogue:
        epilogues.fuse_gelu_epilogues(t)
        family.speed_rewrites(model, "epilogues", config, graphs)
    family.set_cross_attention(model, config.cross_attention)
    if graphs and config.attention_patch and (breaks or joint):  # FP8 blocks: each norm and its codes one kernel
        norm_fusion.fuse_block_norms(t)
        family.speed_rewrites(model, "norms", config, graphs)
    if (kernel := family.attention_kernel(model)) is not None:
        attention = kernel
    return Applied(model, attention)


def unsupported_reason(precision: str, device) -> str | None:
    """Why ``precision`` cannot run on ``device``, or None when it can."""
    if precision != "bf16" and (why := fp8.unsupported_reason(device)) is not None:
        return why
    if precision == "fp8+attention":
        return fp8_attention.unavailable_reason(device)
    return None


def to_precision(model, precision: str | None = None):
    """``model`` with its transformer blocks' linears as FP8 matrix products for "fp8" and "fp8+attention"
    (``precision``; None: the one it was loaded for), once: their bf16 weights are released, so a model made
    FP8 stays FP8. ``model.precision`` says which; returns ``model``. The family's own FP8 rewrites (FLUX.1's
    single blocks' GELU folded into their output's quantization) follow in ``apply`` ("precision")."""
    precision = precision or model.precision
    if precision == model.precision and (precision == "bf16" or model.fp8_linears):
        return model
    if precision == "bf16":
        raise ValueError(f"{model.name} runs in {model.precision}: its bf16 weights are gone; load it again")
    if (why := unsupported_reason(precision, model.device)) is not None:
        raise ValueError(f"cannot run {model.name} in {precision}: {why}")
    if not model.fp8_linears:
        model.fp8_linears = len(fp8.quantize_linears(model.transformer))
    model.precision = precision
    log.info("%s: %d linears of its blocks in fp8%s", model.name, model.fp8_linears,
             ", its joint attention too" if precision == "fp8+attention" else "")
    return model


def prepare_compile(cache_dir: str) -> None:
    """Before compiling steps: the attention breaks stay opaque calls for dynamo (so a breakable capture
    still breaks there) and Inductor's cache goes where the config says."""
    opaque_break(attention_into)
    opaque_break(attention_quantized_into, out=("codes", "scales"))
    opaque_break(attention_inline)
    opaque_break(attention_fp8_inline)
    opaque_break(varlen_attention_into)
    opaque_break(varlen_attention_quantized_into, out=("codes", "scales"))
    if cache_dir:
        use_cache_dir(cache_dir)
