"""FLUX.1-dev with random weights (``black-forest-labs/FLUX.1-dev``'s architecture), for benchmarks: built
on the meta device and materialised on the target one (``workers.families.builtins``)."""

from __future__ import annotations

import torch
from torch import nn

from workers.families.builtins import (CLIP_L, MMDIT_VAE, T5_XXL, check_overrides, clip_token_ids, clip_tokenizer,
                                        materialise_all, t5_tokenizer)

# transformer/config.json of FLUX.1-dev (patch_size 1: the pipeline packs 2x2 latent cells into a token of 64)
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
FLUX_VAE_FACTORS = dict(scaling_factor=0.3611, shift_factor=0.1159)


def build_flux_dev(image_size: int, device: str | torch.device, dtype: torch.dtype, seed: int = 0,
                   **overrides: dict) -> dict:
    """FLUX.1-dev with random weights made on ``device`` in ``dtype``, named as FluxPipeline's components:
    transformer, vae, text_encoder / tokenizer (CLIP-L, its pooled output), text_encoder_2 / tokenizer_2
    (T5-XXL). ``image_size`` is the VAE's sample_size only (the transformer takes any size);
    ``overrides`` and ``seed`` as build_sd35_medium's."""
    made = materialise_all(flux_dev_on_meta(image_size, **overrides), device, dtype, seed)
    return {**made, "tokenizer": clip_tokenizer(), "tokenizer_2": t5_tokenizer()}


def flux_dev_on_meta(image_size: int, **overrides: dict) -> dict[str, nn.Module]:
    """The modules of build_flux_dev on the meta device: shapes, no storage."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    o = check_overrides(overrides, ("transformer", "vae", "text_encoder", "text_encoder_2"))
    with torch.device("meta"):
        return {"transformer": FluxTransformer2DModel(**{**FLUX_DEV, **o["transformer"]}),
                "vae": AutoencoderKL(**{**MMDIT_VAE, **FLUX_VAE_FACTORS, "sample_size": image_size, **o["vae"]}),
                "text_encoder": CLIPTextModel(CLIPTextConfig(**{**CLIP_L, **clip_token_ids(), **o["text_encoder"]})),
                "text_encoder_2": T5EncoderModel(T5Config(**{**T5_XXL, **o["text_encoder_2"]}))}
