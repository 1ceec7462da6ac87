"""Class-conditional DiT, the torch part: the condition is a class label; classifier-free guidance pairs
each row with the null class (the label table's extra row)."""

from __future__ import annotations

from pathlib import Path

import torch

from graphs import TensorSpec
from samplers import cfg_combine, model_input, sampler_step
from workers.families.dit import DiT
from workers.loading import LoadedModel, assemble, cast, load_component, load_vae

DIT_XL_2 = dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8,
                num_layers=28, patch_size=2, num_embeds_ada_norm=1000, norm_type="ada_norm_zero")
SD_VAE_FT_EMA = dict(
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=[128, 256, 512, 512],
    down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
    layers_per_block=2, norm_num_groups=32, act_fn="silu", scaling_factor=0.18215)


class DiTRuntime(DiT):
    def reference_pipeline(self, model):
        """DiTPipeline over the model's modules, DDIM on DiT's schedule (the card's sampler)."""
        import diffusers as d

        sched = d.DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear", clip_sample=False)
        pipe = d.DiTPipeline(transformer=model.transformer, vae=model.vae, scheduler=sched)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def reference_call(self, model, specs) -> dict:
        s = specs[0]
        return dict(class_labels=[x.label for x in specs], num_inference_steps=s.steps, guidance_scale=s.guidance)

    def load(self, card, device, dtype) -> LoadedModel:
        """A pipeline directory (transformer/, an optional vae/), a bare transformer directory, or DiT-XL/2
        with random weights (a built-in card)."""
        if card.builtin:
            return _builtin_dit_xl(card, device, dtype)
        path = Path(card.path)
        if not (path / "model_index.json").exists():
            return assemble(card, _load_transformer(path, device, dtype), None)
        vae = load_vae(path / "vae", device, dtype) if (path / "vae" / "config.json").is_file() else None
        return assemble(card, _load_transformer(path / "transformer", device, dtype), vae)

    def cond_specs(self, model) -> dict[str, TensorSpec]:
        return {"labels": TensorSpec((), torch.long)}

    def encode(self, model, specs) -> list[dict[str, torch.Tensor]]:
        """Labels were resolved to class ids by the API (or the CLI): each is its own embedding row."""
        return [{"labels": torch.tensor(s.label)} for s in specs]

    def compile_regions(self, model):
        """None: DiT's steps compile whole. Its blocks' norms read the hoisted modulation by their index
        (``workers.speed.patches.HoistedModulation``), so each block would be a graph of its own."""
        return None

    def make_step(self, model, shape=None):
        """One whole denoising step, the captured unit: CFG-doubled forward, guidance, sampler update. DiT
        makes its native size only, so ``shape`` (the latents' (C, H, W)) changes nothing."""
        transformer, c, null, dtype = model.transformer, model.latent_shape[0], model.null_class, model.dtype

        def step(x, t, guidance, coeffs, hist, noise, labels):
            xin = model_input(x, coeffs).to(dtype)                                  # (B, C, H, W)
            both = torch.cat([labels, torch.full_like(labels, null)])              # (2B,) cond, uncond
            out = transformer(torch.cat([xin, xin]), torch.cat([t, t]), both).sample  # (2B, C_out, H, W)
            cond, uncond = out[:, :c].float().chunk(2)                             # learned sigma dropped
            x_next, denoised = sampler_step(x, cfg_combine(cond, uncond, guidance), hist, noise, coeffs)
            return {"x_next": x_next, "hist_next": denoised}

        return step


def _load_transformer(path: Path, device, dtype) -> torch.nn.Module:
    from diffusers import DiTTransformer2DModel

    return cast(load_component(DiTTransformer2DModel, path), device, dtype)  # the card checked it is a DiT


def _builtin_dit_xl(card, device, dtype) -> LoadedModel:
    """DiT-XL/2 with random weights (a seeded init), built directly on the device."""
    from diffusers import AutoencoderKL, DiTTransformer2DModel

    torch.manual_seed(0)
    with torch.device(device):
        transformer = DiTTransformer2DModel(**DIT_XL_2, sample_size=card.latent_size)
        vae = AutoencoderKL(**SD_VAE_FT_EMA, sample_size=card.image_size)
    return assemble(card, cast(transformer, device, dtype), cast(vae, device, dtype))
