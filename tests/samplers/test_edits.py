"""What image-to-image and inpainting read of a plan, against the diffusers schedulers as the edit pipelines drive
them: ``edit_start`` is ``get_timesteps``; each plan's ``levels`` are the scheduler's ``add_noise`` /
``scale_noise`` at every step (the begin-index path the pipelines take: ``set_begin_index(start)``, then one
more step per step); a plan cut by ``start_at`` runs the scheduler's trajectory from ``timesteps[start:]``,
started at the clean sample noised to its first step. Same fake model and tolerance as test_vs_diffusers."""

import numpy as np
import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler
from diffusers.utils import logging as diffusers_logging

from samplers import NoiseSchedule, edit_start, flow_mu, make_plan, sample, start_at
from samplers.plans import C_H

from .test_flow_dpm import SANA
from .test_vs_diffusers import SCHEDULERS, fake_model, rel

diffusers_logging.set_verbosity_error()
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

FLUX = {"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
        "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
        "use_dynamic_shifting": True}
CASES = {  # name: (sampler, config)
    "ddpm": ("ddpm", {"timestep_spacing": "leading", "clip_sample": False}),
    "ddim": ("ddim", {"timestep_spacing": "trailing", "clip_sample": False}),
    "euler": ("euler", {"timestep_spacing": "linspace"}),
    "euler_a": ("euler_a", {"timestep_spacing": "leading", "steps_offset": 1}),
    "dpmpp_2m": ("dpmpp_2m", {"timestep_spacing": "linspace"}),  # PixArt's scheduler
    "flow_euler": ("flow_euler", {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0}),  # SD3's
    "flow_euler_flux": ("flow_euler", FLUX),  # FluxPipeline's sigmas, shifted by mu
    "flow_dpmpp_2m": ("flow_dpmpp_2m", SANA),
}
STEPS = 10
MU = flow_mu(64, FLUX)


def _scheduler(case: str, steps: int):
    name, cfg = CASES[case]
    if case == "flow_dpmpp_2m":
        sched = DPMSolverMultistepScheduler.from_config(cfg)
        sched.set_timesteps(steps)
    elif case == "flow_euler_flux":
        sched = FlowMatchEulerDiscreteScheduler.from_config(cfg)
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=MU)
    else:
        cls, extra = SCHEDULERS[name]
        sched = cls.from_config({**cfg, **extra})
        sched.set_timesteps(steps)
    return sched


def _plan(case: str, steps: int):
    name, cfg = CASES[case]
    return make_plan(name, steps, NoiseSchedule.from_config({**cfg, **({"flow_grid": "flux"} if "flux" in case
                                                                      else {})}), mu=MU)


def _begin(sched, start: int) -> None:
    """As the pipelines' get_timesteps: DDPM and DDIM index by timestep and have no begin index."""
    if hasattr(sched, "set_begin_index"):
        sched.set_begin_index(start)


def _noised(sched, x0, noise, t):
    if isinstance(sched, FlowMatchEulerDiscreteScheduler):
        return sched.scale_noise(x0, t.reshape(1), noise)
    return sched.add_noise(x0, noise, t.reshape(1))


@pytest.mark.parametrize("steps", [1, 4, 10, 28])
def test_the_start_is_get_timesteps(steps):
    for strength in (0.05, 0.1, 0.25, 0.3, 0.5, 0.6, 0.75, 0.9, 0.99, 1.0):
        init = min(steps * strength, steps)
        expected = int(max(steps - init, 0))
        if expected >= steps:  # the pipelines refuse this: no step left
            with pytest.raises(ValueError, match="leaves no step to run"):
                edit_start(steps, strength)
        else:
            assert edit_start(steps, strength) == expected
    assert edit_start(steps, 1.0) == 0
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="strength must be in"):
            edit_start(steps, bad)


@pytest.mark.parametrize("case", sorted(CASES))
def test_levels_are_the_schedulers_noising_at_every_step(case):
    plan = _plan(case, STEPS)
    assert plan.levels.shape == (STEPS + 1, 2) and plan.levels[-1].tolist() == [1.0, 0.0]
    x0 = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    for start in range(STEPS):  # img2img's first noising: the begin index, before any step
        sched = _scheduler(case, STEPS)
        _begin(sched, start)
        ours = plan.levels[start, 0] * x0 + plan.levels[start, 1] * noise
        assert rel(ours, _noised(sched, x0, noise, sched.timesteps[start])) < 1e-6, start
    sched = _scheduler(case, STEPS)  # inpainting's: after each step, at the next step's level
    _begin(sched, 0)
    x = noise.clone()
    for i, t in enumerate(sched.timesteps[:-1]):
        x = sched.step(fake_model(x, t), t, x).prev_sample
        ours = plan.levels[i + 1, 0] * x0 + plan.levels[i + 1, 1] * noise
        assert rel(ours, _noised(sched, x0, noise, sched.timesteps[i + 1])) < 1e-6, i


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("strength", [0.3, 0.6, 1.0])
def test_a_cut_plan_runs_the_schedulers_trajectory_from_its_begin_index(case, strength):
    start = edit_start(STEPS, strength)
    plan = start_at(_plan(case, STEPS), start)
    assert plan.num_steps == STEPS - start and plan.coeffs[0, C_H] == 0
    x0 = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    noise = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    sched = _scheduler(case, STEPS)
    timesteps = sched.timesteps[start:]
    _begin(sched, start)
    x = _noised(sched, x0, noise, timesteps[0])
    gen = torch.Generator().manual_seed(4)
    for t in timesteps:
        x_in = sched.scale_model_input(x, t) if hasattr(sched, "scale_model_input") else x
        x = sched.step(fake_model(x_in, t), t, x, generator=gen).prev_sample
    ours_gen = torch.Generator().manual_seed(4)
    start_x = plan.levels[0, 0] * x0 + plan.levels[0, 1] * noise
    ours = sample(fake_model, start_x, plan, lambda x: torch.randn(x.shape, generator=ours_gen))
    assert torch.allclose(plan.timesteps, timesteps.float(), rtol=1e-6)
    assert rel(ours, x) < 1e-5, rel(ours, x)


def test_start_zero_is_the_plan_and_a_start_outside_it_is_refused():
    plan = _plan("dpmpp_2m", STEPS)
    assert start_at(plan, 0) is plan
    with pytest.raises(ValueError, match="outside the plan's 10 steps"):
        start_at(plan, STEPS)
