"""Random full-size PixArt-Σ built on the meta device: shrunk configs materialised on the CPU must be whole
(no meta tensors, finite, frozen), their recomputed buffers equal a normal build's, a forward through
the three modules finite and fixed by the seed; the tokenizer T5-like; the full-size counts right."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workers.families.builtins import T5_XXL, materialise, t5_tokenizer
from workers.families.pixart.builtin import build_pixart_sigma, pixart_sigma_on_meta

SMALL = dict(transformer=dict(num_layers=2, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
                              caption_channels=32),
             text_encoder=dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4),  # vocab stays 32128
             vae=dict(block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=8))  # still 8x
PROMPT = "A photo of a red cat sitting on a wooden table at sunset, highly detailed."


def _build(seed: int, image_size: int = 64, dtype=torch.float32):
    return build_pixart_sigma(image_size, "cpu", dtype, seed, **SMALL)


@pytest.fixture(scope="module")
def built():
    return _build(0)


def _generate(built) -> torch.Tensor:
    """Prompt -> T5 -> one transformer step (CFG rows: prompt, "") -> VAE decode of the first half."""
    transformer, text_encoder, tokenizer, vae = built
    tok = tokenizer([PROMPT, ""], padding="max_length", max_length=24, truncation=True, return_tensors="pt")
    embeds = text_encoder(tok.input_ids, attention_mask=tok.attention_mask)[0]              # (2, 24, 32)
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0)).expand(2, -1, -1, -1)
    mask = tok.attention_mask.to(transformer.dtype)
    out = transformer(x.to(transformer.dtype), encoder_hidden_states=embeds, encoder_attention_mask=mask,
                      timestep=torch.tensor([500, 500]), added_cond_kwargs={"resolution": None, "aspect_ratio": None}
                      ).sample                                                               # (2, 8, 8, 8)
    return vae.decode(out[:1, :4] / vae.config.scaling_factor).sample                       # (1, 3, 64, 64)


def test_built_models_are_whole_finite_and_frozen(built):
    transformer, text_encoder, _, vae = built
    for m in (transformer, text_encoder, vae):
        tensors = [*m.parameters(), *m.buffers()]
        assert all(t.device.type == "cpu" and t.dtype == torch.float32 and t.isfinite().all() for t in tensors)
        assert not m.training and not any(p.requires_grad for p in m.parameters())
    assert text_encoder.shared.weight is text_encoder.encoder.embed_tokens.weight  # the tie survives
    config = transformer.config
    assert (config.sample_size, config.interpolation_scale, vae.config.sample_size) == (8, 0.125, 64)


@pytest.mark.parametrize("image_size, dtype", [(64, torch.float32), (1024, torch.bfloat16)])
def test_recomputed_buffers_equal_a_normal_build(image_size, dtype):
    # 1024 px: latents 128, 64x64 patches, interpolation 2, as the full model; bfloat16 as a cast of a normal build
    transformer, text_encoder, _, vae = build_pixart_sigma(image_size, "cpu", dtype, **SMALL)
    normal = (type(transformer).from_config(transformer.config), type(text_encoder)(text_encoder.config),
              type(vae).from_config(vae.config))
    for ours, ref in zip((transformer, text_encoder, vae), normal):
        ref_buffers = dict(nn.Module.to(ref, dtype=dtype).named_buffers())
        assert ref_buffers.keys() == dict(ours.named_buffers()).keys()
        for name, b in ours.named_buffers():
            assert torch.equal(b, ref_buffers[name]), name
    tokens = (image_size // 16) ** 2  # latents image_size // 8, patches of 2
    assert transformer.pos_embed.pos_embed.shape == (1, tokens, 16) and transformer.pos_embed.pos_embed.abs().sum() > 0


def test_a_forward_is_finite_and_fixed_by_the_seed(built):
    with torch.no_grad():
        a, again, other = _generate(built), _generate(_build(0)), _generate(_build(1))
    assert a.shape == (1, 3, 64, 64) and a.isfinite().all()
    assert torch.equal(a, again) and not torch.allclose(a, other)


def test_a_bfloat16_forward_is_finite():
    with torch.no_grad():
        assert _generate(_build(0, dtype=torch.bfloat16)).isfinite().all()


def test_the_tokenizer_is_t5_like():
    tokenizer = t5_tokenizer()
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert len(tokenizer) == T5_XXL["vocab_size"]
    ids = tokenizer(PROMPT).input_ids
    assert 10 <= len(ids) <= 40 and ids[-1] == 1 and all(0 <= i < T5_XXL["vocab_size"] for i in ids)
    assert ids.count(2) == 0 and tokenizer("Café, NAÏVE").input_ids.count(2) == 0  # accents stripped, lower-cased
    assert tokenizer.decode(ids, skip_special_tokens=True) == PROMPT.lower()
    padded = tokenizer([PROMPT], padding="max_length", max_length=8, truncation=True).input_ids[0]
    assert len(padded) == 8 and padded[-1] == 1  # truncation keeps </s>
    assert tokenizer("").input_ids == [1] and t5_tokenizer().get_vocab() == tokenizer.get_vocab()


def test_unknown_buffers_are_refused():
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(2, 2))
        m.register_buffer("table", torch.arange(3.0), persistent=False)
    with pytest.raises(RuntimeError, match="meta construction leaves empty"):
        materialise(m, "cpu", torch.float32, torch.Generator().manual_seed(0))


def test_full_size_parameter_counts_on_meta():
    transformer, text_encoder, vae = pixart_sigma_on_meta(1024)
    count = [sum(p.numel() for p in m.parameters()) for m in (transformer, text_encoder, vae)]
    # PixArt-Sigma-XL-2-1024-MS's transformer, t5-v1_1-xxl's encoder (embedding counted once), the SDXL VAE
    assert count == [610_856_096, 4_762_310_656, 83_653_863]
    assert transformer.pos_embed.pos_embed.shape == (1, 64 * 64, 1152) and transformer.config.interpolation_scale == 2
    assert text_encoder.config.is_gated_act and text_encoder.config.dense_act_fn == "gelu_new"


def test_a_builtins_text_encoders_are_made_on_the_offload_device_never_on_the_gpu_first(monkeypatch):
    """With ``[workers] text_encoder_device`` set, a built-in's encoders are materialised there directly (FLUX.2-dev's
    48 GB encoder beside its 64 GB transformer would not fit one 80 GB GPU even for a moment), the rest on the
    model's device, each device with its own seeded generator."""
    import workers.families.builtins as b
    from workers.families.encoders import encoders_on

    made = []
    monkeypatch.setattr(b, "_generator", lambda device, seed: ("gen", str(device), seed))
    monkeypatch.setattr(b, "materialise", lambda m, where, dtype, gen: made.append((m, str(where), gen)) or m)
    modules = {"transformer": "T", "vae": "V", "text_encoder": "E", "text_encoder_2": "E2"}
    with encoders_on("cpu"):
        b.materialise_all(modules, "cuda:0", torch.bfloat16, 7)
    assert made == [("T", "cuda:0", ("gen", "cuda:0", 7)), ("V", "cuda:0", ("gen", "cuda:0", 7)),
                    ("E", "cpu", ("gen", "cpu", 7)), ("E2", "cpu", ("gen", "cpu", 7))]
    made.clear()
    b.materialise_all(modules, "cuda:0", torch.bfloat16, 7)
    assert {where for _, where, _ in made} == {"cuda:0"}
