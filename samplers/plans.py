"""Plan builders: one pure host function per sampler, float64 on the CPU, run once per request at admission.

A Plan is a table. Row i holds the model timestep of step i and nine coefficients, which the one update
every sampler shares (samplers.update.sampler_step) applies to a sample:

    denoised = clamp(c_skip * x + c_out * out, -clip, clip)              # x0 estimate
    x_next   = c_x * x + c_e * out + c_d * denoised + c_h * hist + c_z * noise

where out is the (guided) network output at input c_in * x, hist the previous step's denoised and noise a
fresh N(0, 1) draw. Each builder below is "the rows that make this update equal my scheduler's step". The
target is diffusers' scheduler of the same name, quirks included (each docstring lists the quirks).

Edits (image-to-image, inpainting) read two more things of a plan. ``levels`` (S + 1, 2): where the sampler's x
stands at the start of each step (and after the last) as ``a x0 + b eps``, the (a, b) the scheduler's own
``add_noise`` / ``scale_noise`` noise a clean sample to that step with, in its float32 arithmetic (row S: (1, 0)).
``start_at`` cuts a plan where strength starts it (``edit_start``: the pipelines' ``get_timesteps``).
"""
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from samplers.rules import RULES, Grid, check_mu, check_plan
from samplers.schedules import (
    NoiseSchedule,
    alphas_cumprod,
    dpm_timesteps,
    flow_dpm_sigmas,
    flow_sigmas,
    interp,
    scm_timesteps,
    sigmas,
    spaced_timesteps,
)

COEFFS = ("c_in", "c_skip", "c_out", "clip", "c_x", "c_e", "c_d", "c_h", "c_z")
C_IN, C_SKIP, C_OUT, CLIP, C_X, C_E, C_D, C_H, C_Z = range(len(COEFFS))


# eq=False: fields are tensors, and a generated __eq__ would compare them elementwise and fail.
@dataclass(frozen=True, eq=False)
class Plan:
    """One request's sampler, unrolled: what to feed the model and how to update x at each step."""

    sampler: str
    timesteps: torch.Tensor  # (S,) float32: the model timestep at step i
    coeffs: torch.Tensor  # (S, 9) float32: the row of step i, columns in COEFFS order
    init_sigma: float  # x_T = init_sigma * randn
    stochastic: bool  # some step has c_z != 0: it needs fresh noise per step
    levels: torch.Tensor | None = None  # (S + 1, 2) float32: x at the start of step i is levels[i, 0] x0 +
    # levels[i, 1] eps, as the scheduler's add_noise / scale_noise makes it; row S (the end) is (1, 0)

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)


def _plan(sampler: str, timesteps: torch.Tensor, init_sigma: float, levels: tuple, **columns) -> Plan:
    """Stack (S,) float64 columns (or scalars) in COEFFS order; a column left out is 0 (c_in 1, clip inf).
    ``levels``: the (a, b) columns of each step's noise level (S,), float32 as the scheduler computes them; the
    end's (1, 0) is added here."""
    defaults = {"c_in": 1.0, "clip": math.inf}
    steps = len(timesteps)
    cols = [torch.as_tensor(columns.pop(k, defaults.get(k, 0.0)), dtype=torch.float64).expand(steps) for k in COEFFS]
    if columns:
        raise TypeError(f"unknown coefficient columns: {sorted(columns)}")
    coeffs = torch.stack(cols, dim=1)
    a, b = (torch.as_tensor(c, dtype=torch.float32).expand(steps) for c in levels)
    table = torch.cat([torch.stack([a, b], dim=1), torch.tensor([[1.0, 0.0]])])
    return Plan(sampler, timesteps.float(), coeffs.float(), float(init_sigma), bool((coeffs[:, C_Z] != 0).any()),
                table)


def _vp_levels(schedule: NoiseSchedule, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DDPMScheduler's and DDIMScheduler's add_noise at timesteps t: sqrt(abar_t) x0 + sqrt(1 - abar_t) eps, from
    the float32 table in float32."""
    abar = alphas_cumprod(schedule).float()[t.long()]
    return abar**0.5, (1 - abar) ** 0.5


def _dpm_levels(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DPMSolverMultistepScheduler's add_noise at VP sigmas (its float32 table): alpha_t x0 + sigma_t eps with
    alpha_t = 1 / sqrt(sigma^2 + 1), sigma_t = sigma alpha_t (_sigma_to_alpha_sigma_t), in float32."""
    s = sigma.float()
    alpha = 1 / ((s**2 + 1) ** 0.5)
    return alpha, s * alpha


def _flow_levels(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlowMatchEulerDiscreteScheduler's scale_noise (and DPMSolverMultistepScheduler's add_noise on flow sigmas):
    sigma eps + (1 - sigma) x0, in float32."""
    s = sigma.float()
    return 1.0 - s, s


def _vp_denoiser(schedule: NoiseSchedule, abar: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(c_skip, c_out): x0 = c_skip x + c_out out for x = sqrt(abar) x0 + sqrt(1 - abar) eps.

    epsilon: x0 = (x - sqrt(1 - abar) eps) / sqrt(abar)   (Ho et al. 2020, eq. 15)
    v:       x0 = sqrt(abar) x - sqrt(1 - abar) v         (Salimans & Ho 2022, v = sqrt(abar) eps - sqrt(1 - abar) x0)
    """
    a, s = abar.sqrt(), (1 - abar).sqrt()
    if schedule.prediction_type == "epsilon":
        return 1 / a, -s / a
    return a, -s


def _vp_eps(schedule: NoiseSchedule, abar: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(c_x, c_e): eps = c_x x + c_e out; for v, eps = sqrt(abar) v + sqrt(1 - abar) x."""
    if schedule.prediction_type == "epsilon":
        return torch.zeros_like(abar), torch.ones_like(abar)
    return (1 - abar).sqrt(), abar.sqrt()


def _ve_denoiser(schedule: NoiseSchedule, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(c_skip, c_out) for x = x0 + sigma eps (Karras et al. 2022, Table 1): eps: x0 = x - sigma eps;
    v: x0 = x / (sigma^2 + 1) - sigma / sqrt(sigma^2 + 1) v."""
    if schedule.prediction_type == "epsilon":
        return torch.ones_like(sigma), -sigma
    return 1 / (sigma**2 + 1), -sigma / (sigma**2 + 1).sqrt()


def _clip(schedule: NoiseSchedule) -> float:
    return schedule.clip_sample_range if schedule.clip_sample else math.inf


def _table_timesteps(schedule: NoiseSchedule, num_steps: int) -> torch.Tensor:
    """The grid of samplers that index alphas_cumprod by t: steps_offset may push a leading grid past it
    (diffusers then fails with an IndexError mid-request)."""
    t = spaced_timesteps(schedule, num_steps)
    if t[0] >= schedule.num_train_timesteps:
        raise ValueError(
            f"{num_steps} steps with steps_offset {schedule.steps_offset} reach timestep {int(t[0])}, "
            f"past the last one ({schedule.num_train_timesteps - 1}): use fewer steps"
        )
    return t


def ddpm(num_steps: int, schedule: NoiseSchedule, eta: float = 0.0) -> Plan:
    """Ancestral DDPM (Ho et al. 2020, eqs. 6-7) on a strided grid, as DDPMScheduler (variance fixed_small).

    x_prev = sqrt(abar_prev) beta_t / (1 - abar_t) x0 + sqrt(alpha_t) (1 - abar_prev) / (1 - abar_t) x + sigma_t z,
    alpha_t = abar_t / abar_prev over the stride, sigma_t^2 = (1 - abar_prev) / (1 - abar_t) beta_t.
    Quirks kept: abar_prev = 1 after the last step; no noise at t = 0; the variance is clamped at 1e-20,
    so a last step at t > 0 (trailing grid) still adds 1e-10 z.
    """
    abar = alphas_cumprod(schedule)
    t = _table_timesteps(schedule, num_steps)
    a_t = abar[t.long()]
    a_prev = torch.cat([abar[t.long()[1:]], abar.new_ones(1)])
    beta = 1 - a_t / a_prev
    c_skip, c_out = _vp_denoiser(schedule, a_t)
    std = ((1 - a_prev) / (1 - a_t) * beta).clamp(min=1e-20).sqrt()
    return _plan(
        "ddpm", t, 1.0, _vp_levels(schedule, t), c_skip=c_skip, c_out=c_out, clip=_clip(schedule),
        c_x=(1 - beta).sqrt() * (1 - a_prev) / (1 - a_t),
        c_d=a_prev.sqrt() * beta / (1 - a_t),
        c_z=torch.where(t > 0, std, 0.0),
    )  # fmt: skip


def ddim(num_steps: int, schedule: NoiseSchedule, eta: float = 0.0) -> Plan:
    """DDIM (Song et al. 2021, eq. 12; stochastic for eta > 0, eq. 16), as DDIMScheduler.

    x_prev = sqrt(abar_prev) x0 + sqrt(1 - abar_prev - sigma_t^2) eps + sigma_t z,
    sigma_t = eta sqrt((1 - abar_prev) / (1 - abar_t)) sqrt(1 - abar_t / abar_prev).
    Quirks kept: the previous timestep is t - N // S whatever the spacing; below 0 it is 1 (set_alpha_to_one)
    or abar_0; eps is the raw prediction even when x0 is clipped.
    """
    abar = alphas_cumprod(schedule)
    t = _table_timesteps(schedule, num_steps)
    prev = t.long() - schedule.num_train_timesteps // num_steps
    final = 1.0 if schedule.set_alpha_to_one else abar[0]
    a_t, a_prev = abar[t.long()], torch.where(prev >= 0, abar[prev.clamp(min=0)], final)
    std = eta * ((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)).sqrt()
    direction = (1 - a_prev - std**2).clamp(min=0).sqrt()  # clamp: at eta = 1 rounding can go below 0
    c_skip, c_out = _vp_denoiser(schedule, a_t)
    eps_x, eps_out = _vp_eps(schedule, a_t)
    return _plan(
        "ddim", t, 1.0, _vp_levels(schedule, t), c_skip=c_skip, c_out=c_out, clip=_clip(schedule),
        c_x=direction * eps_x, c_e=direction * eps_out, c_d=a_prev.sqrt(), c_z=std,
    )  # fmt: skip


def _euler_sigmas(schedule: NoiseSchedule, num_steps: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Timesteps (S,), sigmas (S + 1,) and init_noise_sigma of Euler(-ancestral)DiscreteScheduler.

    sigma is the training table interpolated linearly in t, stored in float32, then a final 0. Quirk kept:
    init_noise_sigma is sigma_max on linspace/trailing grids but sqrt(sigma_max^2 + 1) on leading ones.
    """
    t = spaced_timesteps(schedule, num_steps, integer=False)
    s = torch.cat([interp(t, sigmas(schedule)).float().double(), torch.zeros(1, dtype=torch.float64)])
    s_max = s.max().item()
    init = s_max if schedule.timestep_spacing != "leading" else math.sqrt(s_max**2 + 1)
    return t, s, init


def euler(num_steps: int, schedule: NoiseSchedule, eta: float = 0.0) -> Plan:
    """Euler on the probability-flow ODE dx/dsigma = (x - D(x)) / sigma (Karras et al. 2022, Alg. 2 without
    churn), as EulerDiscreteScheduler. x lives in sigma space; the model sees x / sqrt(sigma^2 + 1).

    x_next = x + (x - denoised) / sigma (sigma_next - sigma)
           = (sigma_next / sigma) x + (1 - sigma_next / sigma) denoised.
    """
    t, s, init = _euler_sigmas(schedule, num_steps)
    sigma, ratio = s[:-1], s[1:] / s[:-1]
    c_skip, c_out = _ve_denoiser(schedule, sigma)
    return _plan(
        "euler", t, init, (1.0, sigma.float()), c_in=(sigma**2 + 1).rsqrt(), c_skip=c_skip, c_out=c_out, c_x=ratio,
        c_d=1 - ratio,
    )  # fmt: skip


def euler_a(num_steps: int, schedule: NoiseSchedule, eta: float = 0.0) -> Plan:
    """Euler ancestral (k-diffusion sample_euler_ancestral, eta 1), as EulerAncestralDiscreteScheduler.

    sigma_up = sqrt(sigma_next^2 (sigma^2 - sigma_next^2) / sigma^2), sigma_down = sqrt(sigma_next^2 - sigma_up^2);
    x_next = x + (x - denoised) / sigma (sigma_down - sigma) + sigma_up z.
    """
    t, s, init = _euler_sigmas(schedule, num_steps)
    sigma, sigma_next = s[:-1], s[1:]
    sigma_up = (sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2).sqrt()
    ratio = (sigma_next**2 - sigma_up**2).clamp(min=0).sqrt() / sigma  # sigma_down / sigma
    c_skip, c_out = _ve_denoiser(schedule, sigma)
    return _plan(
        "euler_a", t, init, (1.0, sigma.float()), c_in=(sigma**2 + 1).rsqrt(), c_skip=c_skip, c_out=c_out,
        c_x=ratio, c_d=1 - ratio, c_z=sigma_up,
    )  # fmt: skip


def dpmpp_2m(num_steps: int, schedule: NoiseSchedule, eta: float = 0.0) -> Plan:
    """DPM-Solver++(2M) (Lu et al. 2022, Algorithm 2, midpoint form), as DPMSolverMultistepScheduler with
    solver_order 2, lower_order_final and final_sigmas_type "zero".

    In VP terms alpha_t = 1 / sqrt(sigma^2 + 1), s_t = sigma alpha_t, lambda = log(alpha_t / s_t),
    h = lambda_next - lambda:
    x_next = (s_next / s_t) x + alpha_next (1 - e^-h) ((1 + 1 / 2r) D - 1 / 2r D_prev), r = h_prev / h,
    with D = denoised and D_prev = hist. Quirks kept: the first and the last step are first order (the last
    always is with final sigma 0), the grid is the scheduler's own (n + 1 points, t = 0 dropped).
    """
    t = dpm_timesteps(schedule, num_steps)
    s = torch.cat([interp(t, sigmas(schedule)).float().double(), torch.zeros(1, dtype=torch.float64)])
    alpha = (s**2 + 1).rsqrt()
    lam = -s.log()  # log(alpha / (sigma alpha)); +inf at the final sigma 0
    h = lam[1:] - lam[:-1]
    a = alpha[1:] * -torch.expm1(-h)
    half_inv_r = torch.zeros_like(h)  # 1 / 2r on second-order steps, 0 on first-order ones
    half_inv_r[1:-1] = 0.5 * h[1:-1] / h[:-2]
    c_skip, c_out = _vp_denoiser(schedule, alpha[:-1] ** 2)
    return _plan(
        "dpmpp_2m", t, 1.0, _dpm_levels(s[:-1]), c_skip=c_skip, c_out=c_out,
        c_x=s[1:] * alpha[1:] / (s[:-1] * alpha[:-1]), c_d=a * (1 + half_inv_r), c_h=-a * half_inv_r,
    )  # fmt: skip


def flow_euler(num_steps: int, schedule: NoiseSchedule, eta: float = 0.0, *, mu: float | None = None) -> Plan:
    """Euler on the rectified-flow ODE dx/dsigma = v (Liu et al. 2023; shifted sigmas, Esser et al. 2024),
    as FlowMatchEulerDiscreteScheduler: x_next = x + (sigma_next - sigma) v, model timestep sigma N.

    The sigmas are samplers.schedules.flow_sigmas (grid, static or dynamic shift by mu, shift_terminal), then 0.
    On a DPMSolverMultistepScheduler flow config (use_flow_sigmas: Sana) it is FlowMatchEulerDiscreteScheduler
    with shift = flow_shift, the scheduler such a pipeline is given to sample with Euler. Quirk kept: the
    "scheduler" grid runs linearly from 1 to the *shifted* last training sigma, and is shifted again.
    """
    sigma = flow_sigmas(schedule, num_steps, mu)
    s = torch.cat([sigma, torch.zeros(1, dtype=torch.float64)])
    n = schedule.num_train_timesteps
    return _plan("flow_euler", sigma * n, 1.0, _flow_levels(sigma), c_skip=1.0, c_out=-sigma, c_x=1.0,
                 c_e=s[1:] - s[:-1])


def flow_dpmpp_2m(num_steps: int, schedule: NoiseSchedule, eta: float = 0.0) -> Plan:
    """DPM-Solver++(2M) on the rectified-flow path (Lu et al. 2022, Algorithm 2, midpoint form; Sana's "Flow-DPM-
    Solver", Xie et al. 2024), as DPMSolverMultistepScheduler with use_flow_sigmas, prediction_type
    "flow_prediction", solver_order 2, final_sigmas_type "zero": SanaPipeline's default scheduler.

    x = (1 - sigma) x0 + sigma eps, so alpha_t = 1 - sigma, s_t = sigma and lambda = log((1 - sigma) / sigma); the
    model predicts v = eps - x0, so D = x - sigma v. With h = lambda_next - lambda and r = h_prev / h:
    x_next = (sigma_next / sigma) x + alpha_next (1 - e^-h) ((1 + 1 / 2r) D - 1 / 2r D_prev), D_prev = hist.
    The grid is samplers.schedules.flow_dpm_sigmas: model timesteps are sigma N truncated to integers, while
    the update uses the float32 sigmas. Quirks kept: the first and the last step are first order (the last always
    is with final sigma 0, lower_order_final or not); timestep_spacing plays no part.
    """
    t, s = flow_dpm_sigmas(schedule, num_steps)
    alpha = 1 - s
    lam = alpha.log() - s.log()  # +inf at the final sigma 0
    h = lam[1:] - lam[:-1]
    a = alpha[1:] * -torch.expm1(-h)
    half_inv_r = torch.zeros_like(h)  # 1 / 2r on second-order steps, 0 on first-order ones
    half_inv_r[1:-1] = 0.5 * h[1:-1] / h[:-2]
    return _plan(
        "flow_dpmpp_2m", t, 1.0, _flow_levels(s[:-1]), c_skip=1.0, c_out=-s[:-1],
        c_x=s[1:] / s[:-1], c_d=a * (1 + half_inv_r), c_h=-a * half_inv_r,
    )  # fmt: skip


def scm(num_steps: int, schedule: NoiseSchedule, eta: float = 0.0) -> Plan:
    """sCM's multistep sampling in TrigFlow (Lu & Song 2024, "Simplifying, Stabilizing, and Scaling Continuous-Time
    Consistency Models", Algorithm 1), as SCMScheduler (prediction_type "trigflow") on SanaSprintPipeline's grid
    (samplers.schedules.scm_timesteps: 1.5708, 1.3, 0 at 2 steps).

    TrigFlow noises x0 as x_s = cos(s) x0 + sin(s) z, s from pi/2 (noise) to 0; the network's F at angle s gives
    denoised = cos(s) x - sin(s) F, and the step noises that afresh to the next angle:
    x_next = cos(s_next) denoised + sin(s_next) z (the last step, s_next = 0, ends at denoised).
    x is in units of sigma_data: the scheduler's sample over sigma_data. Its pipeline starts from sigma_data randn,
    shows the network sample / sigma_data, scales F and the fresh noise by sigma_data and decodes denoised /
    sigma_data, so sigma_data cancels: x_T = randn, the network sees x, and the end is the latents the VAE decodes.
    The model timestep is the angle s: a family whose network is no TrigFlow one converts it and its output in the
    step (Sana Sprint's flow transformer: workers.families.sana.sprint). cos and sin are the scheduler's, in float32
    (cos(1.5708) is -3.7e-6, not 0). Stochastic from 2 steps on; ``levels``: the img2img rule, cos(s) x0 + sin(s) z.
    """
    s = scm_timesteps(num_steps).float()
    cos, sin = s.cos(), s.sin()
    return _plan("scm", s[:-1], 1.0, (cos[:-1], sin[:-1]), c_skip=cos[:-1], c_out=-sin[:-1], c_d=cos[1:],
                 c_z=sin[1:])


# name -> builder(num_steps, schedule, eta) -> Plan, plus mu= where the rule says takes_mu; builders trust
# their input (make_plan checks it).
SAMPLERS = {
    "ddpm": ddpm,
    "ddim": ddim,
    "euler": euler,
    "euler_a": euler_a,
    "dpmpp_2m": dpmpp_2m,
    "flow_euler": flow_euler,
    "flow_dpmpp_2m": flow_dpmpp_2m,
    "scm": scm,
}
assert set(SAMPLERS) == set(RULES), "every sampler has its rule (samplers/rules.py)"


def make_plan(name: str, num_steps: int, schedule: NoiseSchedule, eta: float = 0.0, *,
              mu: float | Callable[[int], float] | None = None) -> Plan:
    """Check a request's sampler settings and build its plan. Raises ValueError with a message to act on.

    mu: the resolution-dependent shift of a flow schedule with use_dynamic_shifting, required there
    (samplers.rules.flow_mu gives it for an image size); ignored by other samplers and schedules, as
    diffusers' FlowMatchEulerDiscreteScheduler ignores it without dynamic shifting. Where the pipeline's mu
    depends on the step count too (FLUX.2's compute_empirical_mu), a function of it: called with num_steps.
    """
    check_plan(name, num_steps, eta, Grid.of(dataclasses.asdict(schedule)))
    if callable(mu):
        mu = mu(num_steps)
    takes_mu = RULES[name].takes_mu
    if takes_mu and schedule.use_dynamic_shifting:
        check_mu(mu, schedule.time_shift_type)
    plan = SAMPLERS[name](num_steps, schedule, eta, **({"mu": mu} if takes_mu else {}))
    rest = [k for k in range(len(COEFFS)) if k != CLIP]
    if not torch.isfinite(plan.coeffs[:, rest]).all():  # check_plan's rules (samplers.rules) missed a case
        raise RuntimeError(f"{name} with {num_steps} steps passed samplers.rules.check_plan but its plan is not "
                           "finite: a grid rule is missing there")
    return plan


def edit_start(num_steps: int, strength: float) -> int:
    """The first step an edit of ``strength`` runs of a ``num_steps`` plan, as the img2img and inpaint pipelines'
    ``get_timesteps``: init = min(num_steps * strength, num_steps), start = int(max(num_steps - init, 0)) (every
    scheduler here has order 1: no ``* order``). ValueError when that leaves no step, as the pipelines refuse it."""
    if not 0 < strength <= 1:
        raise ValueError(f"strength must be in (0, 1], got {strength!r}")
    init = min(num_steps * strength, num_steps)
    start = int(max(num_steps - init, 0))
    if start >= num_steps:
        raise ValueError(f"strength {strength} of {num_steps} steps leaves no step to run "
                         f"(int({num_steps} - {num_steps} x {strength}) = {start}): raise the strength or the steps")
    return start


def start_at(plan: Plan, start: int) -> Plan:
    """The steps of ``plan`` from ``start`` on: an edit's plan, as a pipeline runs its scheduler from
    ``set_begin_index(start)`` over ``timesteps[start:]`` (rows, timesteps and levels kept). The first kept step is
    made first order, as the multistep schedulers restart their count of lower-order steps there (DPM-Solver++'s
    first step of any run is first order): its history term is folded into the current estimate (c_d += c_h,
    c_h = 0; the same as reading hist = denoised). The other samplers have c_h = 0 and are only cut."""
    if not 0 <= start < plan.num_steps:
        raise ValueError(f"start {start} is outside the plan's {plan.num_steps} steps")
    if start == 0:
        return plan
    coeffs = plan.coeffs[start:].clone()
    coeffs[0, C_D] += coeffs[0, C_H]
    coeffs[0, C_H] = 0.0
    return dataclasses.replace(plan, timesteps=plan.timesteps[start:], coeffs=coeffs,
                               levels=None if plan.levels is None else plan.levels[start:],
                               stochastic=bool((coeffs[:, C_Z] != 0).any()))
