"""A FLUX.1 pipeline directory in the layout of ``black-forest-labs/FLUX.1-dev`` (or ``-schnell``), shrunk
to run on a CPU in seconds, with random weights: transformer (sharded safetensors with its index, as the
real 3-shard checkpoint), CLIP text encoder and its BPE tokenizer (vocab.json + merges.txt, built here
with ``tokenizers``), T5 encoder (sharded, as the real one) and a word-level T5-like tokenizer, a 16-channel
VAE with FLUX's scaling and shift factors, and the real scheduler configs. Nothing is downloaded.

Images 64x64 (latents 16x8x8, 16 packed tokens), also 96x64 and 64x96; prompts of ``MAX_TOKENS`` T5 tokens.

    python -m workers.models.tiny_flux OUT_DIR [--schnell]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from workers.models.tiny_pixart import WORDS, tokenizer as t5_tokenizer  # T5's specials, a small word list

MAX_TOKENS = 16
IMAGE_SIZE = 64
SIZES = ("64x64", "96x64", "64x96")  # width x height
CLIP_CORPUS = ("a red cat", "the big blue house", "a small green tree", "a dog drawn in ink",
               "photo of a cat holding a sign that says hello world")
CLIP_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
# the schedulers' configs on the hub (scheduler/scheduler_config.json)
DEV_SCHEDULER = {"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
                 "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True}
SCHNELL_SCHEDULER = {**DEV_SCHEDULER, "shift": 1.0, "use_dynamic_shifting": False}


def clip_vocab() -> tuple[dict[str, int], list[str]]:
    """CLIP's vocabulary layout, small: the 256 byte-level symbols, each again with ``</w>``, the tokens of
    BPE merges learned on CLIP_CORPUS (CLIP's normaliser and pre-tokeniser), then <|startoftext|> and
    <|endoftext|> last, as in openai/clip-vit-large-patch14."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>", continuing_subword_prefix=""))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                           normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(CLIP_SPLIT), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.train_from_iterator(CLIP_CORPUS, trainers.BpeTrainer(
        vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), end_of_word_suffix="</w>",
        show_progress=False))
    merges = [" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = [*alphabet, *(c + "</w>" for c in alphabet), *(m.replace(" ", "") for m in merges)]
    tokens = list(dict.fromkeys(tokens)) + ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}, merges


def save_clip_tokenizer(path: Path) -> int:
    """vocab.json, merges.txt and the configs, as FLUX.1-dev's tokenizer/ holds them; returns the vocab size."""
    vocab, merges = clip_vocab()
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    specials = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>"}
    (path / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {**specials, "tokenizer_class": "CLIPTokenizer", "model_max_length": 77, "do_lower_case": True,
         "clean_up_tokenization_spaces": True}, indent=2))
    return len(vocab)


def make_tiny_flux(path: Path, seed: int = 0, schnell: bool = False) -> Path:
    """FLUX.1-dev's layout (guidance-distilled: the transformer embeds the guidance scale), or schnell's
    (``schnell``: no guidance embedding, static shift 1)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    path = Path(path)
    torch.manual_seed(seed)
    vocab = save_clip_tokenizer(path / "tokenizer")
    CLIPTextModel(CLIPTextConfig(vocab_size=vocab, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=77, bos_token_id=vocab - 2,
                                 eos_token_id=vocab - 1, pad_token_id=vocab - 1)
                  ).save_pretrained(path / "text_encoder", safe_serialization=True)
    t5_tokenizer().save_pretrained(path / "tokenizer_2")
    T5EncoderModel(T5Config(vocab_size=len(WORDS), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                            feed_forward_proj="gated-gelu")
                   ).save_pretrained(path / "text_encoder_2", safe_serialization=True, max_shard_size="40KB")
    FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=8,
                           num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                           guidance_embeds=not schnell, axes_dims_rope=(2, 2, 4)
                           ).save_pretrained(path / "transformer", safe_serialization=True, max_shard_size="40KB")
    AutoencoderKL(block_out_channels=[8, 8, 16, 16], down_block_types=["DownEncoderBlock2D"] * 4,
                  up_block_types=["UpDecoderBlock2D"] * 4, latent_channels=16, norm_num_groups=8,
                  layers_per_block=1, sample_size=IMAGE_SIZE, scaling_factor=0.3611, shift_factor=0.1159,
                  use_quant_conv=False, use_post_quant_conv=False
                  ).save_pretrained(path / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(**(SCHNELL_SCHEDULER if schnell else DEV_SCHEDULER)).save_pretrained(
        path / "scheduler")
    (path / "model_index.json").write_text(json.dumps({
        "_class_name": "FluxPipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"], "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
        "dit_serve": {"dtype": "float32", "max_sequence_length": MAX_TOKENS, "image_size": IMAGE_SIZE,
                      "sizes": list(SIZES)}}, indent=2))
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--schnell", action="store_true", help="FLUX.1-schnell's layout (no guidance embedding)")
    args = parser.parse_args()
    print(make_tiny_flux(args.out, schnell=args.schnell))
