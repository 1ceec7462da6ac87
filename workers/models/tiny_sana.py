"""A Sana pipeline directory in the layout of ``Efficient-Large-Model/Sana_1600M_1024px_diffusers``, shrunk to run
on a CPU in seconds, with random weights: transformer (SanaTransformer2DModel, sharded safetensors with its index,
as the real checkpoint), Gemma-2 text encoder (Gemma2Model, sharded, as the real one) and a Gemma tokenizer made
offline (``workers.families.sana.builtin.gemma_tokenizer``), a 32x, 32-channel DC-AE (AutoencoderDC with Sana's
scaling factor), and the real scheduler config (DPMSolverMultistepScheduler on flow sigmas, flow_shift 3; or
FlowMatchEulerDiscreteScheduler, as diffusers' conversion script writes with ``--scheduler_type flow-euler``);
or Sana Sprint's (``make_tiny_sana_sprint``: SanaSprintPipeline, SCMScheduler). Nothing is downloaded.

Images 128x128 (latents 32x4x4, 16 tokens), also 192x128 and 128x192 (``dit_serve.sizes``: a sample size of 4
has no reference bins); prompts of ``MAX_TOKENS`` tokens after the complex human instruction.

    python -m workers.models.tiny_sana OUT_DIR [--flow-euler]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

MAX_TOKENS = 16
IMAGE_SIZE = 128
SIZES = ("128x128", "192x128", "128x192")  # width x height
FLOW_SHIFT = 3.0


def make_tiny_sana(path: Path, seed: int = 0, flow_euler: bool = False, interpolation_scale: float | None = None,
                   sample_size: int = IMAGE_SIZE // 32, sizes: tuple[str, ...] | None = SIZES,
                   flow_shift: float = FLOW_SHIFT) -> Path:
    """Sana_1600M_1024px's layout; ``flow_euler``: its scheduler FlowMatchEulerDiscreteScheduler(shift=flow_shift);
    ``flow_shift``: 3.0 as the 512 px to 2K models' schedulers, 6.0 as the 4K one's;
    ``interpolation_scale``: a sin-cos positional embedding, as the 2K (1.0) and 4K (2.0) transformers have;
    ``sample_size`` the transformer's (the pipeline's bins and the native size follow it); ``sizes`` None leaves
    dit_serve.sizes out (the card then lists the reference bins of ``sample_size``, where it has them)."""
    import torch
    from diffusers import (AutoencoderDC, DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler,
                           SanaTransformer2DModel)
    from transformers import Gemma2Config, Gemma2Model

    from workers.families.sana.builtin import gemma_tokenizer

    path = Path(path)
    torch.manual_seed(seed)
    tokenizer = gemma_tokenizer()
    tokenizer.save_pretrained(path / "tokenizer")
    Gemma2Model(Gemma2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                             max_position_embeddings=1024, pad_token_id=0, eos_token_id=1, bos_token_id=2)
                ).save_pretrained(path / "text_encoder", safe_serialization=True, max_shard_size="40KB")
    SanaTransformer2DModel(in_channels=32, out_channels=32, num_attention_heads=2, attention_head_dim=8, num_layers=2,
                           num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16,
                           caption_channels=32, sample_size=sample_size, patch_size=1,
                           interpolation_scale=interpolation_scale
                           ).save_pretrained(path / "transformer", safe_serialization=True, max_shard_size="40KB")
    blocks = ("ResBlock",) * 5 + ("EfficientViTBlock",)
    AutoencoderDC(in_channels=3, latent_channels=32, attention_head_dim=8, encoder_block_types=blocks,
                  decoder_block_types=blocks, encoder_block_out_channels=(8, 8, 8, 8, 32, 32),
                  decoder_block_out_channels=(8, 8, 8, 8, 32, 32), encoder_layers_per_block=(1,) * 6,
                  decoder_layers_per_block=(1,) * 6, encoder_qkv_multiscales=((),) * 5 + ((5,),),
                  decoder_qkv_multiscales=((),) * 5 + ((5,),), upsample_block_type="interpolate",
                  downsample_block_type="conv", decoder_norm_types="rms_norm", decoder_act_fns="silu",
                  scaling_factor=0.41407).save_pretrained(path / "vae", safe_serialization=True)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=flow_shift) if flow_euler else DPMSolverMultistepScheduler(
        flow_shift=flow_shift, use_flow_sigmas=True, prediction_type="flow_prediction")
    scheduler.save_pretrained(path / "scheduler")
    extra = {"dtype": "float32", "max_sequence_length": MAX_TOKENS, **({"sizes": list(sizes)} if sizes else {})}
    (path / "model_index.json").write_text(json.dumps({
        "_class_name": "SanaPipeline", "_diffusers_version": "0.32.0.dev0",
        "scheduler": ["diffusers", type(scheduler).__name__], "text_encoder": ["transformers", "Gemma2Model"],
        "tokenizer": ["transformers", "GemmaTokenizerFast"], "transformer": ["diffusers", "SanaTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderDC"], "dit_serve": extra}, indent=2))
    return path


def make_tiny_sana_sprint(path: Path, seed: int = 0) -> Path:
    """The tiny Sana directory (``make_tiny_sana``) made Sana Sprint's: its transformer replaced by one with
    guidance_embeds and Sprint's QK norm (rms_norm_across_heads), sharded as the real one; SCMScheduler's config as
    diffusers' conversion script writes it; model_index.json naming SanaSprintPipeline and SCMScheduler."""
    import torch
    from diffusers import SanaTransformer2DModel, SCMScheduler

    path = make_tiny_sana(path, seed=seed)
    shutil.rmtree(path / "transformer")
    shutil.rmtree(path / "scheduler")
    torch.manual_seed(seed + 1)
    SanaTransformer2DModel(in_channels=32, out_channels=32, num_attention_heads=2, attention_head_dim=8, num_layers=2,
                           num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16,
                           caption_channels=32, sample_size=IMAGE_SIZE // 32, patch_size=1, guidance_embeds=True,
                           qk_norm="rms_norm_across_heads"
                           ).save_pretrained(path / "transformer", safe_serialization=True, max_shard_size="40KB")
    SCMScheduler(num_train_timesteps=1000, prediction_type="trigflow", sigma_data=0.5).save_pretrained(
        path / "scheduler")
    index = json.loads((path / "model_index.json").read_text())
    index.update({"_class_name": "SanaSprintPipeline", "_diffusers_version": "0.33.0.dev0",
                  "scheduler": ["diffusers", "SCMScheduler"]})
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--flow-euler", action="store_true", help="FlowMatchEulerDiscreteScheduler(shift=3)")
    args = parser.parse_args()
    print(make_tiny_sana(args.out, flow_euler=args.flow_euler))
