"""Train the shipped ``digits-text`` model: a tiny text-to-image model in PixArt-Sigma's format, on the 8x8 digits.

Reproducible recipe (seeded, offline): the images are scikit-learn's bundled digits on the same stratified
split as ``digits`` (``workers.models.digits.load_split``), pixels in [-1, 1], no VAE (pixel space). Prompts come
from a small grammar: a prefix, the digit as a word or a numeral, a suffix ("a bold 3", "the number seven,
drawn thin"), some capitalised and some carrying random letter strings between their words, so that words
the model never saw are noise to it rather than a signal. ``HELD_OUT_TEMPLATES`` are phrasings the
grammar cannot produce; they are never trained on and measure how far the text side generalises.

1. A T5-style Unigram tokenizer (``tokenizers``) is fitted on the grammar's prompts: ``<pad>`` 0,
   ``</s>`` 1, ``<unk>`` 2, as T5's, so PixArt's tokenizer call works unchanged.
2. A small ``T5EncoderModel`` is pre-trained from scratch to read which digit a prompt names (a linear
   probe on its mean output, class 10 for "" and for prompts of random letters). This is cheap (a few
   hundred steps of a 0.5M-parameter encoder), it teaches the encoder which token matters and to ignore
   the rest, and a frozen encoder lets stage 3 embed its prompt pool once instead of every step.
3. A ``PixArtTransformer2DModel`` is trained from scratch under the frozen encoder's embeddings:
   epsilon prediction with DDPM linear betas (1e-4..0.02, 1000 steps) as ``digits``; 10% of prompts
   are replaced by "" (the pipeline's default negative prompt) for classifier-free guidance.
4. The encoder and an EMA of the transformer are saved as a diffusers ``PixArtSigmaPipeline`` directory
   (``vae`` null), the oracle figures are measured through that pipeline, and README.md is written.

    python -m workers.models.train_digits_text --out workers/models/digits-text

Runs on CUDA when present, else on the CPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import random
import string
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from workers.models.digits import DIGIT_NAMES, load_split

log = logging.getLogger(__name__)

NUMERALS = tuple(str(d) for d in range(10))
# "{a}" is the article of the word right after it ("an eight", "an 8"); adjectives take "a"
PREFIXES = ("", "{a} ", "the ", "digit ", "the digit ", "number ", "the number ", "a handwritten ", "a bold ",
            "a thin ", "a neat ", "a messy ", "a small ", "a big ", "a drawing of {a} ", "a sketch of {a} ",
            "draw {a} ", "write {a} ", "handwritten ", "bold ")
SUFFIXES = ("", ", drawn thin", ", handwritten", ", bold", ", neat", ", messy", " on a dark background",
            " in white on black", ", low resolution", ", written quickly", ", scanned", " digit")
# never trained on: none of these can come out of PREFIXES x (word | numeral) x SUFFIXES
HELD_OUT_TEMPLATES = (
    "an image of the digit {word}",
    "number {word} written by hand",
    "a picture of {a} {numeral}",
    "please draw the numeral {word}",
    "the handwritten digit {numeral}",
    "{Word} in pencil",
    "a tiny {word}, scanned from paper",
    "I want the number {numeral}",
)
MAX_SEQUENCE_LENGTH = 32  # tokens; the longest grammar prompt with two noise words is well under this
SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2 as T5's

TEXT_ENCODER = dict(d_model=128, d_kv=32, d_ff=256, num_layers=3, num_heads=4, relative_attention_num_buckets=16,
                    relative_attention_max_distance=32, feed_forward_proj="gated-gelu", dropout_rate=0.0,
                    is_encoder_decoder=False, use_cache=False, pad_token_id=0, eos_token_id=1,
                    decoder_start_token_id=0, tie_word_embeddings=False)
TRANSFORMER = dict(num_attention_heads=4, attention_head_dim=32, in_channels=1, out_channels=1, num_layers=4,
                   sample_size=8, patch_size=2, cross_attention_dim=128, caption_channels=TEXT_ENCODER["d_model"],
                   norm_type="ada_norm_single", num_embeds_ada_norm=1000, use_additional_conditions=False,
                   interpolation_scale=1, attention_bias=True, activation_fn="gelu-approximate",
                   norm_elementwise_affine=False, norm_eps=1e-6, dropout=0.0)
SCHEDULER = {
    "_class_name": "DPMSolverMultistepScheduler", "num_train_timesteps": 1000, "beta_start": 0.0001,
    "beta_end": 0.02, "beta_schedule": "linear", "prediction_type": "epsilon", "algorithm_type": "dpmsolver++",
    "solver_order": 2, "solver_type": "midpoint", "lower_order_final": True, "timestep_spacing": "linspace",
    "steps_offset": 0,
}
EMA_DECAY = 0.998  # averages about the last 500 steps of a run of a few thousand
DEFAULTS = {"sampler": "dpmpp_2m", "steps": 20, "guidance": 3.0}


def article(digit: int) -> str:
    return "an" if digit == 8 else "a"  # "an eight", "an 8"


def fill(template: str, digit: int, core: str = "") -> str:
    """A template with the digit's word, numeral or ``core`` (either) and its article filled in."""
    word = DIGIT_NAMES[digit]
    return template.format(a=article(digit), word=word, Word=word.capitalize(), numeral=str(digit), core=core)


def training_prompts(digit: int) -> list[str]:
    """Every prompt the grammar makes for ``digit``, lower case (PREFIXES x (word | numeral) x SUFFIXES)."""
    cores = (DIGIT_NAMES[digit], NUMERALS[digit])
    return [fill(p + "{core}" + s, digit, core) for p in PREFIXES for core in cores for s in SUFFIXES]


def held_out_prompts(digit: int) -> list[str]:
    return [fill(t, digit) for t in HELD_OUT_TEMPLATES]


def recase(prompt: str, rng: random.Random) -> str:
    """Upper case one time in twenty, every word capitalised one in ten, the first one in six."""
    r = rng.random()
    if r < 0.05:
        return prompt.upper()
    if r < 0.15:
        return " ".join(w[:1].upper() + w[1:] for w in prompt.split(" "))
    return prompt[:1].upper() + prompt[1:] if r < 0.32 else prompt


def junk_word(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8)))


def add_noise_words(prompt: str, rng: random.Random) -> str:
    """One random letter string (20% of prompts) or two (10%), each at a random word boundary: words the
    grammar never uses must not move the image."""
    for _ in range(rng.choices((0, 1, 2), weights=(70, 20, 10))[0]):
        words = prompt.split(" ") if prompt else []
        at = rng.randint(0, len(words))
        words.insert(at, junk_word(rng))
        prompt = " ".join(words)
    return prompt


def prompt_pool(per_digit: int, seed: int) -> list[list[str]]:
    """``per_digit`` augmented training prompts for each digit: pool[digit][j]."""
    rng = random.Random(seed)
    grammar = [training_prompts(d) for d in range(10)]
    return [[add_noise_words(recase(rng.choice(grammar[d]), rng), rng) for _ in range(per_digit)] for d in range(10)]


def train_tokenizer(seed: int):
    """A T5 tokenizer (Unigram over Metaspace pieces; T5's special ids) fitted on the grammar's prompts.

    The pieces come from tokenizers' BPE trainer, each scored by the log of its frequency in the
    corpus: its Unigram trainer seeds pieces from substrings shared by *distinct* words, so on a
    corpus of a few dozen words it never proposes the words themselves. The tokenizer is stored as
    Unigram because transformers' T5 tokenizer reads only that; it also rebuilds its pre-tokenizer,
    decoder and ``$A </s>`` post-processor itself, so the same ones are set here and every
    transformers version reads the saved tokenizer.json alike. Every letter, digit and punctuation
    mark is a piece: a new word splits into known pieces instead of becoming ``<unk>``.
    """
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE, Unigram
    from tokenizers.trainers import BpeTrainer
    from transformers import T5TokenizerFast

    rng = random.Random(seed)
    corpus = [recase(p, rng) for d in range(10) for p in training_prompts(d) for _ in range(3)]
    pre = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                   pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")])
    bpe = Tokenizer(BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre
    alphabet = list(string.ascii_letters + string.digits + string.punctuation)
    bpe.train_from_iterator(corpus, BpeTrainer(vocab_size=400, special_tokens=list(SPECIAL_TOKENS),
                                               initial_alphabet=alphabet, show_progress=False))
    counts = Counter(piece for p in corpus for piece in bpe.encode(p).tokens)
    total = sum(counts.values()) + bpe.get_vocab_size()
    pieces = sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])  # ids 0..2 are SPECIAL_TOKENS
    vocab = [(p, 0.0 if p in SPECIAL_TOKENS else math.log((counts[p] + 1) / total)) for p, _ in pieces]
    tok = Tokenizer(Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    return T5TokenizerFast(tokenizer_object=tok, extra_ids=0, model_max_length=MAX_SEQUENCE_LENGTH,
                           eos_token="</s>", unk_token="<unk>", pad_token="<pad>")


def tokenize(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), each (N, MAX_SEQUENCE_LENGTH): PixArt-Sigma's own tokenizer call."""
    enc = tokenizer(prompts, padding="max_length", max_length=MAX_SEQUENCE_LENGTH, truncation=True,
                    add_special_tokens=True, return_tensors="pt")
    return enc.input_ids, enc.attention_mask


def null_prompts(n: int, seed: int) -> list[str]:
    """Prompts that name no digit: "" (the pipeline's default negative prompt) and random letter strings."""
    rng = random.Random(seed)
    return ["" if i % 4 == 0 else " ".join(junk_word(rng) for _ in range(rng.randint(1, 3))) for i in range(n)]


def pretrain_text_encoder(tokenizer, steps: int, batch: int, lr: float, seed: int, device: str,
                          per_digit: int = 300):
    """Stage 1: the T5 encoder learns to read which digit a prompt names (class 10: none), through a
    linear probe on its masked mean output; the probe is then dropped. Returns (encoder, probe accuracy
    on the held-out phrasings)."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    pool = prompt_pool(per_digit, seed + 1)
    prompts = [p for ps in pool for p in ps] + null_prompts(per_digit, seed + 2)
    labels = torch.tensor([d for d in range(10) for _ in pool[d]] + [10] * per_digit, device=device)
    ids, mask = (t.to(device) for t in tokenize(tokenizer, prompts))                # (P, L)
    encoder = T5EncoderModel(T5Config(vocab_size=len(tokenizer), **TEXT_ENCODER)).to(device).train()
    probe = torch.nn.Linear(TEXT_ENCODER["d_model"], 11).to(device)
    opt = torch.optim.AdamW([*encoder.parameters(), *probe.parameters()], lr=lr, weight_decay=0.0)
    gen = torch.Generator(device=device).manual_seed(seed)

    def read(ids, mask):
        return probe(pooled(encoder, ids, mask))                                    # (N, 11) logits

    for step in range(steps):
        idx = torch.randint(0, len(prompts), (batch,), device=device, generator=gen)
        loss = torch.nn.functional.cross_entropy(read(ids[idx], mask[idx]), labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    held = [p for d in range(10) for p in held_out_prompts(d)]
    with torch.no_grad():
        h_ids, h_mask = (t.to(device) for t in tokenize(tokenizer, held))
        hits = read(h_ids, h_mask).argmax(1).cpu() == torch.arange(10).repeat_interleave(len(HELD_OUT_TEMPLATES))
    log.info("text encoder misreads %s", [p for p, h in zip(held, hits) if not h])
    log.info("text encoder: loss %.4f, reads the digit of %.1f%% of held-out prompts", loss.item(),
             100 * hits.float().mean().item())
    return encoder.eval().requires_grad_(False), round(hits.float().mean().item(), 4)


def pooled(encoder, ids, mask):
    """Masked mean of the encoder's output, (N, D)."""
    keep = int(mask.sum(1).max())  # padding is masked everywhere: cutting it changes nothing
    ids, mask = ids[:, :keep], mask[:, :keep]                                      # (N, L')
    hidden = encoder(ids, attention_mask=mask).last_hidden_state                   # (N, L', D)
    m = mask.unsqueeze(-1).to(hidden.dtype)                                        # (N, L', 1)
    return (hidden * m).sum(1) / m.sum(1)                                          # (N, D)


@torch.no_grad()
def embed(encoder, tokenizer, prompts: list[str], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Caption embeddings as the pipeline computes them, (N, L, D), and their masks (N, L)."""
    ids, mask = (t.to(device) for t in tokenize(tokenizer, prompts))
    chunks = [encoder(i, attention_mask=m).last_hidden_state for i, m in zip(ids.split(512), mask.split(512))]
    return torch.cat(chunks), mask



def denoising_loss(model, x, y, prompts, empty, abar, batch: int, drop: float, gen: torch.Generator) -> torch.Tensor:
    """One batch's epsilon-prediction loss: ``batch`` images of ``x`` (N, 1, 8, 8) with labels ``y``, each under one
    of its digit's pooled prompt embeddings ``prompts`` ((10, P, L, D) text, (10, P, L) mask), replaced by ``empty``
    ((1, L, D), (1, L): "") with probability ``drop``, noised to a random step of ``abar``; draws from ``gen``."""
    text, mask = prompts
    empty_text, empty_mask = empty
    device, per_digit = x.device, text.shape[1]
    idx = torch.randint(0, len(x), (batch,), device=device, generator=gen)
    x0, labels = x[idx], y[idx]                                                     # (B, 1, 8, 8), (B,)
    j = torch.randint(0, per_digit, (batch,), device=device, generator=gen)
    uncond = torch.rand(batch, device=device, generator=gen) < drop                 # (B,)
    b_mask = torch.where(uncond[:, None], empty_mask, mask[labels, j])              # (B, L)
    b_text = torch.where(uncond[:, None, None], empty_text, text[labels, j])        # (B, L, D)
    keep = int(b_mask.sum(1).max())  # padding is masked in cross-attention: cutting it changes nothing
    t = torch.randint(0, 1000, (batch,), device=device, generator=gen)
    eps = torch.randn(x0.shape, device=device, generator=gen)
    a = abar[t].view(-1, 1, 1, 1)
    xt = a.sqrt() * x0 + (1 - a).sqrt() * eps  # q(x_t | x_0)
    pred = model(xt, encoder_hidden_states=b_text[:, :keep], timestep=t,
                 encoder_attention_mask=b_mask[:, :keep]).sample                   # (B, 1, 8, 8)
    return torch.nn.functional.mse_loss(pred, eps)

def train(steps: int, batch: int, lr: float, seed: int, device: str, encoder, tokenizer,
          drop: float = 0.1, per_digit: int = 500) -> tuple[torch.nn.Module, dict]:
    """Stage 2: the PixArt transformer learns epsilon prediction under the frozen encoder's embeddings
    (cached once for a pool of prompts); ``drop`` of them are replaced by the embedding of ""."""
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(seed)
    x_train, y_train, _, _ = load_split()
    x = torch.as_tensor(x_train, dtype=torch.float32).view(-1, 1, 8, 8).to(device)  # (N, 1, 8, 8)
    y = torch.as_tensor(y_train, dtype=torch.long).to(device)                       # (N,)
    text, mask = embed(encoder, tokenizer, [p for ps in prompt_pool(per_digit, seed) for p in ps], device)
    text, mask = text.view(10, per_digit, *text.shape[1:]), mask.view(10, per_digit, -1)  # (10, P, L, D)
    empty_text, empty_mask = embed(encoder, tokenizer, [""], device)                # (1, L, D), (1, L)
    betas = torch.linspace(SCHEDULER["beta_start"], SCHEDULER["beta_end"], 1000, dtype=torch.float64)
    abar = torch.cumprod(1 - betas, 0).float().to(device)  # (1000,)
    model = PixArtTransformer2DModel(**TRANSFORMER).to(device).train()
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 30)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    gen = torch.Generator(device=device).manual_seed(seed)
    ema_params, model_params = list(ema.parameters()), list(model.parameters())
    t0 = time.time()
    for step in range(steps):
        loss = denoising_loss(model, x, y, (text, mask), (empty_text, empty_mask), abar, batch, drop, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():
            decay = min(EMA_DECAY, (1 + step) / (10 + step))
            torch._foreach_lerp_(ema_params, model_params, 1 - decay)  # one call for all the tensors
        if step % 250 == 0 or step == steps - 1:
            log.info("step %d loss %.4f (%.0f s)", step, loss.item(), time.time() - t0)
    info = {"steps": steps, "batch": batch, "lr": lr, "seed": seed, "cfg_dropout": drop,
            "train_seconds": round(time.time() - t0, 1), "final_loss": round(loss.item(), 5)}
    return ema, info


def save(transformer, text_encoder, tokenizer, out: Path, info: dict) -> None:
    """The diffusers pipeline directory: float32 safetensors components, the index and the scheduler."""
    transformer.to("cpu", torch.float32).save_pretrained(out / "transformer", safe_serialization=True)
    text_encoder.to("cpu", torch.float32).save_pretrained(out / "text_encoder", safe_serialization=True)
    tokenizer.save_pretrained(out / "tokenizer")
    (out / "scheduler").mkdir(parents=True, exist_ok=True)
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER, indent=2) + "\n")
    index = {
        "_class_name": "PixArtSigmaPipeline",
        "transformer": ["diffusers", "PixArtTransformer2DModel"],
        "text_encoder": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "scheduler": ["diffusers", SCHEDULER["_class_name"]],
        "vae": [None, None],  # pixel space: the latents are the image
        "dit_serve": {"dtype": "float32", "pixel_space": True, "defaults": DEFAULTS,
                      "max_sequence_length": MAX_SEQUENCE_LENGTH, "training": info},
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def load_pipeline(path: Path, device: str = "cpu"):
    """diffusers' own PixArtSigmaPipeline over the directory; ``vae=None`` because the model has none."""
    from diffusers import PixArtSigmaPipeline

    pipe = PixArtSigmaPipeline.from_pretrained(path, vae=None).to(device)  # float32 on disk
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, prompts: list[str], guidance: float, steps: int, seed: int) -> np.ndarray:
    """Images (N, 8, 8), one per prompt, through PixArtSigmaPipeline.__call__ itself; not clipped to
    [-1, 1] (the oracle and 8-bit conversion clip), so that stray values can be counted.

    With no VAE the pipeline's vae_scale_factor is 8, so height = width = 64 gives 8x8 latents, which
    are the pixels; ``output_type="latent"`` returns them undecoded. Resolution binning knows only
    PixArt's 256..2048 px sizes, and caption cleaning needs bs4 and ftfy: both off.
    """
    gen = torch.Generator(pipe.device).manual_seed(seed)
    out = pipe(prompts, num_inference_steps=steps, guidance_scale=guidance, height=64, width=64,
               generator=gen, output_type="latent", use_resolution_binning=False, clean_caption=False,
               max_sequence_length=MAX_SEQUENCE_LENGTH)
    return out.images.squeeze(1).float().cpu().numpy()  # (N, 8, 8)


def oracle_prompts(per_digit: int, held_out: bool, seed: int) -> tuple[list[str], np.ndarray]:
    """``per_digit`` prompts for each digit: the training grammar, or HELD_OUT_TEMPLATES in turn."""
    rng = random.Random(seed)
    labels = np.repeat(np.arange(10), per_digit)
    pick = (lambda d, i: held_out_prompts(d)[i % len(HELD_OUT_TEMPLATES)]) if held_out else (
        lambda d, i: rng.choice(training_prompts(d)))
    return [pick(int(d), i) for i, d in enumerate(labels)], labels


def evaluate(pipe, per_digit: int, guidance: float, steps: int, held_out: bool, seed: int = 0) -> dict:
    """Oracle accuracy (the fraction of images the digits classifier reads as the prompt's digit) and the
    fraction of images with a pixel beyond +-1.5 before clipping."""
    from workers.models.digits import oracle_accuracy

    prompts, labels = oracle_prompts(per_digit, held_out, seed)
    images = generate(pipe, prompts, guidance, steps, seed)
    stray = float(np.mean(np.abs(images).max(axis=(1, 2)) > 1.5))
    return {"accuracy": round(oracle_accuracy(images, labels), 4), "stray": round(stray, 4)}


def measure(out: Path, device: str, guidances=(1.5, 2.0, 3.0, 4.5)) -> list[dict]:
    """The model card's oracle table: 500 images from training-style prompts and 400 from held-out ones."""
    pipe = load_pipeline(out, device)
    rows = []
    for guidance in guidances:
        for held_out, per_digit in ((False, 50), (True, 40)):
            figures = evaluate(pipe, per_digit, guidance, DEFAULTS["steps"], held_out)
            rows.append({"prompts": "held-out" if held_out else "training-style", "images": 10 * per_digit,
                         "sampler": DEFAULTS["sampler"], "steps": DEFAULTS["steps"], "guidance": guidance,
                         **figures, "device": device})
            log.info("oracle %s", rows[-1])
    return rows


def write_card(out: Path, info: dict, rows: list[dict]) -> None:
    size_mb = sum(f.stat().st_size for f in out.rglob("*.safetensors")) / 1e6
    table = "\n".join(f"| {r['prompts']} | {r['sampler']} | {r['steps']} | {r['guidance']} | {r['images']} | "
                      f"{100 * r['accuracy']:.1f}% | {100 * r['stray']:.1f}% |" for r in rows)
    held = "\n".join(f"- `{t}`" for t in HELD_OUT_TEMPLATES)
    vocab = len(json.loads((out / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"])
    text = CARD.format(**info, **info["parameters"], size_mb=size_mb, ema=EMA_DECAY, table=table, held=held,
                       probe_pct=100 * info["text_encoder_held_out_probe_accuracy"], vocab=vocab,
                       total_seconds=round(info["text_encoder_seconds"] + info["train_seconds"]),
                       max_len=MAX_SEQUENCE_LENGTH, sampler=DEFAULTS["sampler"], steps_default=DEFAULTS["steps"],
                       guidance=DEFAULTS["guidance"])
    (out / "README.md").write_text(text)


CARD = """# digits-text: a tiny text-to-image model in PixArt-Sigma's format, for 8x8 handwritten digits

The shipped text-conditioned model of dit-serve: prompts in, 8x8 digits out, in seconds on a CPU with no
model hub. It is a diffusers `PixArtSigmaPipeline` directory (T5 encoder, tokenizer, PixArt transformer,
scheduler) that diffusers' own pipeline loads and runs, so the text path is tested against the reference
implementation; like `digits` it has no VAE: the 8x8 "latents" are the pixels.

| | |
|---|---|
| transformer | diffusers `PixArtTransformer2DModel`, adaLN-single, 4 layers, 4 heads x 32 (hidden 128), cross-attention to the caption, patch 2 on 8x8x1 pixels (16 tokens), {transformer:,} parameters |
| text encoder | transformers `T5EncoderModel`, 3 layers, d_model 128, 4 heads x 32, gated-GELU FFN 256, {text_encoder:,} parameters; pre-trained from scratch ({text_encoder_steps} steps, {text_encoder_seconds} s with the tokenizer) to name the digit a prompt asks for through a linear probe on its mean output (class 10: "" or random letters; the probe reads {probe_pct:.1f}% of the held-out phrasings), then frozen |
| tokenizer | `T5TokenizerFast`, Unigram, {vocab} pieces (tokenizers' BPE trainer on the prompt grammar, scored by log frequency; every letter, digit and punctuation mark included), `<pad>` 0, `</s>` 1, `<unk>` 2; prompts padded to {max_len} tokens |
| objective | epsilon prediction, DDPM linear betas 1e-4..0.02 over 1000 steps (as `digits`) |
| data | scikit-learn's bundled `load_digits`, the same 1,437-image training split as `digits` |
| prompts | a grammar: prefix x (digit word or numeral) x suffix ("a bold 3", "the number seven, drawn thin"), 480 per digit; about 1 in 6 with a capital first letter, 1 in 10 with every word capitalised, 1 in 20 upper case, 3 in 10 with one or two random letter strings at random word boundaries; 10% replaced by "" for classifier-free guidance (the pipeline's default negative prompt) |
| recipe | transformer: AdamW lr {lr} (warm-up 1/30 of the steps, cosine decay), batch {batch}, {steps:,} steps, grad-norm clip 1.0, EMA {ema} of the weights (saved), seed {seed}; final loss {final_loss} |
| training | {train_seconds} s for the transformer, {total_seconds} s in all, on {device} with {threads} thread (a 2-core machine shared with other work): `python -m workers.models.train_digits_text --steps {steps} --batch {batch}` |
| weights | float32 safetensors, {size_mb:.1f} MB in all |
| defaults | {sampler}, {steps_default} steps, guidance {guidance} |

## Running it with diffusers

```python
pipe = PixArtSigmaPipeline.from_pretrained("workers/models/digits-text", vae=None)
images = pipe(["a handwritten seven"], num_inference_steps=20, guidance_scale=3.0, height=64, width=64,
              output_type="latent", use_resolution_binning=False, clean_caption=False,
              max_sequence_length={max_len}).images  # (1, 1, 8, 8) pixels in [-1, 1]
```

`vae=None` must be passed (PixArt's pipeline lists the VAE as required); with no VAE its scale factor is 8,
so 64 px asks for the 8x8 pixel grid; `output_type="latent"` skips decoding.

## The oracle figure

Images are read by the digits oracle (`workers.models.digits.oracle_accuracy`, an SVC that reads 99.2% of real
held-out digits). Training-style prompts are drawn from the grammar; held-out prompts use templates the
grammar cannot make and that were never trained on:

{held}

| prompts | sampler | steps | guidance | images | read as the asked-for digit | with a pixel beyond +-1.5 |
|---|---|---|---|---|---|---|
{table}

`tests/workers/test_digits_text.py` checks 100 images of each kind on a CPU.

## Known limits

At the default guidance 1 to 2% of images carry stray pixels far outside [-1, 1] before clipping (last
column; more at higher guidance), mostly border pixels that are black in almost every training digit;
clipping turns them into a few white or black pixels, and the oracle still reads the digit. `digits`,
trained on 20 times as many samples on a GPU, showed none in 80 images at guidance 3.0. A longer run
(`--steps 10000 --batch 256 --device cuda`) is the likely fix, not tried here: the 2,000-step recipe is
sized to train in under 10 minutes on a shared 2-core CPU.
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "digits-text")
    p.add_argument("--steps", type=int, default=2000, help="transformer steps (stage 2)")
    p.add_argument("--text-steps", type=int, default=300, help="text-encoder steps (stage 1)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads: a fixed count keeps CPU runs bit-identical across machines (the order of "
                        "float reductions depends on it), and on a machine shared with other work one is fastest")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):  # deterministic cuBLAS; read when cuBLAS starts, so set before any CUDA work
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    t0 = time.time()
    tokenizer = train_tokenizer(args.seed)
    encoder, probe = pretrain_text_encoder(tokenizer, args.text_steps, args.batch, args.lr, args.seed, args.device)
    text_seconds = round(time.time() - t0, 1)
    transformer, info = train(args.steps, args.batch, args.lr, args.seed, args.device, encoder, tokenizer)
    info = {"objective": "eps", **info, "text_encoder_steps": args.text_steps, "text_encoder_seconds": text_seconds,
            "text_encoder_held_out_probe_accuracy": probe,
            "device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
            "threads": args.threads,
            "parameters": {"transformer": sum(p.numel() for p in transformer.parameters()),
                           "text_encoder": sum(p.numel() for p in encoder.parameters())}}
    save(transformer, encoder, tokenizer, args.out, info)
    write_card(args.out, info, measure(args.out, args.device))
    log.info("saved %s: %s", args.out, info)


if __name__ == "__main__":
    main()
