"""Z-Image-Turbo with random weights (``Tongyi-MAI/Z-Image-Turbo``'s architecture), for benchmarks: built on
the meta device and materialised on the target one (``workers.families.builtins``), and the Qwen tokenizer it
reads prompts with (``qwen_tokenizer``: made here, nothing downloaded), which the tiny test directories use too.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.families.builtins import MMDIT_VAE, check_overrides, materialise_all

# transformer/config.json of Z-Image-Turbo (6.15B): 2x2 patches of 16 channels, 30 single-stream layers after
# 2 noise and 2 context refiner layers, captions of Qwen3-4B's width
ZIMAGE_TURBO = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                    n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560,
                    rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512])
# text_encoder/config.json of Z-Image-Turbo: Qwen/Qwen3-4B's base model (Qwen3Model, no LM head)
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu", attention_bias=False,
                tie_word_embeddings=True)
ZIMAGE_VAE_FACTORS = dict(scaling_factor=0.3611, shift_factor=0.1159)  # FLUX.1's VAE

# the Qwen tokenizer's special tokens, in Qwen's order (after the vocabulary), and a chat template that renders
# a conversation as Qwen3's does: ChatML turns, then the assistant's turn, with an empty think block when
# ``enable_thinking`` is False
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def build_zimage_turbo(image_size: int, device: str | torch.device, dtype: torch.dtype, seed: int = 0,
                       **overrides: dict) -> dict:
    """Z-Image-Turbo with random weights made on ``device`` in ``dtype``, named as ZImagePipeline's components:
    transformer, vae, text_encoder (Qwen3-4B's base model), tokenizer. ``image_size`` is the VAE's sample_size
    only (the transformer takes any size); ``overrides`` shrink the configs (``transformer``, ``vae``,
    ``text_encoder``: tests). The text encoder's rotary table is computed, not initialised: made on the device
    after the rest, as its constructor makes it, then cast as a loaded encoder is."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    modules = zimage_turbo_on_meta(image_size, **overrides)
    encoder = modules["text_encoder"]
    encoder.rotary_emb = nn.Identity()  # no tensors to materialise: replaced below
    made = materialise_all(modules, device, dtype, seed)
    with torch.device(device):
        made["text_encoder"].rotary_emb = Qwen3RotaryEmbedding(encoder.config).to(dtype=dtype).eval()
    return {**made, "tokenizer": qwen_tokenizer()}


def zimage_turbo_on_meta(image_size: int, **overrides: dict) -> dict[str, nn.Module]:
    """The modules of build_zimage_turbo on the meta device: shapes, no storage."""
    from diffusers import AutoencoderKL, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    o = check_overrides(overrides, ("transformer", "vae", "text_encoder"))
    with torch.device("meta"):
        return {"transformer": ZImageTransformer2DModel(**{**ZIMAGE_TURBO, **o["transformer"]}),
                "vae": AutoencoderKL(**{**MMDIT_VAE, **ZIMAGE_VAE_FACTORS, "sample_size": image_size, **o["vae"]}),
                "text_encoder": Qwen3Model(Qwen3Config(**{**QWEN3_4B, **o["text_encoder"]}))}


def qwen_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of a small byte-level BPE in Qwen's manner, deterministic: the 256 byte symbols, then
    merges into word-initial letters (``Ġ`` + letter) and a letter followed by a vowel; 412 tokens, and the
    specials after them, in Qwen's order. An ordinary prompt is about a token per 1.5 letters."""
    from tokenizers.pre_tokenizers import ByteLevel

    merges = [("Ġ", c) for c in LETTERS] + [(a, b) for a in LETTERS for b in "aeiou"]
    tokens = [*sorted(ByteLevel.alphabet()), *(a + b for a, b in merges), *QWEN_SPECIALS]
    return {t: i for i, t in enumerate(tokens)}, merges


def qwen_tokenizer():
    """A Qwen2Tokenizer (transformers' Qwen tokenizer: byte-level BPE with Qwen's pre-tokenizer, NFC, no
    prefix space, no BOS) over ``qwen_vocab``: <|endoftext|> pads, <|im_end|> ends, ``QWEN3_CHAT_TEMPLATE`` as
    its chat template, padding on the right, as Qwen3's tokenizer_config.json says."""
    from transformers import Qwen2Tokenizer

    vocab, merges = qwen_vocab()
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         additional_special_tokens=list(QWEN_SPECIALS[1:]), model_max_length=131072)
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    return tok
