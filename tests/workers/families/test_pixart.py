"""PixArt-Σ through our engine equals diffusers' PixArtSigmaPipeline: a tiny random pipeline directory
in the real layout (transformer, T5 text encoder, tokenizer, VAE, scheduler; safetensors), made here,
offline; the same initial latents; float32 on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.config import WorkerConfig
from workers.speed import SpeedConfig
from workers.request.cards import read_card
from workers.families import family_named
from workers.engine import Engine
from workers.loading import load_model
from workers.models.tiny_pixart import MAX_TOKENS, make_tiny_pixart
from workers.request.spec import ItemSpec

from . import edit_cases


@pytest.fixture(scope="module")
def pixart_dir(tmp_path_factory):
    return make_tiny_pixart(tmp_path_factory.mktemp("pixart-tiny"))


@pytest.fixture(scope="module")
def model(pixart_dir):
    return load_model(pixart_dir)


def _reference(model, prompt: str, negative: str, seed: int, steps: int, guidance: float) -> torch.Tensor:
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline

    family_named("pixart").set_cross_attention(model, "padded")  # the reference runs diffusers' processors
    pipe = PixArtSigmaPipeline(tokenizer=model.tokenizer, text_encoder=model.text_encoder, vae=model.vae,
                               transformer=model.transformer,
                               scheduler=DPMSolverMultistepScheduler.from_config(model.card.scheduler))
    latents = torch.randn(model.latent_shape, generator=torch.Generator("cpu").manual_seed(seed))[None]
    out = pipe(prompt, negative_prompt=negative, num_inference_steps=steps, guidance_scale=guidance,
               latents=latents, height=16, width=16, max_sequence_length=MAX_TOKENS, clean_caption=False,
               use_resolution_binning=False, output_type="latent")
    return out.images[0]


def test_the_card_reads_the_pixart_layout(pixart_dir, model):
    card = read_card(pixart_dir)
    assert (card.family, card.conditioning, card.max_tokens) == ("pixart", "text", MAX_TOKENS)
    assert (card.image_size, card.latent_size, card.latent_channels, card.pixel_space) == (16, 8, 4, False)
    assert card.defaults == {"sampler": "dpmpp_2m", "steps": 20, "guidance": 4.5}
    assert model.text_encoder is not None and model.latent_shape == (4, 8, 8)


def test_prompts_batched_together_equal_the_diffusers_pipeline_alone(model):
    # three requests in one batch: different prompts, negative prompts, seeds and guidance; each must
    # equal diffusers' pipeline run alone from the same initial latents
    specs = [ItemSpec(id="a", seed=1, sampler="dpmpp_2m", steps=6, guidance=3.0, prompt="a red cat"),
             ItemSpec(id="b", seed=2, sampler="dpmpp_2m", steps=6, guidance=5.0, prompt="The big blue house",
                      negative_prompt="small photo"),
             ItemSpec(id="c", seed=3, sampler="dpmpp_2m", steps=6, guidance=1.5, prompt="  a dog drawn  ")]
    results = Engine(model, WorkerConfig(backend="eager", max_batch=4)).generate(specs)
    for spec, r in zip(specs, results):
        ref = _reference(model, spec.prompt, spec.negative_prompt, spec.seed, spec.steps, spec.guidance)
        err = (r.latents - ref).abs().max().item()
        assert err <= 1e-4 * max(1.0, ref.abs().max().item()), (spec.id, err)
    assert results[0].image.shape == (16, 16, 3)


def test_prompts_are_encoded_over_their_real_tokens_only(model):
    """T5 runs over the batch's longest real token count: each real token's embedding equals the pipeline's
    padded-to-max_tokens encoding, the padding stays zero and masked, and the shapes are max_tokens long."""
    from workers.families.pixart.runtime import real_length_encode

    texts = ["a red cat", "the number seven drawn thin on paper", ""]
    tok = model.tokenizer(texts, padding="max_length", max_length=MAX_TOKENS, truncation=True, return_tensors="pt")
    with torch.no_grad():
        full = model.text_encoder(tok.input_ids, attention_mask=tok.attention_mask)[0]       # (3, MAX_TOKENS, D)
        embeds, mask = real_length_encode(model, texts)
    assert embeds.shape == full.shape and torch.equal(mask, tok.attention_mask)
    assert int(mask.sum(1).max()) < MAX_TOKENS  # the test means something: the batch is shorter than the limit
    keep = mask.bool()
    torch.testing.assert_close(embeds[keep], full[keep], rtol=1e-5, atol=1e-5)
    assert torch.equal(embeds[~keep], torch.zeros_like(embeds[~keep]))


def test_encodings_are_cached_and_shared(model):
    model.cache.clear()
    e = Engine(model, WorkerConfig(backend="eager", max_batch=4))
    e.add_many([ItemSpec(id=str(i), seed=i, sampler="ddim", steps=2, guidance=2.0, prompt="A cat") for i in range(3)])
    assert sorted(model.cache) == ["", "a cat"]  # one encoding per distinct processed text
    first = model.cache["a cat"][0]
    e.add(ItemSpec(id="x", seed=9, sampler="ddim", steps=2, guidance=2.0, prompt="a cat "))
    assert model.cache["a cat"][0] is first


def test_generate_draws_prompts_from_the_command_line(pixart_dir, tmp_path, capsys):
    import json

    from dit_serve.cli import main

    out = tmp_path / "out"
    assert main(["generate", "--model", str(pixart_dir), "--prompt", "a red cat", "--prompt", "a blue dog",
                 "--num-per-prompt", "2", "--steps", "3", "--negative-prompt", "small", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert [e["prompt"] for e in manifest["images"]] == ["a red cat"] * 2 + ["a blue dog"] * 2
    assert manifest["params"]["negative_prompt"] == "small"
    from PIL import Image

    assert Image.open(out / manifest["images"][0]["file"]).size == (16, 16)
    assert main(["generate", "--model", str(pixart_dir), "--labels", "1", "--out", str(tmp_path / "x")]) == 2
    assert "draws from text: pass --prompt" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse: one of the two
        main(["generate", "--labels", "1", "--prompt", "x", "--out", str(tmp_path / "y")])
    assert e.value.code == 2


def test_the_alpha_layout_equals_the_alpha_pipeline(tmp_path):
    from diffusers import DPMSolverMultistepScheduler, PixArtAlphaPipeline

    model = load_model(make_tiny_pixart(tmp_path / "alpha", seed=1, alpha=True))
    assert read_card(tmp_path / "alpha").max_tokens == MAX_TOKENS  # the directory's own limit wins (α: 120)
    spec = ItemSpec(id="a", seed=4, sampler="dpmpp_2m", steps=5, guidance=4.0, prompt="a green tree")
    (ours,) = Engine(model, WorkerConfig(backend="eager", max_batch=2)).generate([spec])
    family_named("pixart").set_cross_attention(model, "padded")  # the reference runs diffusers' processors
    pipe = PixArtAlphaPipeline(tokenizer=model.tokenizer, text_encoder=model.text_encoder, vae=model.vae,
                               transformer=model.transformer,
                               scheduler=DPMSolverMultistepScheduler.from_config(model.card.scheduler))
    latents = torch.randn(model.latent_shape, generator=torch.Generator("cpu").manual_seed(4))[None]
    ref = pipe("a green tree", num_inference_steps=5, guidance_scale=4.0, latents=latents, height=16, width=16,
               max_sequence_length=MAX_TOKENS, clean_caption=False, use_resolution_binning=False,
               output_type="latent").images[0]
    assert (ours.latents - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


def test_alpha_1024_conditions_on_resolution_and_aspect_ratio(tmp_path):
    model = load_model(make_tiny_pixart(tmp_path / "alpha-cond", alpha=True, additional_conditions=True))
    seen = []
    model.transformer.register_forward_pre_hook(lambda _m, args, kwargs: seen.append(kwargs["added_cond_kwargs"]),
                                                with_kwargs=True)
    specs = [ItemSpec(id=str(i), seed=i, sampler="ddim", steps=2, guidance=2.0, prompt="a cat") for i in range(3)]
    Engine(model, WorkerConfig(backend="eager", max_batch=4)).generate(specs)
    assert seen and all(len(c["resolution"]) == len(c["aspect_ratio"]) and len(c["resolution"]) % 2 == 0 and
                        c["resolution"].tolist() == [[16.0, 16.0]] * len(c["resolution"]) and
                        c["aspect_ratio"].tolist() == [[1.0]] * len(c["aspect_ratio"]) for c in seen)  # both CFG halves


def test_varlen_cross_attention_equals_the_pipeline_too(model):
    """The engine with cross-attention over each prompt's real tokens (workers.speed.varlen) computes what
    the padded, masked reference computes; switching back restores diffusers' processors."""
    specs = [ItemSpec(id="a", seed=4, sampler="dpmpp_2m", steps=5, guidance=3.0, prompt="a red cat"),
             ItemSpec(id="b", seed=5, sampler="dpmpp_2m", steps=5, guidance=4.0, prompt="the big blue house drawn",
                      negative_prompt="small")]
    try:
        results = Engine(model, WorkerConfig(backend="eager", max_batch=4), speed=SpeedConfig(cross_attention="varlen")).generate(specs)
        assert type(model.transformer.transformer_blocks[0].attn2.processor).__name__ == "VarlenCrossAttention"
    finally:
        Engine(model, WorkerConfig(backend="eager", max_batch=4), speed=SpeedConfig(cross_attention="padded"))
    assert type(model.transformer.transformer_blocks[0].attn2.processor).__name__ == "AttnProcessor2_0"
    for spec, r in zip(specs, results):
        ref = _reference(model, spec.prompt, spec.negative_prompt, spec.seed, spec.steps, spec.guidance)
        err = (r.latents - ref).abs().max().item()
        assert err <= 1e-4 * max(1.0, ref.abs().max().item()), (spec.id, err)


def test_the_engine_reports_which_cross_attention_kernel_runs(model):
    """Said per model at start-up (and in the worker's info): on a CPU, varlen cross-attention reads the
    key counts on the host (the grouped SDPA fallback); padded is diffusers' masked SDPA."""
    from workers.engine import Engine

    varlen = Engine(model, WorkerConfig(backend="eager", max_batch=2), speed=SpeedConfig(cross_attention="varlen"))
    assert varlen.attention == {model.name: "cross-attention: SDPA per key length (one host read per layer)"}
    assert varlen.stats()["attention"] == varlen.attention
    padded = Engine(model, WorkerConfig(backend="eager", max_batch=2), speed=SpeedConfig(cross_attention="padded"))
    assert padded.attention[model.name].startswith("cross-attention: padded")


def test_a_captured_decode_makes_the_images_the_plain_decode_makes(model, monkeypatch):
    """``WorkerConfig(backend="eager", decode_graphs=True)``: each group's VAE decode is a GraphRunner of its own (eager on a
    CPU, the same code a capture records on a GPU), batched up to DECODE_PIXELS of output and chunked past
    that; the images equal the plain decode's, in order, including resized sizes."""
    from workers import decode as dec

    specs = [ItemSpec(id=str(i), seed=i, sampler="dpmpp_2m", steps=3, guidance=2.0, prompt=f"a cat number {i}")
             for i in range(5)]
    plain = Engine(model, WorkerConfig(backend="eager", max_batch=8)).generate(specs)
    out_px = model.image_size ** 2
    monkeypatch.setattr(dec, "DECODE_PIXELS", 2 * out_px)  # a largest decode batch of 2: 5 images in 2 + 2 + 1
    captured = Engine(model, WorkerConfig(backend="eager", max_batch=8), speed=SpeedConfig(decode_graphs=True))
    (group,) = captured.groups.values()
    assert group.decoder is not None and group.decoder.max_batch == 2
    got = captured.generate(specs)
    assert [r.request.id for r in got] == [r.request.id for r in plain]
    for a, b in zip(got, plain):
        assert a.image.shape == b.image.shape and np.array_equal(a.image, b.image)
    runs = {b: s["eager_fallbacks"] + s["replays"] for b, s in group.decoder.stats()["buckets"].items()}
    assert sum(runs.values()) >= 3 and runs[2] >= 2  # the five images went through it, in chunks of two
    assert Engine(model, WorkerConfig(backend="eager", max_batch=8)).groups.popitem()[1].decoder is None  # off by default


def test_the_padded_steps_head_bias_is_the_one_diffusers_builds(model):
    """Padded cross-attention takes its (rows * heads, 1, L) bias from ``head_bias``, made by expanding (a
    compiled step kept a dynamic batch that way on CUDA); the values and their order are those of
    PixArtTransformer2DModel's conversion followed by the processor's ``prepare_attention_mask``."""
    from workers.families.pixart.runtime import head_bias

    attn = model.transformer.transformer_blocks[0].attn2
    mask = (torch.arange(MAX_TOKENS)[None] < torch.tensor([[3], [MAX_TOKENS], [1]])).long()  # (3, L)
    want = attn.prepare_attention_mask(((1 - mask.float()) * -10000.0).unsqueeze(1), MAX_TOKENS, 3)
    got = head_bias(mask, attn.heads, torch.float32)
    assert got.shape == (3 * attn.heads, 1, MAX_TOKENS) and torch.equal(got, want)
    assert attn.prepare_attention_mask(got, MAX_TOKENS, 3) is got  # already as long: not repeated again


def test_a_padded_step_still_runs_right_when_varlen_is_switched_on_under_it(model):
    """A step reads the cross-attention mode when it is made (``make_step``); another engine on the same
    model may switch the processors later. The padded step's per-head bias is then read by the varlen
    processor as the keep-mask it stands for: the same outputs as a step made for varlen."""
    from samplers import gather_rows, make_plan
    pixart = family_named("pixart")

    specs = [ItemSpec(id=str(i), seed=i, sampler="dpmpp_2m", steps=8, guidance=3.0, prompt=p)
             for i, p in enumerate(["a red cat", "the big blue house drawn small", "a dog"])]
    encoded = pixart.encode(model, specs)
    cond = {k: torch.stack([c[k] for c in encoded]) for k in encoded[0]}
    t, coeffs = gather_rows([make_plan("dpmpp_2m", 8, model.schedule)] * 3, [2] * 3)
    x = torch.randn(3, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    live = dict(x=x, t=t, coeffs=coeffs, guidance=torch.full((3,), 3.0), hist=torch.zeros_like(x),
                noise=torch.zeros_like(x), **cond)
    try:
        family_named("pixart").set_cross_attention(model, "padded")
        padded = pixart.make_step(model)
        family_named("pixart").set_cross_attention(model, "varlen")
        got, want = padded(**live), pixart.make_step(model)(**live)
    finally:
        family_named("pixart").set_cross_attention(model, "padded")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


def test_encoder_graphs_give_the_encoders_embeddings_at_every_length_and_batch(model):
    """``EncoderGraphs`` (eager on a CPU, the code a capture records on a GPU): one runner per padded
    length, batches past its largest bucket in chunks; each text's embedding equals the plain encoder's,
    so ``real_length_encode`` through it equals it without."""
    from workers.families.encoders import EncoderGraphs, padded_length
    from workers.families.pixart.runtime import real_length_encode

    graphs = EncoderGraphs(model.text_encoder, MAX_TOKENS, max_batch=2)
    texts = ["a red cat", "the big blue house on the hill", "", "a dog drawn", "seven"]  # 5 texts: 2 + 2 + 1
    tok = model.tokenizer(texts, padding="longest", return_tensors="pt")
    length = padded_length(tok.input_ids.shape[1], MAX_TOKENS)
    ids, mask = (torch.nn.functional.pad(t, (0, length - t.shape[1])) for t in (tok.input_ids, tok.attention_mask))
    with torch.no_grad():
        want = model.text_encoder(ids, attention_mask=mask)[0]
        got = graphs(ids, mask)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert list(graphs.runners) == [length] and graphs.runners[length].max_batch == 2
        plain = real_length_encode(model, texts)
        model.text_graphs = graphs
        try:
            graphed = real_length_encode(model, texts)
        finally:
            model.text_graphs = None
    for a, b in zip(graphed, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert padded_length(1, 300) == 64 and padded_length(64, 300) == 64 and padded_length(65, 300) == 128
    assert padded_length(290, 300) == 300 and padded_length(20, 16) == 16


@pytest.mark.slow
def test_a_compiled_decode_compiles_once_and_makes_the_plain_decodes_images(model, monkeypatch):
    """A compiled model's captured decode is compiled too (the engine's wiring), and ``decode_runner(...,
    compiled=True)`` compiles once for every decode batch of 2-4 (as a 512 px decode runs them) plus its
    one-image graph; its images equal the plain decode's within a level. (diffusers' VAE branches on batches
    of 64 and more, and the CPU convolution at 16: batches across those would compile once per range.)"""
    from graphs.compiled import CompiledStep
    from workers import decode as dec

    compiled = Engine(model, WorkerConfig(backend="eager", max_batch=2), speed=SpeedConfig(compile="inductor", decode_graphs=True))
    plain = Engine(model, WorkerConfig(backend="eager", max_batch=2), speed=SpeedConfig(decode_graphs=True))
    assert isinstance(next(iter(compiled.groups.values())).decoder.step, CompiledStep)
    assert not isinstance(next(iter(plain.groups.values())).decoder.step, CompiledStep)
    (stats,) = compiled.stats()["groups"].values()
    assert stats["decode_compile"]["graphs"] == 0  # reported with the group's; compiled at warm-up, not yet
    assert "decode_compile" not in next(iter(plain.stats()["groups"].values()))

    monkeypatch.setattr(dec, "DECODE_PIXELS", 4 * model.image_size ** 2)
    runner = dec.decode_runner(model, model.latent_shape, compiled=True)
    runner.warmup()
    latents = torch.randn(3, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    got = dec.decode(model, latents, None, runner.run(latents=latents)["pixels"])
    want = dec.decode(model, latents)
    stats = runner.step.stats()
    assert runner.max_batch == 4 and stats["compiled"] and stats["fallback_reason"] is None, stats
    assert stats["graphs"] == 1 and stats["one_row_graphs"] == 1, stats
    for a, b in zip(got, want):
        assert np.abs(a.astype(int) - b.astype(int)).max() <= 1


def test_warm_up_captures_the_shortest_encoder_length_before_the_first_request(model):
    """An engine's warm-up asks its text-encoder graphs for the shortest padded length (most prompts), so the
    first request does not pay that capture (on a CPU the runner is eager; the same calls capture on a GPU)."""
    from workers.families.encoders import EncoderGraphs, padded_length

    engine = Engine(model, WorkerConfig(backend="eager", max_batch=2))
    model.text_graphs = EncoderGraphs(model.text_encoder, MAX_TOKENS, max_batch=2)  # as _graph_encoder on CUDA
    try:
        engine.warmup()
        assert list(model.text_graphs.runners) == [padded_length(1, MAX_TOKENS)]
        assert all(r.warmed for r in model.text_graphs.runners.values())
    finally:
        model.text_graphs = None


# -- image-to-image and inpainting (workers.edits) ----------------------------------------------------------
# diffusers has no img2img or inpaint pipeline for PixArt. The rule: StableDiffusionImg2ImgPipeline's and
# StableDiffusionInpaintPipeline's for a 4-channel model (the posterior sampled with the generator, times the
# scaling factor; add_noise; pure noise times init_noise_sigma for inpainting at strength 1). The reference:
# PixArtSigmaPipeline with its retrieve_timesteps followed by get_timesteps, latents noised by its scheduler's
# add_noise, the inpainting blend in its (per-step, in-place) callback, and the generator (after the posterior and the noise)
# for an ancestral sampler's steps.
SCHEDULERS = {"dpmpp_2m": "DPMSolverMultistepScheduler", "euler": "EulerDiscreteScheduler", "ddpm": "DDPMScheduler"}


def _edit_reference(model, spec: ItemSpec, monkeypatch, pixel_size: int = 0) -> torch.Tensor:
    import diffusers
    from diffusers import PixArtSigmaPipeline
    from diffusers.pipelines.pixart_alpha import pipeline_pixart_sigma
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3_img2img import retrieve_latents

    family_named("pixart").set_cross_attention(model, "padded")  # the reference runs diffusers' processors
    config = {**model.card.scheduler, "clip_sample": False}  # as the card's schedule reads it
    scheduler = getattr(diffusers, SCHEDULERS[spec.sampler]).from_config(config)
    pipe = PixArtSigmaPipeline(tokenizer=model.tokenizer, text_encoder=model.text_encoder, vae=model.vae,
                               transformer=model.transformer, scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    monkeypatch.setattr(pipeline_pixart_sigma, "retrieve_timesteps",
                        edit_cases.cut_timesteps(pipeline_pixart_sigma.retrieve_timesteps, spec.strength))
    size = model.card.image_size
    gen = edit_cases.generator(spec)
    image = edit_cases.pipeline_image(spec, size, size)
    if model.vae is None:  # pixel space: the pixels, in one channel as Pillow's luma weights them
        x0 = (image * torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)).sum(1, keepdim=True)
    else:
        x0 = retrieve_latents(model.vae.encode(image), generator=gen) * model.vae.config.scaling_factor
    noise = torch.randn(x0.shape, generator=gen)
    timing = type(scheduler).from_config(config)
    timing.set_timesteps(spec.steps)
    start = edit_cases.start_of(spec.steps, spec.strength)
    if hasattr(timing, "set_begin_index"):
        timing.set_begin_index(start)
    if spec.mask and spec.strength == 1:
        x = noise * timing.init_noise_sigma
    else:
        x = edit_cases.noised(timing, x0, noise, timing.timesteps[start])
    kw = {}
    if spec.mask:
        mask = torch.nn.functional.interpolate(edit_cases.pipeline_mask(spec, size, size), size=x0.shape[-2:])
        blend = edit_cases.blend_callback(x0, noise, mask)  # PixArt's pipeline has the old callback: in place
        kw["callback"] = lambda i, t, latents: latents.copy_(blend(pipe, i, t, {"latents": latents})["latents"])
    try:
        return pipe(spec.prompt, negative_prompt=spec.negative_prompt, num_inference_steps=spec.steps,
                    guidance_scale=spec.guidance, latents=x / pipe.scheduler.init_noise_sigma,
                    height=pixel_size or size, width=pixel_size or size, max_sequence_length=model.card.max_tokens,
                    clean_caption=False, use_resolution_binning=False, output_type="latent", generator=gen,
                    **kw).images[0]
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("strength", edit_cases.STRENGTHS)
def test_image_to_image_follows_the_sd_img2img_rule(model, strength, monkeypatch):
    spec = ItemSpec(id="i", seed=71, sampler="dpmpp_2m", steps=6, guidance=3.0, prompt="a red cat",
                    image=edit_cases.image_bytes(), strength=strength)
    edit_cases.assert_close(Engine(model, WorkerConfig(backend="eager")).generate([spec])[0].latents,
                            _edit_reference(model, spec, monkeypatch))


@pytest.mark.parametrize("strength", edit_cases.STRENGTHS)
def test_inpainting_follows_the_sd_inpaint_rule(model, strength, monkeypatch):
    spec = ItemSpec(id="m", seed=72, sampler="dpmpp_2m", steps=6, guidance=3.0, prompt="a green tree",
                    image=edit_cases.image_bytes(seed=1), mask=edit_cases.mask_bytes(), strength=strength)
    edit_cases.assert_close(Engine(model, WorkerConfig(backend="eager")).generate([spec])[0].latents,
                            _edit_reference(model, spec, monkeypatch))


def test_edits_of_every_kind_of_sampler_batched_with_text_rows_follow_the_rule(model, monkeypatch):
    """Text-to-image, image-to-image and inpainting rows in one engine with DPM-Solver++ (its first kept step first
    order), Euler (x0 + sigma eps) and DDPM (ancestral: its per-step noise from the generator after the posterior
    and the noise): each equals its reference run alone."""
    image, mask = edit_cases.image_bytes(seed=2), edit_cases.mask_bytes(box=(0, 0.25, 1, 0.75))
    specs = [ItemSpec(id="t", seed=1, sampler="dpmpp_2m", steps=6, guidance=3.0, prompt="a red cat"),
             ItemSpec(id="i", seed=2, sampler="dpmpp_2m", steps=7, guidance=4.0, prompt="a dog", image=image,
                      strength=0.5),
             ItemSpec(id="e", seed=3, sampler="euler", steps=6, guidance=2.0, prompt="a house", image=image,
                      mask=mask, strength=0.7),
             ItemSpec(id="a", seed=4, sampler="ddpm", steps=8, guidance=3.0, prompt="a tree", image=image,
                      strength=0.6),
             ItemSpec(id="p", seed=5, sampler="ddpm", steps=5, guidance=3.0, prompt="a boat", image=image,
                      mask=mask, strength=1.0)]
    for spec, r in zip(specs, Engine(model, WorkerConfig(backend="eager")).generate(specs)):
        ref = (_edit_reference(model, spec, monkeypatch) if spec.image else
               _reference(model, spec.prompt, spec.negative_prompt, spec.seed, spec.steps, spec.guidance))
        edit_cases.assert_close(r.latents, ref, spec.id)


def test_digits_text_edits_its_pixels_by_the_rule(monkeypatch):
    """The shipped pixel-space PixArt model: an image's luma is its 8x8 one-channel latents."""
    model = load_model("digits-text")
    image = edit_cases.image_bytes(8, 8, seed=5)
    specs = [ItemSpec(id="i", seed=1, sampler="dpmpp_2m", steps=10, guidance=3.0, prompt="a bold 3", image=image,
                      strength=0.5),
             ItemSpec(id="m", seed=2, sampler="dpmpp_2m", steps=10, guidance=3.0, prompt="an eight", image=image,
                      mask=edit_cases.mask_bytes(8, 8), strength=0.8)]
    for spec, r in zip(specs, Engine(model, WorkerConfig(backend="eager")).generate(specs)):
        edit_cases.assert_close(r.latents, _edit_reference(model, spec, monkeypatch, pixel_size=64), spec.id)
