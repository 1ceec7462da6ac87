"""Random full-size SD3.5 medium and FLUX.1-dev built on the meta device (families/<name>/builtin.py): shrunk configs
materialised on the CPU must be whole (no meta tensors, finite, frozen) with buffers equal to a normal
build's, load through their family's ``load`` and generate finite images through the engine; the CLIP
tokenizer's ids must fit the encoders and pick the pooled token; the full-size counts and cards right."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from workers.config import WorkerConfig
from workers.request.cards import read_card
from workers.engine import Engine
from workers.families.builtins import CLIP_L, clip_token_ids, clip_tokenizer
from workers.families.flux import builtin as flux_builtin
from workers.families.flux import runtime as flux
from workers.families.flux.builtin import build_flux_dev, flux_dev_on_meta
from workers.families.sd3 import builtin as sd3_builtin
from workers.families.sd3 import runtime as sd3
from workers.families.sd3.builtin import build_sd35_medium, sd35_medium_on_meta
from workers.loading import load_model
from workers.request.spec import ItemSpec

# widths as the real models' proportions (CLIP-L + bigG narrower than T5 = joint_attention_dim; SD3's
# projections add up to pooled_projection_dim; FLUX's pooled input is CLIP's width); vocabularies stay full
SD3_SMALL = dict(
    transformer=dict(num_layers=2, num_attention_heads=2, attention_head_dim=8, caption_projection_dim=16,
                     joint_attention_dim=64, pooled_projection_dim=64, pos_embed_max_size=16,
                     dual_attention_layers=(0,)),
    text_encoder=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      projection_dim=32),
    text_encoder_2=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        projection_dim=32),
    text_encoder_3=dict(d_model=64, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
    vae=dict(block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=8))  # still 8x
FLUX_SMALL = dict(
    transformer=dict(num_layers=1, num_single_layers=2, num_attention_heads=2, attention_head_dim=8,
                     joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(2, 2, 4)),
    text_encoder=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2),
    text_encoder_2=dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
    vae=SD3_SMALL["vae"])
FAMILIES = {"sd35-medium-1024": (build_sd35_medium, SD3_SMALL, sd3, sd3_builtin),  # builder, shrunk configs,
            "flux-dev-1024": (build_flux_dev, FLUX_SMALL, flux, flux_builtin)}      # runtime and builder modules
EAGER = WorkerConfig(backend="eager", max_batch=2)


def _small_card(name: str):
    """The built-in's card at 64 px (latents 16 x 8 x 8), 8 T5 tokens, and one non-square size."""
    return dataclasses.replace(read_card(name), image_size=64, latent_size=8, max_tokens=8, sizes=((64, 64), (96, 64)))


@pytest.fixture(scope="module", params=list(FAMILIES))
def small(request):
    """A shrunk built-in loaded by its family's _load_builtin, as load_model loads the full one."""
    _, overrides, family, _ = FAMILIES[request.param]
    return family._load_builtin(_small_card(request.param), "cpu", torch.float32, **overrides)


def _modules(model) -> list[nn.Module]:
    names = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
    return [getattr(model, n) for n in names if getattr(model, n, None) is not None]


def test_built_models_are_whole_finite_and_frozen(small):
    for m in _modules(small):
        tensors = [*m.parameters(), *m.buffers()]
        assert all(t.device.type == "cpu" and t.isfinite().all() for t in tensors if t.is_floating_point())
        assert not any(t.is_meta for t in tensors) and all(p.dtype == torch.float32 for p in m.parameters())
        assert not m.training and not any(p.requires_grad for p in m.parameters())
    assert small.vae_shift == small.vae.config.shift_factor != 0  # _assemble read the 16-channel VAE's shift
    for encoder, tokenizer in ((small.text_encoder, small.tokenizer),
                               (getattr(small, "text_encoder_2", None), getattr(small, "tokenizer_2", None))):
        if encoder is not None and "CLIP" in type(encoder).__name__:  # SD3's bigG pads with "!", CLIP-L with eos
            config = encoder.config
            assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
                tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)


@pytest.mark.parametrize("name, image_size, dtype", [("sd35-medium-1024", 64, torch.float32),
                                                     ("sd35-medium-1024", 1024, torch.bfloat16),
                                                     ("flux-dev-1024", 64, torch.float32)])
def test_recomputed_buffers_equal_a_normal_build(name, image_size, dtype):
    build, overrides, _, _ = FAMILIES[name]
    if image_size == 1024:  # SD3.5's own table: 384 x 384 patches about a base of 64 (sample_size 128)
        overrides = {**overrides, "transformer": {**overrides["transformer"], "pos_embed_max_size": 384}}
    parts = build(image_size, "cpu", dtype, **overrides)
    for part, ours in parts.items():
        if not isinstance(ours, nn.Module):
            continue  # a tokenizer
        cls = type(ours)
        ref = cls.from_config(ours.config) if hasattr(cls, "from_config") else cls(ours.config)  # diffusers | HF
        ref_buffers = dict(nn.Module.to(ref, dtype=dtype).named_buffers())
        assert ref_buffers.keys() == dict(ours.named_buffers()).keys(), part
        for key, b in ours.named_buffers():
            assert torch.equal(b, ref_buffers[key]), (part, key)
    if name.startswith("sd35"):
        grid = parts["transformer"].config.pos_embed_max_size
        assert parts["transformer"].pos_embed.pos_embed.shape == (1, grid * grid, 16)


def test_a_forward_through_the_engine_is_finite(small):
    specs = [ItemSpec(id="a", seed=0, sampler="flow_euler", steps=2, guidance=4.5, prompt="a cat"),
             ItemSpec(id="b", seed=1, sampler="flow_euler", steps=2, guidance=3.5, prompt="a red cat", width=96,
                      height=64)]
    results = Engine(small, EAGER).generate(specs)
    assert [(r.image.shape, r.image.dtype) for r in results] == [((64, 64, 3), np.uint8), ((64, 96, 3), np.uint8)]
    assert [r.latents.shape for r in results] == [(16, 8, 8), (16, 8, 12)]
    assert all(r.latents.isfinite().all() and r.latents.abs().max() > 0 for r in results)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_bfloat16_generation_is_finite_and_fixed_by_the_seed(name):
    _, overrides, family, _ = FAMILIES[name]

    def latents() -> torch.Tensor:  # a fresh build each time: _load_builtin seeds it with 0
        model = family._load_builtin(_small_card(name), "cpu", torch.bfloat16, **overrides)
        spec = ItemSpec(id="a", seed=0, sampler="flow_euler", steps=2, guidance=4.5, prompt="a cat")
        return Engine(model, EAGER).generate([spec])[0].latents

    a = latents()
    assert a.isfinite().all() and torch.equal(a, latents())


def test_load_model_builds_the_builtins_through_their_families(monkeypatch):
    """load_model("flux-dev-1024") reaches flux.load, then _load_builtin (the builders shrunk here)."""
    for name, (build, overrides, _, module) in FAMILIES.items():
        monkeypatch.setattr(module, build.__name__, lambda size, device, dtype, b=build, o=overrides: b(
            size, device, dtype, **o))
        model = load_model(name)
        assert model.card == read_card(name) and model.latent_shape == (16, 128, 128) and model.image_size == 1024
        extra = ("text_encoder_2", "tokenizer_2") + (("text_encoder_3", "tokenizer_3") if "sd35" in name else ())
        assert all(getattr(model, a) is not None for a in ("text_encoder", "tokenizer", *extra))
        assert model.schedule.prediction_type == "flow"


def test_the_clip_tokenizer_fits_the_encoders_and_marks_the_pooled_token():
    tokenizer, bigg = clip_tokenizer(), clip_tokenizer(pad="!")
    ids = tokenizer(["A photo of a red cat sitting on a wooden table at sunset, highly detailed.", ""],
                    padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    assert ids.shape == (2, 77) and ids.max() < CLIP_L["vocab_size"] and ids.min() >= 0
    assert 15 <= (ids[0] != tokenizer.pad_token_id).sum() <= 40  # ~2 tokens a word; 0 unknown
    assert tokenizer.model_max_length == 77 and len(tokenizer) < CLIP_L["vocab_size"]
    assert bigg.pad_token_id == bigg.convert_tokens_to_ids("!") == clip_token_ids("!")["pad_token_id"]
    parts = build_flux_dev(64, "cpu", torch.float32, **FLUX_SMALL)
    with torch.no_grad():
        out = parts["text_encoder"](ids)
    eos = (ids == tokenizer.eos_token_id).int().argmax(-1)  # the first eos: the prompt's end
    assert eos.tolist() == [int((ids[0] != tokenizer.pad_token_id).sum()), 1]
    assert torch.equal(out.pooler_output, out.last_hidden_state[torch.arange(2), eos])


def test_unknown_overrides_are_refused():
    with pytest.raises(TypeError, match="text_encoder_3"):
        flux_dev_on_meta(1024, text_encoder_3={})


def test_full_size_parameter_counts_on_meta():
    sd, fx = sd35_medium_on_meta(1024), flux_dev_on_meta(1024)
    count = {k: sum(p.numel() for p in m.parameters()) for k, m in sd.items()}
    # stable-diffusion-3.5-medium: transformer (2.47B with its 384^2 x 1536 pos_embed buffer), CLIP-L and
    # bigG with projections, t5-v1_1-xxl's encoder (embedding counted once), the 16-channel VAE
    assert count == {"transformer": 2_243_171_520, "vae": 83_819_683, "text_encoder": 123_650_304,
                     "text_encoder_2": 694_659_840, "text_encoder_3": 4_762_310_656}
    assert sd["transformer"].pos_embed.pos_embed.shape == (1, 384 * 384, 1536)
    count = {k: sum(p.numel() for p in m.parameters()) for k, m in fx.items()}
    assert count == {"transformer": 11_901_408_320, "vae": 83_819_683, "text_encoder": 123_060_480,
                     "text_encoder_2": 4_762_310_656}  # FLUX.1-dev; CLIP-L without its projection
    t = fx["transformer"].config
    assert (t.joint_attention_dim, t.pooled_projection_dim) == (fx["text_encoder_2"].config.d_model,
                                                               fx["text_encoder"].config.hidden_size)


def test_the_full_size_sd3_encoders_fit_its_transformer():
    """sd3._check_widths, the directory loader's check, on the meta modules."""
    parts = sd35_medium_on_meta(1024)
    model = SimpleNamespace(**parts, tokenizer=SimpleNamespace(model_max_length=77))
    sd3._check_widths(model, Path("sd35-medium-1024"))
    assert parts["transformer"].config.sample_size == 128 and parts["transformer"].config.qk_norm == "rms_norm"


def test_the_cards_of_the_builtins():
    card = read_card("flux-dev-1024")
    assert (card.family, card.conditioning, card.builtin, card.guidance_mode) == ("flux", "text", "flux-dev-1024",
                                                                                  "embedded")
    assert (card.image_size, card.latent_channels, card.latent_size, card.size_multiple) == (1024, 16, 128, 16)
    assert (1024, 1024) in card.sizes and (1360, 768) in card.sizes and card.max_tokens == 512
    assert card.defaults == {"sampler": "flow_euler", "steps": 28, "guidance": 3.5}
    assert card.scheduler["use_dynamic_shifting"] and card.scheduler["flow_grid"] == "flux"
    assert card.prediction_type == "flow" and read_card("flux-dev-512").made_sizes()[0] == (512, 512)
    card = read_card("sd35-medium-1024")
    assert (card.family, card.guidance_mode, card.max_tokens, card.scheduler["shift"]) == ("sd3", "cfg", 256, 3.0)
    assert card.defaults == {"sampler": "flow_euler", "steps": 40, "guidance": 4.5}
    assert (1024, 1024) in card.sizes and (1344, 768) in card.sizes and card.prediction_type == "flow"
