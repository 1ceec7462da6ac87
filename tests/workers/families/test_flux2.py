"""FLUX.2 through our engine equals diffusers' Flux2KleinPipeline and Flux2Pipeline: tiny random pipeline
directories in the real layouts of FLUX.2-klein-4B (step-distilled), its base variant (classifier-free guidance),
FLUX.2-klein-9B (Qwen3-8B's proportions) and FLUX.2-dev (embedded guidance), made here, offline
(``workers.models.tiny_flux2``); the same initial latents; float32 on the CPU.

Tolerance: max |ours - reference| <= 1e-4 * max(1, max |reference|) on the final latents ([klein]: the VAE's
latents the pipeline returns, ours de-normalised and unpatchified by ``Flux2VAE.latents``; [dev]: the packed,
normalised latents it returns). The two sides differ only in float32 rounding: the engine batches requests
(and both CFG halves) that the pipeline runs one at a time, and computes the Euler update from float64-built
coefficients. Decoded images: within 1 of 255.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from workers.config import WorkerConfig
from workers.engine import Engine
from workers.families import family_named
from workers.families.flux2 import (DEV_ENCODER_PARAMS, DEV_PARAMS, KLEIN, KLEIN_DISTILLED, KLEIN_ENCODER_PARAMS,
                                    KLEIN_PARAMS)
from workers.families.flux2.runtime import (empirical_mu, image_ids, pack, patchify, prompt_embeds, prompt_ids,
                                            text_ids, unpack, unpatchify)
from workers.loading import ModelError, load_model
from workers.models.tiny_flux2 import (DEV_MAX_TOKENS, IMAGE_SIZE, KLEIN_9B_ENCODER, MAX_TOKENS, WIDTH,
                                       make_tiny_flux2)
from workers.request.cards import CardError, read_card
from workers.request.spec import ItemSpec

from . import edit_cases

EAGER = WorkerConfig(backend="eager", max_batch=4)


@pytest.fixture(scope="module")
def klein_dir(tmp_path_factory):
    return make_tiny_flux2(tmp_path_factory.mktemp("flux2") / "klein")


@pytest.fixture(scope="module")
def base_dir(klein_dir, tmp_path_factory):
    """[klein] base: the same weights without ``is_distilled`` (Flux2KleinPipeline's default: CFG)."""
    return _layout_copy(klein_dir, tmp_path_factory.mktemp("flux2") / "klein-base", index={"is_distilled": None})


@pytest.fixture(scope="module")
def klein9_dir(tmp_path_factory):
    """[klein] 9B's layout: a wider Qwen3 of 36 layers with its LM head untied, a wider transformer."""
    return make_tiny_flux2(tmp_path_factory.mktemp("flux2") / "klein-9b", seed=2, nine_b=True)


@pytest.fixture(scope="module")
def dev_dir(tmp_path_factory):
    return make_tiny_flux2(tmp_path_factory.mktemp("flux2") / "dev", seed=1, dev=True)


@pytest.fixture(scope="module")
def klein(klein_dir):
    return load_model(klein_dir)


@pytest.fixture(scope="module")
def base(base_dir):
    return load_model(base_dir)


@pytest.fixture(scope="module")
def dev(dev_dir):
    return load_model(dev_dir)


def _layout_copy(src, dst, drop: str = "", index: dict | None = None):
    """A copy of a pipeline directory without ``drop``; ``index`` updates model_index.json (None values removed)."""
    shutil.copytree(src, dst)
    if drop:
        shutil.rmtree(dst / drop)
    if index is not None:
        old = json.loads((dst / "model_index.json").read_text())
        new = {k: v for k, v in {**old, **index}.items() if v is not None}
        (dst / "model_index.json").write_text(json.dumps(new))
    return dst


def _pipeline(model):
    """The reference pipeline from our loaded components (flow_grid is ours: the pipelines pass that grid)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Pipeline

    config = {k: v for k, v in model.card.scheduler.items() if k != "flow_grid"}
    parts = dict(scheduler=FlowMatchEulerDiscreteScheduler.from_config(config), vae=model.vae.vae,
                 text_encoder=model.text_encoder, tokenizer=model.tokenizer, transformer=model.transformer)
    pipe = (Flux2KleinPipeline(**parts, is_distilled=model.card.guidance_mode == "none") if model.pipeline == KLEIN
            else Flux2Pipeline(**parts))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _initial(model, spec) -> torch.Tensor:
    width, height = spec.width or IMAGE_SIZE, spec.height or IMAGE_SIZE
    return torch.randn(model.card.latent_shape(width, height), generator=torch.Generator("cpu").manual_seed(spec.seed))


def _reference(model, spec: ItemSpec, **kw) -> torch.Tensor:
    """The pipeline's final latents from the engine's initial ones (its pre-pack latents, (1, 128, h, w)): [klein]'s
    (32, 2h, 2w), [dev]'s packed (h w, 128). A request's negative prompt reaches [klein] base as
    ``negative_prompt_embeds`` of the pipeline's own encode_prompt."""
    pipe = _pipeline(model)
    length = model.card.max_tokens
    if model.card.guidance_mode == "cfg" and spec.negative_prompt:
        kw["negative_prompt_embeds"] = pipe.encode_prompt(spec.negative_prompt, max_sequence_length=length)[0]
    return pipe(prompt=spec.prompt, height=spec.height or IMAGE_SIZE, width=spec.width or IMAGE_SIZE,
                num_inference_steps=spec.steps, guidance_scale=spec.guidance, latents=_initial(model, spec)[None],
                max_sequence_length=length, output_type="latent", **kw).images[0]


def _assert_equal_to_pipeline(model, specs, results):
    for spec, r in zip(specs, results):
        ref = _reference(model, spec)
        ours = model.vae.latents(r.latents[None])[0] if model.pipeline == KLEIN else pack(r.latents[None])[0]
        assert ours.shape == ref.shape
        err = (ours - ref).abs().max().item()
        assert err <= 1e-4 * max(1.0, ref.abs().max().item()), (spec.id, err)


# -- the card ------------------------------------------------------------------------------------------------
def test_the_cards_of_klein_its_base_and_dev(klein_dir, base_dir, dev_dir):
    k, b, d = read_card(klein_dir), read_card(base_dir), read_card(dev_dir)
    for card in (k, b, d):
        assert (card.family, card.conditioning, card.size_multiple, card.dtype) == ("flux2", "text", 16, "float32")
        assert (card.image_size, card.latent_size, card.latent_channels, card.pixel_space) == (64, 4, 128, False)
        assert card.sizes == ((64, 64), (96, 64), (64, 96)) and card.latent_shape(96, 64) == (128, 4, 6)
        assert card.prediction_type == "flow" and card.tokenizer_file.endswith("tokenizer/tokenizer.json")
        assert card.scheduler["flow_grid"] == "flux" and card.scheduler["use_dynamic_shifting"]
    assert (k.max_tokens, b.max_tokens, d.max_tokens) == (MAX_TOKENS, MAX_TOKENS, DEV_MAX_TOKENS)
    assert (k.guidance_mode, k.defaults) == ("none", {"sampler": "flow_euler", "steps": 4, "guidance": 1.0})
    assert (b.guidance_mode, b.defaults) == ("cfg", {"sampler": "flow_euler", "steps": 50, "guidance": 4.0})
    assert (d.guidance_mode, d.defaults) == ("embedded", {"sampler": "flow_euler", "steps": 50, "guidance": 4.0})


def test_the_real_models_cards(klein_dir, dev_dir, tmp_path):
    """Without dit_serve overrides: native 1024 (latents 128 x 64 x 64), 512 tokens, bfloat16, the native square
    and four ratios both ways at about a megapixel; any multiple of 16 from 16 to 2048, a side off it rounded down
    as prepare_latents does."""
    k = read_card(_layout_copy(klein_dir, tmp_path / "klein", index={"dit_serve": None}))
    d = read_card(_layout_copy(dev_dir, tmp_path / "dev", index={"dit_serve": {"defaults": {"steps": 28}}}))
    for card in (k, d):
        assert (card.image_size, card.latent_size, card.max_tokens, card.dtype) == (1024, 64, 512, "bfloat16")
        assert card.latent_shape(1024, 1024) == (128, 64, 64) and card.latent_shape(1360, 768) == (128, 48, 85)
        assert card.made_sizes()[:3] == [(1024, 1024), (1184, 880), (880, 1184)] and len(card.made_sizes()) == 9
        assert all(w % 16 == 0 and h % 16 == 0 and abs(w * h / 1024**2 - 1) < 0.05 for w, h in card.made_sizes())
        assert card.size_for(16, 2048) == (16, 2048) and card.resolve_size(1920, 1080)[0] == (1920, 1072)
        with pytest.raises(ValueError, match="multiples of 16 px from 16 to 2048"):
            card.size_for(4096, 1024)
    assert d.defaults == {"sampler": "flow_euler", "steps": 28, "guidance": 4.0}


@pytest.mark.parametrize("part", ["vae", "text_encoder", "tokenizer", "scheduler"])
def test_a_missing_part_is_a_card_error_naming_it(klein_dir, tmp_path, part):
    with pytest.raises(CardError, match=f"Flux2KleinPipeline directory without {part}/"):
        read_card(_layout_copy(klein_dir, tmp_path / "klein", drop=part))


def test_a_wrong_encoder_token_limit_or_bare_transformer_is_a_card_error(klein_dir, dev_dir, tmp_path):
    swapped = _layout_copy(dev_dir, tmp_path / "swapped", index={"_class_name": KLEIN})  # a Mistral3 for klein
    with pytest.raises(CardError, match="text_encoder/config.json has model_type 'mistral3'; a Flux2KleinPipeline's "
                                        "text_encoder is the Qwen3 text encoder"):
        read_card(swapped)
    with pytest.raises(CardError, match="max_sequence_length must be a whole number from 1 to 4096"):
        read_card(_layout_copy(klein_dir, tmp_path / "long", index={"dit_serve": {"max_sequence_length": 0}}))
    with pytest.raises(CardError, match="a FLUX.2 transformer without its pipeline"):
        read_card(klein_dir / "transformer")


def test_the_9b_layout_and_its_base_read_as_klein_as_4b_does(klein_dir, klein9_dir, tmp_path):
    """FLUX.2-klein-9B differs from 4B in sizes only (Qwen3-8B for Qwen3-4B, a wider transformer): the card reads
    model_index.json's class and is_distilled and the encoder's model_type, so 9B's card is 4B's but for its path,
    and its base variant's is [klein] base's (CFG, 50 steps at 4.0)."""
    import dataclasses

    nine, four = read_card(klein9_dir), read_card(klein_dir)
    width = KLEIN_9B_ENCODER["hidden_size"]
    assert json.loads((klein9_dir / "transformer" / "config.json").read_text())["joint_attention_dim"] == 3 * width
    blank = dict(name="", path="", tokenizer_file="")
    assert dataclasses.replace(nine, **blank) == dataclasses.replace(four, **blank)
    assert (nine.family, nine.guidance_mode, nine.defaults) == ("flux2", "none", KLEIN_DISTILLED["defaults"])
    assert nine.tokenizer_file.endswith("klein-9b/tokenizer/tokenizer.json")
    base9 = read_card(_layout_copy(klein9_dir, tmp_path / "klein-base-9b", index={"is_distilled": None}))
    assert (base9.guidance_mode, base9.defaults) == ("cfg", {"sampler": "flow_euler", "steps": 50, "guidance": 4.0})


# -- loading -------------------------------------------------------------------------------------------------
def test_sharded_checkpoints_load_as_diffusers_loads_them(klein_dir, klein):
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    assert len(list((klein_dir / "transformer").glob("diffusion_pytorch_model-*-of-*.safetensors"))) > 1
    assert len(list((klein_dir / "text_encoder").glob("model-*-of-*.safetensors"))) > 1
    ref = Flux2Transformer2DModel.from_pretrained(klein_dir / "transformer").state_dict()
    ours = klein.transformer.state_dict()
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)
    vae = AutoencoderKLFlux2.from_pretrained(klein_dir / "vae")
    assert torch.equal(klein.vae.vae.bn.running_var, vae.bn.running_var) and vae.bn.running_var.std() > 0.1
    assert (klein.vae_scale, klein.vae_shift, klein.latent_shape, klein.vae.config.out_channels) == (1.0, 0.0,
                                                                                                     (128, 4, 4), 3)
    assert type(klein.text_encoder).__name__ == "Qwen3ForCausalLM" and klein.pipeline == KLEIN


def test_the_klein_directory_is_one_diffusers_loads_itself(klein_dir, klein):
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(klein_dir, local_files_only=True)
    assert pipe.config.is_distilled and type(pipe.tokenizer).__name__ == type(klein.tokenizer).__name__
    assert torch.equal(pipe.text_encoder.model.embed_tokens.weight, klein.text_encoder.model.embed_tokens.weight)
    chat = [{"role": "user", "content": "a red cat"}]
    assert pipe.tokenizer.apply_chat_template(chat, add_generation_prompt=True, enable_thinking=False) == \
        klein.tokenizer.apply_chat_template(chat, add_generation_prompt=True, enable_thinking=False)
    config = json.loads((klein_dir / "tokenizer" / "tokenizer_config.json").read_text())
    assert "enable_thinking" in config["chat_template"]
    assert not (klein_dir / "tokenizer" / "chat_template.jinja").exists()


def test_the_dev_directory_is_one_diffusers_loads_itself(dev_dir, dev):
    """Flux2Pipeline loads tokenizer/ as a PixtralProcessor, which transformers builds only with torchvision; its
    text-only chat template tokenises as ours (the tokenizer alone with the processor's template)."""
    pytest.importorskip("torchvision")
    from diffusers import Flux2Pipeline

    from workers.families.flux2.runtime import mistral_messages

    pipe = Flux2Pipeline.from_pretrained(dev_dir, local_files_only=True)
    out = pipe.tokenizer.apply_chat_template(mistral_messages(["a red cat", "[IMG]a dog"]), add_generation_prompt=False,
                                             tokenize=True, return_dict=True, return_tensors="pt",
                                             padding="max_length", truncation=True, max_length=DEV_MAX_TOKENS)
    ids, mask = prompt_ids(dev, ["a red cat", "[IMG]a dog"])
    assert torch.equal(out["input_ids"], ids) and torch.equal(out["attention_mask"], mask)


def test_a_missing_shard_and_pickles_are_refused(klein_dir, tmp_path):
    gone = _layout_copy(klein_dir, tmp_path / "gone")
    (gone / "transformer/diffusion_pytorch_model-00002-of-00004.safetensors").unlink()
    with pytest.raises(ModelError, match="lacks shards its index names: diffusion_pytorch_model-00002-of-00004"):
        load_model(gone)
    for part, stem in (("transformer", "diffusion_pytorch_model"), ("text_encoder", "model")):
        pickled = _layout_copy(klein_dir, tmp_path / f"pickled-{part}")
        for f in (pickled / part).glob(f"{stem}*"):
            f.unlink()
        (pickled / part / f"{stem}.bin").write_bytes(b"not loaded")
        with pytest.raises(ModelError, match="only pickle weights"):
            load_model(pickled)


def test_the_encoders_rotary_frequencies_stay_float32_in_bfloat16(klein_dir):
    """The loader casts the encoder to the model's dtype; its rotary frequencies are made again in float32, as
    transformers' from_pretrained(dtype=bfloat16) keeps them (the pipelines' encoders)."""
    from transformers import Qwen3ForCausalLM

    from workers.families.flux2.runtime import rotary_in_float32
    from workers.loading import cast

    ref = Qwen3ForCausalLM.from_pretrained(klein_dir / "text_encoder", dtype=torch.bfloat16).model.rotary_emb.inv_freq
    encoder = cast(Qwen3ForCausalLM.from_pretrained(klein_dir / "text_encoder"), "cpu", torch.bfloat16)
    assert encoder.model.rotary_emb.inv_freq.dtype == torch.bfloat16  # the cast rounds them
    rotary_in_float32(encoder)
    assert ref.dtype == torch.float32 and torch.equal(encoder.model.rotary_emb.inv_freq, ref)


# -- the text path -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["klein", "dev"])
def test_prompt_embeddings_are_the_pipelines(variant, klein, dev):
    """Chat template, padding to max_tokens, the attention mask, hidden layers (9, 18, 27) / (10, 20, 30) side by
    side: encode_prompt's embeddings, for prompts batched together; [dev]'s prompt loses "[IMG]" as there."""
    model = {"klein": klein, "dev": dev}[variant]
    texts = ["a red cat", "The big blue house, drawn", "", "[IMG]a dog"]
    ours = prompt_embeds(model, texts)
    ref, ids = _pipeline(model).encode_prompt(texts, max_sequence_length=model.card.max_tokens)
    assert ours.shape == (4, model.card.max_tokens, model.transformer.config.joint_attention_dim) == ref.shape
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(ids[0], text_ids(model.card.max_tokens, "cpu"))
    mask = prompt_ids(model, texts)[1]
    assert (mask[0].sum() < mask[1].sum() < model.card.max_tokens) and (mask[:, 0] == 1).all()  # padded on the right


def test_the_9b_encoder_recipe_is_qwen3_8bs_hidden_states_9_18_27_side_by_side(klein9_dir, klein_dir, tmp_path):
    """[klein] 9B loads its untied Qwen3 and stacks hidden states 9, 18 and 27 of its 36 (not the last three) into
    the transformer's joint_attention_dim, 3 x its width: Flux2KleinPipeline.encode_prompt's embeddings. The 9B
    transformer with 4B's narrower encoder is refused at load, naming both widths."""
    from transformers import Qwen3ForCausalLM

    model = load_model(klein9_dir)
    encoder = model.text_encoder
    width, layers = KLEIN_9B_ENCODER["hidden_size"], KLEIN_9B_ENCODER["num_hidden_layers"]
    assert type(encoder) is Qwen3ForCausalLM and model.pipeline == KLEIN
    assert (encoder.config.hidden_size, encoder.config.num_hidden_layers, encoder.config.tie_word_embeddings) == (
        width, layers, False)
    assert not torch.equal(encoder.lm_head.weight, encoder.model.embed_tokens.weight)  # its own head, loaded
    texts = ["a red cat", "The big blue house, drawn", ""]
    ours = prompt_embeds(model, texts)
    ref = _pipeline(model).encode_prompt(texts, max_sequence_length=MAX_TOKENS)[0]
    assert ours.shape == ref.shape == (3, MAX_TOKENS, 3 * width) == (3, MAX_TOKENS,
                                                                     model.transformer.config.joint_attention_dim)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    ids, mask = prompt_ids(model, texts)
    with torch.no_grad():
        states = encoder.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert len(states) == layers + 1
    for i, k in enumerate((9, 18, 27)):                                       # (3, L, W) each
        torch.testing.assert_close(ours[..., i * width:(i + 1) * width], states[k], rtol=1e-6, atol=1e-6)
    mixed = _layout_copy(klein9_dir, tmp_path / "mixed", drop="text_encoder")
    shutil.copytree(klein_dir / "text_encoder", mixed / "text_encoder")
    refusal = (f"the text encoder \\(27 layers of {WIDTH}\\) does not fit the transformer: Flux2KleinPipeline "
               f"stacks .* the transformer's joint_attention_dim is {3 * width}")
    with pytest.raises(ModelError, match=refusal):
        load_model(mixed)


def test_klein_9b_prompts_batched_equal_the_pipeline(klein9_dir):
    model = load_model(klein9_dir)
    specs = [ItemSpec(id="a", seed=1, sampler="flow_euler", steps=4, guidance=1.0, prompt="a red cat"),
             ItemSpec(id="w", seed=2, sampler="flow_euler", steps=3, guidance=1.0, prompt="a green tree", width=96,
                      height=64)]
    _assert_equal_to_pipeline(model, specs, Engine(model, EAGER).generate(specs))


def test_encodings_are_cached_by_the_prompt_as_given(base):
    base.cache.clear()
    e = Engine(base, EAGER)
    e.add_many([ItemSpec(id=str(i), seed=i, sampler="flow_euler", steps=2, guidance=4.0, prompt="A cat",
                         negative_prompt="blurry") for i in range(3)])
    assert sorted(base.cache) == ["A cat", "blurry"]  # one encoding per distinct text, none lower-cased
    first = base.cache["A cat"][0]
    e.add(ItemSpec(id="x", seed=9, sampler="flow_euler", steps=2, guidance=4.0, prompt="A cat"))
    assert base.cache["A cat"][0] is first and sorted(base.cache) == ["", "A cat", "blurry"]
    assert first.shape == (MAX_TOKENS, 48) and first.device.type == "cpu"


# -- the step: equal to the pipelines ----------------------------------------------------------------------------
def test_packing_patchify_and_ids_are_the_pipelines():
    from diffusers import Flux2KleinPipeline as P

    x = torch.randn(3, 128, 4, 6)
    ids = P._prepare_latent_ids(x)                                        # (3, 24, 4)
    assert torch.equal(pack(x), P._pack_latents(x)) and torch.equal(image_ids(4, 6, "cpu"), ids[0])
    assert torch.equal(unpack(pack(x), 4, 6), P._unpack_latents_with_ids(pack(x), ids, 4, 6))
    y = torch.randn(2, 32, 8, 12)
    assert torch.equal(patchify(y), P._patchify_latents(y)) and torch.equal(unpatchify(patchify(y)), y)
    assert torch.equal(unpatchify(x), P._unpatchify_latents(x))
    assert torch.equal(text_ids(7, "cpu"), P._prepare_text_ids(torch.zeros(1, 7, 3))[0])


def test_the_schedule_is_the_pipelines(klein):
    """plan_kwargs' mu is compute_empirical_mu of the packed sequence length and the request's step count, and the
    plan's timesteps are the scheduler's as the pipeline sets them (its sigmas, that mu)."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu, retrieve_timesteps

    from samplers import make_plan

    config = {k: v for k, v in klein.card.scheduler.items() if k != "flow_grid"}
    for shape, steps in (((128, 4, 4), 4), ((128, 4, 6), 50), ((128, 64, 64), 28), ((128, 96, 96), 4)):
        extra = family_named("flux2").plan_kwargs(klein, shape)
        tokens = shape[1] * shape[2]
        assert extra["mu"](steps) == empirical_mu(tokens, steps) == compute_empirical_mu(tokens, steps)
        sched = FlowMatchEulerDiscreteScheduler.from_config(config)
        retrieve_timesteps(sched, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps),
                           mu=compute_empirical_mu(tokens, steps))
        plan = make_plan("flow_euler", steps, klein.schedule, **extra)
        assert torch.equal(plan.timesteps.float(), sched.timesteps)


def test_klein_distilled_prompts_batched_ignore_guidance_and_equal_the_pipeline(klein):
    # one engine batch: different prompts, seeds, steps and sizes (native and both non-square); "d" is "a" at
    # another scale, which the step-distilled model ignores, as Flux2KleinPipeline does
    specs = [ItemSpec(id="a", seed=1, sampler="flow_euler", steps=4, guidance=1.0, prompt="a red cat"),
             ItemSpec(id="b", seed=2, sampler="flow_euler", steps=3, guidance=1.0, prompt="The big blue house"),
             ItemSpec(id="w", seed=5, sampler="flow_euler", steps=4, guidance=1.0, prompt="a green tree", width=96,
                      height=64),
             ItemSpec(id="t", seed=6, sampler="flow_euler", steps=2, guidance=1.0, prompt="a dog", width=64,
                      height=96),
             ItemSpec(id="d", seed=1, sampler="flow_euler", steps=4, guidance=6.0, prompt="a red cat")]
    results = Engine(klein, EAGER).generate(specs)
    assert [r.latents.shape for r in results[1:4]] == [(128, 4, 4), (128, 4, 6), (128, 6, 4)]
    assert results[2].image.shape == (64, 96, 3) and results[3].image.shape == (96, 64, 3)
    torch.testing.assert_close(results[0].latents, results[4].latents, rtol=0, atol=1e-6)  # no guidance input, no CFG
    _assert_equal_to_pipeline(klein, specs[:4], results[:4])


def test_klein_base_cfg_per_row_with_negative_prompts_equals_the_pipeline(base):
    """Both CFG halves in one forward; a scale above 1 guides against the negative prompt ("" or the request's),
    a scale of 1 takes the prompt's velocity alone (the pipeline runs no CFG then)."""
    specs = [ItemSpec(id="a", seed=1, sampler="flow_euler", steps=4, guidance=4.0, prompt="a red cat"),
             ItemSpec(id="b", seed=2, sampler="flow_euler", steps=3, guidance=2.5, prompt="the big blue house",
                      negative_prompt="a small dog"),
             ItemSpec(id="c", seed=1, sampler="flow_euler", steps=4, guidance=1.0, prompt="a red cat"),
             ItemSpec(id="w", seed=3, sampler="flow_euler", steps=3, guidance=5.0, prompt="a tree", width=96,
                      height=64)]
    results = Engine(base, EAGER).generate(specs)
    assert (results[0].latents - results[2].latents).abs().max() > 1e-3  # the scale guides
    _assert_equal_to_pipeline(base, specs, results)


def test_dev_embedded_guidance_batched_equals_the_pipeline(dev):
    specs = [ItemSpec(id="a", seed=1, sampler="flow_euler", steps=4, guidance=4.0, prompt="a red cat"),
             ItemSpec(id="b", seed=2, sampler="flow_euler", steps=3, guidance=2.5, prompt="the big blue house"),
             ItemSpec(id="c", seed=1, sampler="flow_euler", steps=4, guidance=1.5, prompt="a red cat"),
             ItemSpec(id="t", seed=4, sampler="flow_euler", steps=3, guidance=4.0, prompt="a dog", width=64, height=96)]
    results = Engine(dev, EAGER).generate(specs)
    assert (results[0].latents - results[2].latents).abs().max() > 1e-3  # the scale reaches the network
    _assert_equal_to_pipeline(dev, specs, results)


@pytest.mark.parametrize("variant", ["klein", "dev"])
def test_images_decode_as_the_pipeline_decodes(variant, klein, dev):
    """Flux2VAE's decode (de-normalise, unpatchify, the VAE) and the engine's uint8 conversion: the pipeline's image."""
    model = {"klein": klein, "dev": dev}[variant]
    spec = ItemSpec(id="a", seed=9, sampler="flow_euler", steps=2, guidance=4.0, prompt="a red cat", width=96,
                    height=64)
    (ours,) = Engine(model, EAGER).generate([spec])
    ref = _pipeline(model)(prompt=spec.prompt, height=64, width=96, num_inference_steps=2, guidance_scale=4.0,
                           latents=_initial(model, spec)[None], max_sequence_length=model.card.max_tokens,
                           output_type="np").images[0]
    assert ours.image.shape == ref.shape == (64, 96, 3)
    assert np.abs(ref * 255 - ours.image.astype(np.float32)).max() <= 1.0


def test_the_rotary_tables_are_made_once_per_shape_and_a_plain_call_makes_its_own(klein_dir, monkeypatch):
    from diffusers.models.transformers.transformer_flux2 import Flux2PosEmbed

    model = load_model(klein_dir)  # its own: make_step patches its transformer's pos_embed
    calls = []
    real = Flux2PosEmbed.forward
    monkeypatch.setattr(Flux2PosEmbed, "forward", lambda self, ids: calls.append(ids.shape[0]) or real(self, ids))
    specs = [ItemSpec(id=str(i), seed=i, sampler="flow_euler", steps=3, guidance=1.0, prompt="a cat") for i in range(2)]
    Engine(model, EAGER).generate(specs)
    assert calls == [16, MAX_TOKENS]  # made with the step (image, text), none in its 3 steps
    pos = model.transformer.pos_embed
    assert type(pos).__name__ == "GivenFlux2PosEmbed" and pos._given_rotary is None
    ids = torch.zeros(5, 4, dtype=torch.long)
    for got, want in zip(pos(ids), real(pos, ids)):  # nothing handed over: its own
        assert torch.equal(got, want)


def test_previews_map_the_normalised_latents_as_comfyui_does(klein):
    """ComfyUI's Flux2 map reads the 32 channels of the latents unpatchified; ours, per 128-channel cell, is the mean
    of that over the cell's 2x2 pixels."""
    from workers.families import preview_map_of
    from workers.families.flux2 import FLUX2_RGB
    from workers.families.previews import to_rgb

    pmap = preview_map_of(klein.card)
    assert len(pmap.weight) == 128 and pmap.bias == (-0.0329, -0.0718, -0.0851)
    z = torch.randn(1, 128, 4, 4, generator=torch.Generator().manual_seed(0))
    comfy = torch.einsum("bchw,cr->brhw", unpatchify(z), torch.tensor(FLUX2_RGB))
    comfy = comfy + torch.tensor(pmap.bias).view(3, 1, 1)
    want = ((torch.nn.functional.avg_pool2d(comfy, 2).clamp(-1, 1) + 1) * 127.5).round()      # (1, 3, 4, 4)
    got = to_rgb(z, pmap).permute(0, 3, 1, 2).float()
    assert (got - want).abs().max() <= 1


# -- the built-ins ---------------------------------------------------------------------------------------------
SMALL = dict(transformer=dict(num_layers=1, num_single_layers=1, num_attention_heads=2, attention_head_dim=16,
                              axes_dims_rope=(4, 4, 4, 4), joint_attention_dim=48, timestep_guidance_channels=32),
             vae=dict(block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=8))  # still /8
SMALL_ENCODERS = {"flux2-klein-1024": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=27,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=8),
                  "flux2-dev-1024": dict(text_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=30,
                                                          num_attention_heads=2, num_key_value_heads=1, head_dim=8),
                                         vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                            num_attention_heads=2, head_dim=8, image_size=56))}


def test_the_cards_of_the_builtins():
    k, d = read_card("flux2-klein-1024"), read_card("flux2-dev-1024")
    for card in (k, d):
        assert (card.family, card.conditioning, card.image_size, card.latent_channels, card.latent_size) == (
            "flux2", "text", 1024, 128, 64)
        assert (1024, 1024) in card.sizes and (1360, 768) in card.sizes and card.max_tokens == 512
        assert card.scheduler["use_dynamic_shifting"] and card.scheduler["flow_grid"] == "flux"
        assert card.size_range == (16, 2048) and card.rounds_down and card.prediction_type == "flow"
    assert (k.guidance_mode, k.defaults) == ("none", {"sampler": "flow_euler", "steps": 4, "guidance": 1.0})
    assert (d.guidance_mode, d.defaults) == ("embedded", {"sampler": "flow_euler", "steps": 50, "guidance": 4.0})


def test_full_size_parameter_counts_on_meta():
    """FLUX.2-klein-4B: transformer 3.88B, Qwen3-4B 4.02B (tied embeddings); FLUX.2-dev: transformer 32.2B,
    Mistral-Small-3.2-24B 24.0B (language model 23.6B with its untied LM head, Pixtral 0.4B); the VAE 84M."""
    from workers.families.flux2.builtin import on_meta

    k, d = on_meta("flux2-klein-1024", 1024), on_meta("flux2-dev-1024", 1024)
    count = {name: {p: sum(t.numel() for t in m.parameters()) for p, m in mods.items()}
             for name, mods in (("klein", k), ("dev", d))}
    assert count == {"klein": {"transformer": 3_875_544_576, "vae": 84_046_115, "text_encoder": 4_022_468_096},
                     "dev": {"transformer": 32_223_281_152, "vae": 84_046_115, "text_encoder": 24_011_361_280}}
    assert KLEIN_PARAMS == 3_875_544_576 + 84_046_115 and KLEIN_ENCODER_PARAMS == 4_022_468_096
    assert DEV_PARAMS == 32_223_281_152 + 84_046_115 and DEV_ENCODER_PARAMS == 24_011_361_280
    for mods, layers in ((k, 3), (d, 3)):  # the stacked layers' width is the transformer's text width
        text = mods["text_encoder"].get_decoder().config
        assert layers * text.hidden_size == mods["transformer"].config.joint_attention_dim


@pytest.mark.parametrize("name", ["flux2-klein-1024", "flux2-dev-1024"])
def test_a_shrunk_builtin_is_whole_and_generates(name):
    """Built on the meta device and materialised: no meta tensors, finite, frozen; the buffers materialise has no
    rule for equal a normal build's; its tokenizer's ids inside the encoder's vocabulary; finite images."""
    import dataclasses

    from workers.families.flux2 import runtime

    card = dataclasses.replace(read_card(name), image_size=64, latent_size=4, max_tokens=64, sizes=((64, 64),))
    model = runtime._load_builtin(card, "cpu", torch.float32, **SMALL, text_encoder=SMALL_ENCODERS[name])
    for m in (model.transformer, model.vae.vae, model.text_encoder):
        tensors = [*m.parameters(), *m.buffers()]
        assert not any(t.is_meta for t in tensors) and all(t.isfinite().all() for t in tensors if t.is_floating_point())
        assert not m.training and not any(p.requires_grad for p in m.parameters())
    normal = type(model.vae.vae).from_config(model.vae.vae.config)
    assert all(torch.equal(a, b) for a, b in zip(model.vae.vae.bn.buffers(), normal.bn.buffers()))
    fresh = type(model.text_encoder)(model.text_encoder.config)
    assert all(torch.equal(b, dict(fresh.named_buffers())[k]) for k, b in model.text_encoder.named_buffers())
    ids = prompt_ids(model, ["A photo of a red cat sitting on a wooden table at sunset."])[0]
    assert ids.max() < model.text_encoder.get_decoder().config.vocab_size
    spec = ItemSpec(id="a", seed=0, sampler="flow_euler", steps=2, guidance=4.0, prompt="a cat")
    (r,) = Engine(model, EAGER).generate([spec])
    assert r.image.shape == (64, 64, 3) and r.latents.isfinite().all() and r.latents.abs().max() > 0


# -- image-to-image and inpainting (workers.edits) ----------------------------------------------------------
# diffusers has no FLUX.2 img2img pipeline, and Flux2KleinInpaintPipeline also feeds the image as reference tokens
# (another model input). The rule: FluxImg2ImgPipeline's and FluxInpaintPipeline's, with FLUX.2's encoding (the
# VAE's mode, patchified and batch-norm normalised, as Flux2KleinInpaintPipeline's _encode_vae_image) and its mask
# (bilinear onto the packed grid, as its prepare_mask_latents). The reference: the family's pipeline given the cut
# sigmas (the same values as the full grid's tail: the shift is per sigma, mu from the full step count), latents
# noised by its scheduler's scale_noise, and the inpainting blend in its step-end callback.
def _edit_reference(model, spec: ItemSpec) -> torch.Tensor:
    from diffusers import Flux2KleinInpaintPipeline

    pipe = _pipeline(model)
    width, height = spec.width or IMAGE_SIZE, spec.height or IMAGE_SIZE
    n, (_, h, w) = spec.steps, model.card.latent_shape(width, height)
    sigmas = np.linspace(1.0, 1 / n, n)[edit_cases.start_of(n, spec.strength):]
    mu = empirical_mu(h * w, n)
    encoder = Flux2KleinInpaintPipeline(scheduler=pipe.scheduler, vae=model.vae.vae, text_encoder=model.text_encoder,
                                        tokenizer=model.tokenizer, transformer=model.transformer)
    gen = edit_cases.generator(spec)
    x0 = encoder._encode_vae_image(edit_cases.pipeline_image(spec, width, height), gen)   # (1, 128, h, w), no draw
    noise = torch.randn(x0.shape, generator=gen)
    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    scheduler.set_timesteps(sigmas=sigmas, mu=mu)
    x = noise if spec.mask and spec.strength == 1 else edit_cases.noised(scheduler, x0, noise, scheduler.timesteps[0])
    kw = {}
    if spec.mask:
        mask = torch.nn.functional.interpolate(edit_cases.pipeline_mask(spec, width, height), size=(h, w),
                                               mode="bilinear")
        kw["callback_on_step_end"] = edit_cases.blend_callback(pack(x0), pack(noise), pack(mask))
    if model.card.guidance_mode == "cfg" and spec.negative_prompt:
        kw["negative_prompt_embeds"] = pipe.encode_prompt(spec.negative_prompt,
                                                          max_sequence_length=model.card.max_tokens)[0]
    return pipe(prompt=spec.prompt, height=height, width=width, num_inference_steps=n, sigmas=sigmas,
                guidance_scale=spec.guidance, latents=x, max_sequence_length=model.card.max_tokens,
                output_type="latent", **kw).images[0]


def _assert_edit_equal(model, spec, result):
    ref = _edit_reference(model, spec)
    ours = model.vae.latents(result.latents[None])[0] if model.pipeline == KLEIN else pack(result.latents[None])[0]
    edit_cases.assert_close(ours, ref, spec.id)


@pytest.mark.parametrize("strength", edit_cases.STRENGTHS)
def test_image_to_image_follows_the_flux_img2img_rule(klein, strength):
    spec = ItemSpec(id="i", seed=51, sampler="flow_euler", steps=6, guidance=1.0, prompt="a red cat",
                    image=edit_cases.image_bytes(), strength=strength)
    _assert_edit_equal(klein, spec, Engine(klein, EAGER).generate([spec])[0])


@pytest.mark.parametrize("strength", edit_cases.STRENGTHS)
def test_inpainting_follows_the_flux_inpaint_rule(klein, strength):
    spec = ItemSpec(id="m", seed=52, sampler="flow_euler", steps=6, guidance=1.0, prompt="a green tree",
                    image=edit_cases.image_bytes(seed=1), mask=edit_cases.mask_bytes(box=(0.3, 0.2, 1, 0.7)),
                    strength=strength)
    _assert_edit_equal(klein, spec, Engine(klein, EAGER).generate([spec])[0])


def test_edits_of_base_and_dev_batched_with_text_rows_follow_the_rule(base, dev):
    """[klein] base: CFG rows and rows at scale 1 (the NO_CFG step and its inpainting variant) with text rows in
    one engine; [dev]: the embedded scale. Each equals its reference run alone."""
    image, mask = edit_cases.image_bytes(seed=2), edit_cases.mask_bytes(box=(0, 0, 0.5, 1))
    specs = [ItemSpec(id="t", seed=1, sampler="flow_euler", steps=4, guidance=4.0, prompt="a red cat"),
             ItemSpec(id="i", seed=2, sampler="flow_euler", steps=5, guidance=3.0, prompt="a dog", image=image,
                      strength=0.6, negative_prompt="a small dog"),
             ItemSpec(id="m", seed=3, sampler="flow_euler", steps=4, guidance=1.0, prompt="a house", image=image,
                      mask=mask, strength=0.8),
             ItemSpec(id="w", seed=4, sampler="flow_euler", steps=4, guidance=2.0, prompt="a tree", image=image,
                      mask=mask, strength=0.6, width=96, height=64)]
    engine = Engine(base, EAGER)
    for spec, r in zip(specs, engine.generate(specs)):
        if spec.image:
            _assert_edit_equal(base, spec, r)
        else:
            _assert_equal_to_pipeline(base, [spec], [r])
    assert any(k.endswith(":no-cfg+inpaint") for k in engine.stats()["groups"])
    for spec, r in zip(specs[1:], Engine(dev, EAGER).generate(specs[1:])):
        _assert_edit_equal(dev, spec, r)
