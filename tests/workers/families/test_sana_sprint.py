"""Sana Sprint through our engine equals diffusers' SanaSprintPipeline: a tiny random pipeline directory in the real
layout of Efficient-Large-Model/Sana_Sprint_1.6B_1024px_diffusers (model_index.json naming SanaSprintPipeline, a
sharded SanaTransformer2DModel with guidance_embeds and QK norms, SCMScheduler's config, Sana's Gemma-2, Gemma
tokenizer and DC-AE), made here offline from the tiny Sana directory; the same initial latents and per-step noise
(the request's generator, after its latents: the scheduler's fresh draw at every step); float32 on the CPU.

Tolerance: max |ours - reference| <= 1e-4 * max(1, max |reference|) on the final latents, as Sana's. The sampler
arithmetic is the scheduler's own (samplers.plans.scm: at sigma_data 0.5 the same float32 numbers); what differs is
the batch (rows of other requests, steps and guidance beside each one). Measured: equal alone (0), at most 4.8e-7
batched (largest values 2.3 to 3.9), at most 7.2e-7 for image-to-image (SanaSprintImg2ImgPipeline) and 1.2e-6 for
inpainting (the rule: that pipeline with the inpaint pipelines' blend). Decoded images: within one uint8 level of the
pipeline's (measured 0.5 of a level: the pipeline's float image against our rounded one).
"""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch

from workers.config import WorkerConfig
from workers.engine import Engine
from workers.families import family_named
from workers.families.sana import COMPLEX_HUMAN_INSTRUCTION
from workers.loading import load_model
from workers.models.tiny_sana import IMAGE_SIZE, MAX_TOKENS, make_tiny_sana_sprint
from workers.request.cards import CardError, read_card
from workers.request.spec import ItemSpec

from . import edit_cases

EAGER = WorkerConfig(backend="eager", max_batch=4)
LONG = "a red cat sitting on a wooden table at sunset with a small dog and a big green tree near the blue house"
TOL = 1e-4


@pytest.fixture(scope="module")
def sprint_dir(tmp_path_factory):
    return make_tiny_sana_sprint(tmp_path_factory.mktemp("sprint") / "sana-sprint-tiny")


@pytest.fixture(scope="module")
def model(sprint_dir):
    return load_model(sprint_dir)


def _spec(id: str, seed: int, steps: int, guidance: float = 4.5, prompt: str = "a red cat", **kw) -> ItemSpec:
    return ItemSpec(id=id, seed=seed, sampler="scm", steps=steps, guidance=guidance, prompt=prompt, **kw)


def _pipe(model, img2img: bool = False):
    """SanaSprintPipeline (or its img2img) from our loaded components and the card's SCMScheduler."""
    from diffusers import SanaSprintImg2ImgPipeline, SanaSprintPipeline, SCMScheduler

    cls = SanaSprintImg2ImgPipeline if img2img else SanaSprintPipeline
    pipe = cls(tokenizer=model.tokenizer, text_encoder=model.text_encoder, vae=model.vae.vae,
               transformer=model.transformer, scheduler=SCMScheduler.from_config(model.card.scheduler))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _reference(model, spec: ItemSpec, output_type: str = "latent") -> torch.Tensor:
    """The pipeline's output for one request: from the engine's initial latents (Engine._admit draws them from the
    request's generator), and that generator, now past them, for the scheduler's noise at each step."""
    width, height = spec.width or IMAGE_SIZE, spec.height or IMAGE_SIZE
    gen = torch.Generator("cpu").manual_seed(spec.seed)
    x = torch.randn(model.card.latent_shape(width, height), generator=gen)
    return _pipe(model)(spec.prompt, num_inference_steps=spec.steps, guidance_scale=spec.guidance, height=height,
                        width=width, latents=x[None], generator=gen,
                        intermediate_timesteps=1.3 if spec.steps == 2 else None,  # the pipeline's rule: 2 steps only
                        max_sequence_length=model.card.max_tokens, use_resolution_binning=False,
                        output_type=output_type).images[0]


def _assert_equal_to_pipeline(model, specs, results) -> list[float]:
    errs = []
    for spec, r in zip(specs, results):
        ref = _reference(model, spec)
        err = (r.latents - ref).abs().max().item()
        assert err <= TOL * max(1.0, ref.abs().max().item()), (spec.id, err)
        errs.append(err)
    return errs


def _layout_copy(src: Path, dst: Path, edit: dict) -> Path:
    """A copy of a pipeline directory with ``edit``: {"part/file.json": {key: value}} merged into those files."""
    shutil.copytree(src, dst)
    for file, keys in edit.items():
        cfg = json.loads((dst / file).read_text())
        (dst / file).write_text(json.dumps({**cfg, **keys}))
    return dst


# -- the card ------------------------------------------------------------------------------------------------
def test_the_card_reads_the_sprint_layout(sprint_dir, model):
    card = read_card(sprint_dir)
    assert (card.family, card.conditioning, card.max_tokens, card.image_size, card.latent_shape(192, 128)) == (
        "sana", "text", MAX_TOKENS, IMAGE_SIZE, (32, 4, 6))
    assert card.defaults == {"sampler": "scm", "steps": 2, "guidance": 4.5}  # SanaSprintPipeline.__call__'s
    assert (card.prediction_type, card.guidance_mode, card.lowercase_prompts) == ("trigflow", "embedded", True)
    assert card.scheduler["_class_name"] == "SCMScheduler" and card.scheduler["sigma_data"] == 0.5
    assert (card.takes_image, card.takes_mask) == (True, True)
    assert model.transformer.config.guidance_embeds and model.schedule.prediction_type == "trigflow"


def test_the_real_models_card(sprint_dir, tmp_path):
    """As the published directory says, without dit_serve overrides: 1024 px (sample_size 32), SanaSprintPipeline's
    bins (ASPECT_RATIO_1024_BIN), bfloat16, 300 tokens, 2 scm steps at 4.5."""
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import ASPECT_RATIO_1024_BIN

    real = _layout_copy(sprint_dir, tmp_path / "real", {"transformer/config.json": {"sample_size": 32}})
    index = json.loads((real / "model_index.json").read_text())
    del index["dit_serve"]
    (real / "model_index.json").write_text(json.dumps(index))
    card = read_card(real)
    assert (card.image_size, card.latent_size, card.max_tokens, card.dtype) == (1024, 32, 300, "bfloat16")
    assert set(card.sizes) == {(int(w), int(h)) for h, w in ASPECT_RATIO_1024_BIN.values()}
    assert card.defaults == {"sampler": "scm", "steps": 2, "guidance": 4.5}


def test_the_api_offers_scm_takes_the_defaults_and_refuses_a_negative_prompt(sprint_dir):
    from dit_serve.schemas import JobRequest
    from dit_serve.server.catalog import Catalog, model_entry
    from dit_serve.server.config import LimitsConfig

    card = read_card(sprint_dir)
    entry = model_entry(card)
    assert entry.samplers == ["scm"] and entry.guidance == "embedded"
    catalog = Catalog([card], LimitsConfig(max_steps=10_000))
    params = catalog.resolve_job(JobRequest(prompts=["a cat"])).params
    assert (params.sampler, params.steps, params.guidance) == ("scm", 2, 4.5)
    assert catalog.resolve_job(JobRequest(prompts=["a cat"], steps=1)).params.steps == 1
    assert catalog.resolve_job(JobRequest(prompts=["a cat"], steps=1000)).params.steps == 1000
    with pytest.raises(Exception, match="from 1 to 1000") as e:
        catalog.resolve_job(JobRequest(prompts=["a cat"], steps=1001))
    assert e.value.param == "steps"
    with pytest.raises(Exception, match="supports prediction_type") as e:
        catalog.resolve_job(JobRequest(prompts=["a cat"], sampler="flow_euler"))
    assert e.value.param == "sampler"
    with pytest.raises(Exception, match="negative"):
        catalog.resolve_job(JobRequest(prompts=["a cat"], negative_prompt="blurry"))


@pytest.mark.parametrize("edit, match", [
    ({"scheduler/scheduler_config.json": {"_class_name": "DPMSolverMultistepScheduler",
                                          "prediction_type": "flow_prediction", "use_flow_sigmas": True}},
     "is a DPMSolverMultistepScheduler .* samples with SCMScheduler"),
    ({"scheduler/scheduler_config.json": {"prediction_type": "v_prediction"}}, r"SCMScheduler \('v_prediction'\)"),
    ({"scheduler/scheduler_config.json": {"sigma_data": 0}}, "sigma_data must be a positive number, got 0"),
    ({"transformer/config.json": {"guidance_embeds": False}}, "has no guidance_embeds: SanaSprintPipeline feeds"),
    ({"model_index.json": {"_class_name": "SanaPipeline"}}, "guidance_embeds: Sana Sprint's transformer"),
    ({"model_index.json": {"_class_name": "SanaSprintImg2ImgPipeline"}}, "SanaSprintImg2ImgPipeline is not supported"),
    ({"vae/config.json": {"_class_name": "AutoencoderKL"}}, "vae/config.json is a AutoencoderKL")])
def test_what_sprint_does_not_run_is_a_card_error(sprint_dir, tmp_path, edit, match):
    with pytest.raises(CardError, match=match):
        read_card(_layout_copy(sprint_dir, tmp_path / "bad", edit))


# -- loading -------------------------------------------------------------------------------------------------
def test_the_directory_loads_as_diffusers_loads_it(sprint_dir, model):
    from diffusers import SanaSprintPipeline

    assert len(list((sprint_dir / "transformer").glob("diffusion_pytorch_model-*-of-*.safetensors"))) > 1
    pipe = SanaSprintPipeline.from_pretrained(sprint_dir, local_files_only=True)
    ref, ours = pipe.transformer.state_dict(), model.transformer.state_dict()
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)
    assert any(k.startswith("time_embed.guidance_embedder.") for k in ours) and any("norm_q" in k for k in ours)
    assert type(pipe.scheduler).__name__ == "SCMScheduler" and pipe.scheduler.config.sigma_data == 0.5


def test_the_encodings_are_encode_prompts_and_no_negative_is_encoded(model):
    spec = _spec("a", 0, 2, prompt="  A Red CAT ")
    model.cache.clear()
    (enc,) = family_named("sana").encode(model, [spec])
    assert set(enc) == {"prompt_embeds", "prompt_mask"} and sorted(model.cache) == [("prompt", "a red cat")]
    pipe = _pipe(model)
    instruction = inspect.signature(type(pipe).__call__).parameters["complex_human_instruction"].default
    assert tuple(instruction) == COMPLEX_HUMAN_INSTRUCTION  # __call__'s default, which encode_prompt is handed
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(spec.prompt, max_sequence_length=MAX_TOKENS,
                                          complex_human_instruction=instruction)
    torch.testing.assert_close(enc["prompt_embeds"], embeds[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(enc["prompt_mask"], mask[0].float())


# -- the step: equal to SanaSprintPipeline -------------------------------------------------------------------
@pytest.mark.parametrize("steps", [1, 2])
def test_one_and_two_steps_equal_the_pipeline(model, steps):
    specs = [_spec(f"s{steps}", 11, steps), _spec(f"w{steps}", 12, steps, 3.0, "a dog", width=192, height=128)]
    results = Engine(model, EAGER).generate(specs)
    assert results[1].latents.shape == (32, 4, 6)
    errs = _assert_equal_to_pipeline(model, specs, results)
    assert max(errs) <= 1e-6, errs


def test_rows_of_steps_guidance_and_prompts_batched_together_equal_the_pipeline_alone(model):
    """One group of four rows at 1, 2, 2 and 4 steps (the 4-step grid: a linspace with no intermediate angle),
    guidance 4.5, 7, 1 and 0 (embedded: each a network input, no CFG switch), one prompt past the token limit;
    the shorter rows leave the batch as they finish. A non-square row runs in its own group beside them."""
    specs = [_spec("a", 1, 1),
             _spec("b", 2, 2, 7.0, "The big blue house"),
             _spec("c", 3, 2, 1.0, LONG),
             _spec("d", 4, 4, 0.0, "  A dog drawn  "),
             _spec("e", 5, 4, 2.5, "a green tree", width=128, height=192)]
    engine = Engine(model, EAGER)
    results = engine.generate(specs)
    errs = _assert_equal_to_pipeline(model, specs, results)
    assert max(errs) <= 1e-5, errs
    assert len(engine.stats()["groups"]) == 2  # the square rows in one group, the tall one in its own
    a, b = Engine(model, EAGER).generate([_spec("x", 6, 2, 4.5), _spec("y", 6, 2, 1.5)])
    assert (a.latents - b.latents).abs().max() > 1e-4  # the scale reaches the network


def test_the_reference_hooks_make_the_pipelines_image(model):
    """``reference_pipeline`` / ``reference_call`` (the benchmarks' baseline) run SanaSprintPipeline as the engine
    runs the request: the same latents and noise give the same image."""
    family = family_named("sana")
    for steps in (1, 2, 3):
        spec = _spec(f"r{steps}", 21, steps)
        (ours,) = Engine(model, EAGER).generate([spec])
        gen = torch.Generator("cpu").manual_seed(spec.seed)
        x = torch.randn(model.latent_shape, generator=gen)
        call = family.reference_call(model, [spec])
        assert "negative_prompt" not in call
        ref = family.reference_pipeline(model)(**call, latents=x[None], generator=gen, output_type="latent").images[0]
        assert (ours.latents - ref).abs().max() <= TOL * max(1.0, ref.abs().max().item())


def test_images_decode_as_the_pipeline_decodes(model):
    spec = _spec("i", 9, 2, width=192, height=128)
    (ours,) = Engine(model, EAGER).generate([spec])
    ref = _reference(model, spec, output_type="np")
    assert ref.shape == ours.image.shape == (128, 192, 3)
    assert (torch.from_numpy(ref * 255) - torch.from_numpy(ours.image).float()).abs().max() <= 1.0


# -- image-to-image: SanaSprintImg2ImgPipeline --------------------------------------------------------------
@pytest.mark.parametrize("steps, strength", [(2, 0.5), (4, 0.3), (4, 0.6), (2, 1.0)])
def test_image_to_image_equals_sana_sprint_img2img(model, steps, strength):
    """The DC-AE latent times its scaling factor, noised to the first kept angle as cos(s) x0 + sin(s) z
    (samplers.plans.scm's levels: the pipeline's prepare_latents in units of sigma_data), the grid cut by
    get_timesteps; the generator draws the noise, then each step's."""
    spec = _spec("m", 31, steps, 3.0, image=edit_cases.image_bytes(seed=3), strength=strength)
    (ours,) = Engine(model, EAGER).generate([spec])
    edit_cases.assert_close(ours.latents, _img2img_reference(model, spec), spec.id)


def _img2img_reference(model, spec: ItemSpec) -> torch.Tensor:
    return _pipe(model, img2img=True)(
        spec.prompt, image=edit_cases.decoded(spec)["image"], strength=spec.strength, num_inference_steps=spec.steps,
        guidance_scale=spec.guidance, height=IMAGE_SIZE, width=IMAGE_SIZE, generator=edit_cases.generator(spec),
        intermediate_timesteps=1.3 if spec.steps == 2 else None, max_sequence_length=model.card.max_tokens,
        use_resolution_binning=False, output_type="latent").images[0]


# -- inpainting: the rule (diffusers has no Sana Sprint inpaint pipeline) ----------------------------------
def _inpaint_reference(model, spec: ItemSpec) -> torch.Tensor:
    """SanaSprintImg2ImgPipeline with the inpaint pipelines' blend after each step (outside the mask, the image's
    latents noised to the next angle: cos(s) x0 + sin(s) z, in the pipeline's units, sigma_data times ours), and
    once more on its output (denoised, which it returns unblended, at the end's level (1, 0)). At strength 1 it
    starts from the noise itself (the inpaint pipelines' is_strength_max), drawn first from the generator."""
    pipe = _pipe(model, img2img=True)
    sd = pipe.scheduler.config.sigma_data
    vae = model.vae.vae
    x0 = vae.encode(edit_cases.pipeline_image(spec, IMAGE_SIZE, IMAGE_SIZE)).latent * vae.config.scaling_factor
    gen = edit_cases.generator(spec)
    noise = torch.randn(x0.shape, generator=edit_cases.generator(spec))  # the DC-AE draws nothing before it
    mask = torch.nn.functional.interpolate(edit_cases.pipeline_mask(spec, IMAGE_SIZE, IMAGE_SIZE),
                                           size=x0.shape[-2:])

    def blend(p, i, t, kwargs):
        s = p.scheduler.timesteps[p.scheduler.step_index]  # the step just made moved the index to the next angle
        proper = torch.cos(s) * x0 * sd + torch.sin(s) * noise * sd
        return {"latents": (1 - mask) * proper + mask * kwargs["latents"]}

    start = {}
    if spec.strength == 1:
        start = {"latents": torch.randn(x0.shape, generator=gen) * sd}  # the generator past the noise, as ours
    out = pipe(spec.prompt, image=edit_cases.decoded(spec)["image"], strength=spec.strength,
               num_inference_steps=spec.steps, guidance_scale=spec.guidance, height=IMAGE_SIZE, width=IMAGE_SIZE,
               generator=gen, intermediate_timesteps=1.3 if spec.steps == 2 else None,
               max_sequence_length=model.card.max_tokens, use_resolution_binning=False, output_type="latent",
               callback_on_step_end=blend, **start).images[0]
    return ((1 - mask) * x0 + mask * out)[0]


def test_inpainting_and_text_and_image_rows_batched_together_follow_the_rule(model):
    """Inpainting at strengths 0.5 and 1 (2 steps) and 0.6 (4 steps) beside a text-to-image and an image-to-image
    row in one engine: each equals its reference (the inpainting rows run the engine's inpaint variant)."""
    image, mask = edit_cases.image_bytes(seed=4), edit_cases.mask_bytes(box=(0.2, 0.2, 0.8, 0.8))
    specs = [_spec("p1", 41, 2, 4.5, "a house", image=image, mask=mask, strength=0.5),
             _spec("p2", 42, 2, 2.0, "a tree", image=image, mask=mask, strength=1.0),
             _spec("p3", 43, 4, 4.5, "a dog", image=image, mask=mask, strength=0.6),
             _spec("t", 44, 2, 4.5, "a red cat"),
             _spec("i", 45, 4, 3.0, "a cat", image=image, strength=0.6)]
    engine = Engine(model, EAGER)
    results = engine.generate(specs)
    for spec, r in zip(specs[:3], results):
        edit_cases.assert_close(r.latents, _inpaint_reference(model, spec), spec.id)
    _assert_equal_to_pipeline(model, specs[3:4], results[3:4])
    edit_cases.assert_close(results[4].latents, _img2img_reference(model, specs[4]), "i")
    assert any(k.endswith(":inpaint") for k in engine.stats()["groups"])
