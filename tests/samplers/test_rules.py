"""samplers.rules is the one statement of which settings a plan can be built from: the API checks
requests with it (no torch), make_plan with it. Here it is held to the builders themselves: for every
sampler, spacing, offset and step count of small schedules, the rule accepts exactly the settings whose
plan is finite (the builders with the check taken out)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from samplers.plans import COEFFS, SAMPLERS, CLIP
from samplers.rules import RULES, Grid, check_plan, max_steps
from samplers.schedules import NoiseSchedule


def _builds(name: str, steps: int, schedule: NoiseSchedule) -> bool:
    """The builder's own answer, without the rules: a finite plan, or not (ValueError: the table's check)."""
    try:
        plan = SAMPLERS[name](steps, schedule, 0.0, **({"mu": 0.8} if RULES[name].takes_mu else {}))
    except ValueError:
        return False
    rest = [k for k in range(len(COEFFS)) if k != CLIP]
    return bool(torch.isfinite(plan.coeffs[:, rest]).all())


def _accepts(name: str, steps: int, schedule: NoiseSchedule) -> bool:
    try:
        check_plan(name, steps, 0.0, Grid.of(dataclasses.asdict(schedule)))
    except ValueError:
        return False
    return True


VP_NAMES = [n for n, r in RULES.items() if "epsilon" in r.predictions]


@pytest.mark.parametrize("n", [10, 37])
@pytest.mark.parametrize("spacing", ["leading", "trailing", "linspace"])
@pytest.mark.parametrize("offset", [0, 1, 2, 3])
@pytest.mark.parametrize("name", VP_NAMES)
def test_the_rule_accepts_exactly_the_plans_that_build(name, spacing, offset, n):
    schedule = NoiseSchedule(num_train_timesteps=n, timestep_spacing=spacing, steps_offset=offset)
    for steps in range(1, n + 1):
        assert _accepts(name, steps, schedule) == _builds(name, steps, schedule), (name, spacing, offset, steps)


@pytest.mark.parametrize("shift_terminal", [None, 0.1, 0.5])
@pytest.mark.parametrize("grid", ["scheduler", "flux"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_the_flow_rule_accepts_exactly_the_plans_that_build(shift_terminal, grid, dynamic):
    schedule = NoiseSchedule(num_train_timesteps=20, prediction_type="flow", shift=3.0, flow_grid=grid,
                             shift_terminal=shift_terminal, use_dynamic_shifting=dynamic)
    for steps in range(1, 21):
        assert _accepts("flow_euler", steps, schedule) == _builds("flow_euler", steps, schedule), steps


def test_dpmpp_2m_at_1000_steps_on_a_linspace_grid_is_refused_naming_the_bound():
    """The case that reached a worker: digits-text's DPMSolverMultistepScheduler config, 1000 steps."""
    grid = Grid.of({"_class_name": "DPMSolverMultistepScheduler", "num_train_timesteps": 1000,
                    "timestep_spacing": "linspace"})
    assert max_steps("dpmpp_2m", grid) == 999
    with pytest.raises(ValueError, match="dpmpp_2m with 1000 steps .* degenerate: .*; use at most 999 steps"):
        check_plan("dpmpp_2m", 1000, 0.0, grid)
    check_plan("dpmpp_2m", 999, 0.0, grid)


def test_grid_defaults_are_the_schedules():
    """Grid.of fills what a config leaves out as NoiseSchedule does (the worker's reading of it)."""
    defaults = NoiseSchedule()
    for f in dataclasses.fields(Grid):
        assert getattr(Grid(), f.name) == getattr(defaults, f.name), f.name
    for cfg in ({}, {"_class_name": "EulerDiscreteScheduler"}, {"_class_name": "FlowMatchEulerDiscreteScheduler"},
                {"timestep_spacing": "trailing", "steps_offset": 1, "shift_terminal": None}):
        schedule = NoiseSchedule.from_config(cfg)
        assert Grid.of(cfg) == Grid.of(dataclasses.asdict(schedule)), cfg
