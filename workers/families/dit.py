"""Class-conditional DiT (Peebles & Xie 2023; diffusers' ``DiTTransformer2DModel``): the condition is a
class label; classifier-free guidance pairs each row with the null class (the label table's extra row)."""

from __future__ import annotations

import torch

from graphs import TensorSpec
from samplers import cfg_combine, model_input, sampler_step

BREAK_ATTENTION = True  # under `breakable`, each block's self-attention is an eager break (workers.patches)


def cond_specs(model) -> dict[str, TensorSpec]:
    return {"labels": TensorSpec((), torch.long)}


def encode(model, specs) -> list[dict[str, torch.Tensor]]:
    """Labels were resolved to class ids by the API (or the CLI): each is its own embedding row."""
    return [{"labels": torch.tensor(s.label)} for s in specs]


def compile_regions(model):
    """None: DiT's steps compile whole. Its blocks' norms read the hoisted modulation by their index
    (``workers.patches.HoistedModulation``), so each block would be a graph of its own."""
    return None


def make_step(model, shape=None):
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
