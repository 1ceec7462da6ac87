"""Z-Image through our engine equals diffusers' ZImagePipeline: a tiny random pipeline directory in the real
layout of Z-Image-Turbo (sharded transformer and Qwen3 text encoder, a Qwen2Tokenizer with its chat
template, FLUX.1's 16-channel VAE, Turbo's scheduler), made here, offline; the same initial latents;
float32 on the CPU.

Tolerance: max |ours - reference| <= 1e-4 * max(1, max |reference|) on the final latents; decoded images
within 1/255 (one uint8 level, the engine's rounding). The two sides differ only in float32 rounding: the
engine batches requests (and their prompts and negative prompts) that the pipeline runs one at a time, runs
both CFG halves for every row, encodes a prompt over the batch's longest length rather than 512 tokens,
and takes its sigmas from np.linspace where the pipeline takes torch.linspace (equal at 8 steps, a float32
rounding apart at some others).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from workers.config import WorkerConfig
from workers.engine import Engine
from workers.families import family_named
from workers.families.zimage.runtime import Layout, chat_texts, encode_prompts, forward, guide, patchify, unpatchify
from workers.loading import ModelError, load_model
from workers.models.tiny_zimage import IMAGE_SIZE, MAX_TOKENS, make_tiny_zimage
from workers.request.cards import CardError, read_card
from workers.request.spec import ItemSpec

from . import edit_cases

EAGER = WorkerConfig(backend="eager", max_batch=4)
LONG = ("a very long prompt about a small red cat sitting on a warm mat by the window, looking at the birds "
        "in the garden while the rain falls on the roof of the old house")  # past MAX_TOKENS: truncated


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_zimage(tmp_path_factory.mktemp("zimage"))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir)


def _pipeline(model):
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    config = {k: v for k, v in model.card.scheduler.items() if k != "flow_grid"}  # ours: the pipeline passes sigmas
    return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(config), vae=model.vae,
                          text_encoder=model.text_encoder, tokenizer=model.tokenizer, transformer=model.transformer)


def _reference(model, spec: ItemSpec, output_type: str = "latent", **options):
    """ZImagePipeline from our loaded components (its own sigmas), from the engine's initial latents."""
    width, height = spec.width or IMAGE_SIZE, spec.height or IMAGE_SIZE
    x = torch.randn(model.card.latent_shape(width, height), generator=torch.Generator("cpu").manual_seed(spec.seed))
    return _pipeline(model)(spec.prompt, negative_prompt=spec.negative_prompt, height=height, width=width,
                            num_inference_steps=spec.steps, guidance_scale=spec.guidance, latents=x[None],
                            max_sequence_length=model.card.max_tokens, output_type=output_type, **options).images[0]


def _assert_equal_to_pipeline(model, specs, results, **options):
    for spec, r in zip(specs, results):
        ref = _reference(model, spec, **options)
        err = (r.latents - ref).abs().max().item()
        assert err <= 1e-4 * max(1.0, ref.abs().max().item()), (spec.id, err)


def _layout_copy(src, dst, drop: str = "", dit_serve: dict | None = None):
    """A copy of a pipeline directory without ``drop``; ``dit_serve`` replaces model_index's section."""
    shutil.copytree(src, dst)
    if drop:
        shutil.rmtree(dst / drop)
    if dit_serve is not None:
        index = json.loads((dst / "model_index.json").read_text())
        (dst / "model_index.json").write_text(json.dumps({**index, "dit_serve": dit_serve}))
    return dst


# -- the card ------------------------------------------------------------------------------------------------
def test_the_card_of_the_tiny_directory(tiny_dir):
    card = read_card(tiny_dir)
    assert (card.family, card.conditioning, card.max_tokens, card.size_multiple) == ("zimage", "text", MAX_TOKENS, 16)
    assert (card.image_size, card.latent_size, card.latent_channels, card.pixel_space) == (64, 8, 16, False)
    assert card.sizes == ((64, 64), (96, 64), (64, 96)) and card.latent_shape(96, 64) == (16, 8, 12)
    assert card.prediction_type == "flow" and card.dtype == "float32" and card.guidance_mode == "cfg"
    assert card.defaults == {"sampler": "flow_euler", "steps": 8, "guidance": 0.0}  # Turbo's
    assert card.scheduler["shift"] == 3.0 and not card.scheduler["use_dynamic_shifting"]
    assert card.scheduler["flow_grid"] == "flux" and card.tokenizer_file.endswith("tokenizer/tokenizer.json")


def test_the_real_models_card(tiny_dir, tmp_path):
    """Without dit_serve overrides: Turbo's native 1024, 512 tokens, bfloat16, the native square and four
    ratios both ways at about a megapixel; any multiple of 16 up to 2048, a side off it refused as the
    pipeline refuses it."""
    card = read_card(_layout_copy(tiny_dir, tmp_path / "turbo", dit_serve={}))
    assert (card.image_size, card.latent_size, card.max_tokens, card.dtype) == (1024, 128, 512, "bfloat16")
    assert card.made_sizes()[:3] == [(1024, 1024), (1184, 880), (880, 1184)] and len(card.made_sizes()) == 9
    assert all(w % 16 == 0 and h % 16 == 0 and abs(w * h / 1024**2 - 1) < 0.05 for w, h in card.made_sizes())
    assert card.size_for(256, 512) == (256, 512) and card.size_for(2048, 16) == (2048, 16)
    with pytest.raises(ValueError, match="multiples of 16 px from 16 to 2048"):
        card.size_for(1000, 1024)
    base = read_card(_layout_copy(tiny_dir, tmp_path / "base", dit_serve={"defaults": {"steps": 50, "guidance": 4.0}}))
    assert base.defaults == {"sampler": "flow_euler", "steps": 50, "guidance": 4.0}


@pytest.mark.parametrize("part", ["vae", "text_encoder", "tokenizer", "scheduler"])
def test_a_missing_part_is_a_card_error_naming_it(tiny_dir, tmp_path, part):
    with pytest.raises(CardError, match=f"without {part}/"):
        read_card(_layout_copy(tiny_dir, tmp_path / "zimage", drop=part))


def test_a_wrong_encoder_token_limit_or_option_is_a_card_error(tiny_dir, tmp_path):
    bad = _layout_copy(tiny_dir, tmp_path / "t5")
    config = json.loads((bad / "text_encoder/config.json").read_text())
    (bad / "text_encoder/config.json").write_text(json.dumps({**config, "model_type": "t5"}))
    with pytest.raises(CardError, match="text_encoder/config.json has model_type 't5'"):
        read_card(bad)
    (bad / "text_encoder/config.json").write_text(json.dumps({**config, "hidden_size": 48}))
    with pytest.raises(CardError, match="hidden_size 48 is not the transformer's cap_feat_dim 32"):
        read_card(bad)
    for limit in (1024, 100, 0):
        with pytest.raises(CardError, match="max_sequence_length must be a multiple of 32"):
            read_card(_layout_copy(tiny_dir, tmp_path / f"long{limit}", dit_serve={"max_sequence_length": limit}))
    with pytest.raises(CardError, match="cfg_truncation must be a number >= 0"):
        read_card(_layout_copy(tiny_dir, tmp_path / "opt", dit_serve={"cfg_truncation": "half"}))


# -- loading -------------------------------------------------------------------------------------------------
def test_sharded_checkpoints_load_as_diffusers_loads_them(tiny_dir, tiny):
    from diffusers import ZImageTransformer2DModel

    assert len(list((tiny_dir / "transformer").glob("diffusion_pytorch_model-*-of-*.safetensors"))) > 1
    assert len(list((tiny_dir / "text_encoder").glob("model-*-of-*.safetensors"))) > 1
    ref = ZImageTransformer2DModel.from_pretrained(tiny_dir / "transformer").state_dict()
    ours = tiny.transformer.state_dict()
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)
    assert not any(p.is_meta for p in tiny.transformer.parameters())
    assert (tiny.vae_scale, tiny.vae_shift, tiny.latent_shape, tiny.learned_sigma) == (0.3611, 0.1159, (16, 8, 8),
                                                                                        False)
    assert type(tiny.text_encoder).__name__ == "Qwen3Model" and type(tiny.tokenizer).__name__ == "Qwen2Tokenizer"
    assert (tiny.cfg_normalization, tiny.cfg_truncation) == (0.0, 1.0)  # the pipeline's defaults


def test_the_directory_is_one_diffusers_loads_itself(tiny_dir, tiny):
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(tiny_dir, local_files_only=True)
    assert torch.equal(pipe.text_encoder.embed_tokens.weight, tiny.text_encoder.embed_tokens.weight)
    assert pipe.tokenizer.chat_template == tiny.tokenizer.chat_template and pipe.tokenizer.padding_side == "right"
    assert pipe.tokenizer("a red cat").input_ids == tiny.tokenizer("a red cat").input_ids


def test_a_missing_shard_pickles_and_no_chat_template_are_refused(tiny_dir, tmp_path):
    gone = _layout_copy(tiny_dir, tmp_path / "gone")
    (gone / "transformer/diffusion_pytorch_model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ModelError, match="lacks shards its index names: diffusion_pytorch_model-00002-of-00003"):
        load_model(gone)
    for part, stem in (("transformer", "diffusion_pytorch_model"), ("text_encoder", "model")):
        pickled = _layout_copy(tiny_dir, tmp_path / f"pickled-{part}")
        for f in (pickled / part).glob(f"{stem}*"):
            f.unlink()
        (pickled / part / f"{stem}.bin").write_bytes(b"not loaded")
        with pytest.raises(ModelError, match="only pickle weights"):
            load_model(pickled)
    plain = _layout_copy(tiny_dir, tmp_path / "plain")
    config = json.loads((plain / "tokenizer/tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer/tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="no chat template"):
        load_model(plain)


# -- the text path -------------------------------------------------------------------------------------------
def test_prompts_are_encoded_as_the_pipeline_encodes_them(tiny):
    """The chat template, hidden_states[-2], the real tokens only: the pipeline's list, laid out first in
    fixed rows; at the card's 64 tokens (a long prompt truncated there) and at 128, where the encoder runs
    over the batch's longest prompt (rounded to 64) and the pipeline over all 128."""
    prompts = ["a red cat", LONG, "", "The big blue house"]
    for limit in (MAX_TOKENS, 128):
        model = SimpleNamespace(card=SimpleNamespace(max_tokens=limit), tokenizer=tiny.tokenizer,
                                text_encoder=tiny.text_encoder)
        embeds, mask = encode_prompts(model, prompts)
        ref = _pipeline(tiny)._encode_prompt(list(prompts), device="cpu", max_sequence_length=limit)
        assert embeds.shape == (4, limit, 32) and mask.sum(-1).tolist() == [len(r) for r in ref]
        for e, m, r in zip(embeds, mask, ref):
            assert m[:len(r)].all() and not m[len(r):].any() and not e[len(r):].any()
            torch.testing.assert_close(e[:len(r)], r, rtol=0, atol=1e-5)
    full = len(tiny.tokenizer(chat_texts(tiny.tokenizer, [LONG])[0]).input_ids)
    assert MAX_TOKENS < full <= 128  # truncated at 64, whole at 128


def test_a_left_padding_tokenizer_is_run_at_the_full_length(tiny, monkeypatch):
    monkeypatch.setattr(tiny.tokenizer, "padding_side", "left")
    embeds, mask = encode_prompts(tiny, ["a red cat", "The big blue house"])
    ref = _pipeline(tiny)._encode_prompt(["a red cat", "The big blue house"], device="cpu",
                                         max_sequence_length=MAX_TOKENS)
    assert mask.sum(-1).tolist() == [len(r) for r in ref]  # the real tokens moved first
    for e, r in zip(embeds, ref):
        torch.testing.assert_close(e[:len(r)], r, rtol=0, atol=1e-5)


def test_encodings_are_cached_by_the_prompt_as_given(tiny):
    tiny.cache.clear()
    e = Engine(tiny, EAGER)
    e.add_many([ItemSpec(id=str(i), seed=i, sampler="flow_euler", steps=2, guidance=0.0, prompt="A cat")
                for i in range(3)])
    assert sorted(tiny.cache) == ["", "A cat"]  # the prompt and the negative prompt "", once each
    embeds, mask = tiny.cache["A cat"]
    assert embeds.shape == (MAX_TOKENS, 32) and mask.shape == (MAX_TOKENS,) and embeds.device.type == "cpu"


# -- the fixed-shape forward ----------------------------------------------------------------------------------
def test_the_fixed_shape_forward_equals_the_modules_forward(tiny):
    """Rows of different caption lengths (32 and 64 padded, one truncated) and times, at a square size (16
    patches: 16 x_pad_tokens) and a non-square one (24: 8 x_pad_tokens), against the module's list forward."""
    tr = tiny.transformer
    prompts = ["a red cat", LONG, "", "The big blue house on a hill"]
    embeds, mask = encode_prompts(tiny, prompts)
    captions = [e[m] for e, m in zip(embeds, mask)]
    assert {len(c) for c in captions} & {MAX_TOKENS} and min(len(c) for c in captions) < 32
    time = torch.tensor([0.3, 0.7, 0.1, 1.0])
    for h, w in ((8, 8), (8, 12), (12, 8)):
        x = torch.randn(4, 16, h, w, generator=torch.Generator().manual_seed(h * w))
        with torch.no_grad():
            ours = forward(tr, Layout.make(tr, h, w, MAX_TOKENS), x, time, embeds, mask.float())
            ref = torch.stack(tr(list(x.unsqueeze(2).unbind(0)), time, captions, return_dict=False)[0]).squeeze(2)
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_patches_are_the_modules():
    from diffusers import ZImageTransformer2DModel

    x = torch.randn(2, 16, 8, 12)
    tr = SimpleNamespace(out_channels=16)
    for i in range(2):
        ref, size, _ = ZImageTransformer2DModel._patchify_image(None, x[i].unsqueeze(1), 2, 1)
        assert torch.equal(patchify(x)[i], ref)
        back = ZImageTransformer2DModel.unpatchify(tr, [ref], [size], 2, 1)[0].squeeze(1)
        assert torch.equal(unpatchify(patchify(x), 8, 12)[i], back)


def test_guidance_follows_the_pipelines_rule():
    """s > 0: pos + s (pos - neg); s <= 0: pos exactly; truncation past its time: pos; the norm cap."""
    pos, neg = torch.randn(4, 16, 2, 2), torch.randn(4, 16, 2, 2)
    scale, time = torch.tensor([0.0, 2.0, -1.0, 2.0]), torch.tensor([0.5, 0.5, 0.5, 0.9])
    out = guide(pos, neg, scale, time, 0.0, 0.8)
    assert torch.equal(out[0], pos[0]) and torch.equal(out[2], pos[2]) and torch.equal(out[3], pos[3])
    torch.testing.assert_close(out[1], pos[1] + 2 * (pos[1] - neg[1]))
    capped = guide(pos, neg, scale, time, 1.0, 1.0)
    assert capped[1].norm() == pytest.approx(pos[1].norm().item(), rel=1e-5)  # capped at the prompt's norm
    assert torch.equal(capped[0], pos[0])


# -- the step: equal to ZImagePipeline ------------------------------------------------------------------------
def test_turbo_prompts_batched_together_equal_the_pipeline_alone(tiny):
    # four requests in one batch: prompts of different caption lengths, seeds, scales (0: Turbo's, no CFG;
    # > 0: CFG against "" or a negative prompt) and step counts; each equals ZImagePipeline run alone
    specs = [ItemSpec(id="a", seed=1, sampler="flow_euler", steps=8, guidance=0.0, prompt="a red cat"),
             ItemSpec(id="b", seed=2, sampler="flow_euler", steps=5, guidance=3.0, prompt=LONG),
             ItemSpec(id="c", seed=3, sampler="flow_euler", steps=3, guidance=0.5, prompt="  a dog drawn  ",
                      negative_prompt="blurry, dark"),
             ItemSpec(id="d", seed=1, sampler="flow_euler", steps=8, guidance=2.0, prompt="a red cat")]
    results = Engine(tiny, EAGER).generate(specs)
    _assert_equal_to_pipeline(tiny, specs, results)
    assert (results[0].latents - results[3].latents).abs().max() > 1e-3  # the scale takes effect


def test_non_square_and_unlisted_sizes(tiny):
    specs = [ItemSpec(id="w", seed=5, sampler="flow_euler", steps=4, guidance=0.0, prompt="a green tree",
                      width=96, height=64),
             ItemSpec(id="t", seed=6, sampler="flow_euler", steps=4, guidance=1.5, prompt="a cat", width=64, height=96),
             ItemSpec(id="s", seed=7, sampler="flow_euler", steps=3, guidance=0.0, prompt="a dog", width=32, height=48)]
    results = Engine(tiny, EAGER).generate(specs)
    assert results[0].latents.shape == (16, 8, 12) and results[0].image.shape == (64, 96, 3)
    assert results[1].latents.shape == (16, 12, 8) and results[2].image.shape == (48, 32, 3)
    _assert_equal_to_pipeline(tiny, specs, results)


def test_the_guidance_options_equal_the_pipelines(tiny_dir, tmp_path):
    """cfg_normalization and cfg_truncation, set in model_index.json, as the pipeline's arguments."""
    path = _layout_copy(tiny_dir, tmp_path / "options", dit_serve={
        **json.loads((tiny_dir / "model_index.json").read_text())["dit_serve"],
        "cfg_normalization": 1.0, "cfg_truncation": 0.5})
    model = load_model(path)
    assert (model.cfg_normalization, model.cfg_truncation) == (1.0, 0.5)
    specs = [ItemSpec(id="a", seed=1, sampler="flow_euler", steps=6, guidance=4.0, prompt="a red cat"),
             ItemSpec(id="b", seed=2, sampler="flow_euler", steps=6, guidance=0.0, prompt="a blue car")]
    results = Engine(model, EAGER).generate(specs)
    _assert_equal_to_pipeline(model, specs, results, cfg_normalization=1.0, cfg_truncation=0.5)
    plain = _reference(model, specs[0])
    assert (results[0].latents - plain).abs().max() > 1e-3  # the options take effect


def test_images_decode_as_the_pipeline_decodes(tiny):
    """The engine's VAE decode (latents / 0.3611 + 0.1159) and uint8 conversion match the pipeline's image."""
    spec = ItemSpec(id="a", seed=9, sampler="flow_euler", steps=2, guidance=0.0, prompt="a red cat")
    (ours,) = Engine(tiny, EAGER).generate([spec])
    ref = _reference(tiny, spec, output_type="np")
    assert (torch.from_numpy(ref * 255) - torch.from_numpy(ours.image).float()).abs().max() <= 1.0


# -- the schedule --------------------------------------------------------------------------------------------
def test_the_sigmas_are_the_pipelines(tiny):
    """flow_euler's sigmas against the scheduler's after ZImagePipeline's set_timesteps: equal at Turbo's 8
    steps (and 9), within one float32 rounding (torch.linspace against np.linspace) at every count to 50."""
    from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

    from samplers import make_plan

    scheduler = _pipeline(tiny).scheduler
    for n in range(1, 51):
        scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(n), mu=0.7)
        plan = make_plan("flow_euler", n, tiny.schedule)
        if n in (8, 9):
            assert torch.equal(plan.timesteps, scheduler.timesteps), n
        torch.testing.assert_close(plan.timesteps, scheduler.timesteps, rtol=2.4e-7, atol=0)  # 2 eps: one rounding


def test_plan_kwargs_shift_only_a_dynamic_schedule(tiny):
    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift

    family = family_named("zimage")
    assert family.plan_kwargs(tiny, (16, 8, 12)) == {}
    dynamic = SimpleNamespace(card=dataclasses.replace(tiny.card, scheduler={**tiny.card.scheduler,
                                                                              "use_dynamic_shifting": True}))
    assert family.plan_kwargs(dynamic, (16, 8, 12))["mu"] == pytest.approx(calculate_shift(24))


# -- the built-in --------------------------------------------------------------------------------------------
def test_the_builtin_card_and_counts():
    from workers.families.zimage import TURBO_ENCODER_PARAMS, TURBO_PARAMS
    from workers.families.zimage.builtin import zimage_turbo_on_meta

    card = read_card("z-image-turbo-1024")
    assert (card.family, card.conditioning, card.builtin, card.guidance_mode) == ("zimage", "text",
                                                                                  "z-image-turbo-1024", "cfg")
    assert (card.image_size, card.latent_channels, card.latent_size, card.size_multiple) == (1024, 16, 128, 16)
    assert (1024, 1024) in card.sizes and (1360, 768) in card.sizes and card.max_tokens == 512
    assert card.defaults == {"sampler": "flow_euler", "steps": 8, "guidance": 0.0}
    assert card.scheduler["shift"] == 3.0 and card.prediction_type == "flow"
    parts = zimage_turbo_on_meta(1024)
    count = {k: sum(p.numel() for p in m.parameters()) for k, m in parts.items()}
    # Z-Image-Turbo's 6.15B transformer, FLUX.1's VAE, Qwen3-4B's 4.02B base model (tied embedding, no head)
    assert count == {"transformer": 6_154_908_736, "vae": 83_819_683, "text_encoder": 4_022_468_096}
    assert (TURBO_PARAMS, TURBO_ENCODER_PARAMS) == (count["transformer"] + count["vae"], count["text_encoder"])
    encoder = parts["text_encoder"].config
    assert (encoder.hidden_size, encoder.num_hidden_layers, encoder.rope_parameters["rope_theta"]) == (2560, 36, 1e6)
    assert parts["transformer"].config.cap_feat_dim == encoder.hidden_size


def test_a_shrunk_builtin_loads_and_generates(tiny):
    from workers.families.zimage import runtime

    small = dataclasses.replace(read_card("z-image-turbo-1024"), image_size=64, latent_size=8, max_tokens=32,
                                sizes=((64, 64),))
    model = runtime._load_builtin(small, "cpu", torch.float32, transformer=dict(
        dim=32, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[4, 4, 8],
        axes_lens=[64, 32, 32]), text_encoder=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8),
        vae=dict(block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=8))
    rotary = model.text_encoder.rotary_emb
    assert torch.equal(rotary.inv_freq, type(rotary)(model.text_encoder.config).inv_freq)
    assert not any(t.is_meta for t in [*model.text_encoder.parameters(), *model.transformer.parameters()])
    (out,) = Engine(model, EAGER).generate([ItemSpec(id="a", seed=0, sampler="flow_euler", steps=2, guidance=2.0,
                                                     prompt="a red cat")])
    assert out.image.shape == (64, 64, 3) and out.latents.isfinite().all()


@pytest.mark.slow
def test_the_step_compiles_whole_and_equals_eager(tiny):
    """The step traces into one graph (no breaks: the rotary tables' complex products included) and Inductor's
    code computes what eager does."""
    from samplers import gather_rows, make_plan
    from workers.engine import step_specs

    family, shape = family_named("zimage"), (16, 8, 12)
    specs = [ItemSpec(id=str(i), seed=i, sampler="flow_euler", steps=8, guidance=(0.0, 3.0)[i % 2], prompt=p)
             for i, p in enumerate(["a red cat", LONG, "", "a dog"])]
    enc = family.encode(tiny, specs)
    t, coeffs = gather_rows([make_plan("flow_euler", 8, tiny.schedule)] * 4, [2] * 4)
    x = torch.randn(4, *shape, generator=torch.Generator().manual_seed(0))
    live = dict(x=x, t=t, coeffs=coeffs, guidance=torch.tensor([s.guidance for s in specs]), hist=torch.zeros_like(x),
                noise=torch.zeros_like(x), **{k: torch.stack([c[k] for c in enc]) for k in enc[0]})
    assert set(live) == set(step_specs(tiny, shape)[0])
    step = family.make_step(tiny, shape)
    with torch.no_grad():
        want = step(**live)
        got = torch.compile(step, fullgraph=True)(**live)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-5)


def test_rows_at_guidance_0_run_one_forward_each_as_the_pipeline_and_guided_rows_two(tiny, monkeypatch):
    """Z-Image-Turbo's default (guidance 0) is the pipeline's step without CFG: the engine runs those rows in its
    no-CFG step (``NO_CFG``: one transformer forward per image), guided rows in the CFG step (two), both in one
    engine, each equal to the pipeline."""
    from workers.families.base import NO_CFG
    from workers.families.zimage import runtime

    rows, real = [], runtime.forward
    monkeypatch.setattr(runtime, "forward", lambda tr, layout, x, *a: rows.append(len(x)) or real(tr, layout, x, *a))
    engine = Engine(tiny, EAGER)
    assert {g.variant for g in engine.groups.values()} == {"", NO_CFG}
    specs = [ItemSpec(id=f"r{i}", seed=i, sampler="flow_euler", steps=2, guidance=g, prompt="a red cat")
             for i, g in enumerate((0.0, 0.0, 5.0))]
    results = engine.generate(specs)
    assert sorted(rows) == [2, 2, 2, 2]  # per step: the two unguided rows (one forward each), the guided one (two)
    _assert_equal_to_pipeline(tiny, specs, results)


# -- image-to-image and inpainting (workers.edits) ----------------------------------------------------------
def _edit_reference(model, spec: ItemSpec) -> torch.Tensor:
    """ZImageImg2ImgPipeline, or ZImageInpaintPipeline for a spec with a mask, on the decoded image (and mask), with
    a generator seeded as the request's. Quirk: both preprocess the image at its own size (no resize to height x
    width, which must then be its size), so the tests give them images of the generation size."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageImg2ImgPipeline, ZImageInpaintPipeline

    cls = ZImageInpaintPipeline if spec.mask else ZImageImg2ImgPipeline
    config = {k: v for k, v in model.card.scheduler.items() if k != "flow_grid"}
    pipe = cls(scheduler=FlowMatchEulerDiscreteScheduler.from_config(config), vae=model.vae,
               text_encoder=model.text_encoder, tokenizer=model.tokenizer, transformer=model.transformer)
    pipe.set_progress_bar_config(disable=True)
    width, height = spec.width or IMAGE_SIZE, spec.height or IMAGE_SIZE
    return pipe(spec.prompt, negative_prompt=spec.negative_prompt, strength=spec.strength, height=height, width=width,
                num_inference_steps=spec.steps, guidance_scale=spec.guidance, max_sequence_length=model.card.max_tokens,
                output_type="latent", generator=edit_cases.generator(spec), **edit_cases.decoded(spec)).images[0]


@pytest.mark.parametrize("strength", edit_cases.STRENGTHS)
def test_image_to_image_equals_the_img2img_pipeline(tiny, strength):
    spec = ItemSpec(id="i", seed=41, sampler="flow_euler", steps=6, guidance=0.0, prompt="a red cat",
                    image=edit_cases.image_bytes(IMAGE_SIZE, IMAGE_SIZE), strength=strength)
    edit_cases.assert_close(Engine(tiny, EAGER).generate([spec])[0].latents, _edit_reference(tiny, spec))


@pytest.mark.parametrize("strength", edit_cases.STRENGTHS)
def test_inpainting_equals_the_inpaint_pipeline(tiny, strength):
    spec = ItemSpec(id="m", seed=42, sampler="flow_euler", steps=6, guidance=2.5, prompt="a green tree",
                    negative_prompt="blurry", image=edit_cases.image_bytes(IMAGE_SIZE, IMAGE_SIZE, seed=1),
                    mask=edit_cases.mask_bytes(IMAGE_SIZE, IMAGE_SIZE), strength=strength)
    edit_cases.assert_close(Engine(tiny, EAGER).generate([spec])[0].latents, _edit_reference(tiny, spec))


def test_edits_and_text_rows_batched_together_each_equal_their_pipeline(tiny):
    """Text-to-image, image-to-image and inpainting rows in one engine, at Turbo's scale 0 (the NO_CFG step and its
    inpainting variant) and with CFG, a non-square size among them: each equals its own pipeline."""
    wide, square = edit_cases.image_bytes(96, 64, seed=2), edit_cases.image_bytes(IMAGE_SIZE, IMAGE_SIZE, seed=3)
    specs = [ItemSpec(id="t", seed=1, sampler="flow_euler", steps=4, guidance=0.0, prompt="a red cat"),
             ItemSpec(id="i", seed=2, sampler="flow_euler", steps=5, guidance=2.0, prompt="a dog", image=square,
                      strength=0.6),
             ItemSpec(id="m", seed=3, sampler="flow_euler", steps=4, guidance=0.0, prompt="a house", image=square,
                      mask=edit_cases.mask_bytes(IMAGE_SIZE, IMAGE_SIZE, box=(0, 0, 1, 0.5)), strength=0.8),
             ItemSpec(id="w", seed=4, sampler="flow_euler", steps=4, guidance=3.0, prompt="a tree", image=wide,
                      mask=edit_cases.mask_bytes(96, 64), strength=0.6, width=96, height=64)]
    engine = Engine(tiny, EAGER)
    for spec, r in zip(specs, engine.generate(specs)):
        edit_cases.assert_close(r.latents, _edit_reference(tiny, spec) if spec.image else _reference(tiny, spec),
                                spec.id)
    assert any(k.endswith(":no-cfg+inpaint") for k in engine.stats()["groups"])
