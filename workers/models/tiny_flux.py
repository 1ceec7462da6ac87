"""A FLUX.1 pipeline directory in the layout of ``black-forest-labs/FLUX.1-dev`` (or ``-schnell``), shrunk
to run on a CPU in seconds, with random weights: transformer (sharded safetensors with its index, as the
real 3-shard checkpoint), CLIP text encoder and its BPE tokenizer (vocab.json + merges.txt, as
``workers.models.tiny_sd3`` writes them), T5 encoder (sharded, as the real one) and a word-level
T5-like tokenizer, a 16-channel VAE with FLUX's scaling and shift factors, and the real scheduler
configs. Nothing is downloaded.

Images 64x64 (latents 16x8x8, 16 packed tokens), also 96x64 and 64x96; prompts of ``MAX_TOKENS`` T5 tokens.

``kontext``: FLUX.1 Kontext's directory (``FluxKontextPipeline``), its references kept at their own size
(``dit_serve.kontext_auto_resize`` false: the preferred Kontext resolutions are 1 MP, slow on a CPU).

    python -m workers.models.tiny_flux OUT_DIR [--schnell | --kontext]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from workers.models.tiny_pixart import WORDS, tokenizer as t5_tokenizer  # T5's specials, a small word list
from workers.models.tiny_sd3 import clip_vocab, write_clip_tokenizer  # CLIP's BPE files, small

MAX_TOKENS = 16
IMAGE_SIZE = 64
SIZES = ("64x64", "96x64", "64x96")  # width x height
# the schedulers' configs on the hub (scheduler/scheduler_config.json)
DEV_SCHEDULER = {"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
                 "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True}
SCHNELL_SCHEDULER = {**DEV_SCHEDULER, "shift": 1.0, "use_dynamic_shifting": False}


def make_tiny_flux(path: Path, seed: int = 0, schnell: bool = False, head_dim: int = 8, kontext: bool = False
                   ) -> Path:
    """FLUX.1-dev's layout (guidance-distilled: the transformer embeds the guidance scale), or schnell's
    (``schnell``: no guidance embedding, static shift 1). ``head_dim``: 2 heads of it (16 for FP8 attention,
    whose kernel wants a multiple of 16)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    path = Path(path)
    torch.manual_seed(seed)
    write_clip_tokenizer(path / "tokenizer", pad="<|endoftext|>")
    vocab = len(clip_vocab()[0])
    CLIPTextModel(CLIPTextConfig(vocab_size=vocab, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=77, bos_token_id=vocab - 2,
                                 eos_token_id=vocab - 1, pad_token_id=vocab - 1)
                  ).save_pretrained(path / "text_encoder", safe_serialization=True)
    t5_tokenizer().save_pretrained(path / "tokenizer_2")
    T5EncoderModel(T5Config(vocab_size=len(WORDS), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                            feed_forward_proj="gated-gelu")
                   ).save_pretrained(path / "text_encoder_2", safe_serialization=True, max_shard_size="40KB")
    FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                           attention_head_dim=head_dim, num_attention_heads=2, joint_attention_dim=32,
                           pooled_projection_dim=32, guidance_embeds=not schnell,
                           axes_dims_rope=(head_dim // 4, head_dim // 4, head_dim // 2)
                           ).save_pretrained(path / "transformer", safe_serialization=True, max_shard_size="40KB")
    AutoencoderKL(block_out_channels=[8, 8, 16, 16], down_block_types=["DownEncoderBlock2D"] * 4,
                  up_block_types=["UpDecoderBlock2D"] * 4, latent_channels=16, norm_num_groups=8,
                  layers_per_block=1, sample_size=IMAGE_SIZE, scaling_factor=0.3611, shift_factor=0.1159,
                  use_quant_conv=False, use_post_quant_conv=False
                  ).save_pretrained(path / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(**(SCHNELL_SCHEDULER if schnell else DEV_SCHEDULER)).save_pretrained(
        path / "scheduler")
    (path / "model_index.json").write_text(json.dumps({
        "_class_name": "FluxKontextPipeline" if kontext else "FluxPipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"], "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
        "dit_serve": {"dtype": "float32", "max_sequence_length": MAX_TOKENS, "image_size": IMAGE_SIZE,
                      "sizes": list(SIZES), **({"kontext_auto_resize": False} if kontext else {})}}, indent=2))
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--schnell", action="store_true", help="FLUX.1-schnell's layout (no guidance embedding)")
    parser.add_argument("--kontext", action="store_true", help="FLUX.1 Kontext's (FluxKontextPipeline)")
    args = parser.parse_args()
    print(make_tiny_flux(args.out, schnell=args.schnell, kontext=args.kontext))
