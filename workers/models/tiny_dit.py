"""A DiT pipeline directory laid out as ``facebook/DiT-XL-2-256`` is, with the same config keys,
shrunk to run on a CPU in seconds, with random weights (safetensors). The loading tests and the
benchmarks' CPU smoke runs use it, since nothing may be downloaded.

    python -m workers.models.tiny_dit OUT_DIR
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

# the keys of the hub's transformer/config.json (class Transformer2DModel), with small sizes
HUB_TRANSFORMER = {
    "_class_name": "Transformer2DModel", "_diffusers_version": "0.12.0.dev0",
    "activation_fn": "gelu-approximate", "attention_bias": True, "attention_head_dim": 8,
    "cross_attention_dim": None, "dropout": 0.0, "in_channels": 4, "norm_elementwise_affine": False,
    "norm_num_groups": 32, "norm_type": "ada_norm_zero", "num_attention_heads": 2,
    "num_embeds_ada_norm": 1000, "num_layers": 2, "num_vector_embeds": None,
    "only_cross_attention": False, "out_channels": 8, "patch_size": 2, "sample_size": 8,
    "upcast_attention": False, "use_linear_projection": False,
}
HUB_VAE = {
    "_class_name": "AutoencoderKL", "act_fn": "silu", "block_out_channels": [32, 32],
    "down_block_types": ["DownEncoderBlock2D"] * 2, "in_channels": 3, "latent_channels": 4,
    "layers_per_block": 1, "norm_num_groups": 32, "out_channels": 3, "sample_size": 16,
    "up_block_types": ["UpDecoderBlock2D"] * 2,
}
HUB_SCHEDULER = {"_class_name": "DDIMScheduler", "beta_end": 0.02, "beta_schedule": "linear",
                 "beta_start": 0.0001, "clip_sample": False, "num_train_timesteps": 1000,
                 "prediction_type": "epsilon", "set_alpha_to_one": True, "steps_offset": 0,
                 "trained_betas": None}
ID2LABEL = {"0": "tench, Tinca tinca", "1": "goldfish, Carassius auratus", "207": "golden retriever",
            "360": "otter", "999": "toilet tissue, toilet paper, bathroom tissue"}


def _fields(cls, cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k in inspect.signature(cls.__init__).parameters}


def _save(model, folder: Path, config: dict) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(folder / "diffusion_pytorch_model.safetensors"))


def write_tiny_dit(root: Path, seed: int = 0):
    """Write the pipeline directory to ``root`` (which must not exist); returns the transformer."""
    import torch
    from diffusers import AutoencoderKL, DiTTransformer2DModel

    root = Path(root)
    torch.manual_seed(seed)
    transformer = DiTTransformer2DModel(**_fields(DiTTransformer2DModel, HUB_TRANSFORMER))
    vae = AutoencoderKL(**_fields(AutoencoderKL, HUB_VAE))
    _save(transformer, root / "transformer", HUB_TRANSFORMER)
    _save(vae, root / "vae", HUB_VAE)
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(HUB_SCHEDULER))
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "DiTPipeline", "_diffusers_version": "0.12.0.dev0", "id2label": ID2LABEL,
        "scheduler": ["diffusers", "DDIMScheduler"], "transformer": ["diffusers", "Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"]}))
    return transformer


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    write_tiny_dit(p.parse_args().out)
