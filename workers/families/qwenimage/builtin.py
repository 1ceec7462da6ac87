"""Qwen-Image with random weights (``Qwen/Qwen-Image``'s architecture), for benchmarks: built on the meta device
and materialised on the target one (``workers.families.builtins``), and what its loader shares with the
directory loader: the tables whose tensors these modules compute in ``__init__`` (``rebuild_tables``).

Its parts: the 20.4B-parameter MMDiT (60 dual-stream blocks of 24 heads x 128, text width 3584), the
16-channel video VAE, Qwen2.5-VL-7B-Instruct as text encoder (language model, vision tower and LM head, as
the published text_encoder/ holds them: 8.29B) and a Qwen2-style byte-level BPE tokenizer made here
(``qwen2_tokenizer``: nothing is downloaded).
"""

from __future__ import annotations

from itertools import product

import torch
from torch import nn

from workers.families.builtins import LETTERS, check_overrides, materialise_all

# transformer/config.json of Qwen/Qwen-Image (QwenImageTransformer2DModel's defaults)
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
# vae/config.json (AutoencoderKLQwenImage's defaults: Wan 2.1's VAE and its latent statistics)
QWEN_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                temperal_downsample=[False, True, True], dropout=0.0)
# text_encoder/config.json: Qwen2.5-VL-7B-Instruct
QWEN25_VL_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                      num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                      rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu",
                      rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})
QWEN25_VL_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                        fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", in_channels=3, tokens_per_second=2)
QWEN25_VL = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                 vision_end_token_id=151653, bos_token_id=151643, eos_token_id=151645, tie_word_embeddings=False)
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # Qwen2's ids 151643, 151644, 151645

# modules whose tensors __init__ computes (rotary tables), and how to make one again from one built on meta
TABLES = {"QwenEmbedRope": lambda m: type(m)(theta=m.theta, axes_dim=list(m.axes_dim), scale_rope=m.scale_rope),
          "Qwen2_5_VLRotaryEmbedding": lambda m: type(m)(m.config),
          "Qwen2_5_VLVisionRotaryEmbedding": lambda m: type(m)(m.config)}


def build_qwen_image(image_size: int, device: str | torch.device, dtype: torch.dtype, seed: int = 0,
                     **overrides: dict) -> dict:
    """Qwen-Image with random weights made on ``device`` in ``dtype``, named as QwenImagePipeline's components:
    transformer, vae (AutoencoderKLQwenImage; its RMS norms' gains 1), text_encoder (Qwen2.5-VL) and tokenizer.
    ``image_size`` is not part of any config (the transformer and VAE take any size); ``overrides`` shrink the
    configs ({"transformer": {...}, "vae": {...}, "text_encoder": {"text_config": {...}, "vision_config": {...}}}),
    ``seed`` seeds the weights."""
    modules = qwen_image_on_meta(image_size, **overrides)
    taken = {name: _take_tables(m) for name, m in modules.items()}  # materialise refuses what it cannot remake
    made = materialise_all(modules, device, dtype, seed)
    for name, module in made.items():
        rebuild_tables(module, taken[name])
    for m in made["vae"].modules():
        if type(m).__name__ == "QwenImageRMS_norm":  # its gain is ``gamma``: materialise's rule for norms misses it
            m.gamma.fill_(1.0)
    return {**made, "tokenizer": qwen2_tokenizer()}


def qwen_image_on_meta(image_size: int, **overrides: dict) -> dict[str, nn.Module]:
    """The modules of build_qwen_image on the meta device: shapes, no storage."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    o = check_overrides(overrides, ("transformer", "vae", "text_encoder"))
    te = o["text_encoder"]
    config = Qwen2_5_VLConfig(text_config={**QWEN25_VL_TEXT, **te.get("text_config", {})},
                              vision_config={**QWEN25_VL_VISION, **te.get("vision_config", {})},
                              **{**QWEN25_VL, **{k: v for k, v in te.items() if not k.endswith("_config")}})
    with torch.device("meta"):
        return {"transformer": QwenImageTransformer2DModel(**{**QWEN_IMAGE, **o["transformer"]}),
                "vae": AutoencoderKLQwenImage(**{**QWEN_VAE, **o["vae"]}),
                "text_encoder": Qwen2_5_VLForConditionalGeneration(config)}


def _tables(root: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in root.named_modules() if type(m).__name__ in TABLES]


def _set(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, module)


def _take_tables(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """``root``'s table modules, each replaced by an empty module (put back by ``rebuild_tables``)."""
    found = _tables(root)
    for name, _ in found:
        _set(root, name, nn.Module())
    return found


def rebuild_tables(root: nn.Module, found: list[tuple[str, nn.Module]] | None = None) -> nn.Module:
    """``root`` with each module whose tensors ``__init__`` computes made again on the host and put in its place
    (``found``: those taken out by ``_take_tables``; by default the ones in ``root``), as a plain build makes
    them: QwenImage's rotary tables (complex, kept on the host; the transformer moves them to its device on first
    use, as diffusers does), Qwen2.5-VL's rotary frequencies in float32 on ``root``'s device (a cast of the whole
    encoder to bfloat16 would round them: the pipeline's text encoder keeps them in float32). Returns ``root``."""
    device = next(root.parameters()).device
    for name, old in _tables(root) if found is None else found:
        with torch.device("cpu"):
            fresh = TABLES[type(old).__name__](old)
        for key, buf in fresh._buffers.items():
            if buf is not None:
                fresh._buffers[key] = buf.to(device)
        _set(root, name, fresh.eval())
    return root


def qwen2_tokenizer():
    """A Qwen2 tokenizer (transformers' Qwen2Tokenizer: Qwen2's pre-tokenizing regex, byte-level BPE) over a
    generated vocabulary of 36,789 tokens, fewer than Qwen2.5-VL's 152,064: the 256 byte symbols, then merges
    into letter bigrams and trigrams, each also after a space (Qwen's ``Ġ``), so an ordinary prompt is about
    two tokens a word (Qwen's own about 1.3); then <|endoftext|> (also the padding), <|im_start|> and <|im_end|>, Qwen2's specials in
    its order, which the pipeline's chat template uses."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    base = sorted(ByteLevel.alphabet())  # a-z stand for themselves; "Ġ" is the space
    pairs = ["".join(p) for p in product(LETTERS, repeat=2)]
    merges = [("Ġ", c) for c in LETTERS] + [(a, b) for a, b in pairs] + [("Ġ" + a, b) for a, b in pairs]
    merges += [(p, c) for p in pairs for c in LETTERS] + [("Ġ" + p, c) for p in pairs for c in LETTERS]
    tokens = [*base, *(a + b for a, b in merges), *QWEN_SPECIALS]
    return Qwen2Tokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, errors="replace",
                          unk_token=None, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                          additional_special_tokens=["<|im_start|>", "<|im_end|>"], model_max_length=131072)
