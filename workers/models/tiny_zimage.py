"""A Z-Image pipeline directory in the layout of ``Tongyi-MAI/Z-Image-Turbo``, shrunk to run on a CPU in
seconds, with random weights: transformer (ZImageTransformer2DModel, sharded safetensors with its index, as
the real 3-shard checkpoint), text encoder (Qwen3Model, sharded, as the real one) and its tokenizer (a small
byte-level BPE Qwen2Tokenizer with its chat template in tokenizer_config.json, and vocab.json / merges.txt,
as the real tokenizer/ has them), a 16-channel VAE with FLUX.1's scaling and shift factors, and Turbo's
scheduler config. Nothing is downloaded.

Images 64x64 (latents 16x8x8: 16 tokens, padded to 32 by the transformer), also 96x64 and 64x96 (24
tokens); prompts of ``MAX_TOKENS`` tokens with the chat template, so a short prompt pads its caption to 32
and a longer one to 64.

    python -m workers.models.tiny_zimage OUT_DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MAX_TOKENS = 64
IMAGE_SIZE = 64
SIZES = ("64x64", "96x64", "64x96")  # width x height
# Z-Image-Turbo's scheduler/scheduler_config.json
TURBO_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}


def make_tiny_zimage(path: Path, seed: int = 0, dim: int = 32, heads: int = 2) -> Path:
    """Z-Image-Turbo's layout. ``dim`` / ``heads``: the transformer's width and heads (head_dim = dim / heads,
    split 1:1:2 over the three rotary axes: frame, row, column)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    path = Path(path)
    torch.manual_seed(seed)
    tokenizer = write_qwen_tokenizer(path / "tokenizer")
    Qwen3Model(Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                           rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                           eos_token_id=tokenizer.eos_token_id)
               ).save_pretrained(path / "text_encoder", safe_serialization=True, max_shard_size="20KB")
    head = dim // heads
    ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=dim, n_layers=2,
                             n_refiner_layers=1, n_heads=heads, n_kv_heads=heads, cap_feat_dim=32,
                             axes_dims=[head // 4, head // 4, head // 2], axes_lens=[128, 32, 32]
                             ).save_pretrained(path / "transformer", safe_serialization=True, max_shard_size="400KB")
    AutoencoderKL(block_out_channels=[8, 8, 16, 16], down_block_types=["DownEncoderBlock2D"] * 4,
                  up_block_types=["UpDecoderBlock2D"] * 4, latent_channels=16, norm_num_groups=8,
                  layers_per_block=1, sample_size=IMAGE_SIZE, scaling_factor=0.3611, shift_factor=0.1159,
                  use_quant_conv=False, use_post_quant_conv=False
                  ).save_pretrained(path / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(**TURBO_SCHEDULER).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps({
        "_class_name": "ZImagePipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3Model"], "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "ZImageTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
        "dit_serve": {"dtype": "float32", "max_sequence_length": MAX_TOKENS, "image_size": IMAGE_SIZE,
                      "sizes": list(SIZES)}}, indent=2))
    return path


def write_qwen_tokenizer(folder: Path):
    """``workers.families.zimage.builtin.qwen_tokenizer`` saved as Qwen3's tokenizer/ is: tokenizer.json,
    vocab.json, merges.txt, and tokenizer_config.json holding the chat template (transformers 5 would write it
    to chat_template.jinja). Returns the tokenizer."""
    from workers.families.zimage.builtin import QWEN_SPECIALS, qwen_tokenizer, qwen_vocab

    tok = qwen_tokenizer()
    tok.save_pretrained(folder)
    config_file, template_file = folder / "tokenizer_config.json", folder / "chat_template.jinja"
    config = json.loads(config_file.read_text())
    config["chat_template"] = tok.chat_template
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    template_file.unlink(missing_ok=True)
    vocab, merges = qwen_vocab()
    vocab = {t: i for t, i in vocab.items() if t not in QWEN_SPECIALS}  # those are tokenizer.json's added tokens
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return tok


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    print(make_tiny_zimage(args.out))
