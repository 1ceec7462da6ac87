"""Full-size PixArt-Σ with random weights, for benchmarks: the architectures of
``PixArt-alpha/PixArt-Sigma-XL-2-1024-MS`` (transformer 0.61B, ``google/t5-v1_1-xxl`` encoder 4.76B,
the SDXL VAE) and a T5-like tokenizer made here, nothing downloaded.

Modules are built on the meta device, given storage on the target device in the target dtype, and
initialised there from a seeded generator: the host never holds the 10 GB of weights. Meta
construction leaves every tensor computed in ``__init__`` empty, so the one non-persistent buffer these
models have (``PatchEmbed.pos_embed``, a sin-cos table) is recomputed on the device; any other buffer or
plain tensor attribute is refused, so that a library upgrade cannot leave garbage in a model silently.

    transformer, text_encoder, tokenizer, vae = build_pixart_sigma(1024, "cuda", torch.bfloat16)
"""

from __future__ import annotations

import math
from itertools import product

import torch
from torch import nn

# transformer/config.json of PixArt-Sigma-XL-2-1024-MS (sample_size and interpolation_scale follow the size)
PIXART_SIGMA_XL_2 = dict(
    num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28, patch_size=2,
    cross_attention_dim=1152, caption_channels=4096, attention_bias=True, activation_fn="gelu-approximate",
    num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
    use_additional_conditions=False, attention_type="default")
# google/t5-v1_1-xxl (gated-gelu implies is_gated_act and dense_act_fn "gelu_new"); only its encoder is built
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128,
              layer_norm_epsilon=1e-6, tie_word_embeddings=False)
# vae/config.json of PixArt-Σ: the SDXL VAE
SDXL_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=[128, 256, 512, 512],
    down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
    layers_per_block=2, norm_num_groups=32, act_fn="silu", scaling_factor=0.13025, force_upcast=True)
INIT_STD = 0.02  # every weight matrix, embedding and free parameter; PixArt's output stays ~N(0, 0.7)

SPECIALS = ("<pad>", "</s>", "<unk>")  # T5's ids 0, 1, 2
LETTERS = "abcdefghijklmnopqrstuvwxyz"
SYMBOLS = LETTERS + "0123456789.,!?;:'\"-()&/%+*#@$="
# English letter frequencies (%), to choose which word-initial trigrams fit in the vocabulary
LETTER_FREQ = (8.2, 1.5, 2.8, 4.3, 12.7, 2.2, 2.0, 6.1, 7.0, 0.15, 0.77, 4.0, 2.4, 6.7, 7.5, 1.9, 0.095, 6.0, 6.3,
               9.1, 2.8, 0.98, 2.4, 0.15, 2.0, 0.074)


def build_pixart_sigma(image_size: int, device: str | torch.device, dtype: torch.dtype, seed: int = 0, *,
                       transformer: dict | None = None, text_encoder: dict | None = None, vae: dict | None = None):
    """PixArt-Σ at ``image_size`` pixels (latents image_size // 8 per side) with random weights made on
    ``device`` in ``dtype``: ``(transformer, text_encoder, tokenizer, vae)``, in eval mode, frozen. The
    dicts override keys of PIXART_SIGMA_XL_2, T5_XXL and SDXL_VAE (tests shrink them). One generator
    seeded with ``seed`` initialises the three modules in that order, so a seed gives the same weights."""
    gen = torch.Generator(device).manual_seed(seed)
    modules = pixart_sigma_on_meta(image_size, transformer=transformer, text_encoder=text_encoder, vae=vae)
    made = [materialise(m, device, dtype, gen) for m in modules]
    return made[0], made[1], t5_tokenizer(), made[2]


def pixart_sigma_on_meta(image_size: int, *, transformer: dict | None = None, text_encoder: dict | None = None,
                         vae: dict | None = None) -> tuple[nn.Module, nn.Module, nn.Module]:
    """The transformer, T5 encoder and VAE of build_pixart_sigma on the meta device: shapes, no storage
    (parameter counts and memory estimates cost nothing)."""
    from diffusers import AutoencoderKL, PixArtTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    # the reference pipelines' positional-embedding interpolation, {256: 0.5, 512: 1, 1024: 2, 2048: 4}
    sizes = dict(sample_size=image_size // 8, interpolation_scale=image_size / 512)
    with torch.device("meta"):
        return (PixArtTransformer2DModel(**{**PIXART_SIGMA_XL_2, **sizes, **(transformer or {})}),
                T5EncoderModel(T5Config(**{**T5_XXL, **(text_encoder or {})})),
                AutoencoderKL(**{**SDXL_VAE, "sample_size": image_size, **(vae or {})}))


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
    """Recompute what meta construction left empty: PatchEmbed's sin-cos table, as its ``__init__`` does
    (float32 on the device, then the buffer's dtype, as a cast of a normally built model would give)."""
    from diffusers.models.embeddings import PatchEmbed, get_2d_sincos_pos_embed

    for mod_name, mod in model.named_modules():
        tensors = [n for n, v in vars(mod).items() if isinstance(v, torch.Tensor)]
        buffers = [n for n, b in mod._buffers.items() if b is not None]
        if isinstance(mod, PatchEmbed) and buffers == ["pos_embed"]:
            grid = mod.pos_embed_max_size or int((mod.height * mod.width) ** 0.5)  # in patches
            table = get_2d_sincos_pos_embed(mod.proj.out_channels, grid, base_size=mod.base_size,
                                            interpolation_scale=mod.interpolation_scale, device=mod.pos_embed.device)
            mod.pos_embed.copy_(table.float().unsqueeze(0))  # (1, T, D)
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
