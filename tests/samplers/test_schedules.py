"""Schedules and timestep grids against diffusers' own tables, and config parsing."""
import math

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler

from samplers import NoiseSchedule
from samplers.schedules import alphas_cumprod, betas, dpm_timesteps, spaced_timesteps

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

BETA_CONFIGS = [
    {"beta_schedule": "linear"},
    {"beta_schedule": "scaled_linear"},
    {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012},  # Stable Diffusion
    {"beta_schedule": "squaredcos_cap_v2"},
    {"beta_schedule": "linear", "num_train_timesteps": 500},
]


@pytest.mark.parametrize("cfg", BETA_CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
def test_tables_are_diffusers_bit_for_bit(cfg):
    theirs = DDIMScheduler(**cfg)
    schedule = NoiseSchedule(**cfg)
    assert torch.equal(betas(schedule), theirs.betas.double())
    assert torch.equal(alphas_cumprod(schedule), theirs.alphas_cumprod.double())


def _trailing_overshoots(n: int, big_n: int = 1000) -> bool:
    """numpy's arange(N, 0, -N/n) has n + 1 points for some n (61, 103, ...): diffusers' known off-by-one."""
    return len(np.arange(big_n, 0, -big_n / n)) == n + 1


GRIDS = [  # diffusers class, our grid function
    pytest.param(DDIMScheduler, lambda s, n: spaced_timesteps(s, n), id="ddim"),  # DDPM's is the same code
    # Euler ancestral's is the same code as Euler's
    pytest.param(EulerDiscreteScheduler, lambda s, n: spaced_timesteps(s, n, integer=False), id="euler"),
    pytest.param(DPMSolverMultistepScheduler, dpm_timesteps, id="dpm"),
]


@pytest.mark.parametrize("spacing", ["leading", "trailing", "linspace"])
@pytest.mark.parametrize("cls, grid", GRIDS)
def test_timesteps_match_diffusers_for_every_step_count(cls, grid, spacing):
    """Every n from 1 to N: rounding ties of arange/linspace must fall as numpy's do."""
    offset = 1 if spacing == "leading" else 0
    theirs = cls(timestep_spacing=spacing, steps_offset=offset)
    schedule = NoiseSchedule(timestep_spacing=spacing, steps_offset=offset)
    for n in range(1, 1001):
        theirs.set_timesteps(n)
        ours, ref = grid(schedule, n), theirs.timesteps.double()
        if spacing == "trailing" and _trailing_overshoots(n):
            # not reproduced: diffusers adds a step at t = -1 (alphas_cumprod[-1], the noisiest entry)
            assert len(ref) == n + 1 and ref[-1] == -1
            ref = ref[:n]
        assert torch.equal(ours, ref), n


def test_trailing_overshoot_is_rare():
    overshoots = [n for n in range(1, 1001) if _trailing_overshoots(n)]
    assert overshoots[:3] == [61, 103, 121] and len(overshoots) == 62


def test_from_config_reads_a_dit_config_and_ignores_unknown_keys():
    cfg = {  # facebook/DiT-XL-2-256 scheduler/scheduler_config.json
        "_class_name": "DDIMScheduler",
        "_diffusers_version": "0.12.0.dev0",
        "beta_end": 0.02,
        "beta_schedule": "linear",
        "beta_start": 0.0001,
        "clip_sample": False,
        "num_train_timesteps": 1000,
        "prediction_type": "epsilon",
        "set_alpha_to_one": True,
        "steps_offset": 0,
        "trained_betas": None,
    }
    assert NoiseSchedule.from_config(cfg) == NoiseSchedule()


@pytest.mark.parametrize(
    "cfg, expected",
    [
        ({"_class_name": "DDIMScheduler"}, {"clip_sample": True, "timestep_spacing": "leading"}),
        ({"_class_name": "DDPMScheduler"}, {"clip_sample": True}),
        ({"_class_name": "EulerDiscreteScheduler"}, {"timestep_spacing": "linspace", "clip_sample": False}),
        ({"_class_name": "DPMSolverMultistepScheduler"}, {"timestep_spacing": "linspace"}),
        ({"_class_name": "EulerDiscreteScheduler", "timestep_spacing": "trailing"}, {"timestep_spacing": "trailing"}),
        ({"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0}, {"prediction_type": "flow", "shift": 3.0}),
        ({"use_karras_sigmas": False, "thresholding": None, "lambda_min_clipped": -math.inf}, {}),
    ],
)
def test_from_config_takes_the_named_class_defaults(cfg, expected):
    """A key the file leaves out takes the default of the diffusers class that wrote it."""
    schedule = NoiseSchedule.from_config(cfg)
    assert {k: getattr(schedule, k) for k in expected} == expected


@pytest.mark.parametrize(
    "cfg",
    [
        {"use_karras_sigmas": True},
        {"rescale_betas_zero_snr": True},
        {"trained_betas": [0.1, 0.2]},
        {"thresholding": True},
        {"final_sigmas_type": "sigma_min"},
        {"invert_sigmas": True},
        {"lambda_min_clipped": -5.1},
    ],
)
def test_from_config_refuses_options_it_would_silently_change(cfg):
    with pytest.raises(ValueError, match="do not implement"):
        NoiseSchedule.from_config(cfg)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"beta_schedule": "sigmoid"}, "beta_schedule must be one of linear, scaled_linear, squaredcos_cap_v2"),
        ({"prediction_type": "sample"}, "prediction_type must be one of"),
        ({"timestep_spacing": "karras"}, "timestep_spacing must be one of"),
        ({"num_train_timesteps": 1}, "num_train_timesteps"),
        ({"shift": 0.0}, "shift"),
    ],
)
def test_bad_schedule_fields_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NoiseSchedule(**kwargs)
