"""Stable Diffusion 3 / 3.5 through our engine equals diffusers' StableDiffusion3Pipeline: a tiny random
pipeline directory in the real layout (workers.models.tiny_sd3: sharded transformer, CLIP-L, CLIP-bigG,
T5, their tokenizers, a shifted VAE, the shift-3 flow scheduler; safetensors), made here, offline; the
same initial latents; float32 on the CPU.

Tolerance: max |ours - reference| <= 1e-4 * max(1, max |reference|) over the final latents. Both sides
run the same float32 modules; what differs is the batch (3 requests and both CFG halves in one forward
here, one request there: a different matmul blocking) and the sampler arithmetic (our plan's
sigma_next - sigma is made in float64 then rounded, the scheduler's in float32). Measured: <= 4e-7 relative
(2e-6 absolute), also over 28 steps at guidance 7.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from workers.config import WorkerConfig
from workers.request.cards import CardError, read_card
from workers.engine import Engine
from workers.decode import decode
from workers.families.sd3 import aspect_sizes
from workers.loading import ModelError, load_model
from workers.models.tiny_sd3 import MAX_TOKENS, make_tiny_sd3
from workers.request.spec import ItemSpec

from . import edit_cases


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return make_tiny_sd3(tmp_path_factory.mktemp("sd3") / "stable-diffusion-3.5-medium")


@pytest.fixture(scope="module")
def model(sd3_dir):
    return load_model(sd3_dir)


def _copy(src, dst, **index_extra):
    shutil.copytree(src, dst)
    index = json.loads((dst / "model_index.json").read_text())
    index["dit_serve"].update(index_extra)
    (dst / "model_index.json").write_text(json.dumps(index))
    return dst


def _pipeline(model):
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    return StableDiffusion3Pipeline(
        transformer=model.transformer, vae=model.vae,
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(model.card.scheduler),
        text_encoder=model.text_encoder, tokenizer=model.tokenizer,
        text_encoder_2=model.text_encoder_2, tokenizer_2=model.tokenizer_2,
        text_encoder_3=model.text_encoder_3, tokenizer_3=model.tokenizer_3)


def _reference(model, spec: ItemSpec) -> torch.Tensor:
    w, h = spec.width or model.card.image_size, spec.height or model.card.image_size
    latents = torch.randn(model.card.latent_shape(w, h), generator=torch.Generator("cpu").manual_seed(spec.seed))[None]
    out = _pipeline(model)(spec.prompt, negative_prompt=spec.negative_prompt, num_inference_steps=spec.steps,
                           guidance_scale=spec.guidance, latents=latents, height=h, width=w,
                           max_sequence_length=model.card.max_tokens, output_type="latent")
    return out.images[0]


def _assert_equal_to_pipeline(model, specs, results):
    for spec, r in zip(specs, results):
        ref = _reference(model, spec)
        err = (r.latents - ref).abs().max().item()
        assert err <= 1e-4 * max(1.0, ref.abs().max().item()), (spec.id, err)


# -- the card ---------------------------------------------------------------------------------------------
def test_the_card_reads_the_sd3_layout(sd3_dir, model):
    card = read_card(sd3_dir)
    assert (card.family, card.conditioning, card.max_tokens, card.dtype) == ("sd3", "text", MAX_TOKENS, "float32")
    assert (card.image_size, card.latent_size, card.latent_channels, card.size_multiple) == (16, 8, 16, 4)
    assert card.prediction_type == "flow" and card.scheduler["shift"] == 3.0
    assert card.defaults == {"sampler": "flow_euler", "steps": 28, "guidance": 7.0}
    assert card.made_sizes() == [(16, 16), (32, 16), (16, 32), (32, 32)]
    assert card.tokenizer_file.endswith("tokenizer_3/tokenizer.json")
    assert model.latent_shape == (16, 8, 8) and not model.learned_sigma
    assert (model.vae_scale, model.vae_shift) == (pytest.approx(1.5305), pytest.approx(0.0609))
    assert type(model.tokenizer).__name__ == "CLIPTokenizer" and model.tokenizer_2.pad_token == "!"


def _medium_layout(root, **extra):
    """The JSON files of stabilityai/stable-diffusion-3.5-medium (configs only: a card reads no weights)."""
    files = {
        "model_index.json": {"_class_name": "StableDiffusion3Pipeline", **({"dit_serve": extra} if extra else {})},
        "transformer/config.json": {"_class_name": "SD3Transformer2DModel", "sample_size": 128, "patch_size": 2,
                                    "in_channels": 16, "pos_embed_max_size": 384, "qk_norm": "rms_norm"},
        "vae/config.json": {"_class_name": "AutoencoderKL", "block_out_channels": [128, 256, 512, 512],
                            "latent_channels": 16, "scaling_factor": 1.5305, "shift_factor": 0.0609},
        "scheduler/scheduler_config.json": {"_class_name": "FlowMatchEulerDiscreteScheduler",
                                            "num_train_timesteps": 1000, "shift": 3.0},
        "text_encoder/config.json": {"architectures": ["CLIPTextModelWithProjection"]},
        "text_encoder_2/config.json": {"architectures": ["CLIPTextModelWithProjection"]},
        "text_encoder_3/config.json": {"architectures": ["T5EncoderModel"]},
        "tokenizer/vocab.json": {}, "tokenizer_2/vocab.json": {}, "tokenizer_3/tokenizer.json": {},
    }
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(json.dumps(content))
    return root


def test_a_full_size_card_lists_aspect_ratio_sizes_and_the_directorys_defaults(tmp_path):
    card = read_card(_medium_layout(tmp_path / "sd35m", defaults={"steps": 40, "guidance": 4.5}))
    assert (card.image_size, card.latent_size, card.size_multiple, card.max_tokens) == (1024, 128, 16, 256)
    assert card.defaults == {"sampler": "flow_euler", "steps": 40, "guidance": 4.5}
    assert card.made_sizes() == [(1024, 1024), (1152, 896), (896, 1152), (1280, 832), (832, 1280),
                                 (1344, 768), (768, 1344), (1536, 640), (640, 1536)]
    assert card.latent_shape(1344, 768) == (16, 96, 168)
    # any multiple of 16 as asked, as StableDiffusion3Pipeline makes it; a side off the multiple refused, as it does
    assert card.size_for(1920, 1088) == (1920, 1088) and card.size_for(256, 256) == (256, 256)
    with pytest.raises(ValueError, match="multiples of 16 px from 16 to"):
        card.size_for(1920, 1080)
    assert read_card(_medium_layout(tmp_path / "long", max_sequence_length=512)).max_tokens == 512
    assert aspect_sizes(16, 4)[0] == (16, 16) and all(w % 4 == 0 and h % 4 == 0 for w, h in aspect_sizes(16, 4))


@pytest.mark.parametrize("part", ["vae", "scheduler", "text_encoder", "text_encoder_2", "tokenizer",
                                  "tokenizer_2", "tokenizer_3"])
def test_a_missing_part_is_a_card_error_naming_it(tmp_path, part):
    root = _medium_layout(tmp_path / "m")
    shutil.rmtree(root / part)
    with pytest.raises(CardError, match=f"without {part}/"):
        read_card(root)


def test_card_errors_for_what_the_transformer_cannot_make(tmp_path):
    with pytest.raises(CardError, match="larger than the transformer's positional embedding allows"):
        read_card(_medium_layout(tmp_path / "big", sizes=["7168x1024"]))  # 384 patches = 6144 px
    with pytest.raises(CardError, match="multiple of 16 pixels"):
        read_card(_medium_layout(tmp_path / "odd", sizes=["1000x1000"]))
    with pytest.raises(CardError, match="max_sequence_length must be 1..512"):
        read_card(_medium_layout(tmp_path / "long", max_sequence_length=1024))
    root = _medium_layout(tmp_path / "arch")
    (root / "text_encoder_2/config.json").write_text(json.dumps({"architectures": ["CLIPTextModel"]}))
    with pytest.raises(CardError, match="SD3's text_encoder_2 is a CLIPTextModelWithProjection"):
        read_card(root)


def test_t5_is_optional(tmp_path):
    root = _medium_layout(tmp_path / "m")
    shutil.rmtree(root / "text_encoder_3")
    shutil.rmtree(root / "tokenizer_3")
    card = read_card(root)
    assert card.max_tokens == 256 and card.tokenizer_file == ""


# -- loading ----------------------------------------------------------------------------------------------
def test_the_sharded_transformer_loads_every_shard(sd3_dir, model):
    from safetensors.torch import load_file

    shards = sorted((sd3_dir / "transformer").glob("diffusion_pytorch_model-*-of-*.safetensors"))
    assert len(shards) >= 2 and (sd3_dir / "transformer/diffusion_pytorch_model.safetensors.index.json").is_file()
    state = {k: v for f in shards for k, v in load_file(str(f)).items()}
    assert state.keys() == model.transformer.state_dict().keys()
    assert all(torch.equal(model.transformer.state_dict()[k], v) for k, v in state.items())


def test_pickle_weights_are_refused(sd3_dir, tmp_path):
    root = _copy(sd3_dir, tmp_path / "pickled")
    for f in (root / "transformer").glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    with pytest.raises(ModelError, match="only pickle weights.*Convert them to .safetensors"):
        load_model(root)
    root = _copy(sd3_dir, tmp_path / "pickled-t5")
    (root / "text_encoder_3/model.safetensors").rename(root / "text_encoder_3/pytorch_model.bin")
    with pytest.raises(ModelError, match="text_encoder_3 has only pickle weights"):
        load_model(root)


# -- equivalence with the reference pipeline -------------------------------------------------------------
def test_prompts_batched_together_equal_the_diffusers_pipeline_alone(model):
    # three requests in one batch: different prompts (case and spaces kept), negatives, seeds, guidance
    # and step counts; each must equal diffusers' pipeline run alone from the same initial latents
    specs = [ItemSpec(id="a", seed=1, sampler="flow_euler", steps=5, guidance=3.0, prompt="a red cat"),
             ItemSpec(id="b", seed=2, sampler="flow_euler", steps=5, guidance=5.0, prompt="The big Blue house!",
                      negative_prompt="small photo"),
             ItemSpec(id="c", seed=3, sampler="flow_euler", steps=4, guidance=1.5, prompt="  a dog drawn  ")]
    results = Engine(model, WorkerConfig(backend="eager", max_batch=4)).generate(specs)
    _assert_equal_to_pipeline(model, specs, results)
    assert results[0].image.shape == (16, 16, 3)


def test_a_non_square_size_equals_the_pipeline_at_that_size(model):
    specs = [ItemSpec(id="w", seed=5, sampler="flow_euler", steps=4, guidance=4.0, prompt="a green tree",
                      width=32, height=16),
             ItemSpec(id="t", seed=6, sampler="flow_euler", steps=4, guidance=4.0, prompt="a green tree",
                      width=16, height=32)]
    results = Engine(model, WorkerConfig(backend="eager", max_batch=4)).generate(specs)
    assert results[0].latents.shape == (16, 8, 16) and results[1].latents.shape == (16, 16, 8)
    _assert_equal_to_pipeline(model, specs, results)


@pytest.mark.parametrize("how", ["no text_encoder_3", "skip_t5"])
def test_without_t5_equals_the_pipeline_without_text_encoder_3(sd3_dir, tmp_path, how):
    root = (make_tiny_sd3(tmp_path / "no-t5", t5=False) if how == "no text_encoder_3"
            else _copy(sd3_dir, tmp_path / "skip", skip_t5=True))
    model = load_model(root)
    assert model.text_encoder_3 is None and model.tokenizer_3 is None
    assert read_card(root).tokenizer_file == ""  # T5's token count means nothing then
    specs = [ItemSpec(id="a", seed=7, sampler="flow_euler", steps=4, guidance=3.0, prompt="a small dog",
                      negative_prompt="photo")]
    _assert_equal_to_pipeline(model, specs, Engine(model, WorkerConfig(backend="eager", max_batch=2)).generate(specs))
    embeds = model.cache["a small dog"][0]
    assert embeds.shape == (77 + MAX_TOKENS, 64) and not embeds[77:].any()  # T5's part is zeros


def test_encodings_are_cached_and_equal_encode_prompt(model):
    model.cache.clear()
    e = Engine(model, WorkerConfig(backend="eager", max_batch=4))
    e.add_many([ItemSpec(id=str(i), seed=i, sampler="flow_euler", steps=2, guidance=2.0, prompt="A cat")
                for i in range(3)])
    assert sorted(model.cache) == ["", "A cat"]  # one encoding per distinct text, nothing lower-cased
    first = model.cache["A cat"][0]
    e.add(ItemSpec(id="x", seed=9, sampler="flow_euler", steps=2, guidance=2.0, prompt="A cat"))
    assert model.cache["A cat"][0] is first
    embeds, neg, pooled, neg_pooled = _pipeline(model).encode_prompt(
        "A cat", None, None, negative_prompt="", max_sequence_length=MAX_TOKENS)
    # equal up to float32 rounding: we encode "" and "A cat" in one batch, the pipeline one at a time
    for ours, ref in ((model.cache["A cat"][0], embeds[0]), (model.cache["A cat"][1], pooled[0]),
                      (model.cache[""][0], neg[0]), (model.cache[""][1], neg_pooled[0])):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert neg.abs().sum() > 0  # "" is encoded, not zeros


def test_decoding_applies_the_vaes_shift(model):
    latents = torch.randn((1, 16, 8, 8), generator=torch.Generator("cpu").manual_seed(0))
    (ours,) = decode(model, latents)
    with torch.no_grad():  # the pipeline's: latents / scaling_factor + shift_factor
        shifted = model.vae.decode(latents / model.vae.config.scaling_factor + model.vae.config.shift_factor).sample
        unshifted = model.vae.decode(latents / model.vae.config.scaling_factor).sample
    as_uint8 = lambda p: ((p[0].clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy().astype(int)
    assert abs(ours.astype(int) - as_uint8(shifted)).max() <= 1
    assert abs(ours.astype(int) - as_uint8(unshifted)).max() > 1  # the shift shows at this size


# -- image-to-image and inpainting (workers.edits) ----------------------------------------------------------
def _edit_reference(model, spec: ItemSpec) -> torch.Tensor:
    """StableDiffusion3Img2ImgPipeline, or StableDiffusion3InpaintPipeline for a spec with a mask, on the decoded
    image (and mask), with a generator seeded as the request's: it draws the posterior, then the noise."""
    import diffusers as d

    cls = d.StableDiffusion3InpaintPipeline if spec.mask else d.StableDiffusion3Img2ImgPipeline
    pipe = cls(**{k: v for k, v in _pipeline(model).components.items() if k in cls._get_signature_keys(cls)[0]})
    w, h = spec.width or model.card.image_size, spec.height or model.card.image_size
    return pipe(spec.prompt, negative_prompt=spec.negative_prompt, strength=spec.strength, num_inference_steps=spec.steps,
                guidance_scale=spec.guidance, height=h, width=w, max_sequence_length=model.card.max_tokens,
                output_type="latent", generator=edit_cases.generator(spec), **edit_cases.decoded(spec)).images[0]


@pytest.mark.parametrize("strength", edit_cases.STRENGTHS)
def test_image_to_image_equals_the_img2img_pipeline(model, strength):
    spec = ItemSpec(id="i", seed=11, sampler="flow_euler", steps=6, guidance=3.0, prompt="a red cat",
                    image=edit_cases.image_bytes(), strength=strength)
    result = Engine(model, WorkerConfig(backend="eager", max_batch=4)).generate([spec])[0]
    edit_cases.assert_close(result.latents, _edit_reference(model, spec))


@pytest.mark.parametrize("strength", edit_cases.STRENGTHS)
def test_inpainting_equals_the_inpaint_pipeline(model, strength):
    spec = ItemSpec(id="m", seed=12, sampler="flow_euler", steps=6, guidance=3.0, prompt="a green tree",
                    image=edit_cases.image_bytes(seed=1), mask=edit_cases.mask_bytes(), strength=strength)
    result = Engine(model, WorkerConfig(backend="eager", max_batch=4)).generate([spec])[0]
    edit_cases.assert_close(result.latents, _edit_reference(model, spec))


def test_edits_and_text_rows_batched_together_each_equal_their_pipeline(model):
    """Text-to-image, image-to-image and inpainting requests of one model in one engine, joining at different
    steps, a non-square size among them: each equals its own reference pipeline run alone."""
    image, mask = edit_cases.image_bytes(seed=2), edit_cases.mask_bytes(box=(0.2, 0.1, 0.7, 0.9))
    specs = [ItemSpec(id="t", seed=1, sampler="flow_euler", steps=5, guidance=3.0, prompt="a red cat"),
             ItemSpec(id="i", seed=2, sampler="flow_euler", steps=6, guidance=4.0, prompt="a dog", image=image,
                      strength=0.6),
             ItemSpec(id="m", seed=3, sampler="flow_euler", steps=5, guidance=2.0, prompt="a house", image=image,
                      mask=mask, strength=0.8, negative_prompt="small"),
             ItemSpec(id="w", seed=4, sampler="flow_euler", steps=4, guidance=3.0, prompt="a tree", image=image,
                      mask=mask, strength=1.0, width=32, height=16)]
    results = Engine(model, WorkerConfig(backend="eager", max_batch=4)).generate(specs, max_active=2)
    for spec, r in zip(specs, results):
        ref = _edit_reference(model, spec) if spec.image else _reference(model, spec)
        edit_cases.assert_close(r.latents, ref, spec.id)
