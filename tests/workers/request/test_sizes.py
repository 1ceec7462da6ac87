"""Sizes: aspect-ratio bins as the reference pipelines pick them, cards that list sizes, and an engine
that serves several latent shapes of one model at once (mixed-size traffic), each image equal to
diffusers' PixArtSigmaPipeline at that size."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from workers.config import WorkerConfig
from workers.request.cards import CardError, read_card
from workers.families import family_named
from workers.engine import Engine
from workers.decode import resize_and_crop
from workers.families.pixart.bins import pixart_bins
from workers.loading import load_model
from workers.models.tiny_pixart import MAX_TOKENS, make_tiny_pixart
from workers.request.sizes import nearest_bin, parse_size
from workers.request.spec import ItemSpec


@pytest.fixture(scope="module")
def pixart_dir(tmp_path_factory):
    return make_tiny_pixart(tmp_path_factory.mktemp("pixart-sizes"))


@pytest.fixture(scope="module")
def model(pixart_dir):
    return load_model(pixart_dir)


def test_bins_pick_what_the_reference_pipeline_picks():
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import ASPECT_RATIO_512_BIN, ASPECT_RATIO_1024_BIN
    from diffusers.video_processor import VideoProcessor

    rng = random.Random(0)
    for sample_size, table in ((64, ASPECT_RATIO_512_BIN), (128, ASPECT_RATIO_1024_BIN)):
        bins = pixart_bins(sample_size)
        assert len(bins) == len(table)
        for _ in range(500):
            w, h = rng.randint(64, 4096), rng.randint(64, 4096)
            ref_h, ref_w = VideoProcessor.classify_height_width_bin(h, w, table)
            assert nearest_bin(w, h, bins) == (ref_w, ref_h), (w, h)
    assert pixart_bins(8) == []  # the reference pipelines bin only their trained sizes


def test_parse_size():
    assert parse_size("512x768") == (512, 768)
    for bad in ("512", "ax5", "0x5", "-5x5"):
        with pytest.raises(ValueError, match="WIDTHxHEIGHT|positive"):
            parse_size(bad)


def test_cards_list_sizes_and_snap(pixart_dir):
    card = read_card(pixart_dir)
    assert card.made_sizes() == [(16, 16), (32, 16), (16, 32), (32, 32)]
    assert card.size_for(None, None) == (16, 16)
    assert card.size_for(32, None) == (32, 16)   # a missing side is the native one
    assert card.size_for(300, 150) == (32, 16)   # nearest aspect ratio
    assert card.latent_shape(32, 16) == (4, 8, 16)  # the VAE halves each side
    digits = read_card("digits")
    assert digits.made_sizes() == [(8, 8)]
    with pytest.raises(ValueError, match="makes 8x8 images only"):
        digits.size_for(64, 64)


def test_a_snapped_size_is_named_in_the_jobs_warnings(pixart_dir):
    """PixArt snaps to its sizes as its pipelines do, and the job says so; a size it makes gets no warning."""
    from dit_serve.schemas import JobRequest
    from dit_serve.server.catalog import Catalog
    from dit_serve.server.config import LimitsConfig

    card = read_card(pixart_dir)
    assert card.size_range == (0, 0) and (48, 16) not in card.made_sizes()  # only what it lists
    catalog = Catalog([card], LimitsConfig())
    params = catalog.resolve_job(JobRequest(prompts=["a cat"], width=300, height=150)).params
    assert (params.width, params.height) == (32, 16)
    assert params.warnings == [f"model {card.name!r} makes 32x16 for 300x150: its size of the nearest aspect ratio, "
                               "as its reference pipeline snaps"]
    exact = catalog.resolve_job(JobRequest(prompts=["a cat"], width=300, height=150, exact_size=True)).params
    assert exact.warnings == [params.warnings[0] + ", then resized to 300x150"]
    assert catalog.resolve_job(JobRequest(prompts=["a cat"], width=32, height=16)).params.warnings == []


def test_a_size_that_is_not_a_patch_multiple_is_a_card_error(tmp_path):
    path = make_tiny_pixart(tmp_path / "bad")
    index = json.loads((path / "model_index.json").read_text())
    index["dit_serve"]["sizes"] = ["18x16"]
    (path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(CardError, match="multiple of 4 pixels"):
        read_card(path)


def _reference(model, spec: ItemSpec) -> torch.Tensor:
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline

    family_named("pixart").set_cross_attention(model, "padded")  # the reference runs diffusers' processors
    pipe = PixArtSigmaPipeline(tokenizer=model.tokenizer, text_encoder=model.text_encoder, vae=model.vae,
                               transformer=model.transformer,
                               scheduler=DPMSolverMultistepScheduler.from_config(model.card.scheduler))
    shape = model.card.latent_shape(spec.width, spec.height)
    latents = torch.randn(shape, generator=torch.Generator("cpu").manual_seed(spec.seed))[None]
    return pipe(spec.prompt, num_inference_steps=spec.steps, guidance_scale=spec.guidance, latents=latents,
                height=spec.height, width=spec.width, max_sequence_length=MAX_TOKENS, clean_caption=False,
                use_resolution_binning=False, output_type="latent").images[0]


def test_mixed_sizes_in_one_engine_equal_the_pipeline_at_each_size(model):
    sizes = [(16, 16), (32, 16), (16, 32), (32, 16), (16, 16), (16, 32)]
    specs = [ItemSpec(id=str(i), seed=10 + i, sampler="dpmpp_2m", steps=4, guidance=2.5,
                      prompt=("a red cat", "a blue house", "the big dog")[i % 3], width=w, height=h)
             for i, (w, h) in enumerate(sizes)]
    engine = Engine(model, WorkerConfig(backend="eager", max_batch=4))
    results = engine.generate(specs)
    shapes = {k.split(":")[1] for k in engine.stats()["groups"]}
    assert shapes == {"4x8x8", "4x8x16", "4x16x8"}  # one group per latent shape (C x H x W)
    for spec, r in zip(specs, results):
        assert r.image.shape == (spec.height, spec.width, 3)
        ref = _reference(model, spec)
        err = (r.latents - ref).abs().max().item()
        assert err <= 1e-4 * max(1.0, ref.abs().max().item()), (spec.id, err)


def test_an_exact_size_is_resized_and_cropped_from_the_made_image(model):
    spec = ItemSpec(id="a", seed=3, sampler="ddim", steps=3, guidance=2.0, prompt="a cat", width=32, height=16)
    engine = Engine(model, WorkerConfig(backend="eager", max_batch=2))
    made = engine.generate([spec])[0]
    exact = engine.generate([ItemSpec(**{**spec.__dict__, "id": "b", "out_width": 30, "out_height": 14})])[0]
    assert exact.image.shape == (14, 30, 3)
    assert torch.equal(made.latents, exact.latents)  # the same image, resized afterwards
    pixels = torch.from_numpy(made.image).permute(2, 0, 1)[None].float() / 127.5 - 1
    assert resize_and_crop(pixels, 30, 14).shape == (1, 3, 14, 30)


def test_a_size_the_model_does_not_make_is_refused_at_admission(model):
    engine = Engine(model, WorkerConfig(backend="eager", max_batch=2))
    with pytest.raises(ValueError, match="does not make 48x16"):
        engine.add(ItemSpec(id="a", seed=0, sampler="ddim", steps=2, guidance=1.0, prompt="a", width=48, height=16))
    assert engine.num_active == 0


def test_generate_makes_the_size_asked_from_the_command_line(pixart_dir, tmp_path, capsys):
    from PIL import Image

    from dit_serve.cli import main

    out = tmp_path / "out"
    assert main(["generate", "--model", str(pixart_dir), "--prompt", "a red cat", "--steps", "2",
                 "--width", "40", "--height", "19", "--out", str(out)]) == 0
    assert Image.open(out / "00000.png").size == (32, 16)  # the nearest size it makes, and it says so
    snapped = f"model {pixart_dir.name!r} makes 32x16 for 40x19: its size of the nearest aspect ratio, as its " \
              "reference pipeline snaps"
    assert f"dit-serve: warning: {snapped}\n" in capsys.readouterr().err
    assert json.loads((out / "manifest.json").read_text())["params"]["warnings"] == [snapped]
    assert main(["generate", "--model", str(pixart_dir), "--prompt", "a red cat", "--steps", "2",
                 "--width", "40", "--height", "19", "--exact-size", "--out", str(out)]) == 0
    assert Image.open(out / "00000.png").size == (40, 19)
    assert main(["generate", "--model", "digits", "--labels", "3", "--width", "16", "--out", str(tmp_path / "d")]) == 2


def test_only_max_shapes_stay_captured_the_least_recently_used_idle_one_goes(model):
    engine = Engine(model, WorkerConfig(backend="eager", max_batch=2, max_shapes=2))
    spec = lambda i, w, h: ItemSpec(id=str(i), seed=i, sampler="ddim", steps=2, guidance=2.0, prompt="a cat",
                                    width=w, height=h)
    first = engine.generate([spec(0, 32, 16)])[0]
    engine.generate([spec(1, 16, 32)])  # a third shape: 32x16 (idle, least recently used) is dropped
    shapes = sorted(k.latent_shape for k in engine.groups)
    assert shapes == [(4, 8, 8), (4, 16, 8)]  # the native shape stays
    again = engine.generate([spec(0, 32, 16)])[0]  # made again on demand, same image
    assert torch.equal(first.latents, again.latents) and len(engine.groups) == 2


def test_a_batch_decoded_at_several_output_sizes_equals_each_image_decoded_alone():
    from types import SimpleNamespace

    from workers.decode import decode

    model = SimpleNamespace(vae=None)  # a pixel-space model: its latents are the image
    g = torch.Generator().manual_seed(0)
    pixels = torch.rand(5, 3, 16, 24, generator=g) * 2.4 - 1.2  # beyond [-1, 1] too: clamped
    sizes = [(0, 0), (30, 14), (0, 0), (12, 12), (30, 14)]
    together = decode(model, pixels, sizes)
    for i, size in enumerate(sizes):
        (alone,) = decode(model, pixels[i:i + 1], [size])
        assert together[i].shape == alone.shape == ((16, 24, 3) if size == (0, 0) else (size[1], size[0], 3))
        assert together[i].dtype == np.uint8 and np.array_equal(together[i], alone)
    before = pixels.clone()
    many = decode(model, pixels.repeat(4, 1, 1, 1), sizes * 4)  # 20 images: in chunks of DECODE_CONVERT
    assert all(np.array_equal(many[k], together[k % 5]) for k in range(20))
    assert torch.equal(pixels, before)  # the decode's output is read, never written
    gray = decode(model, pixels[:2, :1], None)  # one channel: (H, W) images
    assert [x.shape for x in gray] == [(16, 24), (16, 24)]
