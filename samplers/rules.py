"""Which settings each sampler accepts, as plain data: the API validates requests with these rules
without importing torch (``samplers/__init__`` imports torch lazily), and ``make_plan`` applies the
same rules (``check_plan``) before it builds a plan in the worker, so a job the API accepts is one
the worker can run. ``flow_mu`` (a flow schedule's dynamic shift for an
image size) is here for the same reason: plain arithmetic on the scheduler config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from numbers import Real


class SettingError(ValueError):
    """Settings no plan can be built from; ``param`` names the request field to change (sampler, steps, eta)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplerRule:
    takes_eta: bool = False  # eta > 0 only means something to this sampler
    predictions: tuple[str, ...] = ("epsilon", "v_prediction")  # model outputs it can integrate
    takes_mu: bool = False  # its builder takes mu, the dynamic shift of a flow schedule
    # Grid rules (the quirks of the diffusers scheduler each builder follows; samplers.schedules):
    extra_points: int = 0  # points its leading/linspace grid spaces beyond its steps (DPM-Solver: n + 1, t = 0 dropped)
    indexes_table: bool = False  # reads alphas_cumprod[t]: its first timestep must be at most N - 1
    distinct: bool = False  # two equal timesteps (also two clamped to N - 1) are a step of h = 0 in log-SNR,
    # which it divides by
    min_steps_shift_terminal: int = 1  # shift_terminal stretches by 1 / (1 - sigma_last): 0 at one step
    flow_sigmas: bool = False  # DPMSolverMultistepScheduler's flow grid (samplers.schedules.flow_dpm_sigmas): its
    # first two model timesteps must differ (diffusers starts at the second of two equal ones and runs off its end)


RULES: dict[str, SamplerRule] = {
    "ddpm": SamplerRule(indexes_table=True),
    "ddim": SamplerRule(takes_eta=True, indexes_table=True),
    "euler": SamplerRule(),
    "euler_a": SamplerRule(),
    "dpmpp_2m": SamplerRule(extra_points=1, distinct=True),
    "flow_euler": SamplerRule(predictions=("flow", "flow_prediction"), takes_mu=True, min_steps_shift_terminal=2),
    "flow_dpmpp_2m": SamplerRule(predictions=("flow_prediction",), flow_sigmas=True),
    "scm": SamplerRule(predictions=("trigflow",)),
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
    "SCMScheduler": {"prediction_type": "trigflow"},
}


def prediction_type(scheduler_config: dict) -> str:
    """What the model predicts, from its scheduler config as NoiseSchedule.from_config reads it."""
    cfg = {**SCHEDULER_CLASS_DEFAULTS.get(scheduler_config.get("_class_name"), {}), **scheduler_config}
    return cfg.get("prediction_type", "epsilon")


@dataclass(frozen=True)
class Grid:
    """What a sampler's rules read of a schedule: NoiseSchedule's fields of these names, with its defaults
    (a test holds them equal), so the API reads them from a scheduler config without torch."""

    num_train_timesteps: int = 1000
    prediction_type: str = "epsilon"
    timestep_spacing: str = "leading"
    steps_offset: int = 0
    shift_terminal: float | None = None
    flow_shift: float = 1.0

    @classmethod
    def of(cls, scheduler_config: dict) -> "Grid":
        """From a scheduler_config.json dict (or dataclasses.asdict of a NoiseSchedule)."""
        cfg = {**SCHEDULER_CLASS_DEFAULTS.get(scheduler_config.get("_class_name"), {}), **scheduler_config}
        return cls(**{f.name: cfg[f.name] for f in fields(cls) if cfg.get(f.name) is not None})


def check_plan(name: str, num_steps, eta, grid: Grid) -> None:
    """Raise SettingError, with a message to act on, unless a plan can be built: the one check of a request's
    sampler settings, made by the API at submission and by make_plan in the worker."""
    check_settings(name, num_steps, eta, grid.prediction_type, grid.num_train_timesteps)
    low = RULES[name].min_steps_shift_terminal if grid.shift_terminal else 1
    if num_steps < low:
        raise SettingError(f"{name} with {num_steps} step is degenerate with this model's shift_terminal: use at "
                           f"least {low} steps", "steps")
    if (why := _grid_problem(RULES[name], num_steps, grid)) is not None:
        offset = f", steps_offset {grid.steps_offset}" if grid.steps_offset else ""
        where = "flow sigma" if RULES[name].flow_sigmas else grid.timestep_spacing
        raise SettingError(f"{name} with {num_steps} steps on this model's {where} grid{offset} is "
                           f"degenerate: it {why}; use at most {max_steps(name, grid)} steps", "steps")


def max_steps(name: str, grid: Grid) -> int:
    """The most steps ``name`` takes on ``grid`` (a leading grid with steps_offset may refuse a few below it)."""
    rule, n = RULES[name], grid.num_train_timesteps
    if not (rule.indexes_table or rule.distinct or rule.flow_sigmas):
        return n
    return next((s for s in range(n, 0, -1) if _grid_problem(rule, s, grid) is None), 0)


def _grid_problem(rule: SamplerRule, steps: int, grid: Grid) -> str | None:
    """What breaks the rule on the grid of ``steps`` steps, or None: samplers.schedules.spaced_timesteps
    and dpm_timesteps, as arithmetic on the first timestep and the stride."""
    n, spacing = grid.num_train_timesteps, grid.timestep_spacing
    if rule.flow_sigmas:
        return _flow_sigmas_problem(steps, grid)
    if spacing == "trailing":  # round(N - i N / steps) - 1: distinct, the first N - 1, for steps <= N
        return None
    points = steps + rule.extra_points
    if rule.distinct and points > n:  # linspace: fewer than one timestep per point; leading: a stride of 0
        return f"spaces {points} points over {n} training timesteps, so two coincide"
    if spacing != "leading":
        return None
    stride = n // points  # the grid is arange(points - 1, ...) * stride + steps_offset (t = 0 dropped)
    first = (points - 1) * stride + grid.steps_offset
    if rule.indexes_table and first > n - 1:
        return f"reaches timestep {first}, past the last training one ({n - 1})"
    if rule.distinct and steps > 1 and first - stride >= n - 1:
        return f"puts its first two timesteps past the last training one ({n - 1}), so they coincide"
    return None


def _flow_sigmas_problem(steps: int, grid: Grid) -> str | None:
    """DPMSolverMultistepScheduler's flow grid (samplers.schedules.flow_dpm_sigmas, the same float64 arithmetic on
    its first two points): its first two timesteps, truncated to integers, must differ. Where they coincide,
    diffusers' step begins its count at the second of them (index_for_timestep) and fails at the last step."""
    n, s = grid.num_train_timesteps, grid.flow_shift
    if steps < 2:
        return None
    step = (1 / n - 1.0) / steps  # np.linspace(1, 1/n, steps + 1): i * step + 1, the last point exactly 1/n
    first, second = 1.0 - 1 / n, 1.0 - ((steps - 1) * step + 1.0)
    t0, t1 = (int(s * x / (1 + (s - 1) * x) * n) for x in (first, second))
    if t0 == t1:
        return f"puts its first two timesteps at the same integer ({t0})"
    return None


def check_settings(name: str, num_steps, eta, prediction_type: str, num_train_timesteps: int) -> None:
    """Raise SettingError, with a message to act on, for a sampler, steps or eta no plan takes (grids aside:
    check_plan)."""
    if name not in RULES:
        raise SettingError(f"unknown sampler {name!r}; valid samplers: {', '.join(RULES)}", "sampler")
    n = num_train_timesteps
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or not 1 <= num_steps <= n:
        raise SettingError(f"steps must be an integer from 1 to {n} (the model's num_train_timesteps), got "
                           f"{num_steps!r}", "steps")
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not eta >= 0:  # not >=: also NaN
        raise SettingError(f"eta must be >= 0, got {eta!r}", "eta")
    rule = RULES[name]
    if eta and not rule.takes_eta:
        takers = ", ".join(k for k, r in RULES.items() if r.takes_eta)
        raise SettingError(f"eta applies only to {takers}; {name!r} got eta={eta!r}", "eta")
    if prediction_type not in rule.predictions:
        raise SettingError(f"sampler {name!r} supports prediction_type {' or '.join(rule.predictions)}, "
                           f"the model's schedule says {prediction_type!r}", "sampler")


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
