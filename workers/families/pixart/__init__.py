"""PixArt-α and PixArt-Σ (Chen et al. 2023, 2024; diffusers' ``PixArtTransformer2DModel``), torch-free: the
model card of its pipeline directories and its built-in architectures. The model runs in ``runtime``.

The layout is ``PixArt-alpha/PixArt-Sigma-XL-2-1024-MS``'s (and the α pipelines'): transformer/
(PixArtTransformer2DModel), text_encoder/ (T5EncoderModel) with tokenizer/, an optional vae/, scheduler/.
Sizes are the reference pipelines' aspect-ratio bins (``bins.pixart_bins``) unless the directory lists its
own (``dit_serve.sizes``).

Built-ins: ``pixart-sigma-512`` / ``-1024``, PixArt-Σ-XL/2 with a T5-XXL-sized encoder and the SDXL VAE,
randomly initialised on the device (``builtin``), for benchmarks.
"""

from __future__ import annotations

from pathlib import Path

from workers.families.base import Builtin, CardError, Family, ModelCard, listed_sizes
from workers.families.pixart.bins import pixart_bins
from workers.families.previews import SD_VAE

PIXART_SCHEDULER = {"num_train_timesteps": 1000, "beta_start": 0.0001, "beta_end": 0.02, "beta_schedule": "linear",
                    "prediction_type": "epsilon", "algorithm_type": "dpmsolver++", "solver_order": 2,
                    "timestep_spacing": "linspace"}  # PixArt-Σ's scheduler_config.json
DEFAULTS = {"sampler": "dpmpp_2m", "steps": 20, "guidance": 4.5}  # the reference pipelines' defaults
# transformer + SDXL VAE, T5-XXL's encoder: counted on the meta device
SIGMA_PARAMS, T5_XXL_PARAMS = 610_856_096 + 83_653_863, 4_762_310_656


class PixArt(Family):
    name = "pixart"
    pipelines = ("PixArtSigmaPipeline", "PixArtAlphaPipeline")
    transformers = ("PixArtTransformer2DModel",)
    builtins = {"pixart-sigma-512": Builtin(512, SIGMA_PARAMS, T5_XXL_PARAMS),
                "pixart-sigma-1024": Builtin(1024, SIGMA_PARAMS, T5_XXL_PARAMS)}
    previews = {4: SD_VAE}
    runtime = "workers.families.pixart.runtime:PixArtRuntime"
    # image-to-image and inpainting (workers.edits) by StableDiffusionImg2ImgPipeline's and
    # StableDiffusionInpaintPipeline's rule for a 4-channel model (diffusers has none for PixArt)
    takes_image = True
    takes_mask = True
    rate_reference = "pixart-sigma-512"  # its measured rate (workers.families.rates)
    break_attention = True  # self-attention (attn1: no mask) through workers.speed.patches: fused q, k, v, the kernel
    compile_scope = "blocks"  # PixArt-Σ 512 end to end 160 ms compiled by blocks (docs/benchmarks/pixart_inductor-blocks.md)
    encoder_graphs = True  # under the graph backends T5 replays from CUDA graphs (runtime.real_length_encode)

    def read_card(self, name: str, path: Path, transformer: dict, vae: dict | None, index: dict,
                  scheduler: dict) -> ModelCard:
        """PixArt-α/Σ pipeline directories: PixArtTransformer2DModel, a T5 text encoder and its tokenizer."""
        cfg = transformer
        for part in ("text_encoder/config.json", "tokenizer"):
            if not (path / part).exists():
                raise CardError(f"{path} is a PixArt pipeline without {part}: a text model needs its encoder and "
                                "tokenizer")
        extra = index.get("dit_serve", {})
        sigma = index.get("_class_name") != "PixArtAlphaPipeline"
        factor = 2 ** (len(vae["block_out_channels"]) - 1) if vae is not None else 1
        size = int(cfg.get("sample_size", 128))
        multiple = factor * int(cfg.get("patch_size", 2))
        sizes = listed_sizes(path, extra, multiple) or pixart_bins(size)
        return ModelCard(
            name, "pixart", "text", path=str(path), image_size=size * factor,
            latent_channels=int(cfg.get("in_channels", 4)), latent_size=size, pixel_space=vae is None,
            dtype=extra.get("dtype", "bfloat16"), scheduler=scheduler,
            defaults={**DEFAULTS, **extra.get("defaults", {})},
            max_tokens=int(extra.get("max_sequence_length", 300 if sigma else 120)), sizes=tuple(sizes),
            size_multiple=multiple, lowercase_prompts=True, tokenizer_file=str(path / "tokenizer" / "tokenizer.json")
            if (path / "tokenizer" / "tokenizer.json").is_file() else "")

    def builtin_card(self, name: str) -> ModelCard:
        size = self.builtins[name].image_size
        return ModelCard(name, "pixart", "text", builtin=name, image_size=size, latent_channels=4,
                         latent_size=size // 8, scheduler=dict(PIXART_SCHEDULER), max_tokens=300,
                         sizes=tuple(pixart_bins(size // 8)), size_multiple=16, defaults=dict(DEFAULTS),
                         lowercase_prompts=True)
