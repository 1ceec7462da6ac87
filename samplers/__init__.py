"""Noise schedules, sampler updates and classifier-free guidance: stateless, graph-safe functions.

A sampler is split in two: a host-side plan builder (make_plan, once per request, float64 on the CPU) that
unrolls the sampler into per-step model timesteps and coefficient rows, and one update (sampler_step) that
every sampler shares, so samples of different samplers and steps share one batch and one CUDA graph.
"""
from samplers.plans import COEFFS, SAMPLERS, Plan, make_plan
from samplers.schedules import NoiseSchedule
from samplers.update import cfg_combine, gather_rows, hold_row, model_input, sample, sampler_step

__all__ = [
    "COEFFS",
    "SAMPLERS",
    "NoiseSchedule",
    "Plan",
    "cfg_combine",
    "gather_rows",
    "hold_row",
    "make_plan",
    "model_input",
    "sample",
    "sampler_step",
]
