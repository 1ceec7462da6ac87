"""Noise schedules: beta tables, sigmas and timestep spacings, reproducing diffusers' schedulers.

Where diffusers keeps a table in float32 (betas, alphas_cumprod, inference sigmas), the same float32 values
are made here and handed out as float64, so the coefficients computed from them in float64 start from the
numbers the checkpoint's scheduler uses. Timestep grids repeat numpy's arange/linspace arithmetic (diffusers
builds them with numpy), so rounding ties fall the same way.
"""
import math
from dataclasses import dataclass, fields

import torch

from samplers.rules import SCHEDULER_CLASS_DEFAULTS

BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
PREDICTION_TYPES = ("epsilon", "v_prediction", "flow", "flow_prediction", "trigflow")
TIMESTEP_SPACINGS = ("leading", "trailing", "linspace")
TIME_SHIFT_TYPES = ("exponential", "linear")
FLOW_GRIDS = ("scheduler", "flux")

# diffusers options implemented here only at their default: refused when a config sets them, because
# ignoring them would sample from a different schedule than the checkpoint's.
_ONLY_DEFAULT = {
    "trained_betas": None,
    "rescale_betas_zero_snr": False,
    "thresholding": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "use_lu_lambdas": False,
    "invert_sigmas": False,
    "stochastic_sampling": False,
    "interpolation_type": "linear",
    "final_sigmas_type": "zero",
    "timestep_type": "discrete",
    "lambda_min_clipped": -math.inf,
}

@dataclass(frozen=True)
class NoiseSchedule:
    """A model's training noise schedule and how inference timesteps are spaced (diffusers' field names)."""

    num_train_timesteps: int = 1000
    beta_start: float = 0.0001
    beta_end: float = 0.02
    beta_schedule: str = "linear"  # linear | scaled_linear | squaredcos_cap_v2
    prediction_type: str = "epsilon"  # epsilon | v_prediction | flow (rectified-flow velocity) | flow_prediction
    # (the same velocity, named as DPMSolverMultistepScheduler names it: on its flow sigmas, use_flow_sigmas) |
    # trigflow (TrigFlow's F, SCMScheduler's: samplers.plans.scm)
    timestep_spacing: str = "leading"  # leading | trailing | linspace
    steps_offset: int = 0
    clip_sample: bool = False
    clip_sample_range: float = 1.0
    set_alpha_to_one: bool = True
    # flow matching (FlowMatchEulerDiscreteScheduler; defaults are that class's)
    shift: float = 1.0  # sigma -> shift * sigma / (1 + (shift - 1) * sigma)
    use_dynamic_shifting: bool = False  # shift by a per-request mu (image size) instead: make_plan(..., mu=)
    base_shift: float | None = 0.5  # mu at base_image_seq_len tokens (samplers.rules.flow_mu)
    max_shift: float | None = 1.15  # mu at max_image_seq_len tokens
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    time_shift_type: str = "exponential"  # mu shifts as shift = e^mu (exponential) or shift = mu (linear)
    shift_terminal: float | None = None  # stretch the shifted grid so that its last sigma is this
    # not a diffusers key: the sigma grid the model's pipeline asks for (flow_sigmas), "scheduler" (SD3) or "flux"
    # (FluxPipeline). None: "flux" with dynamic shifting, else "scheduler"; FLUX.1-schnell needs "flux" set.
    flow_grid: str | None = None
    # DPMSolverMultistepScheduler on flow sigmas (Sana): its grid, shifted by flow_shift (flow_dpm_sigmas); with it,
    # flow_euler is FlowMatchEulerDiscreteScheduler(shift=flow_shift), the scheduler such pipelines swap in
    use_flow_sigmas: bool = False
    flow_shift: float = 1.0

    def __post_init__(self):
        _check_choice("beta_schedule", self.beta_schedule, BETA_SCHEDULES)
        _check_choice("prediction_type", self.prediction_type, PREDICTION_TYPES)
        _check_choice("timestep_spacing", self.timestep_spacing, TIMESTEP_SPACINGS)
        _check_choice("time_shift_type", self.time_shift_type, TIME_SHIFT_TYPES)
        if self.flow_grid is not None:
            _check_choice("flow_grid", self.flow_grid, FLOW_GRIDS)
        if self.num_train_timesteps < 2:
            raise ValueError(f"num_train_timesteps must be at least 2, got {self.num_train_timesteps}")
        if not self.shift > 0:
            raise ValueError(f"shift must be positive, got {self.shift}")
        if not self.flow_shift > 0:
            raise ValueError(f"flow_shift must be positive, got {self.flow_shift}")
        if (self.prediction_type == "flow_prediction") != self.use_flow_sigmas:
            raise ValueError("prediction_type 'flow_prediction' goes with use_flow_sigmas (DPMSolverMultistepScheduler "
                             f"on flow sigmas); got prediction_type {self.prediction_type!r} and use_flow_sigmas "
                             f"{self.use_flow_sigmas}")
        if self.shift_terminal and not 0 < self.shift_terminal < 1:  # 0 and None are off, as in diffusers
            raise ValueError(f"shift_terminal must be between 0 and 1 (or null), got {self.shift_terminal}")

    @classmethod
    def from_config(cls, cfg: dict) -> "NoiseSchedule":
        """Build from a diffusers scheduler_config.json dict; keys this class does not use are ignored."""
        unsupported = {k: cfg[k] for k, default in _ONLY_DEFAULT.items() if k in cfg and not _same(cfg[k], default)}
        if unsupported:
            raise ValueError(f"scheduler config sets options dit-serve's samplers do not implement: {unsupported}")
        known = {f.name for f in fields(cls)}
        kwargs = {**SCHEDULER_CLASS_DEFAULTS.get(cfg.get("_class_name"), {}), **cfg}
        return cls(**{k: v for k, v in kwargs.items() if k in known})


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _same(value, default) -> bool:
    """Config equality where null and false both mean 'off' (configs write either)."""
    return value == default or (not value and not default)


def betas(schedule: NoiseSchedule) -> torch.Tensor:
    """beta_t, (N,) float64 holding diffusers' float32 values.

    linear: Ho et al. 2020; scaled_linear: linear in sqrt(beta) (latent diffusion); squaredcos_cap_v2: Nichol &
    Dhariwal 2021, eq. 17, beta capped at 0.999.
    """
    n = schedule.num_train_timesteps
    if schedule.beta_schedule == "linear":
        return torch.linspace(schedule.beta_start, schedule.beta_end, n, dtype=torch.float32).double()
    if schedule.beta_schedule == "scaled_linear":
        root = torch.linspace(schedule.beta_start**0.5, schedule.beta_end**0.5, n, dtype=torch.float32)
        return (root**2).double()
    abar = [math.cos((i / n + 0.008) / 1.008 * math.pi / 2) ** 2 for i in range(n + 1)]
    return torch.tensor([min(1 - abar[i + 1] / abar[i], 0.999) for i in range(n)], dtype=torch.float32).double()


def alphas_cumprod(schedule: NoiseSchedule) -> torch.Tensor:
    """abar_t = prod_{s <= t} (1 - beta_s) (Ho et al. 2020, eq. 4), (N,); multiplied up in float32 like diffusers."""
    return torch.cumprod(1 - betas(schedule).float(), dim=0).double()


def sigmas(schedule: NoiseSchedule) -> torch.Tensor:
    """sigma_t = sqrt((1 - abar_t) / abar_t), (N,): the VE noise level of timestep t (Karras et al. 2022, Table 1)."""
    abar = alphas_cumprod(schedule)
    return ((1 - abar) / abar).sqrt()


def interp(t: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """np.interp(t, arange(len(table)), table): table at fractional timesteps, clamped at its ends."""
    t = t.clamp(0, len(table) - 1)
    lo = t.floor().clamp(max=len(table) - 2)
    i = lo.long()
    return (table[i + 1] - table[i]) * (t - lo) + table[i]


def np_linspace(start: float, stop: float, n: int) -> torch.Tensor:
    """np.linspace(start, stop, n) in float64, same arithmetic: i * step + start, the last point exactly stop."""
    if n == 1:
        return torch.tensor([float(start)], dtype=torch.float64)
    y = torch.arange(n, dtype=torch.float64) * ((stop - start) / (n - 1)) + start
    y[-1] = stop
    return y


def trailing_timesteps(schedule: NoiseSchedule, n: int) -> torch.Tensor:
    """round(arange(N, 0, -N/n)) - 1, descending, (n,) float64.

    numpy fills arange as start + i * ((start + step) - start); that arithmetic is kept. For some n (61,
    103, ...) numpy's arange yields n + 1 points, the last rounding to t = -1; diffusers then runs an extra
    step at t = -1 (alphas_cumprod[-1] is the *noisiest* entry). That bug is not reproduced: exactly n points.
    """
    big_n = schedule.num_train_timesteps
    delta = (big_n - big_n / n) - big_n
    return (torch.arange(n, dtype=torch.float64) * delta + big_n).round() - 1


def spaced_timesteps(schedule: NoiseSchedule, n: int, *, integer: bool = True) -> torch.Tensor:
    """The n inference timesteps of DDPM/DDIM/Euler(-ancestral) set_timesteps, descending, float64.

    Spacings of Lin et al. 2023, Table 2. integer=False is Euler's linspace: fractional, rounded to float32.
    """
    big_n = schedule.num_train_timesteps
    if schedule.timestep_spacing == "leading":
        return torch.arange(n - 1, -1, -1, dtype=torch.float64) * (big_n // n) + schedule.steps_offset
    if schedule.timestep_spacing == "trailing":
        return trailing_timesteps(schedule, n)
    t = np_linspace(0, big_n - 1, n).flip(0)
    return t.round() if integer else t.float().double()


def dpm_timesteps(schedule: NoiseSchedule, n: int) -> torch.Tensor:
    """DPMSolverMultistepScheduler.set_timesteps: leading and linspace space n + 1 points and drop t = 0."""
    big_n = schedule.num_train_timesteps
    if schedule.timestep_spacing == "leading":
        return torch.arange(n, 0, -1, dtype=torch.float64) * (big_n // (n + 1)) + schedule.steps_offset
    if schedule.timestep_spacing == "trailing":
        return trailing_timesteps(schedule, n)
    return np_linspace(0, big_n - 1, n + 1).round().flip(0)[:-1]


def flow_grid(schedule: NoiseSchedule) -> str:
    """The flow sigma grid a pipeline of this schedule asks for (see flow_sigmas)."""
    return schedule.flow_grid or ("flux" if schedule.use_dynamic_shifting else "scheduler")


def flow_sigmas(schedule: NoiseSchedule, n: int, mu: float | None = None) -> torch.Tensor:
    """The n sigmas of FlowMatchEulerDiscreteScheduler.set_timesteps, descending, (n,) float64 holding its
    float32 values (the final 0 not included). Model timesteps are sigma * num_train_timesteps.

    1. grid. "scheduler", set_timesteps(n) as StableDiffusion3Pipeline calls it: linspace from the first to
       the last sigma of the training table (already shifted by `shift` unless dynamic), in float64.
       "flux", the sigmas FluxPipeline passes: np.linspace(1, 1/n, n), which set_timesteps casts to float32
       first, so steps 2 and 3 run in float32 too.
    2. shift (Esser et al. 2024, eq. 23): s sigma / (1 + (s - 1) sigma) with s = `shift`, or with dynamic
       shifting s = e^mu (exponential) or s = mu (linear), written as s / (s + 1/sigma - 1) as diffusers does.
    3. shift_terminal: 1 - sigma is scaled so that the last sigma becomes shift_terminal (LTX-Video).
    """
    big_n = schedule.num_train_timesteps
    if flow_grid(schedule) == "flux":
        sigma = np_linspace(1.0, 1 / n, n).float()
    else:
        table = torch.arange(big_n, 0, -1, dtype=torch.float32) / big_n  # __init__'s table, in float32
        if not schedule.use_dynamic_shifting:
            table = flow_shift(schedule, table)
        sigma = np_linspace(table[0].item() * big_n, table[-1].item() * big_n, n) / big_n
    if schedule.use_dynamic_shifting:
        s = torch.tensor(math.exp(mu) if schedule.time_shift_type == "exponential" else mu, dtype=sigma.dtype)
        sigma = s / (s + (sigma.reciprocal() - 1))
    else:
        sigma = flow_shift(schedule, sigma)
    if schedule.shift_terminal:
        scale = (1 - sigma[-1]) / (1 - schedule.shift_terminal)
        sigma = 1 - (1 - sigma) / scale
    return sigma.float().double()


def flow_shift(schedule: NoiseSchedule, sigma: torch.Tensor) -> torch.Tensor:
    """Timestep shift of flow matching, sigma -> s sigma / (1 + (s - 1) sigma) (Esser et al. 2024, eq. 23), s the
    schedule's ``shift`` (its ``flow_shift`` on a DPMSolverMultistepScheduler flow config, use_flow_sigmas)."""
    s = schedule.flow_shift if schedule.use_flow_sigmas else schedule.shift
    return s * sigma / (1 + (s - 1) * sigma)


def flow_dpm_sigmas(schedule: NoiseSchedule, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DPMSolverMultistepScheduler.set_timesteps(n) with use_flow_sigmas: the model timesteps (n,) and the sigmas
    (n + 1,) with the final 0 (final_sigmas_type "zero"), descending, float64.

    As diffusers builds them in numpy: 1 - np.linspace(1, 1/N, n + 1), shifted by flow_shift (s sigma / (1 +
    (s - 1) sigma)), flipped, the last (0) dropped; timesteps sigma N cast to int64 (truncated), sigmas cast to
    float32 (the solver's). timestep_spacing plays no part. Two neighbouring timesteps can coincide on a fine
    grid (the sigmas do not)."""
    big_n = schedule.num_train_timesteps
    raw = 1.0 - np_linspace(1.0, 1 / big_n, n + 1)
    s = schedule.flow_shift
    sigma = (s * raw / (1 + (s - 1) * raw)).flip(0)[:-1]
    return (sigma * big_n).trunc(), torch.cat([sigma.float().double(), sigma.new_zeros(1)])


# SanaSprintPipeline.__call__'s max_timesteps and intermediate_timesteps (SCMScheduler.set_timesteps' defaults)
SCM_MAX_TIMESTEP, SCM_INTERMEDIATE_TIMESTEP = 1.57080, 1.3


def scm_timesteps(n: int) -> torch.Tensor:
    """SCMScheduler.set_timesteps(n) as SanaSprintPipeline calls it: the TrigFlow angles (n + 1,) from the noise end,
    1.5708, down to 0, float64 holding the scheduler's float32 values. At 2 steps [1.5708, 1.3, 0] (its intermediate
    timestep); at any other count linspace(1.5708, 0, n + 1), where the pipeline must be given
    intermediate_timesteps=None (the scheduler takes one at 2 steps only)."""
    if n == 2:
        return torch.tensor([SCM_MAX_TIMESTEP, SCM_INTERMEDIATE_TIMESTEP, 0.0], dtype=torch.float32).double()
    return torch.linspace(SCM_MAX_TIMESTEP, 0, n + 1, dtype=torch.float32).double()
