"""flow_dpmpp_2m as Sana samples: DPMSolverMultistepScheduler with use_flow_sigmas, flow_shift and prediction_type
"flow_prediction" (SanaPipeline's default scheduler, diffusers 0.42), against diffusers step by step on identical
model outputs; and flow_euler on the same config, which is FlowMatchEulerDiscreteScheduler(shift=flow_shift).

The grid (timesteps, which the model sees, and the solver's float32 sigmas) must be diffusers' bit for bit for every
step count. Trajectories: after every step, within 1e-5 (relative to the largest value) of diffusers run in float64
(the same code and float32 sigmas, float64 arithmetic, as test_vs_diffusers does), and of the stock float32 run.
"""
import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler
from diffusers.utils import logging as diffusers_logging

from samplers import NoiseSchedule, make_plan, model_input, sample, sampler_step
from samplers.rules import Grid, check_plan, max_steps
from samplers.schedules import flow_dpm_sigmas

from .test_vs_diffusers import _KeepFloat64

diffusers_logging.set_verbosity_error()
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

TOL = 1e-5
# scheduler/scheduler_config.json of Efficient-Large-Model/Sana_1600M_1024px_diffusers (4K: flow_shift 6.0)
SANA = {"_class_name": "DPMSolverMultistepScheduler", "algorithm_type": "dpmsolver++", "beta_end": 0.02,
        "beta_schedule": "linear", "beta_start": 0.0001, "dynamic_thresholding_ratio": 0.995, "euler_at_final": False,
        "final_sigmas_type": "zero", "flow_shift": 3.0, "lambda_min_clipped": -float("inf"), "lower_order_final": True,
        "num_train_timesteps": 1000, "prediction_type": "flow_prediction", "rescale_betas_zero_snr": False,
        "sample_max_value": 1.0, "solver_order": 2, "solver_type": "midpoint", "steps_offset": 0,
        "thresholding": False, "timestep_spacing": "linspace", "trained_betas": None, "use_beta_sigmas": False,
        "use_exponential_sigmas": False, "use_flow_sigmas": True, "use_karras_sigmas": False, "use_lu_lambdas": False,
        "variance_type": None}  # fmt: skip


def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A smooth nonlinear stand-in for the transformer; t (B,) model timesteps."""
    s = (torch.as_tensor(t).float() / 1000).reshape(-1, *(1,) * (x.dim() - 1))
    return 0.5 * torch.tanh(x) + 0.3 * torch.cos(3 * s) + 0.2 * x * torch.sin(5 * s)


def _diffusers(cfg: dict, steps: int, float64: bool = False) -> DPMSolverMultistepScheduler:
    sched = DPMSolverMultistepScheduler.from_config(cfg)
    sched.set_timesteps(steps)
    if float64:
        sched.sigmas = sched.sigmas.double()
    return sched


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("shift", [1.0, 3.0, 6.0])
def test_the_grid_is_diffusers_bit_for_bit_at_every_step_count(shift):
    cfg = {**SANA, "flow_shift": shift}
    schedule = NoiseSchedule.from_config(cfg)
    for n in range(1, max_steps("flow_dpmpp_2m", Grid.of(cfg)) + 1):
        sched = _diffusers(cfg, n)
        t, s = flow_dpm_sigmas(schedule, n)
        assert torch.equal(t, sched.timesteps.double()), n
        assert torch.equal(s, sched.sigmas.double()), n


@pytest.mark.parametrize("shift", [1.0, 3.0, 6.0])
@pytest.mark.parametrize("steps", [1, 2, 3, 7, 20, 50])
def test_each_step_matches_diffusers(shift, steps):
    cfg = {**SANA, "flow_shift": shift}
    plan = make_plan("flow_dpmpp_2m", steps, NoiseSchedule.from_config(cfg))
    stock, exact = _diffusers(cfg, steps), _diffusers(cfg, steps, float64=True)
    assert torch.equal(plan.timesteps, stock.timesteps.float())
    x0 = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    ours, hist = x0.clone(), torch.zeros_like(x0)
    x, x64 = x0.clone(), x0.double().as_subclass(_KeepFloat64)
    for i, t in enumerate(stock.timesteps):
        coeffs = plan.coeffs[i].expand(len(x0), -1)
        v = velocity(model_input(ours, coeffs), plan.timesteps[i].expand(len(x0)))
        ours, hist = sampler_step(ours, v, hist, torch.zeros_like(ours), coeffs)
        x = stock.step(velocity(x, t.expand(len(x0))), t, x).prev_sample
        x64 = exact.step(velocity(x64.as_subclass(torch.Tensor).float(), t.expand(len(x0))), t, x64).prev_sample
        reference = x64.as_subclass(torch.Tensor)
        assert _rel(ours, reference) <= TOL, i
        assert _rel(ours, x) <= TOL, i
    assert exact.step_index == steps  # every step taken, none skipped


def test_the_last_step_lands_on_the_data_prediction():
    """final_sigmas_type "zero": the last step is first order to sigma 0, x = D = x - sigma v."""
    plan = make_plan("flow_dpmpp_2m", 20, NoiseSchedule.from_config(SANA))
    c = dict(zip(("c_in", "c_skip", "c_out", "clip", "c_x", "c_e", "c_d", "c_h", "c_z"), plan.coeffs[-1].tolist()))
    assert (c["c_x"], c["c_e"], c["c_d"], c["c_h"], c["c_z"]) == (0.0, 0.0, 1.0, 0.0, 0.0)
    assert plan.coeffs[0, 7] == 0 and (plan.coeffs[1:-1, 7] < 0).all()  # first order first, then 2M (c_h)
    assert plan.init_sigma == 1.0 and not plan.stochastic


@pytest.mark.parametrize("shift, bound", [(1.0, 1000), (3.0, 500), (6.0, 200)])
def test_step_counts_whose_first_two_timesteps_coincide_are_refused(shift, bound):
    """Past ``bound`` steps the grid's first two timesteps truncate to the same integer (999): diffusers then starts
    its count at the second (index_for_timestep) and fails at the last step. The rule refuses them, naming the bound."""
    cfg = {**SANA, "flow_shift": shift}
    grid = Grid.of(cfg)
    assert max_steps("flow_dpmpp_2m", grid) == bound
    check_plan("flow_dpmpp_2m", bound, 0.0, grid)
    if bound == 1000:
        return
    over = _diffusers(cfg, bound + 1)
    assert over.timesteps[0] == over.timesteps[1] == 999
    x = torch.zeros(1, 1, 2, 2)
    with pytest.raises(IndexError):
        for t in over.timesteps:
            x = over.step(velocity(x, t.expand(1)), t, x).prev_sample
    with pytest.raises(ValueError, match=f"flow_dpmpp_2m with {bound + 1} steps on this model's flow sigma grid is "
                                         f"degenerate: it puts its first two timesteps at the same integer \\(999\\); "
                                         f"use at most {bound} steps"):
        make_plan("flow_dpmpp_2m", bound + 1, NoiseSchedule.from_config(cfg))


@pytest.mark.parametrize("steps", [1, 4, 20])
def test_flow_euler_on_the_config_is_flow_match_euler_at_the_flow_shift(steps):
    """What a Sana pipeline given FlowMatchEulerDiscreteScheduler(shift=flow_shift) samples, bit for bit."""
    ref = FlowMatchEulerDiscreteScheduler(shift=SANA["flow_shift"])
    ref.set_timesteps(steps)
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    plan = make_plan("flow_euler", steps, NoiseSchedule.from_config(SANA))
    ours = sample(velocity, x, plan)
    for t in ref.timesteps:
        x = ref.step(velocity(x, t.expand(len(x))), t, x).prev_sample
    assert torch.equal(plan.timesteps, ref.timesteps) and torch.equal(ours, x)


def test_flow_prediction_belongs_to_flow_sigmas_and_to_the_flow_samplers():
    with pytest.raises(ValueError, match="'flow_prediction' goes with use_flow_sigmas"):
        NoiseSchedule(prediction_type="flow_prediction")
    with pytest.raises(ValueError, match="'flow_prediction' goes with use_flow_sigmas"):
        NoiseSchedule(prediction_type="epsilon", use_flow_sigmas=True)
    for name in ("dpmpp_2m", "ddim", "euler"):
        with pytest.raises(ValueError, match="supports prediction_type"):
            make_plan(name, 10, NoiseSchedule.from_config(SANA))
    with pytest.raises(ValueError, match="supports prediction_type flow_prediction"):
        make_plan("flow_dpmpp_2m", 10, NoiseSchedule(prediction_type="flow"))  # a FlowMatchEuler config: no DPM grid
