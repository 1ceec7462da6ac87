"""Plan builders: request validation and the shape of what they return."""
import math

import pytest
import torch

from samplers import COEFFS, SAMPLERS, NoiseSchedule, Plan, make_plan

VP = NoiseSchedule()
FLOW = NoiseSchedule(prediction_type="flow")
FLOW_DPM = NoiseSchedule(prediction_type="flow_prediction", use_flow_sigmas=True)  # DPMSolverMultistep, flow sigmas
TRIGFLOW = NoiseSchedule(prediction_type="trigflow")  # SCMScheduler's


def _schedule(name):
    return {"flow_euler": FLOW, "flow_dpmpp_2m": FLOW_DPM, "scm": TRIGFLOW}.get(name, VP)


@pytest.mark.parametrize("name", list(SAMPLERS))
@pytest.mark.parametrize("steps", [1, 2, 25, 999])
def test_plan_shapes_and_dtypes(name, steps):
    plan = make_plan(name, steps, _schedule(name))
    assert isinstance(plan, Plan) and plan.sampler == name and plan.num_steps == steps
    assert plan.timesteps.shape == (steps,) and plan.timesteps.dtype == torch.float32
    assert plan.coeffs.shape == (steps, len(COEFFS)) and plan.coeffs.dtype == torch.float32
    if name == "flow_dpmpp_2m":  # diffusers truncates these timesteps to integers: neighbours can coincide
        assert (plan.timesteps[:-1] >= plan.timesteps[1:]).all()
    else:
        assert (plan.timesteps[:-1] > plan.timesteps[1:]).all()  # descending
    assert plan.stochastic == bool((plan.coeffs[:, COEFFS.index("c_z")] != 0).any())


@pytest.mark.parametrize(
    "name, eta, stochastic",
    [("ddpm", 0, True), ("ddim", 0, False), ("ddim", 0.3, True), ("euler", 0, False),
     ("euler_a", 0, True), ("dpmpp_2m", 0, False), ("flow_euler", 0, False), ("flow_dpmpp_2m", 0, False),
     ("scm", 0, True)],
)  # fmt: skip
def test_stochastic_flag(name, eta, stochastic):
    assert make_plan(name, 10, _schedule(name), eta).stochastic is stochastic


def test_dpmpp_2m_history_use():
    """First and last steps are first order (c_h = 0); the steps between use the previous denoised."""
    c_h = make_plan("dpmpp_2m", 6, VP).coeffs[:, COEFFS.index("c_h")]
    assert c_h[0] == 0 and c_h[-1] == 0 and (c_h[1:-1] < 0).all()


def test_clip_column():
    clip = COEFFS.index("clip")
    assert make_plan("ddim", 5, NoiseSchedule(clip_sample=True, clip_sample_range=2.0)).coeffs[:, clip].eq(2.0).all()
    assert make_plan("ddim", 5, VP).coeffs[:, clip].eq(math.inf).all()
    assert make_plan("euler", 5, NoiseSchedule(clip_sample=True)).coeffs[:, clip].eq(math.inf).all()  # as diffusers


def test_unknown_sampler_lists_the_valid_ones():
    valid = "ddpm, ddim, euler, euler_a, dpmpp_2m, flow_euler"
    with pytest.raises(ValueError, match=f"unknown sampler 'heun'; valid samplers: {valid}"):
        make_plan("heun", 10, VP)


@pytest.mark.parametrize("steps", [0, -3, 1001, 2.5, "10", True, None])
def test_bad_step_counts(steps):
    with pytest.raises(ValueError, match=r"steps must be an integer from 1 to 1000"):
        make_plan("ddim", steps, VP)


@pytest.mark.parametrize("eta", [-0.1, -1, math.nan])
def test_negative_eta(eta):
    with pytest.raises(ValueError, match="eta must be >= 0"):
        make_plan("ddim", 10, VP, eta)


def test_eta_only_for_ddim():
    with pytest.raises(ValueError, match="eta applies only to ddim"):
        make_plan("euler", 10, VP, eta=0.5)


@pytest.mark.parametrize("name, schedule", [("flow_euler", VP), ("ddim", FLOW), ("dpmpp_2m", FLOW)])
def test_prediction_type_must_fit_the_sampler(name, schedule):
    with pytest.raises(ValueError, match="supports prediction_type"):
        make_plan(name, 10, schedule)


@pytest.mark.parametrize("name", ["ddpm", "ddim"])
def test_offset_past_the_table_is_refused(name):
    """Leading grid, 1000 steps, steps_offset 1: the first timestep would be 1000."""
    with pytest.raises(ValueError, match="reaches timestep 1000, past the last training one"):
        make_plan(name, 1000, NoiseSchedule(steps_offset=1))


def test_degenerate_grid_is_refused():
    """dpmpp_2m on a leading grid with S = N: N // (S + 1) = 0 puts every step at t = 0 (h = 0)."""
    with pytest.raises(ValueError, match="degenerate"):
        make_plan("dpmpp_2m", 1000, VP)
