"""PixArt-Σ through our engine equals diffusers' PixArtSigmaPipeline: a tiny random pipeline directory
in the real layout (transformer, T5 text encoder, tokenizer, VAE, scheduler; safetensors), made here,
offline; the same initial latents; float32 on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from workers.cards import read_card
from workers.engine import Engine, EngineConfig
from workers.loading import load_model
from workers.spec import ItemSpec

MAX_TOKENS = 16
WORDS = "<pad> </s> <unk> a an the red blue green cat dog tree house small big drawn photo of".split()


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])  # as T5
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def pixart_dir(tmp_path_factory):
    """A PixArt-Σ pipeline directory with tiny random components (latents 4x8x8, images 16x16)."""
    from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, PixArtTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    path = tmp_path_factory.mktemp("pixart-tiny")
    torch.manual_seed(0)
    T5EncoderModel(T5Config(vocab_size=len(WORDS), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
                   ).save_pretrained(path / "text_encoder", safe_serialization=True)
    _tokenizer().save_pretrained(path / "tokenizer")
    PixArtTransformer2DModel(sample_size=8, in_channels=4, out_channels=8, patch_size=2, num_layers=2,
                             num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16, caption_channels=32,
                             norm_type="ada_norm_single", use_additional_conditions=False
                             ).save_pretrained(path / "transformer", safe_serialization=True)
    AutoencoderKL(block_out_channels=[8, 16], down_block_types=["DownEncoderBlock2D"] * 2,
                  up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=4, norm_num_groups=8, sample_size=16
                  ).save_pretrained(path / "vae", safe_serialization=True)
    DPMSolverMultistepScheduler(beta_schedule="linear", beta_start=0.0001, beta_end=0.02).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps({
        "_class_name": "PixArtSigmaPipeline", "transformer": ["diffusers", "PixArtTransformer2DModel"],
        "text_encoder": ["transformers", "T5EncoderModel"], "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "vae": ["diffusers", "AutoencoderKL"], "scheduler": ["diffusers", "DPMSolverMultistepScheduler"],
        "dit_serve": {"max_sequence_length": MAX_TOKENS}}))
    return path


@pytest.fixture(scope="module")
def model(pixart_dir):
    return load_model(pixart_dir)


def _reference(model, prompt: str, negative: str, seed: int, steps: int, guidance: float) -> torch.Tensor:
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline

    pipe = PixArtSigmaPipeline(tokenizer=model.tokenizer, text_encoder=model.text_encoder, vae=model.vae,
                               transformer=model.transformer,
                               scheduler=DPMSolverMultistepScheduler.from_config(model.card.scheduler))
    latents = torch.randn(model.latent_shape, generator=torch.Generator("cpu").manual_seed(seed))[None]
    out = pipe(prompt, negative_prompt=negative, num_inference_steps=steps, guidance_scale=guidance,
               latents=latents, height=16, width=16, max_sequence_length=MAX_TOKENS, clean_caption=False,
               use_resolution_binning=False, output_type="latent")
    return out.images[0]


def test_the_card_reads_the_pixart_layout(pixart_dir, model):
    card = read_card(pixart_dir)
    assert (card.family, card.conditioning, card.max_tokens) == ("pixart", "text", MAX_TOKENS)
    assert (card.image_size, card.latent_size, card.latent_channels, card.pixel_space) == (16, 8, 4, False)
    assert card.defaults == {"sampler": "dpmpp_2m", "steps": 20, "guidance": 4.5}
    assert model.text_encoder is not None and model.latent_shape == (4, 8, 8)


def test_prompts_batched_together_equal_the_diffusers_pipeline_alone(model):
    # three requests in one batch: different prompts, negative prompts, seeds and guidance; each must
    # equal diffusers' pipeline run alone from the same initial latents
    specs = [ItemSpec(id="a", seed=1, sampler="dpmpp_2m", steps=6, guidance=3.0, prompt="a red cat"),
             ItemSpec(id="b", seed=2, sampler="dpmpp_2m", steps=6, guidance=5.0, prompt="The big blue house",
                      negative_prompt="small photo"),
             ItemSpec(id="c", seed=3, sampler="dpmpp_2m", steps=6, guidance=1.5, prompt="  a dog drawn  ")]
    results = Engine(model, EngineConfig(backend="eager", max_batch=4)).generate(specs)
    for spec, r in zip(specs, results):
        ref = _reference(model, spec.prompt, spec.negative_prompt, spec.seed, spec.steps, spec.guidance)
        err = (r.latents - ref).abs().max().item()
        assert err <= 1e-4 * max(1.0, ref.abs().max().item()), (spec.id, err)
    assert results[0].image.shape == (16, 16, 3)


def test_encodings_are_cached_and_shared(model):
    model.cache.clear()
    e = Engine(model, EngineConfig(backend="eager", max_batch=4))
    e.add_many([ItemSpec(id=str(i), seed=i, sampler="ddim", steps=2, guidance=2.0, prompt="A cat") for i in range(3)])
    assert sorted(model.cache) == ["", "a cat"]  # one encoding per distinct processed text
    first = model.cache["a cat"][0]
    e.add(ItemSpec(id="x", seed=9, sampler="ddim", steps=2, guidance=2.0, prompt="a cat "))
    assert model.cache["a cat"][0] is first
