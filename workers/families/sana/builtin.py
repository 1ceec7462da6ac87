"""Sana 1600M at 1024 px with random weights (``Efficient-Large-Model/Sana_1600M_1024px_diffusers``'s
architecture), for benchmarks: built on the meta device and materialised on the target one
(``workers.families.builtins``), with a Gemma-like tokenizer made here (``gemma_tokenizer``: nothing is
downloaded; ``workers.models.tiny_sana`` writes it too). With ``sprint``, Sana Sprint 1.6B's
(``Efficient-Large-Model/Sana_Sprint_1.6B_1024px_diffusers``): the same modules, its transformer embedding the
guidance scale and QK-normalised (``SANA_SPRINT_1600M``)."""

from __future__ import annotations

import json

import torch
from torch import nn

from workers.families.builtins import check_overrides, materialise
from workers.families.sana import COMPLEX_HUMAN_INSTRUCTION

# transformer/config.json of Sana_1600M_1024px_diffusers (diffusers' conversion script, SanaMS_1600M_P1_D20 at
# 1024 px: sample_size 32, no positional embedding; the 2K and 4K models set interpolation_scale 1.0 and 2.0)
SANA_1600M = dict(in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32, num_layers=20,
                  num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240,
                  caption_channels=2304, mlp_ratio=2.5, attention_bias=False, sample_size=32, patch_size=1,
                  norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=None)
# transformer/config.json of Sana_Sprint_1.6B_1024px_diffusers (the conversion script's SanaSprint_1600M_P1_D20):
# Sana 1600M's plus the guidance embedder (the scale times guidance_embeds_scale) and RMS norms of the queries and
# keys across heads in both attentions; guidance_embeds_scale and timestep_scale are the class's defaults, written out
SANA_SPRINT_1600M = dict(SANA_1600M, guidance_embeds=True, guidance_embeds_scale=0.1, qk_norm="rms_norm_across_heads",
                         timestep_scale=1.0)
# vae/config.json of mit-han-lab/dc-ae-f32c32-sana-1.0-diffusers (diffusers' convert_dcae_to_diffusers.py)
DC_AE_F32C32 = dict(
    in_channels=3, latent_channels=32, attention_head_dim=32,
    encoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
    decoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
    encoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
    decoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
    encoder_layers_per_block=(2, 2, 2, 3, 3, 3), decoder_layers_per_block=(3, 3, 3, 3, 3, 3),
    encoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)), decoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
    upsample_block_type="interpolate", downsample_block_type="conv", decoder_norm_types="rms_norm",
    decoder_act_fns="silu", scaling_factor=0.41407)
# text_encoder/config.json: google/gemma-2-2b-it's decoder (AutoModelForCausalLM(...).get_decoder(), Gemma2Model)
GEMMA2_2B = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                 max_position_embeddings=8192, rms_norm_eps=1e-6, attention_bias=False, query_pre_attn_scalar=256,
                 sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                 pad_token_id=0, eos_token_id=1, bos_token_id=2)

GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")  # Gemma's ids 0 to 4
PROMPT_WORDS = ("a an the of on in with at and red blue green white black small big cat dog tree house photo "
                "drawn painting city street sunset table wooden sitting").split()


def gemma_tokenizer(words: tuple[str, ...] | list[str] = ()):
    """A GemmaTokenizer (transformers' fast one: BPE with byte fallback, spaces as "▁", ``<bos>`` prepended; pad 0,
    eos 1, bos 2, unk 3, mask 4, as Gemma's) over a small vocabulary made here: the specials, the 256 byte tokens,
    then the tokens and merges of a BPE trained (``tokenizers``, deterministic) on the complex human instruction,
    ``PROMPT_WORDS`` and ``words``, each line also with a leading space, until every word of them is one token.
    Other text falls back to the pieces it has, and to bytes. Pads on the right, as SanaPipeline sets it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GemmaTokenizer

    lines = [*COMPLEX_HUMAN_INSTRUCTION, " ".join([*PROMPT_WORDS, *words])]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    bpe.train_from_iterator([*lines, *(" " + line for line in lines)],
                            trainers.BpeTrainer(vocab_size=1 << 20, min_frequency=1, show_progress=False))
    trained = json.loads(bpe.to_str())["model"]
    vocab = {t: i for i, t in enumerate(GEMMA_SPECIALS)}
    vocab.update({f"<0x{b:02X}>": len(GEMMA_SPECIALS) + b for b in range(256)})
    for token in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) for m in trained["merges"]]
    return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, padding_side="right")


def build_sana_1600m(image_size: int, device: str | torch.device, dtype: torch.dtype, seed: int = 0,
                     sprint: bool = False, **overrides: dict) -> dict:
    """Sana 1600M (Sana Sprint 1.6B's transformer with ``sprint``) with random weights made on ``device`` in
    ``dtype``, named as SanaPipeline's components: transformer, vae (AutoencoderDC), text_encoder (Gemma2Model) and
    tokenizer. ``image_size`` sets the transformer's sample_size (image_size / 32); ``overrides`` maps a module's
    name to keys of its config (tests shrink them); one generator seeded with ``seed`` initialises the modules in
    that order."""
    modules = sana_1600m_on_meta(image_size, sprint, **overrides)
    gen = torch.Generator(device).manual_seed(seed)
    made = {name: (_materialise_gemma if name == "text_encoder" else materialise)(m, device, dtype, gen)
            for name, m in modules.items()}
    return {**made, "tokenizer": gemma_tokenizer()}


def sana_1600m_on_meta(image_size: int, sprint: bool = False, **overrides: dict) -> dict[str, nn.Module]:
    """The modules of build_sana_1600m on the meta device: shapes, no storage."""
    from diffusers import AutoencoderDC, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    o = check_overrides(overrides, ("transformer", "vae", "text_encoder"))
    config = SANA_SPRINT_1600M if sprint else SANA_1600M
    with torch.device("meta"):
        return {"transformer": SanaTransformer2DModel(**{**config, "sample_size": image_size // 32,
                                                         **o["transformer"]}),
                "vae": AutoencoderDC(**{**DC_AE_F32C32, **o["vae"]}),
                "text_encoder": Gemma2Model(Gemma2Config(**{**GEMMA2_2B, **o["text_encoder"]}))}


@torch.no_grad()
def _materialise_gemma(encoder: nn.Module, device, dtype: torch.dtype, gen: torch.Generator) -> nn.Module:
    """``materialise`` for Gemma2Model, whose buffers it does not know: the rotary embedding's inverse frequencies
    and the embedding's scale sqrt(hidden_size), taken out first, then made as its ``__init__`` makes them (on the
    host, in float32) and cast as a cast of a normally built model casts them."""
    rotary, embed = encoder.rotary_emb, encoder.embed_tokens
    for module, names in ((rotary, ("inv_freq", "original_inv_freq")), (embed, ("embed_scale",))):
        for name in names:
            del module._buffers[name]
    materialise(encoder, device, dtype, gen)
    inv_freq, _ = type(rotary).compute_default_rope_parameters(encoder.config)
    rotary.register_buffer("inv_freq", inv_freq.to(device, dtype), persistent=False)
    rotary.register_buffer("original_inv_freq", inv_freq.clone().to(device, dtype), persistent=False)
    embed.register_buffer("embed_scale", torch.tensor(embed.scalar_embed_scale).to(device, dtype), persistent=False)
    return encoder
