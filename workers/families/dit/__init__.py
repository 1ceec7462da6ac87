"""Class-conditional DiT (Peebles & Xie 2023; diffusers' ``DiTTransformer2DModel``), torch-free: the model
card of its directories and its built-in architectures. The model runs in ``runtime``.

Accepted layouts, never fetched from a hub:
- a pipeline directory: ``model_index.json`` with ``transformer/``, optional ``vae/`` and
  ``scheduler/scheduler_config.json`` (the layout of ``facebook/DiT-XL-2-256`` and ``-512``,
  whose ``id2label`` lets users name classes; the shipped ``digits`` models), or
- a bare transformer directory: ``config.json`` plus ``*.safetensors``.

Built-ins: ``dit-xl-2-256`` / ``dit-xl-2-512``, the DiT-XL/2 architecture with the sd-vae-ft-ema VAE,
randomly initialised on the device, for benchmarks.
"""

from __future__ import annotations

from pathlib import Path

from workers.families.base import DIT_SCHEDULER, FALLBACK_DEFAULTS, Builtin, CardError, Family, ModelCard
from workers.families.previews import SD_VAE

DIT_CONFIG_DEFAULTS = {"sample_size": 32, "in_channels": 4}  # DiTTransformer2DModel's, for keys a config omits
DIT_XL_2_PARAMS = 749_826_464 + 83_653_863  # transformer + sd-vae-ft-ema, counted on the meta device


class DiT(Family):
    name = "dit"
    pipelines = ("DiTPipeline",)
    transformers = ("DiTTransformer2DModel", "Transformer2DModel")
    builtins = {"dit-xl-2-256": Builtin(256, DIT_XL_2_PARAMS), "dit-xl-2-512": Builtin(512, DIT_XL_2_PARAMS)}
    previews = {4: SD_VAE}
    runtime = "workers.families.dit.runtime:DiTRuntime"
    # image-to-image and inpainting (workers.edits) by StableDiffusionImg2ImgPipeline's and
    # StableDiffusionInpaintPipeline's rule (diffusers has none for DiT); a pixel-space model on its pixels
    takes_image = True
    takes_mask = True
    rate_reference = "dit-xl-2-256"  # its measured rate (workers.families.rates)
    break_attention = True  # under `breakable`, each block's self-attention is an eager break (workers.speed.patches)

    def read_card(self, name: str, path: Path, transformer: dict, vae: dict | None, index: dict,
                  scheduler: dict) -> ModelCard:
        cfg = transformer
        if cfg.get("norm_type") != "ada_norm_zero" or not cfg.get("num_embeds_ada_norm"):
            raise CardError(f"{path} is not a class-conditional DiT (needs norm_type 'ada_norm_zero' and "
                            "num_embeds_ada_norm): other transformers are not supported yet")
        extra = index.get("dit_serve", {})
        factor = 2 ** (len(vae["block_out_channels"]) - 1) if vae is not None else 1  # the VAE's downsampling
        size = int(cfg.get("sample_size", DIT_CONFIG_DEFAULTS["sample_size"]))
        return ModelCard(
            name, "dit", "class", path=str(path), num_classes=int(cfg["num_embeds_ada_norm"]),
            id2label={int(k): v for k, v in (index.get("id2label") or {}).items()}, image_size=size * factor,
            latent_channels=int(cfg.get("in_channels", DIT_CONFIG_DEFAULTS["in_channels"])), latent_size=size,
            pixel_space=vae is None, dtype=extra.get("dtype", "bfloat16"), scheduler=scheduler,
            defaults={**FALLBACK_DEFAULTS, **extra.get("defaults", {})})

    def builtin_card(self, name: str) -> ModelCard:
        size = self.builtins[name].image_size
        return ModelCard(name, "dit", "class", builtin=name, num_classes=1000, image_size=size, latent_channels=4,
                         latent_size=size // 8, scheduler=dict(DIT_SCHEDULER))
