"""Noise schedules, sampler updates and classifier-free guidance: stateless, graph-safe functions.

A sampler is split in two: a host-side plan builder (make_plan, once per request, float64 on the CPU) that
unrolls the sampler into per-step model timesteps and coefficient rows, and one update (sampler_step) that
every sampler shares, so samples of different samplers and steps share one batch and one CUDA graph.

Names are imported lazily: ``samplers.rules`` (which settings each sampler takes, plain data) must import
without torch, for the API process.
"""
import importlib

_WHERE = {
    "COEFFS": "plans", "SAMPLERS": "plans", "Plan": "plans", "make_plan": "plans", "edit_start": "plans",
    "start_at": "plans",
    "NoiseSchedule": "schedules", "flow_mu": "rules",
    "cfg_combine": "update", "gather_rows": "update", "hold_row": "update", "model_input": "update",
    "sample": "update", "sampler_step": "update",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'samplers' has no attribute {name!r}")
    return getattr(importlib.import_module(f"samplers.{_WHERE[name]}"), name)
