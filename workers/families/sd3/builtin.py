"""Stable Diffusion 3.5 medium with random weights (``stabilityai/stable-diffusion-3.5-medium``'s
architecture), for benchmarks: built on the meta device and materialised on the target one
(``workers.families.builtins``)."""

from __future__ import annotations

import torch
from torch import nn

from workers.families.builtins import (CLIP_BIGG, CLIP_L, MMDIT_VAE, T5_XXL, check_overrides, clip_token_ids,
                                        clip_tokenizer, materialise_all, t5_tokenizer)

# transformer/config.json of stable-diffusion-3.5-medium (sample_size follows the size: 128 at 1024 px)
SD35_MEDIUM = dict(
    patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
    joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
SD3_VAE_FACTORS = dict(scaling_factor=1.5305, shift_factor=0.0609)


def build_sd35_medium(image_size: int, device: str | torch.device, dtype: torch.dtype, seed: int = 0,
                      **overrides: dict) -> dict:
    """Stable Diffusion 3.5 medium at ``image_size`` pixels with random weights made on ``device`` in
    ``dtype``, named as StableDiffusion3Pipeline's components: transformer, vae, text_encoder /
    tokenizer (CLIP-L), text_encoder_2 / tokenizer_2 (bigG, padding with "!" as SD3's), text_encoder_3 /
    tokenizer_3 (T5-XXL). ``overrides`` maps a module's name to keys of its config (tests shrink them);
    one generator seeded with ``seed`` initialises the modules in that order."""
    made = materialise_all(sd35_medium_on_meta(image_size, **overrides), device, dtype, seed)
    return {**made, "tokenizer": clip_tokenizer(), "tokenizer_2": clip_tokenizer(pad="!"),
            "tokenizer_3": t5_tokenizer()}


def sd35_medium_on_meta(image_size: int, **overrides: dict) -> dict[str, nn.Module]:
    """The modules of build_sd35_medium on the meta device: shapes, no storage."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    o = check_overrides(overrides, ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"))
    clip_l = CLIPTextConfig(**{**CLIP_L, **clip_token_ids(), **o["text_encoder"]})
    clip_g = CLIPTextConfig(**{**CLIP_BIGG, **clip_token_ids(pad="!"), **o["text_encoder_2"]})
    with torch.device("meta"):
        return {"transformer": SD3Transformer2DModel(**{**SD35_MEDIUM, "sample_size": image_size // 8,
                                                        **o["transformer"]}),
                "vae": AutoencoderKL(**{**MMDIT_VAE, **SD3_VAE_FACTORS, "sample_size": image_size, **o["vae"]}),
                "text_encoder": CLIPTextModelWithProjection(clip_l),
                "text_encoder_2": CLIPTextModelWithProjection(clip_g),
                "text_encoder_3": T5EncoderModel(T5Config(**{**T5_XXL, **o["text_encoder_3"]}))}
