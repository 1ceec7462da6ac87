"""A Stable Diffusion 3.5 pipeline directory in the layout of ``stabilityai/stable-diffusion-3.5-medium``
(transformer with dual-attention and RMS qk-norm layers, CLIP-L and CLIP-bigG with projections, T5, their
tokenizers, a 16-channel VAE with a shift factor, the shift-3 flow scheduler; safetensors), shrunk to run
on a CPU in seconds, with random weights and tokenizers built here: nothing is downloaded. The
transformer is saved in several shards, as SD3.5-large's is. Latents 16x8x8, images 16x16 (also 32x16,
16x32, 32x32), T5 prompts of ``MAX_TOKENS`` tokens.

Widths keep the real model's proportions: the CLIP hidden states side by side (16 + 32 here; 768 + 1280
there) are narrower than T5 (64; 4096), so the pipeline's zero padding of the CLIP part is exercised; the
pooled projections (32 + 32; 768 + 1280) make ``pooled_projection_dim``.

    python -m workers.models.tiny_sd3 OUT_DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MAX_TOKENS = 16
SIZES = ("16x16", "32x16", "16x32", "32x32")  # width x height
CLIP_WIDTHS = (16, 32)  # CLIP-L's and CLIP-bigG's hidden sizes, shrunk
PROJECTION = 32  # each CLIP's text projection
T5_WIDTH = 64  # = the transformer's joint_attention_dim
SHARD_BYTES = 40_000  # the tiny transformer (~100 kB) saves as 3+ shards


def clip_vocab() -> tuple[dict[str, int], list[str]]:
    """A byte-level BPE vocabulary in CLIP's form: the 256 byte symbols, each also with the end-of-word
    suffix ``</w>``, then every prefix of tiny_pixart's words (one merge each, so a known word is one
    token and anything else falls back to bytes), then <|startoftext|> and <|endoftext|> last, as CLIP's."""
    from tokenizers.pre_tokenizers import ByteLevel

    from workers.models.tiny_pixart import WORDS

    base = sorted(ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(base + [c + "</w>" for c in base])}
    merges: list[str] = []
    for word in (w for w in WORDS if w.isalpha()):
        parts = [*word[:-1], word[-1] + "</w>"]
        made = parts[0]
        for part in parts[1:]:
            if f"{made} {part}" not in merges:
                merges.append(f"{made} {part}")
            made += part
            vocab.setdefault(made, len(vocab))
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    return vocab, merges


def write_clip_tokenizer(path: Path, pad: str) -> None:
    """vocab.json, merges.txt and the configs, as the SD3 repositories ship them (no tokenizer.json):
    transformers' CLIPTokenizer loads them. CLIP-L pads with <|endoftext|>, bigG with "!" (as SD3's)."""
    vocab, merges = clip_vocab()
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    special = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": pad,
               "unk_token": "<|endoftext|>"}
    (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "CLIPTokenizer", "model_max_length": 77, "do_lower_case": True, **special}, indent=2))


def make_tiny_sd3(path: Path, seed: int = 0, t5: bool = True) -> Path:
    """The directory at ``path``; ``t5=False`` leaves text_encoder_3/ and tokenizer_3/ out (the reference
    pipeline then uses zeros for T5's part of the prompt)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from workers.models.tiny_pixart import WORDS, tokenizer

    path = Path(path)
    torch.manual_seed(seed)
    vocab, _ = clip_vocab()
    for i, (width, pad, act) in enumerate(zip(CLIP_WIDTHS, ("<|endoftext|>", "!"), ("quick_gelu", "gelu"))):
        suffix = "" if i == 0 else "_2"
        write_clip_tokenizer(path / f"tokenizer{suffix}", pad)
        cfg = CLIPTextConfig(vocab_size=len(vocab), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                             num_attention_heads=2, max_position_embeddings=77, projection_dim=PROJECTION,
                             hidden_act=act, bos_token_id=vocab["<|startoftext|>"],
                             eos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab[pad])
        CLIPTextModelWithProjection(cfg).save_pretrained(path / f"text_encoder{suffix}", safe_serialization=True)
    if t5:
        T5EncoderModel(T5Config(vocab_size=len(WORDS), d_model=T5_WIDTH, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
                       ).save_pretrained(path / "text_encoder_3", safe_serialization=True)
        tokenizer().save_pretrained(path / "tokenizer_3")
    SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8,
                          num_attention_heads=2, joint_attention_dim=T5_WIDTH, caption_projection_dim=16,
                          pooled_projection_dim=2 * PROJECTION, out_channels=16, pos_embed_max_size=16,
                          dual_attention_layers=(0,), qk_norm="rms_norm"
                          ).save_pretrained(path / "transformer", safe_serialization=True, max_shard_size=SHARD_BYTES)
    AutoencoderKL(block_out_channels=[8, 16], down_block_types=["DownEncoderBlock2D"] * 2,
                  up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=16, norm_num_groups=8, sample_size=16,
                  shift_factor=0.0609, scaling_factor=1.5305, use_quant_conv=False, use_post_quant_conv=False
                  ).save_pretrained(path / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(path / "scheduler")
    clip, none = ["transformers", "CLIPTextModelWithProjection"], [None, None]
    (path / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusion3Pipeline", "transformer": ["diffusers", "SD3Transformer2DModel"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": clip, "tokenizer": ["transformers", "CLIPTokenizer"],
        "text_encoder_2": clip, "tokenizer_2": ["transformers", "CLIPTokenizer"],
        "text_encoder_3": ["transformers", "T5EncoderModel"] if t5 else none,
        "tokenizer_3": ["transformers", "PreTrainedTokenizerFast"] if t5 else none,
        "image_encoder": none, "feature_extractor": none,
        "dit_serve": {"dtype": "float32", "max_sequence_length": MAX_TOKENS, "sizes": list(SIZES)}}, indent=2))
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    print(make_tiny_sd3(parser.parse_args().out))
