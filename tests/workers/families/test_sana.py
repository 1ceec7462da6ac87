"""Sana through our engine equals diffusers' SanaPipeline: tiny random pipeline directories in the real layout of
Efficient-Large-Model/Sana_1600M_1024px_diffusers (sharded transformer and Gemma-2, a Gemma tokenizer, a 32x
32-channel DC-AE, the DPMSolverMultistepScheduler flow config), made here, offline; the same initial latents;
float32 on the CPU.

Tolerance: max |ours - reference| <= 1e-4 * max(1, max |reference|) on the final latents. The two sides differ
only in float32 rounding: the engine batches requests (both CFG halves, several prompts) that the pipeline runs
one at a time, and computes the DPM-Solver++ update from float64-built coefficients (samplers.flow_dpmpp_2m).
Decoded images: within one uint8 level of the pipeline's.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import shutil

import pytest
import torch

from workers.config import WorkerConfig
from workers.engine import Engine
from workers.families import family_named
from workers.families.sana import COMPLEX_HUMAN_INSTRUCTION, GEMMA2_2B_PARAMS, SANA_1600M_PARAMS
from workers.loading import ModelError, load_model
from workers.models.tiny_sana import IMAGE_SIZE, MAX_TOKENS, make_tiny_sana
from workers.request.cards import CardError, read_card
from workers.request.spec import ItemSpec

from . import edit_cases

EAGER = WorkerConfig(backend="eager", max_batch=4)
# diffusers 0.42 on numpy 2 warns on every DPMSolverMultistepScheduler.set_timesteps (np.array of a tensor)
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


@pytest.fixture(scope="module")
def sana_dir(tmp_path_factory):
    return make_tiny_sana(tmp_path_factory.mktemp("sana") / "sana-tiny")


@pytest.fixture(scope="module")
def model(sana_dir):
    return load_model(sana_dir)


def _pipe(model, euler: bool = False):
    """SanaPipeline from our loaded components: the card's scheduler, or FlowMatchEulerDiscreteScheduler at its
    flow_shift swapped in (``euler``)."""
    from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, SanaPipeline

    cfg = model.card.scheduler
    scheduler = (FlowMatchEulerDiscreteScheduler(shift=cfg["flow_shift"]) if euler
                 else DPMSolverMultistepScheduler.from_config(cfg))
    return SanaPipeline(tokenizer=model.tokenizer, text_encoder=model.text_encoder, vae=model.vae.vae,
                        transformer=model.transformer, scheduler=scheduler)


def _reference(model, spec: ItemSpec, euler: bool = False, output_type: str = "latent", **kwargs) -> torch.Tensor:
    """The pipeline's output for one request, from the engine's initial latents (as Engine._admit draws them)."""
    width, height = spec.width or IMAGE_SIZE, spec.height or IMAGE_SIZE
    x = torch.randn(model.card.latent_shape(width, height), generator=torch.Generator("cpu").manual_seed(spec.seed))
    return _pipe(model, euler)(spec.prompt, negative_prompt=spec.negative_prompt, num_inference_steps=spec.steps,
                               guidance_scale=spec.guidance, height=height, width=width, latents=x[None],
                               max_sequence_length=model.card.max_tokens, use_resolution_binning=False,
                               output_type=output_type, **kwargs).images[0]


def _assert_equal_to_pipeline(model, specs, results, euler: bool = False, **kwargs):
    for spec, r in zip(specs, results):
        ref = _reference(model, spec, euler, **kwargs)
        err = (r.latents - ref).abs().max().item()
        assert err <= 1e-4 * max(1.0, ref.abs().max().item()), (spec.id, err)


def _layout_copy(src, dst, drop: str = "", dit_serve: dict | None = None, edit: dict | None = None):
    """A copy of a pipeline directory without ``drop``; ``dit_serve`` replaces model_index's section; ``edit``:
    {"part/file.json": {key: value}} merged into those JSON files."""
    shutil.copytree(src, dst)
    if drop:
        shutil.rmtree(dst / drop)
    if dit_serve is not None:
        edit = {**(edit or {}), "model_index.json": {"dit_serve": dit_serve}}
    for file, keys in (edit or {}).items():
        cfg = json.loads((dst / file).read_text())
        (dst / file).write_text(json.dumps({**cfg, **keys}))
    return dst


# -- the card ------------------------------------------------------------------------------------------------
def test_the_card_reads_the_sana_layout(sana_dir, model):
    card = read_card(sana_dir)
    assert (card.family, card.conditioning, card.max_tokens, card.size_multiple) == ("sana", "text", MAX_TOKENS, 32)
    assert (card.image_size, card.latent_size, card.latent_channels, card.pixel_space) == (128, 4, 32, False)
    assert card.sizes == ((128, 128), (192, 128), (128, 192)) and card.latent_shape(192, 128) == (32, 4, 6)
    assert card.defaults == {"sampler": "flow_dpmpp_2m", "steps": 20, "guidance": 4.5}
    assert (card.prediction_type, card.guidance_mode, card.lowercase_prompts, card.dtype) == (
        "flow_prediction", "cfg", True, "float32")
    assert card.tokenizer_file.endswith("tokenizer/tokenizer.json")
    assert (model.vae_scale, model.vae_shift, model.latent_shape) == (0.41407, 0.0, (32, 4, 4))
    assert model.vae.config.out_channels == 3 and model.vae.dtype == torch.float32


def test_the_real_models_cards(sana_dir, tmp_path):
    """Without dit_serve overrides, as the published configs say: 1024 px (sample_size 32), 2K (64) and 4K (128,
    flow_shift 6) with SanaPipeline's bins; bfloat16, 300 tokens, 20 steps of flow_dpmpp_2m at 4.5; a directory
    saved with FlowMatchEulerDiscreteScheduler samples with flow_euler."""
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import ASPECT_RATIO_1024_BIN
    from diffusers.pipelines.sana.pipeline_sana import ASPECT_RATIO_4096_BIN

    one_k = read_card(_layout_copy(sana_dir, tmp_path / "1k", dit_serve={},
                                   edit={"transformer/config.json": {"sample_size": 32}}))
    assert (one_k.image_size, one_k.latent_size, one_k.max_tokens, one_k.dtype) == (1024, 32, 300, "bfloat16")
    assert one_k.defaults == {"sampler": "flow_dpmpp_2m", "steps": 20, "guidance": 4.5}
    assert set(one_k.sizes) == {(int(w), int(h)) for h, w in ASPECT_RATIO_1024_BIN.values()}
    assert one_k.made_sizes()[0] == (1024, 1024) and one_k.size_range == (0, 0)
    (w, h), note = one_k.resolve_size(1920, 1080)  # the pipeline's classify_height_width_bin: ratio 0.5625 -> 0.57
    assert (w, h) == (1344, 768) and "nearest aspect ratio" in note
    four_k = read_card(_layout_copy(sana_dir, tmp_path / "4k", dit_serve={}, edit={
        "transformer/config.json": {"sample_size": 128, "interpolation_scale": 2.0},
        "scheduler/scheduler_config.json": {"flow_shift": 6.0}}))
    assert (four_k.image_size, four_k.latent_size, four_k.scheduler["flow_shift"]) == (4096, 128, 6.0)
    assert set(four_k.sizes) == {(int(w), int(h)) for h, w in ASPECT_RATIO_4096_BIN.values()}
    euler = read_card(_layout_copy(make_tiny_sana(tmp_path / "euler-src", flow_euler=True), tmp_path / "euler",
                                   dit_serve={"defaults": {"steps": 10}}))
    assert euler.defaults == {"sampler": "flow_euler", "steps": 10, "guidance": 4.5}
    assert euler.prediction_type == "flow" and euler.scheduler["shift"] == 3.0


def test_the_bins_are_the_pipelines():
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import ASPECT_RATIO_512_BIN, ASPECT_RATIO_1024_BIN
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma import ASPECT_RATIO_2048_BIN
    from diffusers.pipelines.sana.pipeline_sana import ASPECT_RATIO_4096_BIN

    from workers.families.sana.bins import SANA_BINS

    for sample_size, table in ((16, ASPECT_RATIO_512_BIN), (32, ASPECT_RATIO_1024_BIN), (64, ASPECT_RATIO_2048_BIN),
                               (128, ASPECT_RATIO_4096_BIN)):
        assert SANA_BINS[sample_size] == {float(r): (int(h), int(w)) for r, (h, w) in table.items()}, sample_size


def test_the_api_offers_both_flow_samplers_and_bounds_the_steps(sana_dir):
    """GET /v1/models lists flow_euler and flow_dpmpp_2m; a job takes the card's defaults; past 500 steps (flow_shift
    3) flow_dpmpp_2m's first two timesteps coincide, which diffusers cannot run: refused at the API, naming steps."""
    from dit_serve.schemas import JobRequest
    from dit_serve.server.catalog import Catalog, model_entry
    from dit_serve.server.config import LimitsConfig

    card = read_card(sana_dir)
    assert model_entry(card).samplers == ["flow_euler", "flow_dpmpp_2m"]
    catalog = Catalog([card], LimitsConfig(max_steps=10_000))
    params = catalog.resolve_job(JobRequest(prompts=["a cat"])).params
    assert (params.sampler, params.steps, params.guidance, params.negative_prompt) == ("flow_dpmpp_2m", 20, 4.5, "")
    assert catalog.resolve_job(JobRequest(prompts=["a cat"], steps=500)).params.steps == 500
    with pytest.raises(Exception, match="use at most 500 steps") as e:
        catalog.resolve_job(JobRequest(prompts=["a cat"], steps=501))
    assert e.value.param == "steps"
    assert catalog.resolve_job(JobRequest(prompts=["a cat"], sampler="flow_euler", steps=1000)).params.steps == 1000
    with pytest.raises(Exception, match="supports prediction_type") as e:
        catalog.resolve_job(JobRequest(prompts=["a cat"], sampler="dpmpp_2m"))
    assert e.value.param == "sampler"


@pytest.mark.parametrize("part", ["vae", "text_encoder", "tokenizer", "scheduler"])
def test_a_missing_part_is_a_card_error_naming_it(sana_dir, tmp_path, part):
    with pytest.raises(CardError, match=f"Sana pipeline without {part}/"):
        read_card(_layout_copy(sana_dir, tmp_path / "sana", drop=part))


@pytest.mark.parametrize("edit, match", [
    ({"text_encoder/config.json": {"model_type": "t5"}}, "text_encoder/config.json has model_type 't5'"),
    ({"vae/config.json": {"_class_name": "AutoencoderKL"}}, "vae/config.json is a AutoencoderKL"),
    ({"scheduler/scheduler_config.json": {"use_flow_sigmas": False}}, "samples with DPMSolverMultistepScheduler on"),
    ({"scheduler/scheduler_config.json": {"_class_name": "SCMScheduler", "prediction_type": "trigflow"}},
     "SCMScheduler: Sana Sprint's, whose model_index.json names SanaSprintPipeline"),
    ({"transformer/config.json": {"guidance_embeds": True}}, "guidance_embeds: Sana Sprint's transformer"),
    ({"transformer/config.json": {"caption_channels": 64}}, "hidden_size 32 is not the transformer's caption"),
    ({"model_index.json": {"_class_name": "SanaSprintPipeline"}}, "has no guidance_embeds: SanaSprintPipeline feeds"),
    ({"model_index.json": {"_class_name": "SanaPAGPipeline"}}, "SanaPAGPipeline is not supported")])
def test_parts_of_another_kind_are_card_errors(sana_dir, tmp_path, edit, match):
    """A part SanaPipeline does not run; a Sana Sprint directory's parts under SanaPipeline (and the other way
    round): Sana Sprint itself loads and runs (test_sana_sprint.py)."""
    with pytest.raises(CardError, match=match):
        read_card(_layout_copy(sana_dir, tmp_path / "bad", edit=edit))


# -- loading -------------------------------------------------------------------------------------------------
def test_sharded_checkpoints_load_as_diffusers_loads_them(sana_dir, model):
    from diffusers import SanaTransformer2DModel

    assert len(list((sana_dir / "transformer").glob("diffusion_pytorch_model-*-of-*.safetensors"))) > 1
    assert len(list((sana_dir / "text_encoder").glob("model-*-of-*.safetensors"))) > 1
    ref = SanaTransformer2DModel.from_pretrained(sana_dir / "transformer").state_dict()
    ours = model.transformer.state_dict()
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)
    assert not any(p.is_meta for p in model.transformer.parameters())
    assert (type(model.text_encoder).__name__, type(model.vae.vae).__name__) == ("Gemma2Model", "AutoencoderDC")


def test_the_directory_is_one_diffusers_loads_itself(sana_dir, model):
    from diffusers import SanaPipeline

    pipe = SanaPipeline.from_pretrained(sana_dir, local_files_only=True)
    assert torch.equal(pipe.text_encoder.embed_tokens.weight, model.text_encoder.embed_tokens.weight)
    assert pipe.tokenizer("a red cat").input_ids == model.tokenizer("a red cat").input_ids
    assert pipe.tokenizer("a red cat").input_ids[0] == pipe.tokenizer.bos_token_id == 2
    assert pipe.vae.config.scaling_factor == 0.41407 and pipe.scheduler.config.use_flow_sigmas


def test_a_missing_shard_and_pickles_are_refused(sana_dir, tmp_path):
    gone = _layout_copy(sana_dir, tmp_path / "gone")
    (gone / "transformer/diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelError, match="lacks shards its index names: diffusion_pytorch_model-00002-of-00002"):
        load_model(gone)
    for part, stem in (("transformer", "diffusion_pytorch_model"), ("text_encoder", "model")):
        pickled = _layout_copy(sana_dir, tmp_path / f"pickled-{part}")
        for f in (pickled / part).glob(f"{stem}*"):
            f.unlink()
        (pickled / part / f"{stem}.bin").write_bytes(b"not loaded")
        with pytest.raises(ModelError, match="only pickle weights"):
            load_model(pickled)


# -- the text path -------------------------------------------------------------------------------------------
LONG = "a red cat sitting on a wooden table at sunset with a small dog and a big green tree near the blue house"


def test_the_encodings_are_encode_prompts(model):
    """Prompt (instruction prefixed, first token + last max_tokens - 1 kept) and negative prompt (neither) as
    SanaPipeline.encode_prompt makes them, embeddings and masks; a prompt past the limit is cut as it cuts it;
    a tokenizer saved to pad on the left still pads on the right, as the pipeline sets it."""
    specs = [ItemSpec(id="a", seed=0, sampler="flow_dpmpp_2m", steps=2, guidance=4.5, prompt="  A Red CAT ",
                      negative_prompt="Blurry"),
             ItemSpec(id="b", seed=0, sampler="flow_dpmpp_2m", steps=2, guidance=4.5, prompt=LONG)]
    assert len(model.tokenizer(LONG).input_ids) > MAX_TOKENS
    model.cache.clear()
    model.tokenizer.padding_side = "left"
    try:
        ours = family_named("sana").encode(model, specs)
    finally:
        model.tokenizer.padding_side = "right"
    pipe = _pipe(model)
    instruction = inspect.signature(type(pipe).__call__).parameters["complex_human_instruction"].default
    assert tuple(instruction) == COMPLEX_HUMAN_INSTRUCTION  # __call__'s default, which encode_prompt is handed
    for spec, enc in zip(specs, ours):
        with torch.no_grad():
            embeds, mask, neg, neg_mask = pipe.encode_prompt(spec.prompt, negative_prompt=spec.negative_prompt,
                                                             max_sequence_length=MAX_TOKENS,
                                                             complex_human_instruction=instruction)
        assert embeds.shape == neg.shape == (1, MAX_TOKENS, 32)
        torch.testing.assert_close(enc["prompt_embeds"], embeds[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(enc["neg_embeds"], neg[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(enc["prompt_mask"], mask[0].float()) and torch.equal(enc["neg_mask"], neg_mask[0].float())
    assert 1 < ours[0]["prompt_mask"].sum() < MAX_TOKENS and 1 < ours[0]["neg_mask"].sum() < MAX_TOKENS
    assert ours[1]["prompt_mask"].sum() == MAX_TOKENS  # LONG fills the limit and is cut
    assert sorted(model.cache) == [("negative", ""), ("negative", "blurry"), ("prompt", "a red cat"),
                                   ("prompt", LONG)]


def test_encodings_are_cached_by_role_and_processed_text(model):
    model.cache.clear()
    e = Engine(model, EAGER)
    e.add_many([ItemSpec(id=str(i), seed=i, sampler="flow_dpmpp_2m", steps=2, guidance=4.5, prompt="A cat")
                for i in range(3)])
    assert sorted(model.cache) == [("negative", ""), ("prompt", "a cat")]  # one encoding per role and text
    first = model.cache["prompt", "a cat"][0]
    e.add(ItemSpec(id="x", seed=9, sampler="flow_dpmpp_2m", steps=2, guidance=4.5, prompt="a cat "))
    assert model.cache["prompt", "a cat"][0] is first and first.device.type == "cpu"
    assert not torch.equal(model.cache["prompt", "a cat"][0], model.cache["negative", ""][0])


# -- the step: equal to SanaPipeline -------------------------------------------------------------------------
def test_prompts_and_guidances_batched_together_equal_the_pipeline_alone(model):
    # four requests in one batch: prompts (one past the token limit), negative prompts, seeds, steps and guidance;
    # at guidance 1 and 0.5 the pipeline skips CFG (the prompt's velocity alone), and so do those rows
    specs = [ItemSpec(id="a", seed=1, sampler="flow_dpmpp_2m", steps=6, guidance=4.5, prompt="a red cat"),
             ItemSpec(id="b", seed=2, sampler="flow_dpmpp_2m", steps=5, guidance=7.0, prompt="The big blue house",
                      negative_prompt="small photo"),
             ItemSpec(id="c", seed=3, sampler="flow_dpmpp_2m", steps=4, guidance=1.0, prompt="  A dog drawn  ",
                      negative_prompt="blurry"),
             ItemSpec(id="d", seed=4, sampler="flow_dpmpp_2m", steps=6, guidance=0.5, prompt=LONG)]
    results = Engine(model, EAGER).generate(specs)
    _assert_equal_to_pipeline(model, specs, results)
    assert results[0].image.shape == (IMAGE_SIZE, IMAGE_SIZE, 3)


def test_without_guidance_the_negative_prompt_plays_no_part(model):
    specs = [ItemSpec(id=str(i), seed=5, sampler="flow_dpmpp_2m", steps=3, guidance=g, prompt="a green tree",
                      negative_prompt=n) for i, (g, n) in enumerate(((1.0, ""), (1.0, "blurry"), (1.5, "blurry")))]
    a, b, c = Engine(model, EAGER).generate(specs)
    torch.testing.assert_close(a.latents, b.latents, rtol=1e-6, atol=1e-6)
    assert (a.latents - c.latents).abs().max() > 1e-3  # above 1 it guides


def test_non_square_sizes_equal_the_pipeline(model):
    specs = [ItemSpec(id="w", seed=5, sampler="flow_dpmpp_2m", steps=5, guidance=4.5, prompt="a green tree",
                      width=192, height=128),
             ItemSpec(id="t", seed=6, sampler="flow_dpmpp_2m", steps=5, guidance=3.0, prompt="a cat", width=128,
                      height=192)]
    results = Engine(model, EAGER).generate(specs)
    assert results[0].latents.shape == (32, 4, 6) and results[0].image.shape == (128, 192, 3)
    assert results[1].latents.shape == (32, 6, 4)
    _assert_equal_to_pipeline(model, specs, results)


def test_flow_euler_equals_the_pipeline_with_flow_match_euler_swapped_in(model):
    specs = [ItemSpec(id="e", seed=7, sampler="flow_euler", steps=6, guidance=4.5, prompt="a small house"),
             ItemSpec(id="f", seed=8, sampler="flow_euler", steps=4, guidance=2.0, prompt="a dog", width=192,
                      height=128)]
    _assert_equal_to_pipeline(model, specs, Engine(model, EAGER).generate(specs), euler=True)


def test_images_decode_as_the_pipeline_decodes(model):
    """The engine's DC-AE decode (latents / 0.41407, no shift) and uint8 conversion match the pipeline's image."""
    spec = ItemSpec(id="a", seed=9, sampler="flow_dpmpp_2m", steps=3, guidance=4.5, prompt="a red cat", width=192,
                    height=128)
    (ours,) = Engine(model, EAGER).generate([spec])
    ref = _reference(model, spec, output_type="np")
    assert ref.shape == ours.image.shape == (128, 192, 3)
    assert (torch.from_numpy(ref * 255) - torch.from_numpy(ours.image).float()).abs().max() <= 1.0


def test_the_instruction_can_be_replaced_or_turned_off(sana_dir, tmp_path):
    off = load_model(_layout_copy(sana_dir, tmp_path / "plain", dit_serve={
        **json.loads((sana_dir / "model_index.json").read_text())["dit_serve"], "complex_human_instruction": []}))
    assert off.instruction == "" and off.instruction_tokens == 0
    spec = ItemSpec(id="p", seed=3, sampler="flow_dpmpp_2m", steps=4, guidance=4.5, prompt="a red cat")
    _assert_equal_to_pipeline(off, [spec], Engine(off, EAGER).generate([spec]), complex_human_instruction=[])


def test_the_4k_layout_embeds_positions_tiles_its_decode_and_equals_the_pipeline(tmp_path):
    """The 4K transformer (sample_size 128, a sin-cos positional table at interpolation_scale 2: a buffer the
    checkpoint does not hold), flow_shift 6; at sizes other than its own the table is made for the grid at each
    call, as diffusers' PatchEmbed makes it. Its decode is tiled, as the model's instructions say."""
    from diffusers import SanaTransformer2DModel

    path = make_tiny_sana(tmp_path / "sana-4k", seed=1, interpolation_scale=2.0, sample_size=128, flow_shift=6.0,
                          sizes=("128x128", "192x128"))
    four_k = load_model(path)
    ref = SanaTransformer2DModel.from_pretrained(path / "transformer").patch_embed.pos_embed
    assert four_k.transformer.patch_embed.pos_embed.shape == ref.shape == (1, 128 * 128, 16)
    assert torch.equal(four_k.transformer.patch_embed.pos_embed, ref)
    assert four_k.vae.vae.use_tiling and four_k.card.image_size == 4096
    specs = [ItemSpec(id="s", seed=1, sampler="flow_dpmpp_2m", steps=4, guidance=4.5, prompt="a red cat", width=128,
                      height=128),
             ItemSpec(id="w", seed=2, sampler="flow_dpmpp_2m", steps=4, guidance=4.5, prompt="a dog", width=192,
                      height=128)]
    _assert_equal_to_pipeline(four_k, specs, Engine(four_k, EAGER).generate(specs))


# -- the built-in --------------------------------------------------------------------------------------------
SMALL = dict(transformer=dict(num_attention_heads=2, attention_head_dim=8, num_layers=2, num_cross_attention_heads=2,
                              cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=32),
             vae=dict(attention_head_dim=8, encoder_block_out_channels=(8, 8, 8, 8, 32, 32),
                      decoder_block_out_channels=(8, 8, 8, 8, 32, 32), encoder_layers_per_block=(1,) * 6,
                      decoder_layers_per_block=(1,) * 6),
             text_encoder=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16))  # vocab stays 256000


def test_the_builtin_card_and_full_size_counts_on_meta():
    """Sana_1600M_1024px's 1.6B transformer, the DC-AE f32c32 (encoder and decoder), Gemma-2-2B's 2.6B decoder."""
    from workers.families.sana.builtin import sana_1600m_on_meta

    card = read_card("sana-1600m-1024")
    assert (card.family, card.image_size, card.latent_size, card.latent_channels, card.max_tokens) == (
        "sana", 1024, 32, 32, 300)
    assert card.defaults == {"sampler": "flow_dpmpp_2m", "steps": 20, "guidance": 4.5}
    assert (1024, 1024) in card.sizes and (1344, 768) in card.sizes and card.prediction_type == "flow_prediction"
    modules = sana_1600m_on_meta(1024)
    count = {k: sum(p.numel() for p in m.parameters()) for k, m in modules.items()}
    assert count == {"transformer": 1_604_462_752, "vae": 312_250_275, "text_encoder": 2_614_341_888}
    assert (SANA_1600M_PARAMS, GEMMA2_2B_PARAMS) == (count["transformer"] + count["vae"], count["text_encoder"])
    assert modules["transformer"].patch_embed.pos_embed is None  # 1024 px: no positional embedding


def _shrunk_builtin(name: str):
    """The built-in ``name`` shrunk (SMALL) to a 128 px card that also makes 192x128, loaded on the CPU in float32;
    every weight and buffer made (none on meta) and finite."""
    from workers.families.sana.runtime import _load_builtin

    card = dataclasses.replace(read_card(name), image_size=128, latent_size=4, max_tokens=8,
                               sizes=((128, 128), (192, 128)))
    small = _load_builtin(card, "cpu", torch.float32, **SMALL)
    for m in (small.transformer, small.vae, small.text_encoder):
        assert not any(t.is_meta or not t.isfinite().all() for t in (*m.parameters(), *m.buffers()))
    return small


def _generates_both_sizes(small, square, wide):
    """Two requests through the engine, (sampler, steps, guidance) ``square`` at 128x128 and ``wide`` at 192x128:
    (specs, results), each result an image of its size with finite, nonzero latents."""
    specs = [ItemSpec(id="a", seed=0, sampler=square[0], steps=square[1], guidance=square[2], prompt="a cat"),
             ItemSpec(id="b", seed=1, sampler=wide[0], steps=wide[1], guidance=wide[2], prompt="a red cat",
                      width=192, height=128)]
    results = Engine(small, EAGER).generate(specs)
    assert [r.image.shape for r in results] == [(128, 128, 3), (128, 192, 3)]
    assert all(r.latents.isfinite().all() and r.latents.abs().max() > 0 for r in results)
    return specs, results


def test_a_shrunk_builtin_loads_generates_and_its_buffers_are_a_normal_builds():
    from transformers import Gemma2Model

    small = _shrunk_builtin("sana-1600m-1024")
    encoder = small.text_encoder
    ref = dict(Gemma2Model(encoder.config).named_buffers())
    assert dict(encoder.named_buffers()).keys() == ref.keys()
    assert all(torch.equal(b, ref[k]) for k, b in encoder.named_buffers())
    assert small.tokenizer("a red cat").input_ids[0] == 2 and small.instruction_tokens > 100
    _generates_both_sizes(small, ("flow_dpmpp_2m", 2, 4.5), ("flow_euler", 2, 1.0))


def test_the_sprint_builtin_card_and_full_size_counts_on_meta():
    """Sana Sprint 1.6B: Sana 1600M's transformer plus the guidance embedder (256 -> 2240 -> 2240) and the QK norms
    (4 x 2240 a block), the same DC-AE and Gemma-2-2B; SanaSprintPipeline's defaults and SCMScheduler's config."""
    from workers.families.memory import components, weight_params
    from workers.families.sana import SANA_SPRINT_1600M_PARAMS
    from workers.families.sana.builtin import SANA_1600M, sana_1600m_on_meta

    card = read_card("sana-sprint-1600m-1024")
    assert (card.family, card.builtin, card.image_size, card.latent_size, card.latent_channels, card.max_tokens) == (
        "sana", "sana-sprint-1600m-1024", 1024, 32, 32, 300)
    assert card.defaults == {"sampler": "scm", "steps": 2, "guidance": 4.5}
    assert (card.prediction_type, card.guidance_mode, card.lowercase_prompts) == ("trigflow", "embedded", True)
    assert card.scheduler["_class_name"] == "SCMScheduler" and card.scheduler["sigma_data"] == 0.5
    assert card.sizes == read_card("sana-1600m-1024").sizes and (card.takes_image, card.takes_mask) == (True, True)
    modules = sana_1600m_on_meta(1024, sprint=True)
    config = dict(modules["transformer"].config)
    assert {k: config[k] for k in SANA_1600M} == SANA_1600M
    sprint = {k: config[k] for k in ("guidance_embeds", "guidance_embeds_scale", "qk_norm", "timestep_scale")}
    assert sprint == {"guidance_embeds": True, "guidance_embeds_scale": 0.1, "qk_norm": "rms_norm_across_heads",
                      "timestep_scale": 1.0}
    count = {k: sum(p.numel() for p in m.parameters()) for k, m in modules.items()}
    assert count == {"transformer": 1_604_462_752 + 2240 * (256 + 2240 + 2) + 20 * 4 * 2240, "vae": 312_250_275,
                     "text_encoder": 2_614_341_888}
    assert (SANA_SPRINT_1600M_PARAMS, GEMMA2_2B_PARAMS) == (count["transformer"] + count["vae"], count["text_encoder"])
    assert components(card) == {"model": (SANA_SPRINT_1600M_PARAMS, ""),
                                "text_encoders": (GEMMA2_2B_PARAMS, "sana-sprint-1600m-1024:encoders")}
    assert weight_params(card) == sum(count.values())


def test_the_sprint_builtin_is_listed_and_served_with_scm():
    from dit_serve.schemas import JobRequest
    from dit_serve.server.catalog import Catalog, model_entry
    from dit_serve.server.config import LimitsConfig
    from workers.families import builtin_names

    names = builtin_names()
    assert names.index("sana-sprint-1600m-1024") == names.index("sana-1600m-1024") + 1
    card = read_card("sana-sprint-1600m-1024")
    entry = model_entry(card)
    assert (entry.samplers, entry.guidance) == (["scm"], "embedded")
    params = Catalog([card], LimitsConfig()).resolve_job(JobRequest(prompts=["a cat"])).params
    assert (params.sampler, params.steps, params.guidance) == ("scm", 2, 4.5)


def test_a_shrunk_sprint_builtin_generates_as_sana_sprint_pipeline():
    """The built-in shrunk (SMALL; Sprint's guidance embedder and QK norms kept) loads finite, generates 1 and 2 scm
    steps at two sizes through the engine, and equals SanaSprintPipeline over its modules with its card's
    scheduler (the family's reference hooks), as a directory's model does (test_sana_sprint)."""
    small = _shrunk_builtin("sana-sprint-1600m-1024")
    config = small.transformer.config
    assert (config.guidance_embeds, config.qk_norm, config.sample_size) == (True, "rms_norm_across_heads", 4)
    specs, results = _generates_both_sizes(small, ("scm", 2, 4.5), ("scm", 1, 3.0))
    family = family_named("sana")
    gen = torch.Generator("cpu").manual_seed(specs[0].seed)
    x = torch.randn(small.latent_shape, generator=gen)
    ref = family.reference_pipeline(small)(**family.reference_call(small, specs[:1]), latents=x[None], generator=gen,
                                           output_type="latent").images[0]
    assert (results[0].latents - ref).abs().max() <= 1e-4 * max(1.0, ref.abs().max().item())


# -- image-to-image and inpainting (workers.edits) ----------------------------------------------------------
# diffusers has no img2img or inpaint pipeline for Sana (Sana Sprint's img2img runs another sampler). The rule:
# StableDiffusion3Img2ImgPipeline's and StableDiffusion3InpaintPipeline's, with the DC-AE's latent (deterministic,
# times its scaling factor, as Sana Sprint's img2img encodes). The reference: SanaPipeline with its
# retrieve_timesteps followed by get_timesteps (the begin index set), latents noised by its scheduler's add_noise
# (scale_noise for flow Euler), and the inpainting blend in its step-end callback.
def _edit_reference(model, spec: ItemSpec, monkeypatch, euler: bool = False) -> torch.Tensor:
    from diffusers.pipelines.sana import pipeline_sana

    pipe = _pipe(model, euler)
    width, height = spec.width or IMAGE_SIZE, spec.height or IMAGE_SIZE
    monkeypatch.setattr(pipeline_sana, "retrieve_timesteps",
                        edit_cases.cut_timesteps(pipeline_sana.retrieve_timesteps, spec.strength))
    vae = model.vae.vae
    x0 = vae.encode(edit_cases.pipeline_image(spec, width, height)).latent * vae.config.scaling_factor
    noise = torch.randn(x0.shape, generator=edit_cases.generator(spec))  # the DC-AE draws nothing before it
    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    scheduler.set_timesteps(spec.steps)
    start = edit_cases.start_of(spec.steps, spec.strength)
    scheduler.set_begin_index(start)
    x = noise if spec.mask and spec.strength == 1 else edit_cases.noised(scheduler, x0, noise,
                                                                         scheduler.timesteps[start])
    kw = {}
    if spec.mask:
        mask = torch.nn.functional.interpolate(edit_cases.pipeline_mask(spec, width, height), size=x0.shape[-2:])
        kw["callback_on_step_end"] = edit_cases.blend_callback(x0, noise, mask)
    try:
        return pipe(spec.prompt, negative_prompt=spec.negative_prompt, num_inference_steps=spec.steps,
                    guidance_scale=spec.guidance, height=height, width=width, latents=x,
                    max_sequence_length=model.card.max_tokens, use_resolution_binning=False, output_type="latent",
                    **kw).images[0]
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("strength", edit_cases.STRENGTHS)
def test_image_to_image_follows_the_sd3_img2img_rule(model, strength, monkeypatch):
    spec = ItemSpec(id="i", seed=61, sampler="flow_dpmpp_2m", steps=6, guidance=4.5, prompt="a red cat",
                    image=edit_cases.image_bytes(), strength=strength)
    edit_cases.assert_close(Engine(model, EAGER).generate([spec])[0].latents,
                            _edit_reference(model, spec, monkeypatch))


@pytest.mark.parametrize("strength", edit_cases.STRENGTHS)
def test_inpainting_follows_the_sd3_inpaint_rule(model, strength, monkeypatch):
    spec = ItemSpec(id="m", seed=62, sampler="flow_dpmpp_2m", steps=6, guidance=3.0, prompt="a green tree",
                    image=edit_cases.image_bytes(seed=1), mask=edit_cases.mask_bytes(), strength=strength)
    edit_cases.assert_close(Engine(model, EAGER).generate([spec])[0].latents,
                            _edit_reference(model, spec, monkeypatch))


def test_edits_and_text_rows_batched_together_follow_the_rule(model, monkeypatch):
    """Text-to-image, image-to-image and inpainting rows in one engine, with CFG and without (scale 1: the NO_CFG
    step and its inpainting variant), flow Euler beside DPM-Solver, a non-square size: each equals its reference."""
    image, mask = edit_cases.image_bytes(seed=2), edit_cases.mask_bytes(box=(0.2, 0.2, 0.8, 0.8))
    specs = [ItemSpec(id="t", seed=1, sampler="flow_dpmpp_2m", steps=5, guidance=4.5, prompt="a red cat"),
             ItemSpec(id="i", seed=2, sampler="flow_dpmpp_2m", steps=6, guidance=1.0, prompt="a dog", image=image,
                      strength=0.6),
             ItemSpec(id="m", seed=3, sampler="flow_dpmpp_2m", steps=5, guidance=1.0, prompt="a house", image=image,
                      mask=mask, strength=0.7),
             ItemSpec(id="e", seed=4, sampler="flow_euler", steps=5, guidance=3.0, prompt="a tree", image=image,
                      mask=mask, strength=0.6, width=192, height=128)]
    engine = Engine(model, EAGER)
    for spec, r in zip(specs, engine.generate(specs)):
        euler = spec.sampler == "flow_euler"
        ref = _edit_reference(model, spec, monkeypatch, euler) if spec.image else _reference(model, spec)
        edit_cases.assert_close(r.latents, ref, spec.id)
    assert any(k.endswith(":no-cfg+inpaint") for k in engine.stats()["groups"])
