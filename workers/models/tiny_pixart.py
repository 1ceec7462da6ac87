"""A PixArt-Σ pipeline directory in the layout of ``PixArt-alpha/PixArt-Sigma-XL-2-1024-MS`` (transformer,
T5 text encoder, tokenizer, VAE, scheduler; safetensors), shrunk to run on a CPU in seconds, with random
weights and a word-level tokenizer built here. The text-path tests use it, since nothing may be
downloaded. Latents 4x8x8, images 16x16 (also 32x16, 16x32, 32x32), prompts of at most ``MAX_TOKENS`` tokens.

    python -m workers.models.tiny_pixart OUT_DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MAX_TOKENS = 16
SIZES = ("16x16", "32x16", "16x32", "32x32")  # width x height: it makes these (no reference bins at this size)
WORDS = "<pad> </s> <unk> a an the red blue green cat dog tree house small big drawn photo of".split()


def tokenizer():
    """A fast tokenizer over WORDS with T5's special tokens (<pad> 0, </s> 1 appended, <unk> 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def make_tiny_pixart(path: Path, seed: int = 0, alpha: bool = False, additional_conditions: bool = False) -> Path:
    """Σ's layout, or α's (``alpha``: PixArtAlphaPipeline); ``additional_conditions`` makes the transformer
    take resolution and aspect ratio, as PixArt-α 1024 does."""
    import torch
    from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, PixArtTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    path = Path(path)
    torch.manual_seed(seed)
    T5EncoderModel(T5Config(vocab_size=len(WORDS), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
                   ).save_pretrained(path / "text_encoder", safe_serialization=True)
    tokenizer().save_pretrained(path / "tokenizer")
    head_dim = 12 if additional_conditions else 8  # the size embeddings split the width in three
    PixArtTransformer2DModel(sample_size=8, in_channels=4, out_channels=8, patch_size=2, num_layers=2,
                             num_attention_heads=2, attention_head_dim=head_dim, cross_attention_dim=2 * head_dim,
                             caption_channels=32,
                             norm_type="ada_norm_single", use_additional_conditions=additional_conditions
                             ).save_pretrained(path / "transformer", safe_serialization=True)
    AutoencoderKL(block_out_channels=[8, 16], down_block_types=["DownEncoderBlock2D"] * 2,
                  up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=4, norm_num_groups=8, sample_size=16
                  ).save_pretrained(path / "vae", safe_serialization=True)
    DPMSolverMultistepScheduler(beta_schedule="linear", beta_start=0.0001, beta_end=0.02).save_pretrained(
        path / "scheduler")
    (path / "model_index.json").write_text(json.dumps({
        "_class_name": "PixArtAlphaPipeline" if alpha else "PixArtSigmaPipeline", "transformer": ["diffusers", "PixArtTransformer2DModel"],
        "text_encoder": ["transformers", "T5EncoderModel"], "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "vae": ["diffusers", "AutoencoderKL"], "scheduler": ["diffusers", "DPMSolverMultistepScheduler"],
        "dit_serve": {"max_sequence_length": MAX_TOKENS, "dtype": "float32", "sizes": list(SIZES)}}, indent=2))
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    print(make_tiny_pixart(parser.parse_args().out))
