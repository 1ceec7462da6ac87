"""Image-to-image and inpainting in the engine (``workers.edits``), on the shipped ``digits`` model (pixel-space DiT,
DDIM): the rule against a reference loop over diffusers' scheduler, what is refused and that nothing is admitted
then, the inpainting rows' own groups, the admission batch's one encode, the cut plan's progress, warm-up
examples, and what the cards say. The families' equivalence with diffusers' img2img and inpaint pipelines is in
``tests/workers/families/test_<family>.py``."""

from __future__ import annotations

import pytest
import torch

from workers.config import WorkerConfig
from workers.edits import EDIT_INPUTS
from workers.engine import Engine, step_specs
from workers.families import FAMILIES, family_of
from workers.loading import load_model
from workers.request.cards import read_card
from workers.request.images import ImageError
from workers.request.spec import ItemSpec

from .families import edit_cases

EAGER = WorkerConfig(backend="eager", max_batch=8)


@pytest.fixture(scope="module")
def digits():
    return load_model("digits")


def _spec(i: int = 0, **kw) -> ItemSpec:
    base = dict(id=f"r{i}", seed=100 + i, label=3, sampler="ddim", steps=10, guidance=2.0,
                image=edit_cases.image_bytes(8, 8, seed=i), strength=0.6)
    return ItemSpec(**{**base, **kw})


def _reference(model, spec: ItemSpec) -> torch.Tensor:
    """StableDiffusionImg2ImgPipeline's and StableDiffusionInpaintPipeline's rule, written out over DDIMScheduler
    and the DiT transformer (DiTPipeline takes neither latents nor a callback): the pixels' luma, the noise from the
    request's generator, add_noise at the cut's first timestep (inpainting at strength 1: the noise), each step
    CFG-combined against the null class, and the blend after each step."""
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler.from_config(model.card.scheduler)
    scheduler.set_timesteps(spec.steps)
    start = edit_cases.start_of(spec.steps, spec.strength)
    timesteps = scheduler.timesteps[start:]
    image = edit_cases.pipeline_image(spec, 8, 8)
    x0 = (image * torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)).sum(1, keepdim=True)     # (1, 1, 8, 8)
    noise = torch.randn(x0.shape, generator=edit_cases.generator(spec))
    x = noise if spec.mask and spec.strength == 1 else scheduler.add_noise(x0, noise, timesteps[:1])
    mask = None
    if spec.mask:
        mask = torch.nn.functional.interpolate(edit_cases.pipeline_mask(spec, 8, 8), size=(8, 8))
    labels = torch.tensor([spec.label, model.null_class])
    with torch.no_grad():
        for i, t in enumerate(timesteps):
            out = model.transformer(torch.cat([x, x]), t.expand(2), labels).sample[:, :1]
            cond, uncond = out.chunk(2)
            x = scheduler.step(uncond + spec.guidance * (cond - uncond), t, x).prev_sample
            if mask is not None:
                proper = scheduler.add_noise(x0, noise, timesteps[i + 1:i + 2]) if i + 1 < len(timesteps) else x0
                x = (1 - mask) * proper + mask * x
    return x[0]


@pytest.mark.parametrize("strength", edit_cases.STRENGTHS)
def test_digits_edits_follow_the_sd_rule(digits, strength):
    mask = edit_cases.mask_bytes(8, 8)
    specs = [_spec(0, strength=strength), _spec(1, strength=strength, mask=mask, label=8)]
    for spec, r in zip(specs, Engine(digits, EAGER).generate(specs)):
        edit_cases.assert_close(r.latents, _reference(digits, spec), spec.id)


@pytest.mark.parametrize("change, message", [
    (dict(image=b"", mask=edit_cases.mask_bytes(8, 8)), "mask: a mask needs an image"),
    (dict(strength=0.0), "strength must be a number in \\(0, 1\\]"),
    (dict(strength=1.5), "strength must be a number in \\(0, 1\\]"),
    (dict(image=b"not an image"), "image: not a PNG, JPEG or WebP"),
    (dict(mask=b"\x89PNG broken"), "mask: not a PNG, JPEG or WebP"),
    (dict(mask=edit_cases.mask_bytes(6, 8)), "mask: 6x8 differs from the image's 8x8"),
    (dict(strength=1e-17), "strength 1e-17 of 10 steps leaves no step to run"),
])
def test_bad_edits_are_refused_and_nothing_is_admitted(digits, change, message):
    engine = Engine(digits, EAGER)
    with pytest.raises(ValueError, match=message):
        engine.add_many([_spec(0, image=b"", strength=1.0), _spec(1, **change)])
    assert engine.num_active == 0


def test_a_family_that_takes_no_image_refuses_one(digits, monkeypatch):
    monkeypatch.setattr(type(family_of(digits)), "takes_mask", False)
    with pytest.raises(ValueError, match="mask: model 'digits' \\(dit\\) does not inpaint"):
        Engine(digits, EAGER).add(_spec(0, mask=edit_cases.mask_bytes(8, 8)))
    monkeypatch.setattr(type(family_of(digits)), "takes_image", False)
    with pytest.raises(ValueError, match="image: model 'digits' \\(dit\\) does not take an input image"):
        Engine(digits, EAGER).add(_spec(0))
    assert issubclass(ImageError, ValueError)


def test_inpainting_rows_run_in_groups_of_their_own_and_edits_join_at_their_start(digits):
    engine = Engine(digits, EAGER)
    engine.add_many([_spec(0, image=b""), _spec(1, strength=0.3), _spec(2, mask=edit_cases.mask_bytes(8, 8))])
    assert engine.progress() == {"r0": (0, 10), "r1": (0, 3), "r2": (0, 6)}  # a cut plan's steps
    inpaint = [g for k, g in engine.groups.items() if k.variant == "inpaint"]
    plain = [g for k, g in engine.groups.items() if k.variant == ""]
    assert [a.req.id for g in inpaint for a in g.active] == ["r2"]
    assert sorted(a.req.id for g in plain for a in g.active) == ["r0", "r1"]  # img2img: the text rows' graphs
    assert set(step_specs(digits, inpaint[0].shape, "inpaint")[0]) - set(step_specs(digits)[0]) == set(EDIT_INPUTS)
    done = {}
    while engine.num_active:
        done.update({r.request.id: r for r in engine.step()})
    assert sorted(done) == ["r0", "r1", "r2"] and engine.steps_run == 10


def test_an_admission_batch_encodes_its_images_together(digits, monkeypatch):
    family = type(family_of(digits))
    calls = []
    real = family.encode_image
    monkeypatch.setattr(family, "encode_image", lambda self, model, pixels, generators=None:
                        calls.append((tuple(pixels.shape), len(generators))) or real(self, model, pixels, generators))
    engine = Engine(digits, EAGER)
    engine.add_many([_spec(0), _spec(1, mask=edit_cases.mask_bytes(8, 8)), _spec(2, image=b""), _spec(3)])
    assert calls == [((3, 3, 8, 8), 3)]  # one batch per admission and shape (inpainting rows too), a
    # generator per row


def test_the_warm_up_example_of_an_inpainting_step_has_its_inputs(digits):
    engine = Engine(digits, EAGER)
    example = engine.warmup_example(digits, tuple(digits.latent_shape), "inpaint")
    assert example["mask"].shape == (1, 1, 8, 8) and 0 < example["mask"].mean() < 1
    assert example["image_latents"].shape == example["image_noise"].shape == (1, 1, 8, 8)
    assert example["blend"].shape == (1, 2)
    engine.warmup()
    engine.add(_spec(0, mask=edit_cases.mask_bytes(8, 8)))  # its group made and warmed on first use
    assert any(k.variant == "inpaint" for k in engine.groups)
    while engine.num_active:
        engine.step()


def test_the_cards_say_which_edits_a_model_takes():
    card = read_card("digits")
    assert card.takes_image and card.takes_mask
    assert all(f.takes_image and f.takes_mask for f in FAMILIES.values())
    assert read_card("dit-xl-2-256").takes_image
