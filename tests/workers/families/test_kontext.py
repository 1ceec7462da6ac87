"""FLUX.1 Kontext through our engine equals diffusers' FluxKontextPipeline: a tiny random directory in the real
layout (``make_tiny_flux(kontext=True)``), the same initial latents, float32 on the CPU, final latents within
1e-4 of the largest (``edit_cases.assert_close``). Reference images of two sizes and a text-only request run in
one engine, each in its own group (the variant is the reference's token grid)."""

from __future__ import annotations

import pytest
import torch

from tests.workers.families import edit_cases
from workers.config import WorkerConfig
from workers.engine import Engine, step_specs
from workers.families.flux import PREFERRED_KONTEXT_RESOLUTIONS, reference_size
from workers.loading import load_model
from workers.models.tiny_flux import IMAGE_SIZE, make_tiny_flux
from workers.request.cards import read_card
from workers.request.spec import ItemSpec


@pytest.fixture(scope="module")
def kontext_dir(tmp_path_factory):
    return make_tiny_flux(tmp_path_factory.mktemp("flux-kontext"), seed=2, kontext=True)


def _reference(model, spec: ItemSpec) -> torch.Tensor:
    """FluxKontextPipeline over our loaded modules from the engine's initial latents (seeded noise, packed), the
    request's image decoded as the worker decodes it (or none); ``max_area`` the generation size's, so that the
    pipeline keeps that size; ``_auto_resize`` as the card says. The final latents unpacked to (16, h, w)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline

    config = {k: v for k, v in model.card.scheduler.items() if k != "flow_grid"}
    pipe = FluxKontextPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(config), vae=model.vae,
                               text_encoder=model.text_encoder, tokenizer=model.tokenizer,
                               text_encoder_2=model.text_encoder_2, tokenizer_2=model.tokenizer_2,
                               transformer=model.transformer)
    pipe.set_progress_bar_config(disable=True)
    width, height = spec.width or IMAGE_SIZE, spec.height or IMAGE_SIZE
    c, h, w = model.card.latent_shape(width, height)
    x = torch.randn((c, h, w), generator=torch.Generator("cpu").manual_seed(spec.seed))  # as the engine's start
    image = edit_cases.decoded(spec)["image"] if spec.image else None
    out = pipe(prompt=spec.prompt, image=image, height=height, width=width, num_inference_steps=spec.steps,
               guidance_scale=spec.guidance, latents=FluxKontextPipeline._pack_latents(x[None], 1, c, h, w),
               max_sequence_length=model.card.max_tokens, output_type="latent", max_area=width * height,
               _auto_resize=bool(model.card.reference_sizes), generator=edit_cases.generator(spec)).images
    return FluxKontextPipeline._unpack_latents(out, height, width, pipe.vae_scale_factor)[0]


def _specs() -> list[ItemSpec]:
    return [ItemSpec(id="a", seed=1, sampler="flow_euler", steps=4, guidance=2.5, prompt="make it red",
                     image=edit_cases.image_bytes(70, 50, seed=1)),             # 64x48: 3 x 4 tokens
            ItemSpec(id="b", seed=2, sampler="flow_euler", steps=3, guidance=3.5, prompt="a blue sky",
                     image=edit_cases.image_bytes(40, 60, seed=2), width=96, height=64),  # 32x48: 3 x 2 tokens
            ItemSpec(id="t", seed=3, sampler="flow_euler", steps=4, guidance=3.5, prompt="a red cat"),
            ItemSpec(id="c", seed=4, sampler="flow_euler", steps=3, guidance=4.0, prompt="a green sky",
                     image=edit_cases.image_bytes(66, 52, seed=3))]              # 64x48 again: a's group


def test_the_card_takes_a_reference_image_and_no_mask(kontext_dir):
    card = read_card(kontext_dir)
    assert (card.edit, card.takes_image, card.takes_mask, card.warnings) == ("reference", True, False, ())
    assert card.reference_sizes == ()  # the tiny directory keeps its references' sizes


def test_reference_sizes_are_the_pipelines(kontext_dir, tmp_path):
    """The pipeline's preferred resolutions, the nearest aspect ratio (its min over (|ratio - w/h|, w, h)) after
    the sides are rounded down to 16 px; without auto-resize only the rounding."""
    from dataclasses import replace

    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS as theirs

    assert PREFERRED_KONTEXT_RESOLUTIONS == tuple(theirs)
    card = read_card(kontext_dir)
    assert reference_size(card, 70, 50) == (64, 48) and reference_size(card, 40, 60) == (32, 48)
    auto = replace(card, reference_sizes=PREFERRED_KONTEXT_RESOLUTIONS)
    for (w, h), want in {(1920, 1080): (1392, 752), (1024, 1024): (1024, 1024), (512, 512): (1024, 1024),
                         (600, 800): (880, 1184), (100, 1000): (672, 1568)}.items():
        assert reference_size(auto, w, h) == want, (w, h)
        ww, hh = w - w % 16, h - h % 16
        assert want == min((abs(ww / hh - a / b), a, b) for a, b in theirs)[1:]
    with pytest.raises(ValueError, match="image: 10x40 is too small"):
        reference_size(card, 10, 40)


def test_references_of_two_sizes_and_text_in_one_engine_each_equal_the_pipeline(kontext_dir):
    """Two reference sizes and a text-only request (and a second request of the first size, admitted later) in
    one engine: each request's final latents equal FluxKontextPipeline's run alone."""
    model = load_model(kontext_dir)
    engine = Engine(model, WorkerConfig(backend="eager", max_batch=4))
    specs = _specs()
    results = engine.generate(specs, max_active=3)
    for spec, r in zip(specs, results):
        edit_cases.assert_close(r.latents, _reference(model, spec), spec.id)
    variants = sorted(g.split(":")[4] if g.count(":") == 4 else "" for g in engine.stats()["groups"])
    assert variants == ["", "kontext-3x2", "kontext-3x4"]  # the text request's group, one per reference size
    assert step_specs(model, (16, 8, 8), "kontext-3x4")[0]["reference"].shape_per_sample == (12, 64)


def test_the_graph_engine_with_its_modulation_tables_equals_the_pipeline(kontext_dir):
    """Under the graph backend (the modulation tables, the rotary tables made once per shape and reference grid)."""
    model = load_model(kontext_dir)  # its own: the graph engine patches the transformer it serves
    specs = _specs()[:3]
    results = Engine(model, WorkerConfig(backend="graphs", max_batch=4)).generate(specs)
    for spec, r in zip(specs, results):
        edit_cases.assert_close(r.latents, _reference(model, spec), spec.id)


def test_a_mask_is_refused_and_strength_is_not_used(kontext_dir):
    model = load_model(kontext_dir)
    engine = Engine(model, WorkerConfig(backend="eager", max_batch=4))
    image = edit_cases.image_bytes(70, 50, seed=1)
    with pytest.raises(ValueError, match="mask: model .* takes no mask"):
        engine.add(ItemSpec(id="m", seed=1, sampler="flow_euler", steps=2, guidance=2.5, prompt="x", image=image,
                            mask=edit_cases.mask_bytes(70, 50)))
    assert engine.num_active == 0
    base = dict(seed=1, sampler="flow_euler", steps=2, guidance=2.5, prompt="x", image=image)
    a, b = engine.generate([ItemSpec(id="s1", **base), ItemSpec(id="s2", strength=0.3, **base)])
    assert torch.equal(a.latents, b.latents)
