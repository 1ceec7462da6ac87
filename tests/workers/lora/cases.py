"""Tiny random transformers of three families (FLUX.1, SD3.5, PixArt-Σ: diffusers' own classes, as
``workers/models/tiny_*.py`` build them, smaller), their inputs, random adapters and the merged reference.

The reference of a row with adapters is the transformer with the adapters merged into its weights,
``W + sum_j c_j * alpha_j / r_j * B_j @ A_j``, run on that row alone: what diffusers' ``fuse_lora`` makes of a
loaded adapter, computed here without PEFT.
"""

from __future__ import annotations

import copy

import torch

from workers.lora import Adapter, LoraWeights
from workers.lora.validate import linear_shapes


def tiny_flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                  attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(2, 2, 4)).eval()


def flux_inputs(n: int, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(16, 3)
    ids[:, 1], ids[:, 2] = torch.arange(16) // 4, torch.arange(16) % 4
    return {"hidden_states": torch.randn(n, 16, 16, generator=g),          # (B, 4x4 tokens, C)
            "encoder_hidden_states": torch.randn(n, 8, 32, generator=g),   # (B, L, T5 width)
            "pooled_projections": torch.randn(n, 32, generator=g),
            "timestep": torch.rand(n, generator=g), "guidance": torch.full((n,), 3.5),
            "img_ids": ids, "txt_ids": torch.zeros(8, 3), "return_dict": False}


def tiny_sd3():
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8,
                                 num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=16,
                                 pooled_projection_dim=64, out_channels=16, pos_embed_max_size=16,
                                 dual_attention_layers=(0,), qk_norm="rms_norm").eval()


def sd3_inputs(n: int, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"hidden_states": torch.randn(n, 16, 8, 8, generator=g),
            "encoder_hidden_states": torch.randn(n, 12, 64, generator=g),
            "pooled_projections": torch.randn(n, 64, generator=g),
            "timestep": torch.rand(n, generator=g) * 1000, "return_dict": False}


def tiny_pixart():
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(0)
    return PixArtTransformer2DModel(sample_size=8, in_channels=4, out_channels=8, patch_size=2, num_layers=2,
                                    num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
                                    caption_channels=32, norm_type="ada_norm_single").eval()


def pixart_inputs(n: int, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"hidden_states": torch.randn(n, 4, 8, 8, generator=g),
            "encoder_hidden_states": torch.randn(n, 10, 32, generator=g),
            "timestep": torch.randint(0, 1000, (n,), generator=g),
            "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}, "return_dict": False}


FAMILIES = {"flux": (tiny_flux, flux_inputs), "sd3": (tiny_sd3, sd3_inputs), "pixart": (tiny_pixart, pixart_inputs)}


def random_adapter(transformer, seed: int, rank: int = 4, every: int = 1, amplitude: float = 0.3,
                   names=None) -> Adapter:
    """A random adapter on every ``every``-th linear of ``transformer`` (of ``names`` where given; ranks rank and
    rank - 1 alternating, alpha = 2 r, so the scale 2 is not 1)."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    shapes = linear_shapes(transformer)
    if names is not None:
        shapes = {n: shapes[n] for n in names}
    for i, (name, (fin, fout)) in enumerate(list(shapes.items())[::every]):
        r = rank - i % 2
        weights[name] = LoraWeights(torch.randn(r, fin, generator=g) * amplitude / fin ** 0.5,
                                    torch.randn(fout, r, generator=g) * amplitude, 2.0)
    return Adapter(weights, "peft")


def merged(transformer, loras: list[tuple[Adapter, float]]):
    """A copy of ``transformer`` with ``loras`` ((adapter, scale) pairs) merged into its weights."""
    out = copy.deepcopy(transformer)
    with torch.no_grad():
        for adapter, scale in loras:
            for name, w in adapter.weights.items():
                out.get_submodule(name).weight += scale * w.scale * (w.b.double() @ w.a.double()).float()
    return out


def out(transformer, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return transformer(**inputs)[0]


def rows_of(inputs: dict, i: int) -> dict:
    """Row ``i`` of a batch's inputs (per-sample tensors sliced, shared ones kept)."""
    n = inputs["hidden_states"].shape[0]
    return {k: v[i:i + 1] if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == n and k not in
            ("img_ids", "txt_ids") else v for k, v in inputs.items()}
