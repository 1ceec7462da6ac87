"""Qwen-Image through our engine equals diffusers' QwenImagePipeline: a tiny random pipeline directory in the
real layout of ``Qwen/Qwen-Image`` (workers.models.tiny_qwenimage: sharded transformer and Qwen2.5-VL text
encoder, a BPE Qwen2 tokenizer as vocab.json + merges.txt, the 16-channel video VAE, the real scheduler
config), made here, offline; the same initial latents; float32 on the CPU.

Tolerance: max |ours - reference| <= 1e-4 * max(1, max |reference|) over the final latents (measured: about
1e-6 absolute on latents of magnitude 4). What differs is float32 rounding only: here both CFG halves and
several requests run in one forward, with every text padded to the token limit under a mask, where the
pipeline runs one request, each CFG half alone, its texts unpadded (a different matmul blocking, masked
keys in the softmax); our Euler update uses float64-built coefficients. Images: at most one uint8 level.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from workers.config import WorkerConfig
from workers.engine import Engine
from workers.families import family_named
from workers.families.qwenimage import ENCODER_PARAMS, MODEL_CARD_SIZES, PARAMS, WAN21_VAE
from workers.families.qwenimage import runtime as qwen
from workers.families.qwenimage.runtime import (encode_prompts, pack, rotary_tables, transformer_forward, true_cfg,
                                                unpack)
from workers.loading import ModelError, load_model
from workers.models.tiny_qwenimage import IMAGE_SIZE, MAX_TOKENS, make_tiny_qwenimage
from workers.request.cards import CardError, read_card
from workers.request.spec import ItemSpec

from . import edit_cases

EAGER = WorkerConfig(backend="eager", max_batch=4)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return make_tiny_qwenimage(tmp_path_factory.mktemp("qwen") / "Qwen-Image")


@pytest.fixture(scope="module")
def model(qwen_dir):
    return load_model(qwen_dir)


@pytest.fixture(scope="module")
def pipe(model):
    """QwenImagePipeline from our loaded components (the VAE inside our decode's adapter)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    config = {k: v for k, v in model.card.scheduler.items() if k != "flow_grid"}  # flow_grid is ours
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(config), vae=model.vae.autoencoder,
                             text_encoder=model.text_encoder, tokenizer=model.tokenizer, transformer=model.transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _reference(model, pipe, spec: ItemSpec, output_type: str = "latent") -> torch.Tensor:
    """The pipeline from the engine's initial latents, packed as it packs them, with ``true_cfg_scale`` the
    request's guidance and its negative prompt (" " for an empty one, as the model card passes); the final
    latents unpacked to (16, h, w), or the image."""
    from diffusers import QwenImagePipeline

    width, height = spec.width or IMAGE_SIZE, spec.height or IMAGE_SIZE
    c, h, w = model.card.latent_shape(width, height)
    x = torch.randn((c, h, w), generator=torch.Generator("cpu").manual_seed(spec.seed))  # as Engine._admit
    out = pipe(spec.prompt, negative_prompt=spec.negative_prompt or " ", true_cfg_scale=spec.guidance,
               height=height, width=width, num_inference_steps=spec.steps,
               latents=QwenImagePipeline._pack_latents(x[None], 1, c, h, w), max_sequence_length=model.card.max_tokens,
               output_type=output_type).images
    return out if output_type != "latent" else QwenImagePipeline._unpack_latents(out, height, width, 8)[0, :, 0]


def _assert_equal_to_pipeline(model, pipe, specs, results):
    for spec, r in zip(specs, results):
        ref = _reference(model, pipe, spec)
        err = (r.latents - ref).abs().max().item()
        assert err <= 1e-4 * max(1.0, ref.abs().max().item()), (spec.id, err)


def _layout_copy(src, dst, drop: str = "", dit_serve: dict | None = None, **edits: dict):
    """A copy of a pipeline directory without ``drop``; ``dit_serve`` replaces model_index's section;
    ``edits``: {"<part>": {config keys}} merged into <part>/config.json."""
    shutil.copytree(src, dst)
    if drop:
        shutil.rmtree(dst / drop)
    if dit_serve is not None:
        index = json.loads((dst / "model_index.json").read_text())
        (dst / "model_index.json").write_text(json.dumps({**index, "dit_serve": dit_serve}))
    for part, keys in edits.items():
        config = json.loads((dst / part / "config.json").read_text())
        (dst / part / "config.json").write_text(json.dumps({**config, **keys}))
    return dst


# -- the card ------------------------------------------------------------------------------------------------
def test_the_card_reads_the_tiny_layout(qwen_dir):
    card = read_card(qwen_dir)
    assert (card.family, card.conditioning, card.guidance_mode, card.max_tokens) == ("qwenimage", "text", "cfg", MAX_TOKENS)
    assert (card.image_size, card.latent_size, card.latent_channels, card.size_multiple) == (64, 8, 16, 16)
    assert card.sizes == ((64, 64), (96, 64), (64, 96)) and card.latent_shape(96, 64) == (16, 8, 12)
    assert card.defaults == {"sampler": "flow_euler", "steps": 50, "guidance": 4.0}  # QwenImagePipeline's
    assert card.prediction_type == "flow" and card.dtype == "float32" and card.tokenizer_file == ""  # no tokenizer.json
    assert card.scheduler["flow_grid"] == "flux" and card.scheduler["shift_terminal"] == 0.02
    assert family_named("qwenimage").preview_map(card) is WAN21_VAE


def test_the_real_models_card(qwen_dir, tmp_path):
    """Without dit_serve overrides: the pipeline's native 1024, 512 tokens, bfloat16, and the model card's seven
    sizes (1472 x 1140 as the pipeline makes it); any other multiple of 16 made as asked, a side off it rounded
    down, as the pipeline does."""
    card = read_card(_layout_copy(qwen_dir, tmp_path / "real", dit_serve={}))
    assert (card.image_size, card.latent_size, card.max_tokens, card.dtype) == (1024, 128, 512, "bfloat16")
    assert card.made_sizes() == [(1024, 1024), *MODEL_CARD_SIZES] and (1472, 1136) in MODEL_CARD_SIZES
    assert all(w % 16 == 0 and h % 16 == 0 for w, h in card.made_sizes())
    assert card.size_for(512, 768) == (512, 768)
    assert card.resolve_size(1472, 1140) == ((1472, 1136), "1472x1140 is not a multiple of 16 px per side: model "
                                             "'real' makes 1472x1136 (rounded down, as its reference pipeline does)")
    with pytest.raises(ValueError, match="multiples of 16 px from 16 to 2048"):
        card.size_for(4096, 1024)
    with pytest.raises(CardError, match="max_sequence_length must be 1 to 1024"):
        read_card(_layout_copy(qwen_dir, tmp_path / "long", dit_serve={"max_sequence_length": 1025}))


@pytest.mark.parametrize("part", ["vae", "text_encoder", "tokenizer", "scheduler"])
def test_a_missing_part_is_a_card_error_naming_it(qwen_dir, tmp_path, part):
    with pytest.raises(CardError, match=f"without {part}/"):
        read_card(_layout_copy(qwen_dir, tmp_path / "qwen", drop=part))


@pytest.mark.parametrize("part,keys,message", [
    ("text_encoder", {"model_type": "t5"}, "text_encoder/config.json has model_type 't5'"),
    ("vae", {"_class_name": "AutoencoderKL"}, "vae/config.json has _class_name 'AutoencoderKL'"),
    ("transformer", {"zero_cond_t": True}, "sets zero_cond_t: a transformer of another Qwen-Image pipeline"),
    ("transformer", {"in_channels": 16}, "expected patch_size 2, in_channels 64 and out_channels 16"),
    ("transformer", {"joint_attention_dim": 64}, "hidden size 32 is not the transformer's joint_attention_dim 64")])
def test_a_wrong_part_is_a_card_error_naming_it(qwen_dir, tmp_path, part, keys, message):
    with pytest.raises(CardError, match=message):
        read_card(_layout_copy(qwen_dir, tmp_path / "qwen", **{part: keys}))


# -- loading -------------------------------------------------------------------------------------------------
def test_sharded_checkpoints_load_as_diffusers_loads_them(qwen_dir, model):
    from diffusers import QwenImageTransformer2DModel

    assert len(list((qwen_dir / "transformer").glob("diffusion_pytorch_model-*-of-*.safetensors"))) > 1
    assert len(list((qwen_dir / "text_encoder").glob("model-*-of-*.safetensors"))) > 1
    ref = QwenImageTransformer2DModel.from_pretrained(qwen_dir / "transformer")
    ours = model.transformer.state_dict()
    assert ours.keys() == ref.state_dict().keys() and all(torch.equal(ours[k], v) for k, v in ref.state_dict().items())
    # the rotary tables __init__ computes (the meta build leaves them empty): a plain build's
    assert torch.equal(model.transformer.pos_embed.pos_freqs, ref.pos_embed.pos_freqs)
    assert torch.equal(model.transformer.pos_embed.neg_freqs, ref.pos_embed.neg_freqs)
    assert not any(t.is_meta for t in [*model.transformer.parameters(), *model.text_encoder.buffers()])
    assert (model.vae_scale, model.vae_shift, model.latent_shape, model.learned_sigma) == (1.0, 0.0, (16, 8, 8), False)
    assert type(model.text_encoder).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(model.tokenizer).__name__ == "Qwen2Tokenizer"


def test_the_directory_is_one_diffusers_loads_itself(qwen_dir, model):
    """QwenImagePipeline.from_pretrained reads the tiny layout, and our text recipe's constants are its own."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(qwen_dir, local_files_only=True)
    assert torch.equal(pipe.text_encoder.lm_head.weight, model.text_encoder.lm_head.weight)
    assert pipe.tokenizer("a red cat").input_ids == model.tokenizer("a red cat").input_ids
    assert (pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx, pipe.tokenizer_max_length) == (
        qwen.PROMPT_TEMPLATE, qwen.DROP_TOKENS, qwen.TOKENIZER_MAX_LENGTH)
    assert pipe.vae_scale_factor * 2 == model.card.size_multiple


def test_a_missing_shard_and_pickles_are_refused(qwen_dir, tmp_path):
    gone = _layout_copy(qwen_dir, tmp_path / "gone")
    shard = sorted((gone / "transformer").glob("diffusion_pytorch_model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelError, match=f"lacks shards its index names: {shard.name}"):
        load_model(gone)
    for part, stem in (("transformer", "diffusion_pytorch_model"), ("text_encoder", "model"),
                       ("vae", "diffusion_pytorch_model")):
        pickled = _layout_copy(qwen_dir, tmp_path / f"pickled-{part}")
        for f in (pickled / part).glob(f"{stem}*"):
            f.unlink()
        (pickled / part / f"{stem}.bin").write_bytes(b"not loaded")
        with pytest.raises(ModelError, match="only pickle weights"):
            load_model(pickled)


# -- the text recipe -----------------------------------------------------------------------------------------
def test_the_template_drops_exactly_its_system_part(model):
    """The tiny tokenizer splits the template as Qwen's does: the 34 tokens the pipeline drops are the system
    part and the user turn's opening, so the kept tokens start at the prompt."""
    ids = model.tokenizer(qwen.PROMPT_TEMPLATE.format("a red cat")).input_ids
    assert model.tokenizer.convert_ids_to_tokens(ids[qwen.DROP_TOKENS:qwen.DROP_TOKENS + 3]) == ["a", "Ġred", "Ġcat"]


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_encodings_equal_the_pipelines_alone(model, pipe, side, monkeypatch):
    """Texts of different lengths encoded in one batch (padded as the tokenizer pads, either side) equal
    encode_prompt of each alone: its real tokens after the template's 34, cut at max_tokens (the long one),
    zeros and a zero mask after them."""
    monkeypatch.setattr(model.tokenizer, "padding_side", side)
    texts = ["a red cat", " ", "the big blue house drawn with a small green tree and a dog sitting on a table"]
    embeds, mask = encode_prompts(model, texts)
    assert embeds.shape == (3, MAX_TOKENS, 32) and mask.shape == (3, MAX_TOKENS)
    for i, text in enumerate(texts):
        ref, ref_mask = pipe.encode_prompt(text, device="cpu", max_sequence_length=MAX_TOKENS)
        n = ref.shape[1]
        assert ref_mask is None and int(mask[i].sum()) == n  # one text alone: no padding, no mask
        torch.testing.assert_close(embeds[i, :n], ref[0], rtol=0, atol=1e-5)
        assert not embeds[i, n:].any() and not mask[i, n:].any()
    assert int(mask[2].sum()) == MAX_TOKENS  # the long text is cut at the limit


def test_encodings_are_cached_by_the_text_and_an_empty_negative_is_a_space(model):
    model.cache.clear()
    spec = ItemSpec(id="a", seed=0, sampler="flow_euler", steps=2, guidance=4.0, prompt="A cat")
    conds = family_named("qwenimage").encode(model, [spec, spec])
    assert sorted(model.cache) == [" ", "A cat"]  # one encoding per distinct text, as given
    assert conds[0]["neg_embeds"] is model.cache[" "][0] and conds[1]["prompt_embeds"] is model.cache["A cat"][0]
    assert {k: tuple(v.shape) for k, v in conds[0].items()} == {
        "prompt_embeds": (MAX_TOKENS, 32), "prompt_mask": (MAX_TOKENS,), "neg_embeds": (MAX_TOKENS, 32),
        "neg_mask": (MAX_TOKENS,)}


# -- the step ------------------------------------------------------------------------------------------------
def test_packing_is_the_pipelines():
    from diffusers import QwenImagePipeline

    x = torch.randn(3, 16, 8, 12)
    assert torch.equal(pack(x), QwenImagePipeline._pack_latents(x, 3, 16, 8, 12))
    assert torch.equal(unpack(pack(x), 8, 12), QwenImagePipeline._unpack_latents(pack(x), 64, 96, 8)[:, :, 0])


def test_the_steps_forward_is_the_transformers(model):
    """transformer_forward (the forward without its host-to-device copy, with the tables made once) gives what
    QwenImageTransformer2DModel.forward gives, text masks and padding included."""
    g = torch.Generator().manual_seed(0)
    tokens, text = torch.randn(2, 24, 64, generator=g), torch.randn(2, MAX_TOKENS, 32, generator=g)
    mask = torch.ones(2, MAX_TOKENS)
    mask[1, 5:] = 0
    t = torch.tensor([0.9, 0.3])
    ours = transformer_forward(model.transformer, tokens, text, mask, t, rotary_tables(model.transformer, 4, 6,
                                                                                        MAX_TOKENS, "cpu"))
    with torch.no_grad():
        ref = model.transformer(hidden_states=tokens, encoder_hidden_states=text, encoder_hidden_states_mask=mask,
                                timestep=t, img_shapes=[[(1, 4, 6)]] * 2, return_dict=False)[0]
    assert torch.equal(ours, ref)


def test_true_cfg_is_the_pipelines_per_row():
    """Rows above 1: the pipeline's combination rescaled to the conditional norm over the 64 packed channels;
    rows at or below 1: the conditional prediction itself (the pipeline without CFG), in one batch."""
    cond, uncond = torch.randn(3, 5, 64), torch.randn(3, 5, 64)
    out = true_cfg(cond, uncond, torch.tensor([4.0, 1.0, 0.0]))
    comb = uncond[0] + 4.0 * (cond[0] - uncond[0])  # QwenImagePipeline.__call__, its lines
    want = comb * (torch.norm(cond[0], dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
    assert torch.equal(out[0], want) and torch.equal(out[1:], cond[1:])


def test_the_schedule_is_the_pipelines(model, pipe):
    """The plan's timesteps are the scheduler's for the pipeline's sigmas, shifted by mu from the packed
    sequence length, then stretched to shift_terminal 0.02."""
    import numpy as np
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    from samplers import make_plan

    cfg = model.card.scheduler
    for shape in ((16, 8, 8), (16, 8, 12), (16, 166, 208)):  # 1664 x 1328 among them
        mu = family_named("qwenimage").plan_kwargs(model, shape)["mu"]
        seq = shape[1] * shape[2] // 4
        assert mu == pytest.approx(calculate_shift(seq, cfg["base_image_seq_len"], cfg["max_image_seq_len"],
                                                   cfg["base_shift"], cfg["max_shift"]))
        pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 50, 50), mu=mu)
        plan = make_plan("flow_euler", 50, model.schedule, mu=mu)
        torch.testing.assert_close(plan.timesteps.float(), pipe.scheduler.timesteps, rtol=0, atol=1e-4)
        assert pipe.scheduler.sigmas[-2].item() == pytest.approx(0.02)


def test_true_cfg_with_negative_prompts_and_prompts_batched_together_equal_the_pipeline_alone(model, pipe):
    """One engine batch: two prompts with true CFG against a negative prompt and against none (" "), one
    without guidance (scale 1: its negative prompt ignored, as the pipeline ignores it), one prompt cut at
    the token limit; each equals QwenImagePipeline run alone."""
    specs = [ItemSpec(id="a", seed=1, sampler="flow_euler", steps=4, guidance=4.0, prompt="a red cat",
                      negative_prompt="blurry photo"),
             ItemSpec(id="b", seed=2, sampler="flow_euler", steps=4, guidance=2.5, prompt="the big blue house"),
             ItemSpec(id="c", seed=1, sampler="flow_euler", steps=4, guidance=1.0, prompt="a red cat",
                      negative_prompt="blurry photo"),
             ItemSpec(id="d", seed=3, sampler="flow_euler", steps=3, guidance=4.0,
                      prompt="a small green tree drawn on a big table with a red cat and a blue dog sitting on it")]
    results = Engine(model, EAGER).generate(specs)
    _assert_equal_to_pipeline(model, pipe, specs, results)
    assert (results[0].latents - results[2].latents).abs().max() > 1e-2  # guidance reaches the result


def test_non_square_sizes_equal_the_pipeline_and_make_their_rotary_tables_once(model, pipe, monkeypatch):
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    calls = []
    real = QwenEmbedRope.forward
    monkeypatch.setattr(QwenEmbedRope, "forward", lambda self, *a, **k: calls.append(a[0]) or real(self, *a, **k))
    specs = [ItemSpec(id="w", seed=5, sampler="flow_euler", steps=3, guidance=4.0, prompt="a green tree",
                      negative_prompt="a dog", width=96, height=64),
             ItemSpec(id="t", seed=6, sampler="flow_euler", steps=3, guidance=3.0, prompt="a cat", width=64, height=96)]
    results = Engine(model, EAGER).generate(specs)
    assert results[0].latents.shape == (16, 8, 12) and results[0].image.shape == (64, 96, 3)
    assert results[1].latents.shape == (16, 12, 8) and results[1].image.shape == (96, 64, 3)
    # once per step the engine made (the native shape's two at its start: with CFG and without; the others' on
    # first use), none in the steps
    assert sorted(calls) == [[[(1, 4, 4)]]] * 2 + [[[(1, 4, 6)]]] + [[[(1, 6, 4)]]]
    _assert_equal_to_pipeline(model, pipe, specs, results)


def test_images_decode_as_the_pipeline_decodes(model, pipe):
    """The engine's generic decode through LatentDecoder (statistics, time axis) and its uint8 conversion make
    the pipeline's image; the adapter ignores a channels-last request (3-D convolution weights have none)."""
    spec = ItemSpec(id="a", seed=9, sampler="flow_euler", steps=2, guidance=4.0, prompt="a red cat")
    (ours,) = Engine(model, EAGER).generate([spec])
    ref = _reference(model, pipe, spec, output_type="np")[0]
    assert (torch.from_numpy(ref * 255) - torch.from_numpy(ours.image).float()).abs().max() <= 1.0
    weight = model.vae.autoencoder.decoder.conv_in.weight
    assert model.vae.to(memory_format=torch.channels_last) is model.vae and weight.is_contiguous()


def test_the_graph_engine_with_captured_decodes_equals_the_pipeline(qwen_dir, pipe):
    """Under the graph backend (on a CPU its runners run the step eagerly, after the speed layer's rewrites)
    and with the VAE decode in a runner of its own, the latents are still the pipeline's and the images the
    plain engine's."""
    import numpy as np

    from workers.speed import SpeedConfig

    model = load_model(qwen_dir)  # its own: the graph engine rewrites the transformer it serves
    specs = [ItemSpec(id="a", seed=1, sampler="flow_euler", steps=2, guidance=4.0, prompt="a red cat"),
             ItemSpec(id="b", seed=2, sampler="flow_euler", steps=2, guidance=1.0, prompt="a dog")]
    engine = Engine(model, WorkerConfig(backend="graphs", max_batch=4), speed=SpeedConfig(decode_graphs=True))
    group = next(g for g in engine.groups.values() if not g.variant)
    assert group.decoder is not None
    got = engine.generate(specs)
    _assert_equal_to_pipeline(model, pipe, specs, got)
    plain = Engine(model, EAGER).generate(specs)
    assert all(np.array_equal(a.image, b.image) for a, b in zip(got, plain))


# -- the built-in --------------------------------------------------------------------------------------------
def test_the_builtin_card_and_its_published_size():
    card = read_card("qwen-image-1024")
    assert (card.family, card.builtin, card.guidance_mode, card.max_tokens) == ("qwenimage", "qwen-image-1024", "cfg", 512)
    assert (card.image_size, card.latent_channels, card.latent_size, card.size_multiple) == (1024, 16, 128, 16)
    assert card.made_sizes() == [(1024, 1024), *MODEL_CARD_SIZES] and card.prediction_type == "flow"
    assert card.defaults == {"sampler": "flow_euler", "steps": 50, "guidance": 4.0}
    assert card.scheduler["max_image_seq_len"] == 8192 and card.scheduler["flow_grid"] == "flux"
    # Qwen-Image: a 20.4B transformer and a 0.13B VAE; Qwen2.5-VL-7B-Instruct, 8.3B
    assert 20.4e9 < PARAMS - 126_892_531 < 20.5e9 and 8.2e9 < ENCODER_PARAMS < 8.3e9


# shrunk configs of the built-in: the text width is the transformer's joint_attention_dim, as in the real one
SMALL = dict(transformer=dict(num_layers=1, num_attention_heads=2, attention_head_dim=16, joint_attention_dim=32,
                              axes_dims_rope=(4, 6, 6)),
             vae=dict(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1),
             text_encoder=dict(text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2,
                                                rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
                               vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                                  out_hidden_size=32, fullatt_block_indexes=[0])))


def test_the_builtins_full_size_parameters_counted_on_meta():
    from workers.families.qwenimage.builtin import qwen_image_on_meta

    parts = qwen_image_on_meta(1024)
    count = {k: sum(p.numel() for p in m.parameters()) for k, m in parts.items()}
    assert count["transformer"] + count["vae"] == PARAMS and count["text_encoder"] == ENCODER_PARAMS
    t, te = parts["transformer"].config, parts["text_encoder"].config
    assert (t.num_layers, t.num_attention_heads, t.attention_head_dim, t.joint_attention_dim) == (60, 24, 128, 3584)
    assert (te.text_config.hidden_size, te.text_config.num_hidden_layers, te.vision_config.depth) == (3584, 28, 32)


def test_a_shrunk_builtin_is_whole_and_generates_finite_images():
    import dataclasses

    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    card = dataclasses.replace(read_card("qwen-image-1024"), image_size=64, latent_size=8, max_tokens=8,
                               sizes=((64, 64), (96, 64)))
    model = qwen._load_builtin(card, "cpu", torch.float32, **SMALL)
    for m in (model.transformer, model.vae, model.text_encoder):
        assert not any(t.is_meta or not t.isfinite().all() for t in [*m.parameters(), *m.buffers()])
        assert not m.training and not any(p.requires_grad for p in m.parameters())
    plain = QwenEmbedRope(theta=10000, axes_dim=[4, 6, 6], scale_rope=True)
    assert torch.equal(model.transformer.pos_embed.pos_freqs, plain.pos_freqs)  # remade, not left empty
    rotary = model.text_encoder.model.language_model.rotary_emb
    assert rotary.inv_freq.dtype == torch.float32 and rotary.inv_freq.abs().max() == 1.0
    assert all(m.gamma.eq(1).all() for m in model.vae.modules() if type(m).__name__ == "QwenImageRMS_norm")
    tok = model.tokenizer
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [36786, 36787, 36788]
    assert tok.pad_token == "<|endoftext|>" and len(tok("a photo of a red cat on a table").input_ids) <= 16
    specs = [ItemSpec(id="a", seed=0, sampler="flow_euler", steps=2, guidance=4.0, prompt="a cat"),
             ItemSpec(id="b", seed=1, sampler="flow_euler", steps=2, guidance=1.0, prompt="a red cat", width=96,
                      height=64)]
    results = Engine(model, WorkerConfig(backend="eager", max_batch=2)).generate(specs)
    assert [r.image.shape for r in results] == [(64, 64, 3), (64, 96, 3)]
    assert all(r.latents.isfinite().all() and r.latents.abs().max() > 0 for r in results)


# -- image-to-image and inpainting (workers.edits) ----------------------------------------------------------
def _edit_reference(model, spec: ItemSpec) -> torch.Tensor:
    """QwenImageImg2ImgPipeline, or QwenImageInpaintPipeline for a spec with a mask, on the decoded image (and
    mask), true CFG at the request's guidance against its negative prompt (" " for an empty one), with a generator
    seeded as the request's; the final latents unpacked to (16, h, w)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageImg2ImgPipeline, QwenImageInpaintPipeline

    cls = QwenImageInpaintPipeline if spec.mask else QwenImageImg2ImgPipeline
    config = {k: v for k, v in model.card.scheduler.items() if k != "flow_grid"}
    pipe = cls(scheduler=FlowMatchEulerDiscreteScheduler.from_config(config), vae=model.vae.autoencoder,
               text_encoder=model.text_encoder, tokenizer=model.tokenizer, transformer=model.transformer)
    pipe.set_progress_bar_config(disable=True)
    width, height = spec.width or IMAGE_SIZE, spec.height or IMAGE_SIZE
    out = pipe(spec.prompt, negative_prompt=spec.negative_prompt or " ", true_cfg_scale=spec.guidance,
               strength=spec.strength, height=height, width=width, num_inference_steps=spec.steps,
               max_sequence_length=model.card.max_tokens, output_type="latent", generator=edit_cases.generator(spec),
               **edit_cases.decoded(spec)).images
    return cls._unpack_latents(out, height, width, 8)[0, :, 0]


@pytest.mark.parametrize("strength", edit_cases.STRENGTHS)
def test_image_to_image_equals_the_img2img_pipeline(model, strength):
    spec = ItemSpec(id="i", seed=31, sampler="flow_euler", steps=5, guidance=4.0, prompt="a red cat",
                    negative_prompt="blurry photo", image=edit_cases.image_bytes(), strength=strength)
    edit_cases.assert_close(Engine(model, EAGER).generate([spec])[0].latents, _edit_reference(model, spec))


@pytest.mark.parametrize("strength", edit_cases.STRENGTHS)
def test_inpainting_equals_the_inpaint_pipeline(model, strength):
    spec = ItemSpec(id="m", seed=32, sampler="flow_euler", steps=5, guidance=3.0, prompt="a green tree",
                    image=edit_cases.image_bytes(seed=1), mask=edit_cases.mask_bytes(), strength=strength)
    edit_cases.assert_close(Engine(model, EAGER).generate([spec])[0].latents, _edit_reference(model, spec))


def test_edits_with_and_without_guidance_and_text_rows_each_equal_their_pipeline(model, pipe):
    """Text-to-image, image-to-image and inpainting rows in one engine, with true CFG and without (scale 1: the
    NO_CFG step, and its inpainting variant), a non-square size among them: each equals its own pipeline."""
    image, mask = edit_cases.image_bytes(seed=2), edit_cases.mask_bytes(box=(0, 0.5, 1, 1))
    specs = [ItemSpec(id="t", seed=1, sampler="flow_euler", steps=4, guidance=4.0, prompt="a red cat"),
             ItemSpec(id="i", seed=2, sampler="flow_euler", steps=5, guidance=1.0, prompt="a dog", image=image,
                      strength=0.6),
             ItemSpec(id="m", seed=3, sampler="flow_euler", steps=4, guidance=1.0, prompt="a house", image=image,
                      mask=mask, strength=0.8),
             ItemSpec(id="w", seed=4, sampler="flow_euler", steps=4, guidance=3.0, prompt="a tree", image=image,
                      mask=mask, strength=0.6, width=96, height=64)]
    engine = Engine(model, EAGER)
    results = engine.generate(specs)
    for spec, r in zip(specs, results):
        ref = _edit_reference(model, spec) if spec.image else _reference(model, pipe, spec)
        edit_cases.assert_close(r.latents, ref, spec.id)
    assert any(k.endswith(":no-cfg+inpaint") for k in engine.stats()["groups"])
