"""FLUX.1 through our engine equals diffusers' FluxPipeline: tiny random pipeline directories in the real
layouts of FLUX.1-dev and FLUX.1-schnell (sharded transformer and T5, CLIP + T5 encoders and tokenizers,
16-channel VAE, scheduler), made here, offline; the same initial latents; float32 on the CPU.

Tolerance: max |ours - reference| <= 1e-4 * max(1, max |reference|) on the final latents. The two sides
differ only in float32 rounding: the engine batches requests (and their prompts) that the pipeline runs
one at a time, and computes the Euler update from float64-built coefficients.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from workers.config import WorkerConfig
from workers.request.cards import CardError, read_card
from workers.engine import Engine
from workers.families import family_named
from workers.families.flux.runtime import image_ids, pack, unpack
from workers.loading import ModelError, load_model
from workers.models.tiny_flux import IMAGE_SIZE, MAX_TOKENS, make_tiny_flux
from workers.request.spec import ItemSpec

from . import edit_cases

EAGER = WorkerConfig(backend="eager", max_batch=4)


@pytest.fixture(scope="module")
def dev_dir(tmp_path_factory):
    return make_tiny_flux(tmp_path_factory.mktemp("flux-dev"))


@pytest.fixture(scope="module")
def schnell_dir(tmp_path_factory):
    return make_tiny_flux(tmp_path_factory.mktemp("flux-schnell"), seed=1, schnell=True)


@pytest.fixture(scope="module")
def dev(dev_dir):
    return load_model(dev_dir)


@pytest.fixture(scope="module")
def schnell(schnell_dir):
    return load_model(schnell_dir)


def _scheduler(model):
    """diffusers' scheduler of the card's config (flow_grid is ours: FluxPipeline passes that grid itself)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    config = {k: v for k, v in model.card.scheduler.items() if k != "flow_grid"}
    return FlowMatchEulerDiscreteScheduler.from_config(config)


def _reference(model, spec: ItemSpec) -> torch.Tensor:
    """FluxPipeline from our loaded components, from the engine's initial latents packed as the pipeline
    packs them; the final latents unpacked to (16, h, w)."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline(scheduler=_scheduler(model), vae=model.vae,
                        text_encoder=model.text_encoder, tokenizer=model.tokenizer,
                        text_encoder_2=model.text_encoder_2, tokenizer_2=model.tokenizer_2,
                        transformer=model.transformer)
    width, height = spec.width or IMAGE_SIZE, spec.height or IMAGE_SIZE
    c, h, w = model.card.latent_shape(width, height)
    x = torch.randn((c, h, w), generator=torch.Generator("cpu").manual_seed(spec.seed))  # as Engine._admit
    out = pipe(spec.prompt, height=height, width=width, num_inference_steps=spec.steps, guidance_scale=spec.guidance,
               latents=FluxPipeline._pack_latents(x[None], 1, c, h, w), max_sequence_length=model.card.max_tokens,
               output_type="latent").images
    return FluxPipeline._unpack_latents(out, height, width, pipe.vae_scale_factor)[0]


def _assert_equal_to_pipeline(model, specs, results):
    for spec, r in zip(specs, results):
        ref = _reference(model, spec)
        err = (r.latents - ref).abs().max().item()
        assert err <= 1e-4 * max(1.0, ref.abs().max().item()), (spec.id, err)


# -- the card ------------------------------------------------------------------------------------------------
def test_the_card_reads_dev_and_schnell(dev_dir, schnell_dir):
    d, s = read_card(dev_dir), read_card(schnell_dir)
    for card in (d, s):
        assert (card.family, card.conditioning, card.max_tokens, card.size_multiple) == ("flux", "text", MAX_TOKENS, 16)
        assert (card.image_size, card.latent_size, card.latent_channels, card.pixel_space) == (64, 8, 16, False)
        assert card.sizes == ((64, 64), (96, 64), (64, 96)) and card.latent_shape(96, 64) == (16, 8, 12)
        assert card.prediction_type == "flow" and card.dtype == "float32"
        assert card.tokenizer_file.endswith("tokenizer_2/tokenizer.json")
    assert d.defaults == {"sampler": "flow_euler", "steps": 28, "guidance": 3.5}
    assert s.defaults == {"sampler": "flow_euler", "steps": 4, "guidance": 0.0}
    assert d.scheduler["use_dynamic_shifting"] and not s.scheduler["use_dynamic_shifting"]
    assert d.scheduler["flow_grid"] == s.scheduler["flow_grid"] == "flux"  # FluxPipeline's sigmas, both


def _layout_copy(src, dst, drop: str = "", dit_serve: dict | None = None):
    """A copy of a pipeline directory without ``drop``; ``dit_serve`` replaces model_index's section."""
    shutil.copytree(src, dst)
    if drop:
        shutil.rmtree(dst / drop)
    if dit_serve is not None:
        index = json.loads((dst / "model_index.json").read_text())
        (dst / "model_index.json").write_text(json.dumps({**index, "dit_serve": dit_serve}))
    return dst


def test_the_real_models_cards(dev_dir, schnell_dir, tmp_path):
    """Without dit_serve overrides: the real models' native 1024, token limits 512 (dev) / 256 (schnell),
    bfloat16, and the native square plus four ratios both ways at about a megapixel, multiples of 16."""
    d = read_card(_layout_copy(dev_dir, tmp_path / "dev", dit_serve={}))
    s = read_card(_layout_copy(schnell_dir, tmp_path / "schnell", dit_serve={"defaults": {"steps": 2}}))
    assert (d.image_size, d.latent_size, d.max_tokens, d.dtype) == (1024, 128, 512, "bfloat16")
    assert (s.max_tokens, s.defaults) == (256, {"sampler": "flow_euler", "steps": 2, "guidance": 0.0})
    assert d.made_sizes()[:3] == [(1024, 1024), (1184, 880), (880, 1184)] and len(d.made_sizes()) == 9
    assert all(w % 16 == 0 and h % 16 == 0 and abs(w * h / 1024**2 - 1) < 0.05 for w, h in d.made_sizes())
    # any multiple of 16 as asked, a side off it rounded down, as FluxPipeline does (up to twice the native side)
    assert d.size_for(256, 256) == (256, 256) and d.resolve_size(1920, 1080) == (
        (1920, 1072), "1920x1080 is not a multiple of 16 px per side: model 'dev' makes 1920x1072 (rounded down, "
                      "as its reference pipeline does)")
    with pytest.raises(ValueError, match="multiples of 16 px from 16 to 2048"):
        d.size_for(4096, 1024)


def test_kontext_takes_a_reference_image_and_is_served_without_a_warning(dev_dir, tmp_path):
    """FluxKontextPipeline has FLUX.1-dev's layout; its card takes an image as the reference of an instruction
    edit (``edit`` "reference", no mask), its references resized to the preferred Kontext resolutions unless
    ``dit_serve.kontext_auto_resize`` is false; FLUX.1's own card is an image-to-image one."""
    from workers.families.flux import PREFERRED_KONTEXT_RESOLUTIONS

    kontext = _layout_copy(dev_dir, tmp_path / "kontext")
    index = json.loads((kontext / "model_index.json").read_text())
    (kontext / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxKontextPipeline"}))
    card = read_card(kontext)
    assert (card.edit, card.takes_image, card.takes_mask, card.warnings) == ("reference", True, False, ())
    assert card.reference_sizes == PREFERRED_KONTEXT_RESOLUTIONS
    plain = read_card(dev_dir)
    assert (plain.edit, plain.takes_image, plain.takes_mask, plain.warnings) == ("image-to-image", True, True, ())
    (kontext / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxKontextPipeline",
                                                          "dit_serve": {"kontext_auto_resize": "no"}}))
    with pytest.raises(CardError, match="kontext_auto_resize must be true or false"):
        read_card(kontext)


@pytest.mark.parametrize("part", ["vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"])
def test_a_missing_part_is_a_card_error_naming_it(dev_dir, tmp_path, part):
    with pytest.raises(CardError, match=f"without {part}/"):
        read_card(_layout_copy(dev_dir, tmp_path / "flux", drop=part))


def test_a_wrong_encoder_or_token_limit_is_a_card_error(dev_dir, tmp_path):
    bad = _layout_copy(dev_dir, tmp_path / "swapped")
    shutil.rmtree(bad / "text_encoder")
    shutil.copytree(dev_dir / "text_encoder_2", bad / "text_encoder")
    with pytest.raises(CardError, match="text_encoder/config.json has model_type 't5'"):
        read_card(bad)
    with pytest.raises(CardError, match="max_sequence_length must be 1 to 512"):
        read_card(_layout_copy(dev_dir, tmp_path / "long", dit_serve={"max_sequence_length": 1024}))


# -- loading -------------------------------------------------------------------------------------------------
def test_sharded_checkpoints_load_as_diffusers_loads_them(schnell_dir, schnell):
    from diffusers import FluxTransformer2DModel

    shards = sorted(p.name for p in (schnell_dir / "transformer").glob("*.safetensors"))
    assert len(shards) > 1 and (schnell_dir / "transformer/diffusion_pytorch_model.safetensors.index.json").is_file()
    assert len(list((schnell_dir / "text_encoder_2").glob("model-*-of-*.safetensors"))) > 1
    ref = FluxTransformer2DModel.from_pretrained(schnell_dir / "transformer").state_dict()
    ours = schnell.transformer.state_dict()
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)
    assert not any(p.is_meta for p in schnell.transformer.parameters())
    assert (schnell.vae_scale, schnell.vae_shift, schnell.latent_shape) == (0.3611, 0.1159, (16, 8, 8))
    assert type(schnell.text_encoder).__name__ == "CLIPTextModel"
    assert type(schnell.text_encoder_2).__name__ == "T5EncoderModel"


def test_the_directory_is_one_diffusers_loads_itself(schnell_dir, schnell):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(schnell_dir, local_files_only=True)
    assert torch.equal(pipe.text_encoder_2.shared.weight, schnell.text_encoder_2.shared.weight)
    assert pipe.tokenizer("a red cat").input_ids == schnell.tokenizer("a red cat").input_ids


def test_a_missing_shard_and_pickles_are_refused(schnell_dir, tmp_path):
    gone = _layout_copy(schnell_dir, tmp_path / "gone")
    (gone / "transformer/diffusion_pytorch_model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ModelError, match="lacks shards its index names: diffusion_pytorch_model-00002-of-00003"):
        load_model(gone)
    for part, stem in (("transformer", "diffusion_pytorch_model"), ("text_encoder_2", "model")):
        pickled = _layout_copy(schnell_dir, tmp_path / f"pickled-{part}")
        for f in (pickled / part).glob(f"{stem}*"):
            f.unlink()
        (pickled / part / f"{stem}.bin").write_bytes(b"not loaded")
        with pytest.raises(ModelError, match="only pickle weights"):
            load_model(pickled)


# -- the step: equal to FluxPipeline -------------------------------------------------------------------------
def test_packing_and_ids_are_the_pipelines():
    from diffusers import FluxPipeline

    x = torch.randn(3, 16, 8, 12)
    assert torch.equal(pack(x), FluxPipeline._pack_latents(x, 3, 16, 8, 12))
    assert torch.equal(unpack(pack(x), 8, 12), x)
    ids = FluxPipeline._prepare_latent_image_ids(1, 4, 6, "cpu", torch.float32)  # (24, 3)
    assert torch.equal(image_ids(4, 6, "cpu"), ids)


def test_plan_kwargs_shift_by_the_packed_sequence_length(dev, schnell):
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    cfg = dev.card.scheduler
    for shape in ((16, 8, 8), (16, 8, 12)):
        mu = family_named("flux").plan_kwargs(dev, shape)["mu"]
        assert mu == pytest.approx(calculate_shift(shape[1] * shape[2] // 4, cfg["base_image_seq_len"],
                                                   cfg["max_image_seq_len"], cfg["base_shift"], cfg["max_shift"]))
    assert family_named("flux").plan_kwargs(schnell, (16, 8, 8)) == {}


def test_dev_prompts_and_guidances_batched_together_equal_the_pipeline_alone(dev):
    # four requests in one batch: different prompts, seeds, guidance scales and step counts; each equals
    # FluxPipeline run alone (guidance embedded: one row per image, no CFG); "d" is "a" at another scale
    specs = [ItemSpec(id="a", seed=1, sampler="flow_euler", steps=5, guidance=3.5, prompt="a red cat"),
             ItemSpec(id="b", seed=2, sampler="flow_euler", steps=5, guidance=1.0, prompt="The big blue house"),
             ItemSpec(id="c", seed=3, sampler="flow_euler", steps=3, guidance=7.0, prompt="  a dog drawn  "),
             ItemSpec(id="d", seed=1, sampler="flow_euler", steps=5, guidance=1.0, prompt="a red cat")]
    results = Engine(dev, EAGER).generate(specs)
    _assert_equal_to_pipeline(dev, specs, results)
    assert (results[0].latents - results[3].latents).abs().max() > 1e-3  # the scale reaches the network


def test_dev_at_a_non_square_size(dev):
    specs = [ItemSpec(id="w", seed=5, sampler="flow_euler", steps=5, guidance=3.5, prompt="a green tree",
                      width=96, height=64),
             ItemSpec(id="t", seed=6, sampler="flow_euler", steps=5, guidance=2.0, prompt="a cat", width=64, height=96)]
    results = Engine(dev, EAGER).generate(specs)
    assert results[0].latents.shape == (16, 8, 12) and results[0].image.shape == (64, 96, 3)
    assert results[1].latents.shape == (16, 12, 8)
    _assert_equal_to_pipeline(dev, specs, results)


def test_an_unlisted_multiple_of_16_is_made_as_asked_and_equals_the_pipeline(dev):
    """The tiny card lists 64x64, 96x64 and 64x96; FluxPipeline makes 32x32 and 128x48 as asked, and so does
    the engine (each a new shape, captured on first use), where the card once snapped them to 64x64 and 96x64."""
    from dit_serve.schemas import JobRequest
    from dit_serve.server.catalog import Catalog
    from dit_serve.server.config import LimitsConfig

    catalog = Catalog([dev.card], LimitsConfig())
    for (w, h), warnings in (((32, 32), []), ((128, 48), []), ((50, 40), [
            "50x40 is not a multiple of 16 px per side: model 'flux-dev0' makes 48x32 (rounded down, as its "
            "reference pipeline does)"])):
        params = catalog.resolve_job(JobRequest(prompts=["a cat"], width=w, height=h)).params
        assert (params.width, params.height, params.warnings) == (w // 16 * 16, h // 16 * 16, warnings)
    with pytest.raises(Exception, match="multiples of 16 px from 16 to 128") as e:
        catalog.resolve_job(JobRequest(prompts=["a cat"], width=144, height=64))
    assert e.value.param == "width"
    specs = [ItemSpec(id="s", seed=5, sampler="flow_euler", steps=3, guidance=3.5, prompt="a cat", width=32, height=32),
             ItemSpec(id="w", seed=6, sampler="flow_euler", steps=3, guidance=3.5, prompt="a dog", width=128, height=48)]
    results = Engine(dev, EAGER).generate(specs)
    assert results[0].image.shape == (32, 32, 3) and results[1].image.shape == (48, 128, 3)
    _assert_equal_to_pipeline(dev, specs, results)


def test_schnell_in_four_steps_ignores_guidance_and_equals_the_pipeline(schnell):
    specs = [ItemSpec(id=str(i), seed=7, sampler="flow_euler", steps=4, guidance=g, prompt="a small house")
             for i, g in enumerate((0.0, 5.0))] + [
             ItemSpec(id="w", seed=8, sampler="flow_euler", steps=4, guidance=0.0, prompt="a dog", width=96, height=64)]
    results = Engine(schnell, EAGER).generate(specs)
    assert torch.equal(results[0].latents, results[1].latents)  # no guidance input
    _assert_equal_to_pipeline(schnell, specs, results)


def test_images_decode_as_the_pipeline_decodes(schnell):
    """The engine's VAE decode (latents / 0.3611 + 0.1159) and uint8 conversion match the pipeline's image."""
    from diffusers import FluxPipeline

    spec = ItemSpec(id="a", seed=9, sampler="flow_euler", steps=2, guidance=0.0, prompt="a red cat")
    (ours,) = Engine(schnell, EAGER).generate([spec])
    pipe = FluxPipeline(scheduler=_scheduler(schnell),
                        vae=schnell.vae, text_encoder=schnell.text_encoder, tokenizer=schnell.tokenizer,
                        text_encoder_2=schnell.text_encoder_2, tokenizer_2=schnell.tokenizer_2,
                        transformer=schnell.transformer)
    x = torch.randn((16, 8, 8), generator=torch.Generator("cpu").manual_seed(9))
    ref = pipe("a red cat", height=64, width=64, num_inference_steps=2, guidance_scale=0.0, output_type="np",
               latents=FluxPipeline._pack_latents(x[None], 1, 16, 8, 8), max_sequence_length=MAX_TOKENS).images[0]
    assert (torch.from_numpy(ref * 255) - torch.from_numpy(ours.image).float()).abs().max() <= 1.0


def test_encodings_are_cached_by_the_prompt_as_given(dev):
    dev.cache.clear()
    e = Engine(dev, EAGER)
    e.add_many([ItemSpec(id=str(i), seed=i, sampler="flow_euler", steps=2, guidance=3.5, prompt="A cat")
                for i in range(3)])
    assert list(dev.cache) == ["A cat"]  # one encoding per distinct prompt; no lower-casing of ours
    first = dev.cache["A cat"][0]
    e.add(ItemSpec(id="x", seed=9, sampler="flow_euler", steps=2, guidance=3.5, prompt="A cat"))
    assert dev.cache["A cat"][0] is first
    embeds, pooled = first, dev.cache["A cat"][1]
    assert embeds.shape == (MAX_TOKENS, 32) and pooled.shape == (32,)


def test_the_graph_engine_reading_its_modulation_tables_equals_the_pipeline(dev_dir):
    """Under the graph backends each request's modulation is made at admission for all of its steps
    (``workers.speed.modulation``, tables) and the rotary tables once per shape: still the pipeline's latents."""
    from workers.engine import step_specs

    model = load_model(dev_dir)  # its own: the graph engine patches the transformer it serves
    specs = [ItemSpec(id="a", seed=1, sampler="flow_euler", steps=4, guidance=3.5, prompt="a red cat"),
             ItemSpec(id="b", seed=2, sampler="flow_euler", steps=3, guidance=7.0, prompt="The big blue house")]
    engine = Engine(model, WorkerConfig(backend="graphs", max_batch=4))
    assert "modulation" in step_specs(model)[0]
    _assert_equal_to_pipeline(model, specs, engine.generate(specs))


def test_the_rotary_tables_are_made_once_per_shape_and_a_plain_call_makes_its_own(dev_dir, monkeypatch):
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    model = load_model(dev_dir)
    calls = []
    real = FluxPosEmbed.forward
    monkeypatch.setattr(FluxPosEmbed, "forward", lambda self, ids: calls.append(ids.shape[0]) or real(self, ids))
    specs = [ItemSpec(id=str(i), seed=i, sampler="flow_euler", steps=3, guidance=3.5, prompt="a cat")
             for i in range(2)]
    Engine(model, EAGER).generate(specs)
    _, h, w = model.latent_shape
    assert calls == [MAX_TOKENS + (h // 2) * (w // 2)]  # made with the step, none in its 3 steps
    tr = model.transformer
    assert type(tr.pos_embed).__name__ == "GivenFluxPosEmbed" and tr.pos_embed._given_rotary is None
    ids = torch.zeros(5, 3)
    torch.testing.assert_close(tr.pos_embed(ids), real(tr.pos_embed, ids))  # nothing handed over: its own


# -- image-to-image and inpainting (workers.edits) ----------------------------------------------------------
def _edit_reference(model, spec: ItemSpec) -> torch.Tensor:
    """FluxImg2ImgPipeline, or FluxInpaintPipeline for a spec with a mask, on the decoded image (and mask), with a
    generator seeded as the request's; the final latents unpacked to (16, h, w)."""
    from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline

    cls = FluxInpaintPipeline if spec.mask else FluxImg2ImgPipeline
    pipe = cls(scheduler=_scheduler(model), vae=model.vae, text_encoder=model.text_encoder, tokenizer=model.tokenizer,
               text_encoder_2=model.text_encoder_2, tokenizer_2=model.tokenizer_2, transformer=model.transformer)
    width, height = spec.width or IMAGE_SIZE, spec.height or IMAGE_SIZE
    out = pipe(spec.prompt, strength=spec.strength, height=height, width=width, num_inference_steps=spec.steps,
               guidance_scale=spec.guidance, max_sequence_length=model.card.max_tokens, output_type="latent",
               generator=edit_cases.generator(spec), **edit_cases.decoded(spec)).images
    return cls._unpack_latents(out, height, width, pipe.vae_scale_factor)[0]


@pytest.mark.parametrize("strength", edit_cases.STRENGTHS)
def test_image_to_image_equals_the_img2img_pipeline(dev, strength):
    spec = ItemSpec(id="i", seed=21, sampler="flow_euler", steps=6, guidance=3.5, prompt="a red cat",
                    image=edit_cases.image_bytes(), strength=strength)
    edit_cases.assert_close(Engine(dev, EAGER).generate([spec])[0].latents, _edit_reference(dev, spec))


@pytest.mark.parametrize("strength", edit_cases.STRENGTHS)
def test_inpainting_equals_the_inpaint_pipeline(dev, strength):
    spec = ItemSpec(id="m", seed=22, sampler="flow_euler", steps=6, guidance=3.5, prompt="a green tree",
                    image=edit_cases.image_bytes(seed=1), mask=edit_cases.mask_bytes(), strength=strength)
    edit_cases.assert_close(Engine(dev, EAGER).generate([spec])[0].latents, _edit_reference(dev, spec))


def test_schnell_edits_equal_the_pipelines(schnell):
    image = edit_cases.image_bytes(seed=3)
    specs = [ItemSpec(id="i", seed=5, sampler="flow_euler", steps=4, guidance=0.0, prompt="a cat", image=image,
                      strength=0.5),
             ItemSpec(id="m", seed=6, sampler="flow_euler", steps=4, guidance=0.0, prompt="a cat", image=image,
                      mask=edit_cases.mask_bytes(box=(0, 0, 0.5, 1)), strength=0.75)]
    for spec, r in zip(specs, Engine(schnell, EAGER).generate(specs)):
        edit_cases.assert_close(r.latents, _edit_reference(schnell, spec), spec.id)


def test_edits_and_text_rows_on_the_graph_engine_each_equal_their_pipeline(dev_dir):
    """Text-to-image, image-to-image and inpainting rows of one model in one engine under the graph backend (the
    modulation tables of cut plans, the inpainting variant's own group), joining at different steps, two sizes:
    each equals its own reference pipeline run alone."""
    model = load_model(dev_dir)  # its own: the graph engine patches the transformer it serves
    image, mask = edit_cases.image_bytes(seed=4), edit_cases.mask_bytes(box=(0.25, 0.25, 0.75, 0.75))
    specs = [ItemSpec(id="t", seed=1, sampler="flow_euler", steps=5, guidance=3.5, prompt="a red cat"),
             ItemSpec(id="i", seed=2, sampler="flow_euler", steps=6, guidance=4.0, prompt="a dog", image=image,
                      strength=0.6),
             ItemSpec(id="m", seed=3, sampler="flow_euler", steps=5, guidance=2.0, prompt="a house", image=image,
                      mask=mask, strength=0.7),
             ItemSpec(id="w", seed=4, sampler="flow_euler", steps=4, guidance=3.0, prompt="a tree", image=image,
                      mask=mask, strength=1.0, width=96, height=64),
             ItemSpec(id="v", seed=5, sampler="flow_euler", steps=4, guidance=3.0, prompt="a boat", image=image,
                      strength=0.3, width=96, height=64)]
    engine = Engine(model, WorkerConfig(backend="graphs", max_batch=4))
    results = engine.generate(specs, max_active=3)
    for spec, r in zip(specs, results):
        edit_cases.assert_close(r.latents, _edit_reference(model, spec) if spec.image else _reference(model, spec),
                                spec.id)
    groups = engine.stats()["groups"]  # inpainting rows ran in groups of their own, one per size
    assert sum(k.endswith(":inpaint") for k in groups) == 2 and sum(not k.endswith(":inpaint") for k in groups) == 2
