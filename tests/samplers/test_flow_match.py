"""flow_euler as Stable Diffusion 3 / 3.5 and FLUX.1 sample: whole trajectories against diffusers'
FlowMatchEulerDiscreteScheduler, called the way each pipeline calls it (diffusers 0.42).

  StableDiffusion3Pipeline: retrieve_timesteps(scheduler, n), i.e. set_timesteps(n); mu only with dynamic
                            shifting.
  FluxPipeline:             retrieve_timesteps(scheduler, n, sigmas=np.linspace(1, 1/n, n), mu=calculate_shift(
                            image_seq_len, ...)), image_seq_len = latents.shape[1] of the packed
                            (B, (h/2)(w/2), 4C) latents; the transformer gets timestep / 1000.

The references call the pipeline modules' own retrieve_timesteps and calculate_shift; the last tests run the
real pipelines end to end on tiny random transformers. Same velocity model, same initial latents on both
sides. Trajectories must agree to 1e-5 relative to the reference's largest value (test_vs_diffusers' bound);
timesteps, which the model sees, bit for bit. Every case here is in fact bit-equal: flow_sigmas repeats
diffusers' float32/float64 arithmetic, and the Euler step x + (sigma_next - sigma) v is the same float32 sum.
"""
import inspect
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
from diffusers.pipelines.flux import pipeline_flux as flux
from diffusers.pipelines.stable_diffusion_3 import pipeline_stable_diffusion_3 as sd3
from diffusers.utils import logging as diffusers_logging

from samplers import NoiseSchedule, cfg_combine, flow_mu, make_plan, sample
from samplers.rules import FLOW_SHIFT_DEFAULTS
from samplers.schedules import flow_sigmas

diffusers_logging.set_verbosity_error()

TOL = 1e-5
# scheduler/scheduler_config.json of the checkpoints
SD35 = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.31.0.dev0",
        "num_train_timesteps": 1000, "shift": 3.0}  # fmt: skip
FLUX_DEV = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.30.0.dev0",
            "base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
            "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True}  # fmt: skip
FLUX_SCHNELL = {**FLUX_DEV, "shift": 1.0, "use_dynamic_shifting": False}
RESAVED = {"invert_sigmas": False, "shift_terminal": None, "use_karras_sigmas": False, "use_exponential_sigmas": False,
           "use_beta_sigmas": False, "time_shift_type": "exponential", "stochastic_sampling": False}  # fmt: skip
# what a pipeline that is not FluxPipeline cannot tell from the file: schnell's grid is FluxPipeline's
SCHNELL_SCHEDULE = NoiseSchedule.from_config({**FLUX_SCHNELL, "flow_grid": "flux"})


def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A smooth nonlinear stand-in for the transformer; t (B,) model timesteps, seen as t / 1000 as FLUX does."""
    s = (t / 1000).view(-1, *(1,) * (x.dim() - 1))
    return 0.5 * torch.tanh(x) + 0.3 * torch.cos(3 * s) + 0.2 * x * torch.sin(5 * s)


def reference(cfg: dict, steps: int, x: torch.Tensor, *, flux_pipeline: bool, mu: float | None = None):
    """diffusers' final x and timesteps; flux_pipeline: FluxPipeline's set-up (mu from x.shape[1]), else SD3's."""
    sched = FlowMatchEulerDiscreteScheduler.from_config(cfg)
    if flux_pipeline:
        c = sched.config
        mu = flux.calculate_shift(x.shape[1], c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                                  c.get("base_shift", 0.5), c.get("max_shift", 1.15))  # fmt: skip
        flux.retrieve_timesteps(sched, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    else:
        sd3.retrieve_timesteps(sched, steps, "cpu", **({} if mu is None else {"mu": mu}))
    for t in sched.timesteps:
        x = sched.step(velocity(x, t.expand(len(x))), t, x).prev_sample
    return x, sched.timesteps


def ours(schedule: NoiseSchedule, steps: int, x: torch.Tensor, mu: float | None = None):
    plan = make_plan("flow_euler", steps, schedule, mu=mu)
    return sample(velocity, x, plan), plan.timesteps


def packed_latents(h: int, w: int, seed: int = 0) -> torch.Tensor:
    """FLUX's initial latents for h x w VAE latents (16 channels): (1, (h/2)(w/2), 64)."""
    x = torch.randn(1, 16, h, w, generator=torch.Generator().manual_seed(seed))
    return FluxPipeline._pack_latents(x, 1, 16, h, w)


def assert_same(got, want):
    (x, t), (x_ref, t_ref) = got, want
    assert torch.equal(t, t_ref)
    assert ((x - x_ref).abs().max() / x_ref.abs().max()).item() <= TOL


@pytest.mark.parametrize("cfg", [SD35, {**SD35, **RESAVED}], ids=["sd35", "sd35-resaved"])
@pytest.mark.parametrize("steps", [1, 4, 28, 40])
def test_sd35(cfg, steps):
    x = torch.randn(2, 16, 8, 12, generator=torch.Generator().manual_seed(0))
    assert_same(ours(NoiseSchedule.from_config(cfg), steps, x), reference(cfg, steps, x, flux_pipeline=False))


@pytest.mark.parametrize("h, w", [(32, 32), (64, 64), (128, 128), (64, 96)])  # 256, 1024, 4096, 1536 tokens
@pytest.mark.parametrize("steps", [1, 4, 28, 50])
def test_flux_dev(h, w, steps):
    x = packed_latents(h, w)
    mu = flow_mu((h // 2) * (w // 2), FLUX_DEV)
    want = reference(FLUX_DEV, steps, x, flux_pipeline=True)
    assert_same(ours(NoiseSchedule.from_config(FLUX_DEV), steps, x, mu), want)


@pytest.mark.parametrize("h, w", [(64, 64), (128, 128)])
@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_flux_schnell(h, w, steps):
    """FluxPipeline computes and passes mu for schnell too; without dynamic shifting both sides ignore it."""
    x = packed_latents(h, w)
    mu = flow_mu((h // 2) * (w // 2), FLUX_SCHNELL)
    assert_same(ours(SCHNELL_SCHEDULE, steps, x, mu), reference(FLUX_SCHNELL, steps, x, flux_pipeline=True))


def test_schnell_needs_the_flux_grid():
    """The file alone gives the set_timesteps(n) grid, which is SD3's: the same at 1 step, not after."""
    plain = NoiseSchedule.from_config(FLUX_SCHNELL)
    assert torch.equal(flow_sigmas(plain, 1), flow_sigmas(SCHNELL_SCHEDULE, 1))
    assert flow_sigmas(plain, 4).tolist() == pytest.approx([1, 2 / 3 + 1 / 3000, 1 / 3 + 2 / 3000, 0.001], abs=1e-6)
    assert flow_sigmas(SCHNELL_SCHEDULE, 4).tolist() == pytest.approx([1, 0.75, 0.5, 0.25], abs=1e-6)


@pytest.mark.parametrize("steps", [2, 4, 28])
@pytest.mark.parametrize(
    "extra, flux_pipeline",
    [
        ({**FLUX_DEV, "time_shift_type": "linear"}, True),
        ({**FLUX_DEV, "shift_terminal": 0.1}, True),
        ({**SD35, "shift_terminal": 0.1}, False),
        ({**FLUX_DEV, "flow_grid": "scheduler"}, False),  # StableDiffusion3Pipeline with a dynamic config
    ],
    ids=["linear-shift", "terminal-flux-grid", "terminal-sd3", "dynamic-sd3-grid"],
)
def test_other_flow_options(extra, flux_pipeline, steps):
    x = packed_latents(64, 96)
    schedule = NoiseSchedule.from_config(extra)
    mu = flow_mu(x.shape[1], extra)
    cfg = {k: v for k, v in extra.items() if k != "flow_grid"}
    assert_same(ours(schedule, steps, x, mu), reference(cfg, steps, x, flux_pipeline=flux_pipeline, mu=mu))


def test_missing_mu_is_a_clear_error():
    with pytest.raises(ValueError, match=r"needs mu, the shift for the image size; samplers.rules.flow_mu"):
        make_plan("flow_euler", 28, NoiseSchedule.from_config(FLUX_DEV))


@pytest.mark.parametrize(
    "mu, time_shift_type, match",
    [(math.nan, "exponential", "finite"), (math.inf, "exponential", "finite"), ("0.8", "exponential", "finite"),
     (True, "exponential", "finite"), (100.0, "exponential", "at most 80"), (0.0, "linear", "positive")],
)  # fmt: skip
def test_bad_mu_is_refused(mu, time_shift_type, match):
    schedule = NoiseSchedule.from_config({**FLUX_DEV, "time_shift_type": time_shift_type})
    with pytest.raises(ValueError, match=match):
        make_plan("flow_euler", 28, schedule, mu=mu)


def test_mu_is_ignored_where_unused():
    """As diffusers: a schedule without dynamic shifting ignores mu; so do the other samplers."""
    for name, schedule in [("flow_euler", NoiseSchedule.from_config(SD35)), ("ddim", NoiseSchedule())]:
        a, b = make_plan(name, 10, schedule), make_plan(name, 10, schedule, mu=0.9)
        assert torch.equal(a.timesteps, b.timesteps) and torch.equal(a.coeffs, b.coeffs)


def test_shift_terminal_needs_two_steps():
    """1 - sigma_last is 0 at one step: diffusers divides by it (NaN sigmas)."""
    with pytest.raises(ValueError, match="degenerate"):
        make_plan("flow_euler", 1, NoiseSchedule.from_config({**SD35, "shift_terminal": 0.1}))


@pytest.mark.parametrize(
    "cfg, expected",
    [
        (SD35, {"prediction_type": "flow", "shift": 3.0, "use_dynamic_shifting": False}),
        ({**SD35, **RESAVED}, {"prediction_type": "flow", "shift": 3.0, "shift_terminal": None}),
        (FLUX_DEV, {"prediction_type": "flow", "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
                    "base_image_seq_len": 256, "max_image_seq_len": 4096, "time_shift_type": "exponential"}),
        ({**FLUX_DEV, **RESAVED}, {"use_dynamic_shifting": True}),
        (FLUX_SCHNELL, {"shift": 1.0, "use_dynamic_shifting": False, "flow_grid": None}),
    ],
    ids=["sd35", "sd35-resaved", "flux-dev", "flux-dev-resaved", "flux-schnell"],
)  # fmt: skip
def test_from_config_reads_the_real_configs(cfg, expected):
    schedule = NoiseSchedule.from_config(cfg)
    assert {k: getattr(schedule, k) for k in expected} == expected


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"invert_sigmas": True}, "do not implement"),
        ({"stochastic_sampling": True}, "do not implement"),
        ({"use_karras_sigmas": True}, "do not implement"),
        ({"use_exponential_sigmas": True}, "do not implement"),
        ({"use_beta_sigmas": True}, "do not implement"),
        ({"time_shift_type": "cubic"}, "time_shift_type must be one of exponential, linear"),
        ({"shift_terminal": 1.0}, "shift_terminal must be between 0 and 1"),
        ({"flow_grid": "karras"}, "flow_grid must be one of scheduler, flux"),
    ],
)
def test_from_config_refuses_what_it_cannot_reproduce(extra, match):
    with pytest.raises(ValueError, match=match):
        NoiseSchedule.from_config({**FLUX_DEV, **extra})


@pytest.mark.parametrize("cfg", [FLUX_DEV, {}, {"base_shift": 0.3, "max_shift": 1.7, "max_image_seq_len": 8192}])
@pytest.mark.parametrize("seq_len", [1, 256, 1024, 1536, 4096, 16384])
def test_flow_mu_is_calculate_shift(cfg, seq_len):
    """Bit for bit, extrapolation included; keys left out take the scheduler's defaults, as FluxPipeline reads them."""
    c = FlowMatchEulerDiscreteScheduler.from_config(cfg).config
    want = flux.calculate_shift(seq_len, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    assert flow_mu(seq_len, cfg) == want


@pytest.mark.parametrize(
    "seq_len, cfg, match",
    [(0, FLUX_DEV, "image_seq_len"), (1.5, FLUX_DEV, "image_seq_len"), (True, FLUX_DEV, "image_seq_len"),
     (1024, {"max_image_seq_len": 256}, "must differ"), (1024, {"max_shift": None}, "must be numbers")],
)  # fmt: skip
def test_flow_mu_refuses(seq_len, cfg, match):
    with pytest.raises(ValueError, match=match):
        flow_mu(seq_len, cfg)


def test_defaults_are_the_diffusers_class_defaults():
    """A key a config leaves out means what FlowMatchEulerDiscreteScheduler's __init__ default says."""
    theirs = {k: p.default for k, p in inspect.signature(FlowMatchEulerDiscreteScheduler.__init__).parameters.items()}
    mine = NoiseSchedule()
    shared = ["num_train_timesteps", "shift", "use_dynamic_shifting", "base_shift", "max_shift", "base_image_seq_len",
              "max_image_seq_len", "time_shift_type", "shift_terminal"]  # fmt: skip
    assert {k: getattr(mine, k) for k in shared} == {k: theirs[k] for k in shared}
    assert FLOW_SHIFT_DEFAULTS == {k: theirs[k] for k in FLOW_SHIFT_DEFAULTS}


def test_flow_mu_imports_without_torch():
    code = "import sys, samplers.rules; samplers.rules.flow_mu(1024, {}); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- the real pipelines, end to end: tiny random transformers, prompt embeddings given, output_type "latent"


@torch.no_grad()
@pytest.mark.parametrize(
    "cfg, schedule, steps",
    [(FLUX_DEV, NoiseSchedule.from_config(FLUX_DEV), 28), (FLUX_SCHNELL, SCHNELL_SCHEDULE, 4)],
    ids=["dev", "schnell"],
)
def test_flux_pipeline_end_to_end(cfg, schedule, steps):
    """64 x 96 latents (512 x 768 pixels): 1536 tokens; guidance is FLUX-dev's embedded guidance."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    net = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                 axes_dims_rope=[4, 4, 8], guidance_embeds=True).eval()  # fmt: skip
    none = dict.fromkeys(["vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"])
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(cfg), transformer=net, **none)
    pipe.set_progress_bar_config(disable=True)
    h, w = 64, 96
    gen = torch.Generator().manual_seed(0)
    text, pooled = torch.randn(1, 7, 32, generator=gen), torch.randn(1, 32, generator=gen)
    x = FluxPipeline._pack_latents(torch.randn(1, 1, h, w, generator=gen), 1, 1, h, w)  # (1, 1536, 4)
    want = pipe(prompt_embeds=text, pooled_prompt_embeds=pooled, height=8 * h, width=8 * w, guidance_scale=3.5,
                num_inference_steps=steps, latents=x, output_type="latent").images  # fmt: skip

    img_ids = FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, "cpu", torch.float32)

    def model(x_in, t):
        guidance = torch.full((len(x_in),), 3.5)
        return net(hidden_states=x_in, timestep=t / 1000, guidance=guidance, pooled_projections=pooled,
                   encoder_hidden_states=text, txt_ids=torch.zeros(7, 3), img_ids=img_ids,
                   return_dict=False)[0]  # fmt: skip

    plan = make_plan("flow_euler", steps, schedule, mu=flow_mu((h // 2) * (w // 2), cfg))
    got = sample(model, x, plan)
    assert ((got - want).abs().max() / want.abs().max()).item() <= TOL


@torch.no_grad()
def test_sd3_pipeline_end_to_end():
    """SD3.5's schedule, 28 steps, classifier-free guidance 4.5 on a batch of [uncond, cond] as the pipeline runs it."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(0)
    net = SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                                num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
                                pooled_projection_dim=64, out_channels=4).eval()  # fmt: skip
    none = dict.fromkeys(["vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3",
                          "tokenizer_3"])  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(SD35)
    pipe = StableDiffusion3Pipeline(scheduler=scheduler, transformer=net, **none)
    pipe.set_progress_bar_config(disable=True)
    h, w, steps, guidance = 16, 24, 28, 4.5
    gen = torch.Generator().manual_seed(0)
    text, neg = torch.randn(2, 1, 7, 32, generator=gen)
    pooled, neg_pooled = torch.randn(2, 1, 64, generator=gen)
    x = torch.randn(1, 4, h, w, generator=gen)
    want = pipe(prompt_embeds=text, negative_prompt_embeds=neg, pooled_prompt_embeds=pooled,
                negative_pooled_prompt_embeds=neg_pooled, height=8 * h, width=8 * w, num_inference_steps=steps,
                guidance_scale=guidance, latents=x, output_type="latent").images  # fmt: skip

    def model(x_in, t):
        out = net(hidden_states=torch.cat([x_in, x_in]), timestep=torch.cat([t, t]),
                  encoder_hidden_states=torch.cat([neg, text]), pooled_projections=torch.cat([neg_pooled, pooled]),
                  return_dict=False)[0]  # fmt: skip
        uncond, cond = out.chunk(2)
        return cfg_combine(cond, uncond, torch.full((len(x_in),), guidance))

    got = sample(model, x, make_plan("flow_euler", steps, NoiseSchedule.from_config(SD35)))
    assert ((got - want).abs().max() / want.abs().max()).item() <= TOL


@pytest.mark.parametrize("tokens", [16, 1024, 4096, 4800])  # 4800: past compute_empirical_mu's 4300-token break
@pytest.mark.parametrize("steps", [1, 4, 28, 50])
def test_a_mu_of_the_step_count(tokens, steps):
    """FLUX.2's pipelines: FluxPipeline's sigma grid, shifted by compute_empirical_mu(image_seq_len, num_steps),
    which depends on the step count too: make_plan takes mu as a function of it and calls it with num_steps."""
    from diffusers.pipelines.flux2 import pipeline_flux2 as flux2

    x = torch.randn(1, tokens, 8, generator=torch.Generator().manual_seed(0))
    sched = FlowMatchEulerDiscreteScheduler.from_config(FLUX_DEV)
    flux2.retrieve_timesteps(sched, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps),
                             mu=flux2.compute_empirical_mu(tokens, steps))
    want = x
    for t in sched.timesteps:
        want = sched.step(velocity(want, t.expand(len(want))), t, want).prev_sample
    got = ours(NoiseSchedule.from_config({**FLUX_DEV, "flow_grid": "flux"}), steps, x,
               lambda n: flux2.compute_empirical_mu(tokens, n))
    assert_same(got, (want, sched.timesteps))
