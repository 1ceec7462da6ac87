"""A latent DiT (DiT-XL/2's layout: a DiT transformer with an AutoencoderKL, ``workers.models.tiny_dit``: small
random weights, safetensors, made here) edits images by the rule of StableDiffusionImg2ImgPipeline and
StableDiffusionInpaintPipeline. diffusers has no DiT img2img or inpaint pipeline, and DiTPipeline takes neither
latents nor a callback, so the reference is the rule written out over the DiT transformer and diffusers' own
schedulers (as ``tests/workers/test_edits.py`` does for the pixel-space ``digits``): the VAE posterior's sample
drawn from the request's generator, the noise after it, ``add_noise`` at the first timestep ``get_timesteps``
keeps, each step CFG-combined against the null class on the eps half of the learned-sigma output, and the
inpainting blend after each step. Float32 on the CPU; tolerance as ``edit_cases``."""

from __future__ import annotations

import pytest
import torch

from workers.config import WorkerConfig
from workers.engine import Engine
from workers.loading import load_model
from workers.models.tiny_dit import write_tiny_dit
from workers.request.spec import ItemSpec

from . import edit_cases

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # DPM-Solver's numpy

EAGER = WorkerConfig(backend="eager", max_batch=8)
SCHEDULERS = {"ddim": "DDIMScheduler", "dpmpp_2m": "DPMSolverMultistepScheduler"}
STEPS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("dit") / "DiT-XL-2-256"
    write_tiny_dit(root)
    return load_model(root)


def _spec(i: int, sampler: str, strength: float, mask: bool = False) -> ItemSpec:
    return ItemSpec(id=f"r{i}", seed=300 + i, label=(7, 207, 999)[i % 3], sampler=sampler, steps=STEPS,
                    guidance=3.0, image=edit_cases.image_bytes(seed=i), strength=strength,
                    mask=edit_cases.mask_bytes() if mask else b"")


def _scheduler(model, spec: ItemSpec):
    """``spec``'s sampler's scheduler, its timesteps set, on the model's one schedule: the DDIM config as
    DDIMScheduler reads it, its defaults filled in (timestep_spacing "leading"), as the card reads it. (Given the
    config as it is, ``from_config`` drops the keys left at DDIM's defaults, ``_use_default_values``, and
    DPM-Solver would space its own way, "linspace".)"""
    import diffusers

    own = diffusers.DDIMScheduler.from_config(model.card.scheduler).config
    config = {k: v for k, v in own.items() if k != "_use_default_values"}
    scheduler = getattr(diffusers, SCHEDULERS[spec.sampler]).from_config(config)
    scheduler.set_timesteps(spec.steps)
    return scheduler


def _reference(model, spec: ItemSpec) -> dict:
    """The rule over diffusers' scheduler: the cut timesteps, the clean latents x0 (1, C, h, w) (None for a
    text-to-image row: noise alone, all steps), the noise, the mask on the latent grid (None without one), the
    starting latents and, per step, the latents after it."""
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3_img2img import retrieve_latents

    scheduler = _scheduler(model, spec)
    start = edit_cases.start_of(spec.steps, spec.strength)
    if hasattr(scheduler, "set_begin_index"):  # DPM-Solver: its add_noise and step index from there
        scheduler.set_begin_index(start)
    timesteps = scheduler.timesteps[start:]
    size, shape = model.card.image_size, (1, *model.latent_shape)
    gen = edit_cases.generator(spec)
    x0 = mask = None
    if spec.image:
        image = edit_cases.pipeline_image(spec, size, size)                              # (1, 3, 16, 16)
        with torch.no_grad():
            x0 = retrieve_latents(model.vae.encode(image), generator=gen) * model.vae.config.scaling_factor
    noise = torch.randn(shape, generator=gen)                                            # (1, 4, 8, 8)
    if spec.mask:
        mask = torch.nn.functional.interpolate(edit_cases.pipeline_mask(spec, size, size), size=shape[-2:])
    if x0 is None or mask is not None and spec.strength == 1:  # text; the inpaint pipeline's is_strength_max
        x = noise * scheduler.init_noise_sigma
    else:
        x = edit_cases.noised(scheduler, x0, noise, timesteps[0])
    out = {"timesteps": timesteps, "x0": x0, "noise": noise[0], "mask": mask, "start": x[0], "steps": []}
    labels = torch.tensor([spec.label, model.null_class])
    c = shape[1]
    with torch.no_grad():
        for i, t in enumerate(timesteps):
            xin = scheduler.scale_model_input(torch.cat([x, x]), t)                     # (2, 4, 8, 8)
            eps = model.transformer(xin, t.expand(2), labels).sample[:, :c]             # learned sigma dropped
            cond, uncond = eps.chunk(2)
            x = scheduler.step(uncond + spec.guidance * (cond - uncond), t, x).prev_sample
            if mask is not None:  # the blend: x0 noised to the next timestep, the last step x0 itself
                proper = edit_cases.noised(scheduler, x0, noise, timesteps[i + 1]) if i + 1 < len(timesteps) else x0
                x = (1 - mask) * proper + mask * x
            out["steps"].append(x[0])
    return out


def _active(engine: Engine, request_id: str):
    return next(a for g in engine.groups.values() for a in g.active if a.req.id == request_id)


@pytest.mark.parametrize("sampler", list(SCHEDULERS))
@pytest.mark.parametrize("strength", edit_cases.STRENGTHS)
def test_image_to_image_starts_at_the_cut_step_and_follows_the_sd_img2img_rule(model, sampler, strength):
    """Of STEPS=8, strength s starts at int(8 - 8 s): 0.3 at step 5 (3 steps run), 0.6 at step 3 (5 steps), 1.0 at
    step 0 (all 8). The plan's timesteps are the scheduler's from there; the first latents are x0 noised to the
    first of them; the last are the rule's."""
    spec = _spec(0, sampler, strength)
    ref = _reference(model, spec)
    engine = Engine(model, EAGER)
    engine.add(spec)
    row = _active(engine, spec.id)
    kept = STEPS - edit_cases.start_of(STEPS, strength)
    assert kept == {0.3: 3, 0.6: 5, 1.0: 8}[strength]
    assert engine.progress() == {spec.id: (0, kept)}
    assert torch.equal(row.rows[:, 0].long(), ref["timesteps"].long())  # the plan's timesteps: the cut schedule
    edit_cases.assert_close(row.x, ref["start"], "start")  # a x0 + b noise at its first kept timestep
    if strength < 1:  # the image shows through: not the noise alone
        assert (ref["start"] - ref["noise"]).abs().max() > 0.1
    done = {}
    while engine.num_active:
        done.update({r.request.id: r for r in engine.step()})
    assert engine.steps_run == kept
    edit_cases.assert_close(done[spec.id].latents, ref["steps"][-1], spec.id)


@pytest.mark.parametrize("sampler", list(SCHEDULERS))
@pytest.mark.parametrize("strength", edit_cases.STRENGTHS)
def test_inpainting_keeps_the_unmasked_region_on_the_images_renoising_each_step(model, sampler, strength):
    """After each step, outside the mask (the left half) the latents are x0 noised to the next kept timestep
    (after the last: x0 itself); inside, what the model made; the whole equals the rule's step."""
    spec = _spec(1, sampler, strength, mask=True)
    ref = _reference(model, spec)
    keep = 1 - ref["mask"][0]                                                       # (1, 8, 8), 1 = keep
    assert keep[..., :4].eq(1).all() and keep[..., 4:].eq(0).all()  # the right half repaints
    engine = Engine(model, EAGER)
    engine.add(spec)
    row = _active(engine, spec.id)
    kept = len(ref["timesteps"])
    assert engine.progress() == {spec.id: (0, kept)}
    edit_cases.assert_close(row.x, ref["start"], "start")
    scheduler = _scheduler(model, spec)
    for i in range(kept):
        result = engine.step()
        x = result[0].latents if result else row.x
        edit_cases.assert_close(x, ref["steps"][i], f"step {i}")
        if i + 1 < kept:
            proper = edit_cases.noised(scheduler, ref["x0"], ref["noise"][None], ref["timesteps"][i + 1])[0]
        else:
            proper = ref["x0"][0]
        edit_cases.assert_close(keep * x, keep * proper, f"kept region, step {i}")
        assert ((1 - keep) * (x - proper)).abs().max() > 1e-2  # the masked half is the model's, not the image's
    assert engine.num_active == 0


def test_edits_batched_with_text_rows_each_follow_the_rule_alone(model):
    """Image-to-image and inpainting rows of both samplers at different strengths, with a text-to-image row, in
    one engine: each row's final latents equal its reference run alone (inpainting rows in groups of their own)."""
    specs = [_spec(0, "ddim", 0.5), _spec(1, "ddim", 0.75, mask=True), _spec(2, "dpmpp_2m", 0.4),
             _spec(3, "dpmpp_2m", 1.0, mask=True),
             ItemSpec(id="t", seed=9, label=360, sampler="ddim", steps=STEPS, guidance=3.0)]
    for spec, r in zip(specs, Engine(model, EAGER).generate(specs)):
        edit_cases.assert_close(r.latents, _reference(model, spec)["steps"][-1], spec.id)
