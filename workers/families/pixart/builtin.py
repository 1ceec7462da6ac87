"""PixArt-Σ-XL/2 with random weights (``PixArt-alpha/PixArt-Sigma-XL-2-1024-MS``'s architecture), for
benchmarks: built on the meta device and materialised on the target one (``workers.families.builtins``)."""

from __future__ import annotations

import torch
from torch import nn

from workers.families.builtins import SDXL_VAE, T5_XXL, materialise, t5_tokenizer

# transformer/config.json of PixArt-Sigma-XL-2-1024-MS (sample_size and interpolation_scale follow the size)
PIXART_SIGMA_XL_2 = dict(
    num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28, patch_size=2,
    cross_attention_dim=1152, caption_channels=4096, attention_bias=True, activation_fn="gelu-approximate",
    num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
    use_additional_conditions=False, attention_type="default")


def build_pixart_sigma(image_size: int, device: str | torch.device, dtype: torch.dtype, seed: int = 0, *,
                       transformer: dict | None = None, text_encoder: dict | None = None, vae: dict | None = None):
    """PixArt-Σ at ``image_size`` pixels (latents image_size // 8 per side) with random weights made on
    ``device`` in ``dtype``: ``(transformer, text_encoder, tokenizer, vae)``, in eval mode, frozen. The
    dicts override keys of PIXART_SIGMA_XL_2, T5_XXL and SDXL_VAE (tests shrink them). One generator
    seeded with ``seed`` initialises the three modules in that order, so a seed gives the same weights."""
    gen = torch.Generator(device).manual_seed(seed)
    modules = pixart_sigma_on_meta(image_size, transformer=transformer, text_encoder=text_encoder, vae=vae)
    made = [materialise(m, device, dtype, gen) for m in modules]
    return made[0], made[1], t5_tokenizer(), made[2]


def pixart_sigma_on_meta(image_size: int, *, transformer: dict | None = None, text_encoder: dict | None = None,
                         vae: dict | None = None) -> tuple[nn.Module, nn.Module, nn.Module]:
    """The transformer, T5 encoder and VAE of build_pixart_sigma on the meta device: shapes, no storage
    (parameter counts and memory estimates cost nothing)."""
    from diffusers import AutoencoderKL, PixArtTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    # the reference pipelines' positional-embedding interpolation, {256: 0.5, 512: 1, 1024: 2, 2048: 4}
    sizes = dict(sample_size=image_size // 8, interpolation_scale=image_size / 512)
    with torch.device("meta"):
        return (PixArtTransformer2DModel(**{**PIXART_SIGMA_XL_2, **sizes, **(transformer or {})}),
                T5EncoderModel(T5Config(**{**T5_XXL, **(text_encoder or {})})),
                AutoencoderKL(**{**SDXL_VAE, "sample_size": image_size, **(vae or {})}))
