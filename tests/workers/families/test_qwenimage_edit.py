"""Qwen-Image-Edit through our engine equals diffusers' QwenImageEditPipeline and QwenImageEditPlusPipeline: tiny
random directories in the real layouts (``make_tiny_qwenimage_edit``: processor/ folder, Qwen2.5-VL with its
vision tower), the same initial latents, float32 on the CPU, final latents within 1e-5 of the largest (``TOL``;
the errors seen are 0.6e-7 to 4.5e-7 of it: both sides run the same float32 modules, what differs is the batch, of
the text encoder and VAE at admission and of the step, and the sampler's arithmetic). Reference images of two sizes run in one engine,
with true CFG against a negative prompt and at guidance 1 (no CFG), each reference size in its own groups. The Plus
pipeline's list of references: requests of two and three images of different sizes (the Plus directories take up to
3, ``max_images``) equal QwenImageEditPlusPipeline given the same list, within the same ``TOL`` (errors seen: 1.0e-7
to 3.8e-7 of the largest); requests whose references have the same sizes share a group and run as one batch.

The pipelines resize a reference to 1024 x 1024 px of area (the Plus pipeline's encoder image to 384 x 384): the
tiny directories ask for smaller areas (``dit_serve.reference_area`` / ``vision_area``), and the reference runs
with the pipelines' own ``calculate_dimensions`` given the same areas (patched: they are constants there).
``test_reference_sizes_are_the_pipelines`` holds the real areas to the pipelines'."""

from __future__ import annotations

import json
import logging
import shutil
import sys

import pytest
import torch

from tests.workers.families import edit_cases
from workers.config import WorkerConfig
from workers.engine import Engine, step_specs
from workers.families.base import CardError
from workers.families.qwenimage import EditSetup, calculate_dimensions, reference_size, vision_size
from workers.loading import load_model
from workers.models.tiny_qwenimage import IMAGE_SIZE
from workers.models.tiny_qwenimage_edit import make_tiny_qwenimage_edit
from workers.request.cards import read_card
from workers.request.spec import ItemSpec

TOL = 1e-5  # of the largest reference latent (or of 1)


@pytest.fixture(scope="module")
def edit_dir(tmp_path_factory):
    return make_tiny_qwenimage_edit(tmp_path_factory.mktemp("qwen-edit") / "Qwen-Image-Edit", seed=3)


@pytest.fixture(scope="module")
def plus_dir(tmp_path_factory):
    """Qwen-Image-Edit-2509's layout with Qwen-Image-Edit-2511's transformer (zero_cond_t)."""
    return make_tiny_qwenimage_edit(tmp_path_factory.mktemp("qwen-edit-plus") / "Qwen-Image-Edit-2511", seed=4,
                                    plus=True, zero_cond_t=True)


@pytest.fixture(scope="module")
def edit_model(edit_dir):
    return load_model(edit_dir)


def _reference(model, spec: ItemSpec) -> torch.Tensor:
    """The model's diffusers pipeline (``reference_pipeline``: QwenImageEditPipeline or QwenImageEditPlusPipeline
    over our loaded modules) from the engine's initial latents (seeded noise, packed), the request's image decoded
    as the worker decodes it, its negative prompt (" " for an empty one) at its guidance as true_cfg_scale, the
    directory's areas; the final latents unpacked to (16, h, w)."""
    from workers.families import family_of

    family = family_of(model)
    pipe = family.reference_pipeline(model)
    module = sys.modules[type(pipe).__module__]
    width, height = spec.width or IMAGE_SIZE, spec.height or IMAGE_SIZE
    c, h, w = model.card.latent_shape(width, height)
    x = torch.randn((c, h, w), generator=torch.Generator("cpu").manual_seed(spec.seed))  # as the engine's start
    setup, mp = model.edit, pytest.MonkeyPatch()
    if setup.plus:  # the Plus pipeline's areas are module constants
        mp.setattr(module, "VAE_IMAGE_SIZE", setup.reference_area)
        mp.setattr(module, "CONDITION_IMAGE_SIZE", setup.vision_area)
    else:  # QwenImageEditPipeline calls calculate_dimensions(1024 * 1024, ratio)
        theirs = module.calculate_dimensions
        mp.setattr(module, "calculate_dimensions", lambda area, ratio: theirs(setup.reference_area, ratio))
    try:
        out = pipe(**family.reference_call(model, [spec]), latents=pipe._pack_latents(x[None], 1, c, h, w),
                   output_type="latent", generator=edit_cases.generator(spec)).images
    finally:
        mp.undo()
    return pipe._unpack_latents(out, height, width, pipe.vae_scale_factor)[0, :, 0]


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, (what, tuple(ours.shape), tuple(ref.shape))
    err = (ours - ref).abs().max().item()
    assert err <= TOL * max(1.0, ref.abs().max().item()), (what, err)


@pytest.fixture(scope="module")
def plus_2509_dir(tmp_path_factory):
    """Qwen-Image-Edit-2509's layout and transformer (no zero_cond_t)."""
    return make_tiny_qwenimage_edit(tmp_path_factory.mktemp("qwen-edit-2509") / "Qwen-Image-Edit-2509", seed=5,
                                    plus=True)


def _specs() -> list[ItemSpec]:
    return [ItemSpec(id="a", seed=1, sampler="flow_euler", steps=3, guidance=4.0, prompt="make it red",
                     negative_prompt="blurry", image=edit_cases.image_bytes(70, 50, seed=1)),  # 128x96: 6 x 8 tokens
            ItemSpec(id="b", seed=2, sampler="flow_euler", steps=3, guidance=1.0, prompt="a blue sky",
                     image=edit_cases.image_bytes(40, 60, seed=2), width=96, height=64),  # 64x128: 8 x 4, no CFG
            ItemSpec(id="c", seed=3, sampler="flow_euler", steps=2, guidance=2.5, prompt="the big green tree",
                     image=edit_cases.image_bytes(72, 50, seed=3))]  # a's size, an empty negative prompt: " "


def test_the_card_is_an_instruction_edit_that_needs_an_image(edit_dir, plus_dir):
    for path in (edit_dir, plus_dir):
        card = read_card(path)
        assert (card.family, card.edit, card.takes_image, card.takes_mask, card.needs_image) == \
            ("qwenimage", "reference", True, False, True)
        assert card.guidance_mode == "cfg" and card.warnings == ()
    assert read_card(edit_dir).sizes == ((64, 64), (96, 64), (64, 96))  # the directory's


def test_reference_sizes_are_the_pipelines():
    """calculate_dimensions at the pipelines' areas; QwenImageEditPipeline's encoder reads the reference itself,
    the Plus pipeline's a 384 x 384-area copy; the listed sizes of a published directory are the pipeline's
    default outputs for the model card's aspect ratios."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit_pipe
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus_pipe

    from workers.families.qwenimage import EDIT_RATIOS, REFERENCE_AREA, VISION_AREA

    assert (REFERENCE_AREA, VISION_AREA) == (plus_pipe.VAE_IMAGE_SIZE, plus_pipe.CONDITION_IMAGE_SIZE)
    edit, plus = EditSetup("QwenImageEditPipeline"), EditSetup("QwenImageEditPlusPipeline", vision_area=VISION_AREA)
    for w, h in ((1920, 1080), (1024, 1024), (512, 512), (600, 800), (100, 1000), (70, 50), (3000, 2000)):
        want = edit_pipe.calculate_dimensions(1024 * 1024, w / h)[:2]
        assert reference_size(edit, w, h) == reference_size(plus, w, h) == want == calculate_dimensions(2 ** 20, w / h)
        assert vision_size(edit, w, h) == want
        assert vision_size(plus, w, h) == plus_pipe.calculate_dimensions(384 * 384, w / h)
    assert [calculate_dimensions(2 ** 20, w / h) for w, h in EDIT_RATIOS] == \
        [edit_pipe.calculate_dimensions(2 ** 20, w / h)[:2] for w, h in EDIT_RATIOS]
    assert reference_size(plus, 3000, 5)[1] == 32  # 600:1 at 1024 x 1024 px: one row of 32 px
    with pytest.raises(ValueError, match="image: a 3000x5 reference is too narrow"):  # at 384 x 384 px: none
        vision_size(plus, 3000, 5)


def test_layout_errors_name_the_part(edit_dir, tmp_path):
    def broken(name: str, change) -> str:
        path = tmp_path / name
        shutil.copytree(edit_dir, path)
        change(path)
        return str(path)

    def index(path, **extra):
        data = json.loads((path / "model_index.json").read_text())
        data["dit_serve"].update(extra)
        (path / "model_index.json").write_text(json.dumps(data))

    def processor_type(path):
        cfg = json.loads((path / "processor" / "preprocessor_config.json").read_text())
        (path / "processor" / "preprocessor_config.json").write_text(json.dumps({**cfg, "image_processor_type": "X"}))

    def text_to_image(path):
        data = json.loads((path / "model_index.json").read_text())
        (path / "model_index.json").write_text(json.dumps({**data, "_class_name": "QwenImagePipeline"}))
        cfg = json.loads((path / "transformer" / "config.json").read_text())
        (path / "transformer" / "config.json").write_text(json.dumps({**cfg, "zero_cond_t": True}))

    cases = {"no-processor": (lambda p: shutil.rmtree(p / "processor"), "without processor/preprocessor_config.json"),
             "no-tokenizer": (lambda p: (p / "processor" / "tokenizer_config.json").unlink(),
                              "without processor/tokenizer_config.json"),
             "processor": (processor_type, "image_processor_type 'X'"),
             "area": (lambda p: index(p, reference_area=100), "dit_serve.reference_area must be"),
             "t2i-zero-cond": (text_to_image, "sets zero_cond_t: .* which QwenImagePipeline does not run")}
    for name, (change, message) in cases.items():
        with pytest.raises(CardError, match=message):
            read_card(broken(name, change))
    text = broken("t2i", lambda p: (p / "model_index.json").write_text(json.dumps({
        **json.loads((p / "model_index.json").read_text()), "_class_name": "QwenImagePipeline"})))
    assert (read_card(text).edit, read_card(text).needs_image) == ("image-to-image", False)  # Qwen-Image's card


def test_references_of_two_sizes_with_and_without_cfg_in_one_engine_equal_the_pipeline(edit_model):
    """Two reference sizes (a and c share one) at two generation sizes, true CFG against a negative prompt (a, c)
    and guidance 1 (b, no CFG), c admitted after a and b: each request's final latents equal
    QwenImageEditPipeline's run alone."""
    engine = Engine(edit_model, WorkerConfig(backend="eager", max_batch=4))
    specs = _specs()
    results = engine.generate(specs, max_active=2)
    for spec, r in zip(specs, results):
        _assert_close(r.latents, _reference(edit_model, spec), spec.id)
    groups = [g.split(":") for g in engine.stats()["groups"] if g.count(":") == 4]
    used = sorted((g[1], g[4]) for g in groups)  # (latent shape, variant) of the groups that ran
    assert ("16x8x8", "edit-6x8-vl15") in used and ("16x8x12", "edit-8x4-vl10-no-cfg") in used
    inputs = step_specs(edit_model, (16, 8, 8), "edit-6x8-vl15")[0]
    length = 15 + edit_model.template_tokens[1] + edit_model.card.max_tokens  # vision, template, prompt tokens
    assert inputs["reference"].shape_per_sample == (48, 64) and inputs["prompt_embeds"].shape_per_sample[0] == length
    assert "neg_embeds" not in step_specs(edit_model, (16, 8, 12), "edit-8x4-vl10-no-cfg")[0]


def test_the_plus_pipeline_with_a_zero_cond_t_transformer_equals_its_pipeline(plus_dir):
    """QwenImageEditPlusPipeline (one reference; "Picture 1: " in its template, the encoder's image at its own
    area) with Qwen-Image-Edit-2511's zero_cond_t transformer (the reference's tokens modulated at t = 0)."""
    model = load_model(plus_dir)
    assert model.transformer.zero_cond_t and model.edit.plus
    specs = _specs()[:2]
    for spec, r in zip(specs, Engine(model, WorkerConfig(backend="eager", max_batch=4)).generate(specs)):
        _assert_close(r.latents, _reference(model, spec), spec.id)


def _plus_specs() -> list[ItemSpec]:
    """Several references: p and q two of the same sizes (one layout: 128x96 then 64x128 px, 6 x 8 then 8 x 4
    tokens), p with true CFG against a negative prompt, q against " "; r three in another order (another layout) at
    another generation size without CFG."""
    two = dict(sampler="flow_euler", steps=3, prompt="1 sits in 2")
    return [ItemSpec(id="p", seed=1, guidance=4.0, negative_prompt="blurry",
                     image=edit_cases.image_bytes(70, 50, seed=1),
                     extra_images=(edit_cases.image_bytes(40, 60, seed=2),), **two),
            ItemSpec(id="q", seed=2, guidance=2.5, image=edit_cases.image_bytes(70, 50, seed=5),
                     extra_images=(edit_cases.image_bytes(40, 60, seed=6),), **two),
            ItemSpec(id="r", seed=3, sampler="flow_euler", steps=2, guidance=1.0, prompt="all on a beach",
                     image=edit_cases.image_bytes(40, 60, seed=7), width=96, height=64,
                     extra_images=(edit_cases.image_bytes(50, 50, seed=8), edit_cases.image_bytes(70, 50, seed=9)))]


@pytest.mark.parametrize("which", ["2509", "2511"])
def test_several_references_of_different_sizes_equal_the_plus_pipeline(plus_2509_dir, plus_dir, which):
    """Two and three reference images through our engine (their latent tokens joined in order, img_shapes listing
    each, "Picture 1: ... Picture 2: ..." in the template) equal QwenImageEditPlusPipeline given the same images, the
    same initial latents and true CFG against a negative prompt; with Qwen-Image-Edit-2511's zero_cond_t
    transformer too (every reference's tokens modulated at t = 0). p and q (the same reference sizes) run as one
    batch of two in one group; r's layout is a group of its own."""
    model = load_model(plus_2509_dir if which == "2509" else plus_dir)
    assert model.card.max_images == 3 and model.template_tokens[2] > model.template_tokens[1]
    engine = Engine(model, WorkerConfig(backend="eager", max_batch=4))
    specs = _plus_specs()
    for spec, r in zip(specs, engine.generate(specs)):
        _assert_close(r.latents, _reference(model, spec), spec.id)
    runs = {tuple(k.split(":")[i] for i in (1, 4)): {b: s["eager_fallbacks"] for b, s in g["buckets"].items()}
            for k, g in engine.stats()["groups"].items()}  # (latent shape, variant) -> runs per bucket (eager)
    ran = {k: {b: n for b, n in r.items() if n} for k, r in runs.items() if any(r.values())}
    assert ran == {("16x8x8", "edit-6x8+8x4-vl8"): {2: 3},  # p and q: one batch of two for their 3 steps
                   ("16x8x12", "edit-8x4+6x6+6x8-vl12-no-cfg"): {1: 2}}  # r alone, 2 steps
    inputs = step_specs(model, (16, 8, 8), "edit-6x8+8x4-vl8")[0]
    assert inputs["reference"].shape_per_sample == (48 + 32, 64)
    assert inputs["prompt_embeds"].shape_per_sample[0] == 8 + model.template_tokens[2] + model.card.max_tokens


def test_more_images_than_the_card_takes_are_refused(edit_model, plus_dir):
    """QwenImageEditPipeline reads one reference; the Plus directories take up to 3."""
    image = edit_cases.image_bytes(50, 50, seed=5)
    base = dict(seed=1, sampler="flow_euler", steps=2, guidance=4.0, prompt="x", image=image)
    with pytest.raises(ValueError, match="image: model .* takes at most 1 input image, got 2"):
        Engine(edit_model, WorkerConfig(backend="eager", max_batch=2)).add(
            ItemSpec(id="two", extra_images=(image,), **base))
    plus = Engine(load_model(plus_dir), WorkerConfig(backend="eager", max_batch=2))
    with pytest.raises(ValueError, match="image: model .* takes at most 3 input images, got 4"):
        plus.add(ItemSpec(id="four", extra_images=(image,) * 3, **base))
    with pytest.raises(ValueError, match="need a first one"):
        plus.add(ItemSpec(id="none", **{**base, "image": b""}, extra_images=(image,)))
    assert plus.num_active == 0


def test_the_max_images_of_a_directory(plus_dir, edit_dir, tmp_path):
    """``dit_serve.max_images`` sets a Plus directory's; QwenImageEditPipeline's is 1."""
    def copy(src, name, most):
        path = tmp_path / name
        shutil.copytree(src, path)
        data = json.loads((path / "model_index.json").read_text())
        data["dit_serve"]["max_images"] = most
        (path / "model_index.json").write_text(json.dumps(data))
        return path

    assert (read_card(plus_dir).max_images, read_card(edit_dir).max_images) == (3, 1)
    assert read_card(copy(plus_dir, "two", 2)).max_images == 2
    for src, name, most, message in ((plus_dir, "zero", 0, "must be 1 to 8"), (plus_dir, "many", 9, "must be 1 to 8"),
                                     (edit_dir, "edit", 2, "must be 1 .QwenImageEditPipeline reads one")):
        with pytest.raises(CardError, match=f"dit_serve.max_images {message}"):
            read_card(copy(src, name, most))


def test_warm_up_captures_a_square_reference_and_a_request_without_an_image_is_refused(edit_model, caplog):
    engine = Engine(edit_model, WorkerConfig(backend="eager", max_batch=2))
    with caplog.at_level(logging.WARNING, logger="workers.engine"):
        engine.warmup()
    assert "warm-up runs on zeros" not in caplog.text
    assert {g.variant for g in engine.groups.values()} == {"edit-6x6-vl9", "edit-6x6-vl9-no-cfg"}  # 96x96: 6 x 6
    example = engine.warmup_example(edit_model, (16, 8, 8), "edit-6x6-vl9")  # seeded noise in the variant's shapes
    assert example["reference"].shape == (1, 36, 64) and example["neg_mask"].shape[1] == example["neg_embeds"].shape[1]
    square = ItemSpec(id="s", seed=5, sampler="flow_euler", steps=2, guidance=4.0, prompt="a cat",
                      image=edit_cases.image_bytes(50, 50, seed=5))
    warmed = set(engine.groups)
    engine.generate([square])
    assert set(engine.groups) == warmed  # its group was made and warmed at start-up
    base = dict(seed=1, sampler="flow_euler", steps=2, guidance=4.0, prompt="x")
    with pytest.raises(ValueError, match="image: model .* edits an input image"):
        engine.add(ItemSpec(id="t", **base))
    with pytest.raises(ValueError, match="mask: model .* takes no mask"):
        engine.add(ItemSpec(id="m", image=square.image, mask=edit_cases.mask_bytes(50, 50), **base))
    assert engine.num_active == 0


def test_a_processor_that_cannot_read_the_reference_is_a_model_error(edit_dir, tmp_path):
    """Loading (the card's checks passed): tokenizer files that make no tokenizer, and a tokenizer without Qwen2.5-VL's
    image placeholder (Qwen-Image's, which has no vision tokens)."""
    from workers.loading import ModelError
    from workers.models.tiny_qwenimage import tokenizer_files

    no_vocab, text_only = tmp_path / "no-vocab", tmp_path / "text-only"
    shutil.copytree(edit_dir, no_vocab)
    (no_vocab / "processor" / "vocab.json").unlink()
    shutil.copytree(edit_dir, text_only)
    tokenizer_files(text_only / "processor")
    with pytest.raises(ModelError, match="processor: not Qwen2.5-VL's processor"):
        load_model(no_vocab)
    with pytest.raises(ModelError, match=r"processor: its tokenizer has no <\|image_pad\|> token"):
        load_model(text_only)
