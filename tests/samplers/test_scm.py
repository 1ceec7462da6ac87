"""scm against diffusers' SCMScheduler as SanaSprintPipeline drives it: its grid (1.5708, then 1.3 at 2 steps or a
linspace to 0), whole trajectories on one fake TrigFlow network with the same fresh noise, and the img2img levels.

The scheduler runs in the pipeline's units: x_T = sigma_data randn, the network shown x / sigma_data, its F times
sigma_data, the step's noise sigma_data randn, the image denoised / sigma_data. Ours runs in units of sigma_data
(samplers.plans.scm), so it starts from randn and ends at the image. Tolerance: 1e-6 of the largest value. At
sigma_data 0.5 (Sana Sprint's) the units are a power of two apart and both sides compute the same float32 numbers
(measured: equal; the bound leaves an ulp for a cos or sin of a vector rounding apart from one of an element); at 0.7
only the rounding of the unit differs (measured 2.4e-7).
"""
import math

import pytest
import torch
from diffusers import SCMScheduler

from samplers import NoiseSchedule, make_plan, sample, start_at
from samplers.rules import RULES, SettingError, check_settings, prediction_type
from samplers.schedules import scm_timesteps

from .test_vs_diffusers import rel

SPRINT = {"_class_name": "SCMScheduler", "num_train_timesteps": 1000, "prediction_type": "trigflow",
          "sigma_data": 0.5}  # diffusers' conversion script writes these (its max/intermediate timesteps aside)


def _set_timesteps(sched: SCMScheduler, steps: int) -> None:
    """As SanaSprintPipeline's retrieve_timesteps: its max_timesteps, and its intermediate_timesteps (1.3) where
    the scheduler takes one (2 steps); a caller of another step count passes None."""
    sched.set_timesteps(steps, max_timesteps=1.57080, intermediate_timesteps=1.3 if steps == 2 else None)


def fake_trigflow(x_in: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """A smooth nonlinear stand-in for a TrigFlow network F(x / sigma_data, s); s a scalar or (B,)."""
    s = torch.as_tensor(s).float().reshape(-1, *(1,) * (x_in.dim() - 1))
    return 0.7 * torch.tanh(x_in) * torch.cos(s) - 0.4 * x_in * torch.sin(s) + 0.1 * s


def run_scheduler(steps: int, noise: torch.Tensor, seed: int, sigma_data: float) -> torch.Tensor:
    """SanaSprintPipeline's loop with fake_trigflow for its transformer and conversion (the F it hands the step)."""
    sched = SCMScheduler.from_config({**SPRINT, "sigma_data": sigma_data})
    _set_timesteps(sched, steps)
    sched.set_begin_index(0)
    gen = torch.Generator().manual_seed(seed)
    x = noise * sigma_data
    for t in sched.timesteps[:-1]:
        f = fake_trigflow(x / sigma_data, t) * sigma_data
        x, denoised = sched.step(f, t.expand(len(x)), x, generator=gen, return_dict=False)
    return denoised / sigma_data


def run_ours(steps: int, noise: torch.Tensor, seed: int) -> torch.Tensor:
    plan = make_plan("scm", steps, NoiseSchedule.from_config(SPRINT))
    gen = torch.Generator().manual_seed(seed)
    return sample(fake_trigflow, plan.init_sigma * noise, plan, lambda x: torch.randn(x.shape, generator=gen))


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 10, 40])
def test_the_grid_is_the_pipelines(steps):
    sched = SCMScheduler.from_config(SPRINT)
    _set_timesteps(sched, steps)
    assert torch.equal(scm_timesteps(steps).float(), sched.timesteps)
    plan = make_plan("scm", steps, NoiseSchedule.from_config(SPRINT))
    assert torch.equal(plan.timesteps, sched.timesteps[:-1]) and plan.init_sigma == 1.0
    assert plan.stochastic is (steps > 1)  # the last step's sin(0) = 0: a one-step plan draws nothing


def test_two_steps_stop_at_the_intermediate_angle():
    assert scm_timesteps(2).float().tolist() == pytest.approx([1.5708, 1.3, 0.0])
    assert make_plan("scm", 2, NoiseSchedule(prediction_type="trigflow")).timesteps[1].item() == pytest.approx(1.3)


@pytest.mark.parametrize("sigma_data, tol", [(0.5, 1e-6), (0.7, 1e-6)])
@pytest.mark.parametrize("steps", [1, 2, 3, 4, 8])
def test_trajectory_matches_scm_scheduler(steps, sigma_data, tol):
    noise = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    theirs = run_scheduler(steps, noise, seed=1, sigma_data=sigma_data)
    ours = run_ours(steps, noise, seed=1)
    assert rel(ours, theirs) <= tol, rel(ours, theirs)


def test_rows_at_different_steps_and_step_counts_batch():
    """One batch of a 1-, a 2- and a 4-step request (the shorter ones held once done): each row equals its own
    scheduler run; their noise comes from one generator per row, as the engine draws it."""
    noise = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    plans = [make_plan("scm", n, NoiseSchedule.from_config(SPRINT)) for n in (1, 2, 4)]
    gens = [torch.Generator().manual_seed(10 + i) for i in range(3)]
    x = sample(fake_trigflow, noise, plans, lambda x: torch.stack([torch.randn(x.shape[1:], generator=g)
                                                                   for g in gens]))
    for i, n in enumerate((1, 2, 4)):
        ref = run_scheduler(n, noise[i:i + 1], seed=10 + i, sigma_data=0.5)
        assert rel(x[i:i + 1], ref) <= 1e-6, (n, rel(x[i:i + 1], ref))


@pytest.mark.parametrize("steps, start", [(2, 1), (4, 2), (4, 3), (10, 4)])
def test_levels_and_a_cut_plan_are_sana_sprint_img2imgs(steps, start):
    """SanaSprintImg2ImgPipeline: latents = cos(s) image_latents + sin(s) noise at its first kept angle (in units of
    sigma_data: the pipeline scales both by it), then the scheduler from set_begin_index(start)."""
    sched = SCMScheduler.from_config(SPRINT)
    _set_timesteps(sched, steps)
    plan = make_plan("scm", steps, NoiseSchedule.from_config(SPRINT))
    s = sched.timesteps
    assert torch.equal(plan.levels[:-1], torch.stack([s[:-1].cos(), s[:-1].sin()], dim=1))
    assert plan.levels[-1].tolist() == [1.0, 0.0]
    x0 = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(4))
    cut = start_at(plan, start)
    a, b = cut.levels[0]
    gen = torch.Generator().manual_seed(5)
    ours = sample(fake_trigflow, a * x0 + b * z, cut, lambda x: torch.randn(x.shape, generator=gen))
    sched.set_begin_index(start)
    gen = torch.Generator().manual_seed(5)
    x = torch.cos(s[start:start + 1]) * x0 * 0.5 + torch.sin(s[start:start + 1]) * z * 0.5
    for t in s[start:-1]:
        x, denoised = sched.step(fake_trigflow(x / 0.5, t) * 0.5, t, x, generator=gen, return_dict=False)
    assert rel(ours, denoised / 0.5) <= 1e-6


def test_the_rule_takes_trigflow_models_only():
    assert prediction_type({"_class_name": "SCMScheduler"}) == "trigflow"  # its class default
    assert [n for n, r in RULES.items() if "trigflow" in r.predictions] == ["scm"]
    check_settings("scm", 1000, 0.0, "trigflow", 1000)
    with pytest.raises(SettingError, match="supports prediction_type trigflow"):
        check_settings("scm", 2, 0.0, "flow", 1000)
    with pytest.raises(SettingError, match="steps must be an integer from 1 to 1000"):
        check_settings("scm", 1001, 0.0, "trigflow", 1000)
    with pytest.raises(SettingError, match="supports prediction_type"):
        check_settings("flow_euler", 2, 0.0, "trigflow", 1000)
    assert math.isclose(scm_timesteps(1)[0].item(), 1.5708, rel_tol=1e-6)
