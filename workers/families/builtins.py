"""What the built-in architectures share (full-size diffusion transformers with random weights, for
benchmarks; each family's own in ``workers.families.<name>.builtin``): the text encoders' and VAEs'
configs, the tokenizers (made here, nothing downloaded), and building on the meta device. The families'
built-ins:

- ``PixArt-alpha/PixArt-Sigma-XL-2-1024-MS``: transformer 0.61B, ``google/t5-v1_1-xxl``'s encoder 4.76B,
  the SDXL VAE (``pixart.builtin.build_pixart_sigma``);
- ``stabilityai/stable-diffusion-3.5-medium``: MMDiT-X transformer 2.24B, CLIP-L 0.12B and OpenCLIP-bigG
  0.69B text towers with projections, T5-XXL's encoder, a 16-channel VAE (``sd3.builtin.build_sd35_medium``);
- ``black-forest-labs/FLUX.1-dev``: transformer 11.9B, CLIP-L's text tower, T5-XXL's encoder, a
  16-channel VAE (``flux.builtin.build_flux_dev``).

Modules are built on the meta device, given storage on the target device in the target dtype, and
initialised there from a seeded generator: the host never holds the weights (FLUX.1-dev's are 31 GiB
in bf16). Meta construction leaves every tensor computed in ``__init__`` empty, so the buffers these
models have (``PatchEmbed.pos_embed``, a sin-cos table; CLIP's ``position_ids``) are recomputed on the
device; any other buffer or plain tensor attribute is refused, so that a library upgrade cannot leave
garbage in a model silently.

    transformer, text_encoder, tokenizer, vae = build_pixart_sigma(1024, "cuda", torch.bfloat16)
    parts = build_flux_dev(1024, "cuda", torch.bfloat16)  # {"transformer": ..., "tokenizer_2": ...}
"""

from __future__ import annotations

import math
from itertools import product

import torch
from torch import nn

from workers.families.encoders import encoder_device

# google/t5-v1_1-xxl (gated-gelu implies is_gated_act and dense_act_fn "gelu_new"); only its encoder is built
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128,
              layer_norm_epsilon=1e-6, tie_word_embeddings=False)
# vae/config.json of PixArt-Σ: the SDXL VAE
SDXL_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=[128, 256, 512, 512],
    down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
    layers_per_block=2, norm_num_groups=32, act_fn="silu", scaling_factor=0.13025, force_upcast=True)
# text_encoder/config.json of both (openai/clip-vit-large-patch14's text tower) and SD3's text_encoder_2
# (OpenCLIP ViT-bigG/14's); bos/eos/pad ids are clip_tokenizer's (clip_token_ids), not the hub's
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu", layer_norm_eps=1e-5)
CLIP_BIGG = dict(CLIP_L, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
                 projection_dim=1280, hidden_act="gelu")
# vae/config.json of SD3.5 and FLUX.1: 16 latent channels, no quant convs; each has its scale and shift
MMDIT_VAE = dict(SDXL_VAE, latent_channels=16, use_quant_conv=False, use_post_quant_conv=False)
INIT_STD = 0.02  # every weight matrix, embedding and free parameter; PixArt's output stays ~N(0, 0.7)

SPECIALS = ("<pad>", "</s>", "<unk>")  # T5's ids 0, 1, 2
LETTERS = "abcdefghijklmnopqrstuvwxyz"
SYMBOLS = LETTERS + "0123456789.,!?;:'\"-()&/%+*#@$="
CLIP_SPECIALS = ("<|startoftext|>", "<|endoftext|>")  # last in the vocabulary, as in CLIP's
# English letter frequencies (%), to choose which word-initial trigrams fit in the vocabulary
LETTER_FREQ = (8.2, 1.5, 2.8, 4.3, 12.7, 2.2, 2.0, 6.1, 7.0, 0.15, 0.77, 4.0, 2.4, 6.7, 7.5, 1.9, 0.095, 6.0, 6.3,
               9.1, 2.8, 0.98, 2.4, 0.15, 2.0, 0.074)


def check_overrides(overrides: dict, names: tuple[str, ...]) -> dict[str, dict]:
    unknown = set(overrides) - set(names)
    if unknown:
        raise TypeError(f"no module named {', '.join(sorted(unknown))} to override; the modules: {', '.join(names)}")
    return {name: overrides.get(name) or {} for name in names}


def materialise_all(modules: dict[str, nn.Module], device, dtype: torch.dtype, seed: int) -> dict[str, nn.Module]:
    """Each of a built-in's modules made on ``device``, its text encoders (``text_encoder*``) on the offload device
    when one is set (``[workers] text_encoder_device``): made there, never on the GPU first, so a model whose
    encoder and transformer together exceed the GPU (FLUX.2-dev: 48 + 64 GB) still loads. One seeded generator
    per device, drawn in the modules' order."""
    gens: dict[str, torch.Generator] = {}
    out = {}
    for name, m in modules.items():
        where = encoder_device(device) if name.startswith("text_encoder") else device
        key = str(torch.device(where))
        if key not in gens:
            gens[key] = _generator(where, seed)
        out[name] = materialise(m, where, dtype, gens[key])
    return out


def _generator(device, seed: int) -> torch.Generator:
    return torch.Generator(device).manual_seed(seed)


@torch.no_grad()
def materialise(model: nn.Module, device, dtype: torch.dtype, gen: torch.Generator) -> nn.Module:
    """Give a meta-built model storage on ``device`` (floating tensors in ``dtype``) and initialise it
    there: biases 0, norm weights 1, every other parameter N(0, INIT_STD). Unlike ``nn.Module.to_empty``,
    a parameter shared by two modules (T5's ``shared`` and ``encoder.embed_tokens``) stays one tensor."""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (meta, made): the meta one kept alive
    for owner in model.modules():
        for group in (owner._parameters, owner._buffers):
            for name, t in group.items():
                if t is None:
                    continue
                if id(t) not in made:
                    new = torch.empty_like(t, device=device, dtype=dtype if t.is_floating_point() else t.dtype)
                    if group is owner._parameters:
                        new = nn.Parameter(_init(owner, name, new, gen), requires_grad=False)
                    made[id(t)] = t, new  # buffers are filled by _restore_buffers
                group[name] = made[id(t)][1]
    _restore_buffers(model)
    return model.eval()


def _init(owner: nn.Module, name: str, t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if name == "bias":
        return t.zero_()
    if "Norm" in type(owner).__name__:  # LayerNorm, GroupNorm, T5LayerNorm: identity at the start
        return t.fill_(1.0)
    return t.normal_(0.0, INIT_STD, generator=gen)


def _restore_buffers(model: nn.Module) -> None:
    """Recompute what meta construction left empty, as the modules' ``__init__`` do: PatchEmbed's sin-cos
    table (float32 on the device, then the buffer's dtype, as a cast of a normally built model would give;
    SD3's, 384 x 384 patches, is made in float64 first: ~1.8 GB for a moment), CLIP's position ids."""
    from diffusers.models.embeddings import PatchEmbed, get_2d_sincos_pos_embed
    from transformers.models.clip.modeling_clip import CLIPTextEmbeddings

    for mod_name, mod in model.named_modules():
        tensors = [n for n, v in vars(mod).items() if isinstance(v, torch.Tensor)]
        buffers = [n for n, b in mod._buffers.items() if b is not None]
        if isinstance(mod, PatchEmbed) and buffers == ["pos_embed"]:
            grid = mod.pos_embed_max_size or int((mod.height * mod.width) ** 0.5)  # in patches
            table = get_2d_sincos_pos_embed(mod.proj.out_channels, grid, base_size=mod.base_size,
                                            interpolation_scale=mod.interpolation_scale, device=mod.pos_embed.device)
            mod.pos_embed.copy_(table.float().unsqueeze(0))  # (1, T, D)
        elif isinstance(mod, CLIPTextEmbeddings) and buffers == ["position_ids"]:
            mod.position_ids.copy_(torch.arange(mod.position_ids.shape[-1], device=mod.position_ids.device))  # (1, 77)
        elif tensors or buffers:
            raise RuntimeError(f"{type(model).__name__}.{mod_name} ({type(mod).__name__}) holds tensors built in "
                               f"__init__ ({tensors + buffers}) that meta construction leaves empty: add a rule here")


def t5_tokenizer():
    """A T5-like fast tokenizer over a generated vocabulary of 32128 lower-case pieces: accents stripped,
    SentencePiece's ``▁`` word marker, a Unigram model (a segmentation into the fewest pieces), ``</s>``
    appended; <pad> 0, </s> 1, <unk> 2. Pieces are characters, letter bigrams and trigrams, and
    word-initial trigrams of common letters, so an ordinary prompt is ~1.5-2.5 tokens a word, rarely <unk>."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = [(p, 0.0) for p in SPECIALS] + [(p, -1.0) for p in _pieces(T5_XXL["vocab_size"] - len(SPECIALS))]
    tok = Tokenizer(models.Unigram(vocab, unk_id=SPECIALS.index("<unk>"), byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.NFKD(), normalizers.StripAccents(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def _pieces(n: int) -> list[str]:
    """``n`` distinct pieces, deterministic: every symbol alone and word-initial, letter bigrams (both),
    letter trigrams, then word-initial trigrams by descending letter frequency (the rarest, mostly
    with j, q, x or z, are left out)."""
    bigrams = ["".join(p) for p in product(LETTERS, repeat=2)]
    trigrams = ["".join(p) for p in product(LETTERS, repeat=3)]
    freq = dict(zip(LETTERS, LETTER_FREQ))
    common = sorted(trigrams, key=lambda w: -sum(math.log(freq[c]) for c in w))  # stable: ties stay alphabetical
    pieces = ["▁", *SYMBOLS, *("▁" + s for s in SYMBOLS), *bigrams, *("▁" + b for b in bigrams), *trigrams,
              *("▁" + w for w in common)]
    return pieces[:n]


def clip_tokenizer(pad: str = "<|endoftext|>"):
    """A CLIP tokenizer (transformers' CLIPTokenizer: lower-cased, byte-level BPE with ``</w>`` word ends,
    <|startoftext|> ... <|endoftext|>, model_max_length 77) over a generated vocabulary of 37018 tokens,
    fewer than CLIP's 49408 (every id in range of the models' embeddings): the 512 byte symbols (each
    also word-final), then merges into letter bigrams and trigrams: an ordinary prompt is ~2 tokens a
    word (CLIP's own ~1.3), never unknown. ``pad``: "<|endoftext|>" (CLIP-L's) or "!" (SD3's bigG's)."""
    from transformers import CLIPTokenizer

    vocab, merges = clip_vocab()
    return CLIPTokenizer(vocab=vocab, merges=merges, pad_token=pad, model_max_length=CLIP_L["max_position_embeddings"])


def clip_token_ids(pad: str = "<|endoftext|>") -> dict[str, int]:
    """bos/eos/pad ids of clip_tokenizer(pad), for the CLIP configs: the pooled output is read at the
    first eos (an eos_token_id of 2 would select the legacy argmax of the ids instead)."""
    vocab, _ = clip_vocab()
    return dict(bos_token_id=vocab[CLIP_SPECIALS[0]], eos_token_id=vocab[CLIP_SPECIALS[1]], pad_token_id=vocab[pad])


def clip_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges), deterministic. Merge ranks: letter pairs, letter pairs ending a word, then a pair
    plus a letter (mid-word, word-final): the earlier a merge, the sooner BPE applies it."""
    from tokenizers.pre_tokenizers import ByteLevel

    base = sorted(ByteLevel.alphabet())  # the 256 byte symbols; letters a-z stand for themselves
    pairs = ["".join(p) for p in product(LETTERS, repeat=2)]
    merges = [(a, b) for a, b in pairs] + [(a, b + "</w>") for a, b in pairs]
    merges += [(p, c) for p in pairs for c in LETTERS] + [(p, c + "</w>") for p in pairs for c in LETTERS]
    tokens = [*base, *(c + "</w>" for c in base), *(a + b for a, b in merges), *CLIP_SPECIALS]
    return {t: i for i, t in enumerate(tokens)}, merges
