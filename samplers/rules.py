"""Which settings each sampler accepts, as plain data: the API validates requests with these rules
without importing torch (``samplers/__init__`` imports torch lazily), and ``make_plan`` applies the
same rules before it builds a plan in the worker.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplerRule:
    takes_eta: bool = False  # eta > 0 only means something to this sampler
    predictions: tuple[str, ...] = ("epsilon", "v_prediction")  # model outputs it can integrate


RULES: dict[str, SamplerRule] = {
    "ddpm": SamplerRule(),
    "ddim": SamplerRule(takes_eta=True),
    "euler": SamplerRule(),
    "euler_a": SamplerRule(),
    "dpmpp_2m": SamplerRule(),
    "flow_euler": SamplerRule(predictions=("flow",)),
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
