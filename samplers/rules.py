"""Which settings each sampler accepts, as plain data: the API validates requests with these rules
without importing torch (``samplers/__init__`` imports torch lazily), and ``make_plan`` applies the
same rules before it builds a plan in the worker. ``flow_mu`` (a flow schedule's dynamic shift for an
image size) is here for the same reason: plain arithmetic on the scheduler config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real


@dataclass(frozen=True)
class SamplerRule:
    takes_eta: bool = False  # eta > 0 only means something to this sampler
    predictions: tuple[str, ...] = ("epsilon", "v_prediction")  # model outputs it can integrate
    takes_mu: bool = False  # its builder takes mu, the dynamic shift of a flow schedule


RULES: dict[str, SamplerRule] = {
    "ddpm": SamplerRule(),
    "ddim": SamplerRule(takes_eta=True),
    "euler": SamplerRule(),
    "euler_a": SamplerRule(),
    "dpmpp_2m": SamplerRule(),
    "flow_euler": SamplerRule(predictions=("flow",), takes_mu=True),
}


# Defaults of the diffusers class a scheduler config names (`_class_name`) that differ from NoiseSchedule's,
# for keys the file leaves out: diffusers fills those from that class's __init__.
SCHEDULER_CLASS_DEFAULTS = {
    "DDPMScheduler": {"clip_sample": True},
    "DDIMScheduler": {"clip_sample": True},
    "EulerDiscreteScheduler": {"timestep_spacing": "linspace"},
    "EulerAncestralDiscreteScheduler": {"timestep_spacing": "linspace"},
    "DPMSolverMultistepScheduler": {"timestep_spacing": "linspace"},
    # its config has no prediction_type: the model predicts the rectified-flow velocity
    "FlowMatchEulerDiscreteScheduler": {"prediction_type": "flow"},
}


def prediction_type(scheduler_config: dict) -> str:
    """What the model predicts, from its scheduler config as NoiseSchedule.from_config reads it."""
    cfg = {**SCHEDULER_CLASS_DEFAULTS.get(scheduler_config.get("_class_name"), {}), **scheduler_config}
    return cfg.get("prediction_type", "epsilon")


def check_settings(name: str, num_steps, eta, prediction_type: str, num_train_timesteps: int) -> None:
    """Raise ValueError, with a message to act on, for settings no plan can be built from."""
    if name not in RULES:
        raise ValueError(f"unknown sampler {name!r}; valid samplers: {', '.join(RULES)}")
    n = num_train_timesteps
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or not 1 <= num_steps <= n:
        raise ValueError(f"num_steps must be an integer from 1 to {n} (num_train_timesteps), got {num_steps!r}")
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not eta >= 0:  # not >=: also NaN
        raise ValueError(f"eta must be >= 0, got {eta!r}")
    rule = RULES[name]
    if eta and not rule.takes_eta:
        takers = ", ".join(k for k, r in RULES.items() if r.takes_eta)
        raise ValueError(f"eta applies only to {takers}; {name!r} got eta={eta!r}")
    if prediction_type not in rule.predictions:
        raise ValueError(f"sampler {name!r} supports prediction_type {' or '.join(rule.predictions)}, "
                         f"the model's schedule says {prediction_type!r}")


# FlowMatchEulerDiscreteScheduler's defaults for the keys of calculate_shift (FluxPipeline reads them from
# scheduler.config, which holds the class defaults for keys the file leaves out).
FLOW_SHIFT_DEFAULTS = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15}


def flow_mu(image_seq_len: int, schedule_config: dict) -> float:
    """mu, the dynamic shift for an image of image_seq_len transformer tokens: diffusers' calculate_shift
    (pipelines/flux/pipeline_flux.py), the line through (base_image_seq_len, base_shift) and
    (max_image_seq_len, max_shift), extrapolated past either end.

    schedule_config is the scheduler_config.json dict (or dataclasses.asdict of a NoiseSchedule). FLUX.1:
    image_seq_len = (H // 16) * (W // 16) for an H x W image (the VAE's 8x, then 2x2 packing), i.e.
    (h // 2) * (w // 2) for h x w VAE latents; in general the token count after patchify.
    """
    if isinstance(image_seq_len, bool) or not isinstance(image_seq_len, int) or image_seq_len < 1:
        raise ValueError(f"image_seq_len must be a positive integer (a token count), got {image_seq_len!r}")
    cfg = {**FLOW_SHIFT_DEFAULTS, **{k: schedule_config[k] for k in FLOW_SHIFT_DEFAULTS if k in schedule_config}}
    if not all(isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v) for v in cfg.values()):
        raise ValueError(f"the scheduler config's dynamic shift settings must be numbers, got {cfg}")
    if cfg["max_image_seq_len"] == cfg["base_image_seq_len"]:
        raise ValueError(f"max_image_seq_len must differ from base_image_seq_len, both are {cfg['base_image_seq_len']}")
    m = (cfg["max_shift"] - cfg["base_shift"]) / (cfg["max_image_seq_len"] - cfg["base_image_seq_len"])
    b = cfg["base_shift"] - m * cfg["base_image_seq_len"]
    return image_seq_len * m + b


def check_mu(mu, time_shift_type: str) -> None:
    """Raise ValueError unless mu can shift a flow schedule with dynamic shifting (it is required there)."""
    if mu is None:
        raise ValueError(
            "this flow schedule uses dynamic shifting (use_dynamic_shifting): make_plan needs mu, the shift for "
            "the image size; samplers.rules.flow_mu(image_seq_len, scheduler_config) computes it"
        )
    if isinstance(mu, bool) or not isinstance(mu, Real) or not math.isfinite(mu):
        raise ValueError(f"mu must be a finite number, got {mu!r}")
    if time_shift_type == "exponential" and mu > 80:  # e^mu, the shift, overflows float32 near 88.7
        raise ValueError(f"mu must be at most 80 with time_shift_type 'exponential' (shift = e^mu), got {mu!r}")
    if time_shift_type == "linear" and not mu > 0:
        raise ValueError(f"mu must be positive with time_shift_type 'linear' (shift = mu), got {mu!r}")
