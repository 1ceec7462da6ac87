"""Qwen-Image, torch-free: the model card of a pipeline directory (``Qwen/Qwen-Image``; diffusers'
``QwenImagePipeline``), read from its JSON files, and the built-in architecture (``qwen-image-1024``: random
weights, ``builtin``). The model runs in ``runtime``.

The layout: ``transformer/`` (QwenImageTransformer2DModel, sharded safetensors), ``vae/``
(AutoencoderKLQwenImage: a 16-channel video VAE with per-channel ``latents_mean`` / ``latents_std``),
``text_encoder/`` (Qwen2_5_VLForConditionalGeneration, sharded: its last hidden state) with ``tokenizer/``
(Qwen2Tokenizer: vocab.json + merges.txt), and ``scheduler/`` (FlowMatchEulerDiscreteScheduler). A missing
part is a CardError naming it, and so is a text encoder of another type.

Guidance. Qwen-Image is not guidance-distilled: ``guidance`` is QwenImagePipeline's ``true_cfg_scale``,
classifier-free guidance against the negative prompt with the pipeline's norm rescale (``guidance_mode``
"cfg"; default 4.0, the pipeline's). The pipeline guides only when the scale is above 1 and a negative
prompt is given; a request always has one here: its ``negative_prompt``, and where that is empty " ", what
the published model card passes ("using an empty string if you do not have specific concept to remove").
A scale of 1 or below is the pipeline without guidance: the prompt's prediction alone.

Schedule. QwenImagePipeline passes its own sigmas, np.linspace(1, 1/steps, steps), shifted by ``mu`` from
the packed sequence length (the scheduler's exponential dynamic shift, then its ``shift_terminal``, 0.02 in
the published config): ``flow_grid: "flux"`` in the card's scheduler config, as FLUX.1's.

Sizes. The latents are 16 x H/8 x W/8, packed 2x2 into (H/16)(W/16) tokens of 64, so each side is a
multiple of 16 px; a side off it is rounded down, as the pipeline does (it warns and makes
2 * (side // 16) latent rows). The native size is the pipeline's default, 1024 x 1024
(``default_sample_size`` 128 times the VAE's 8; ``dit_serve.image_size`` overrides). The sizes it lists
are the ones the published model card recommends, 1:1, 16:9, 9:16, 4:3, 3:4, 3:2 and 2:3 at about 1.7
MP (its 1472 x 1140 and 1140 x 1472 as the pipeline makes them: 1472 x 1136 and 1136 x 1472); each size is
one captured graph shape, so the card lists these few (``dit_serve.sizes`` replaces them). Like the
pipeline it makes any other multiple of 16 as asked, from 16 px to twice the native side.

Text. Prompts are read as given, in the pipeline's chat template, up to ``max_tokens`` (512, the
pipeline's ``max_sequence_length``; ``dit_serve.max_sequence_length`` sets 1 to 1024, the pipeline's
limit) after the template's first 34 tokens.

Qwen-Image-Edit (``QwenImageEditPipeline``, ``Qwen/Qwen-Image-Edit``, one reference image;
``QwenImageEditPlusPipeline``, ``Qwen/Qwen-Image-Edit-2509`` and ``-2511``, one to ``max_images`` reference images:
``MAX_IMAGES``, 3, the published model cards' "1 to 3 input images", or the directory's ``dit_serve.max_images``).
Qwen-Image's layout and a ``processor/`` folder (Qwen2.5-VL's image processor, ``preprocessor_config.json``, beside
its tokenizer's files). Its card's ``edit`` is "reference": a request's image is the reference the prompt edits,
read twice (by the Qwen2.5-VL encoder in the edit template, and as VAE latent tokens joined to the sequence:
``edit``), with no strength and no mask; a request without one is refused (``needs_image``: the pipelines need one).
The reference is resized as the pipelines do (``reference_size``: the area ``reference_area``, 1024 x 1024, at the
image's aspect ratio, sides rounded to 32 px), and so is the Plus pipeline's image for the encoder (``vision_area``,
384 x 384), each of a Plus request's images at its own ratio; the directory's ``dit_serve.reference_area`` /
``vision_area`` set smaller ones (test models). The sizes it lists are those the pipeline makes by default for
images of the model card's aspect ratios (its output is the reference's size; of a Plus request with several images,
the last one's, as the Plus pipeline sizes its output); ``max_tokens`` counts the prompt's tokens (the pipelines cut
none: a longer prompt is cut there). The transformer of ``-2511`` (``zero_cond_t``: the reference's tokens modulated
at timestep 0) is read; the other pipelines' flags are not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from workers.families.base import Builtin, CardError, Family, ModelCard, listed_sizes, read_json
from workers.families.previews import PreviewMap

NATIVE_SIZE = 1024  # QwenImagePipeline: default_sample_size 128 x vae_scale_factor 8
MAX_TOKENS = 512  # QwenImagePipeline.__call__'s max_sequence_length
MAX_SEQUENCE_LENGTH = 1024  # QwenImagePipeline.check_inputs refuses more
DEFAULTS = {"sampler": "flow_euler", "steps": 50, "guidance": 4.0}  # QwenImagePipeline.__call__'s
# the published model card's aspect ratios (width, height), rounded down to multiples of 16 as the pipeline makes them
MODEL_CARD_SIZES = ((1328, 1328), (1664, 928), (928, 1664), (1472, 1136), (1136, 1472), (1584, 1056), (1056, 1584))
# part -> (the file that must be there, what it holds: the message's words)
PARTS = {"vae": ("vae/config.json", "the VAE (AutoencoderKLQwenImage)"),
         "text_encoder": ("text_encoder/config.json",
                          "the Qwen2.5-VL text encoder (Qwen2_5_VLForConditionalGeneration)"),
         "tokenizer": ("tokenizer", "the Qwen2 tokenizer"),
         "scheduler": ("scheduler/scheduler_config.json", "the scheduler's config")}
ENCODER_TYPE = "qwen2_5_vl"  # text_encoder/config.json's model_type
VAE_CLASS = "AutoencoderKLQwenImage"
# transformer flags of other Qwen-Image pipelines (edit, layered), which QwenImagePipeline does not run
OTHER_VARIANTS = ("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope", "guidance_embeds")
# instruction-edit pipelines with Qwen-Image's layout and a processor/ folder: what they are
EDIT_PIPELINES = {"QwenImageEditPipeline": "Qwen-Image-Edit", "QwenImageEditPlusPipeline": "Qwen-Image-Edit-Plus"}
EDIT_VARIANTS = ("zero_cond_t",)  # the flags the edit transformers may set (Qwen-Image-Edit-2511's)
REFERENCE_AREA = 1024 * 1024  # the edit pipelines' calculate_dimensions target (the Plus pipeline's VAE_IMAGE_SIZE)
VISION_AREA = 384 * 384  # QwenImageEditPlusPipeline's CONDITION_IMAGE_SIZE: its images as the text encoder sees them
MAX_IMAGES = 3  # a Plus request's reference images: Qwen-Image-Edit-2509's model card, "1 to 3 input images"
MAX_IMAGES_LIMIT = 8  # dit_serve.max_images: each image is its own tokens in the step and in the encoder's text
EDIT_RATIOS = ((1, 1), (16, 9), (9, 16), (4, 3), (3, 4), (3, 2), (2, 3))  # the model card's, width : height
IMAGE_PROCESSORS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
# Qwen/Qwen-Image: transformer + VAE; Qwen2.5-VL-7B-Instruct, vision tower and LM head included (counted on
# the meta device: workers.families.qwenimage.builtin)
PARAMS, ENCODER_PARAMS = 20_430_401_088 + 126_892_531, 8_292_166_656
# Qwen/Qwen-Image's scheduler_config.json, on the pipeline's sigma grid: the built-in's
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
             "invert_sigmas": False, "max_image_seq_len": 8192, "max_shift": 0.9, "num_train_timesteps": 1000,
             "shift": 1.0, "shift_terminal": 0.02, "stochastic_sampling": False, "time_shift_type": "exponential",
             "use_beta_sigmas": False, "use_dynamic_shifting": True, "use_exponential_sigmas": False,
             "use_karras_sigmas": False, "flow_grid": "flux"}

# ComfyUI latent_formats.Wan21 (QwenImage's latent format is Wan 2.1's): the 16-channel VAE (workers.families.previews)
WAN21_VAE = PreviewMap(weight=((-0.1299, -0.1692, 0.2932), (0.0671, 0.0406, 0.0442), (0.3568, 0.2548, 0.1747),
                               (0.0372, 0.2344, 0.1420), (0.0313, 0.0189, -0.0328), (0.0296, -0.0956, -0.0665),
                               (-0.3477, -0.4059, -0.2925), (0.0166, 0.1902, 0.1975), (-0.0412, 0.0267, -0.1364),
                               (-0.1293, 0.0740, 0.1636), (0.0680, 0.3019, 0.1128), (0.0032, 0.0581, 0.0639),
                               (-0.1251, 0.0927, 0.1699), (0.0060, -0.0633, 0.0005), (0.3477, 0.2275, 0.2950),
                               (0.1984, 0.0913, 0.1861)),
                       bias=(-0.1835, -0.0868, -0.3360))


@dataclass(frozen=True)
class EditSetup:
    """How an edit directory reads its references (``edit_setup``): the pipeline, the area a reference is resized
    to, the area of the Plus pipeline's image for the text encoder (0: the reference itself, as
    QwenImageEditPipeline gives the encoder), and the most reference images a request may send (the Plus
    pipeline's list; QwenImageEditPipeline's one)."""

    pipeline: str
    reference_area: int = REFERENCE_AREA
    vision_area: int = 0
    max_images: int = 1

    @property
    def plus(self) -> bool:
        return self.pipeline == "QwenImageEditPlusPipeline"


def calculate_dimensions(area: int, ratio: float) -> tuple[int, int]:
    """(width, height) of about ``area`` pixels at ``ratio`` = width / height, each side rounded to a multiple of 32:
    the edit pipelines' ``calculate_dimensions``."""
    width = math.sqrt(area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


def reference_size(setup: EditSetup, width: int, height: int) -> tuple[int, int]:
    """The (width, height) the edit pipelines resize a width x height reference to (its VAE latents' size).
    ValueError where a side rounds to nothing (an aspect ratio the pipelines cannot make)."""
    return _area_size(setup.reference_area, width, height)


def vision_size(setup: EditSetup, width: int, height: int) -> tuple[int, int]:
    """The (width, height) of the image the text encoder's processor is given for a width x height reference: the
    reference's own size (QwenImageEditPipeline), or ``vision_area`` at its ratio (the Plus pipeline)."""
    return _area_size(setup.vision_area or setup.reference_area, width, height)


def _area_size(area: int, width: int, height: int) -> tuple[int, int]:
    w, h = calculate_dimensions(area, width / height)
    if not (w and h):
        raise ValueError(f"image: a {width}x{height} reference is too narrow: at about {area} px its shorter side "
                         "rounds to nothing (the edit pipelines round sides to 32 px)")
    return w, h


def edit_setup(path: Path, index: dict) -> EditSetup | None:
    """The edit setup of a directory's model_index.json; None for QwenImagePipeline's. CardError for an area
    that is not a positive whole number of pixels."""
    pipeline = index.get("_class_name", "")
    if pipeline not in EDIT_PIPELINES:
        return None
    extra = index.get("dit_serve", {})
    areas = {}
    for key, default in (("reference_area", REFERENCE_AREA), ("vision_area", VISION_AREA)):
        value = extra.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 32 * 32:
            raise CardError(f"{path}/model_index.json: dit_serve.{key} must be a number of pixels, at least "
                            f"{32 * 32}, got {value!r}")
        areas[key] = value
    plus = pipeline == "QwenImageEditPlusPipeline"
    most = extra.get("max_images", MAX_IMAGES if plus else 1)
    if not isinstance(most, int) or isinstance(most, bool) or not 1 <= most <= (MAX_IMAGES_LIMIT if plus else 1):
        allowed = f"1 to {MAX_IMAGES_LIMIT}" if plus else f"1 ({pipeline} reads one reference image)"
        raise CardError(f"{path}/model_index.json: dit_serve.max_images must be {allowed}, got {most!r}")
    return EditSetup(pipeline, areas["reference_area"], areas["vision_area"] if plus else 0, most)


class QwenImage(Family):
    name = "qwenimage"
    pipelines = ("QwenImagePipeline", *EDIT_PIPELINES)
    transformers = ("QwenImageTransformer2DModel",)
    builtins = {"qwen-image-1024": Builtin(1024, PARAMS, ENCODER_PARAMS)}
    previews = {16: WAN21_VAE}
    runtime = "workers.families.qwenimage.runtime:QwenImageRuntime"
    # image-to-image and inpainting (workers.edits), as QwenImageImg2ImgPipeline and
    # QwenImageInpaintPipeline
    takes_image = True
    takes_mask = True
    rate_reference = "flux-dev-1024"  # none of its own measured: FLUX.1-dev's, an MMDiT at 1024 too

    def read_card(self, name: str, path: Path, transformer: dict, vae: dict | None, index: dict,
                  scheduler: dict) -> ModelCard:
        return card(name, path, transformer, vae, index, scheduler)

    def builtin_card(self, name: str) -> ModelCard:
        size = self.builtins[name].image_size
        return ModelCard(name, "qwenimage", "text", builtin=name, image_size=size, latent_channels=16,
                         latent_size=size // 8, scheduler=dict(SCHEDULER), defaults=dict(DEFAULTS),
                         max_tokens=MAX_TOKENS, sizes=MODEL_CARD_SIZES, size_multiple=16, size_range=(16, 2 * size),
                         rounds_down=True, guidance_mode="cfg")


def card(name: str, path: Path, transformer: dict, vae: dict | None, index: dict, scheduler: dict) -> ModelCard:
    setup = edit_setup(path, index)
    _check_layout(path, transformer, vae, setup)
    extra = index.get("dit_serve", {})
    factor = 2 ** len(vae.get("temperal_downsample", [False, True, True]))  # the pipeline's vae_scale_factor
    multiple = factor * 2  # the pipeline packs 2x2 latent cells into one token
    size = int(extra.get("image_size", NATIVE_SIZE))
    if size % multiple:
        raise CardError(f"{path}/model_index.json: dit_serve.image_size {size} is not a multiple of {multiple} pixels")
    max_tokens = int(extra.get("max_sequence_length", MAX_TOKENS))
    if not 0 < max_tokens <= MAX_SEQUENCE_LENGTH:
        raise CardError(f"{path}/model_index.json: dit_serve.max_sequence_length must be 1 to "
                        f"{MAX_SEQUENCE_LENGTH} (QwenImagePipeline's limit), got {max_tokens}")
    tokenizer_json = path / "tokenizer" / "tokenizer.json"
    sizes = MODEL_CARD_SIZES if setup is None else \
        tuple(calculate_dimensions(setup.reference_area, w / h) for w, h in EDIT_RATIOS)
    return ModelCard(
        name, "qwenimage", "text", path=str(path), image_size=size, latent_channels=int(vae.get("z_dim", 16)),
        latent_size=size // factor, dtype=extra.get("dtype", "bfloat16"), scheduler={**scheduler, "flow_grid": "flux"},
        defaults={**DEFAULTS, **extra.get("defaults", {})}, max_tokens=max_tokens,
        sizes=tuple(listed_sizes(path, extra, multiple) or sizes), size_multiple=multiple,
        size_range=(multiple, 2 * size), rounds_down=True, guidance_mode="cfg",
        edit="" if setup is None else "reference", needs_image=setup is not None,
        max_images=1 if setup is None else setup.max_images,
        tokenizer_file=str(tokenizer_json) if tokenizer_json.is_file() else "")


def _check_layout(path: Path, transformer: dict, vae: dict | None, setup: EditSetup | None) -> None:
    for part, (file, what) in PARTS.items():
        if not (path / file).exists():
            raise CardError(f"{path} is a Qwen-Image pipeline without {part}/ ({what}): expected {path / file}")
    if setup is not None:
        _check_processor(path, setup)
    encoder = read_json(path / "text_encoder" / "config.json")
    if encoder.get("model_type") != ENCODER_TYPE:
        raise CardError(f"{path}/text_encoder/config.json has model_type {encoder.get('model_type')!r}; a Qwen-Image "
                        f"pipeline's text_encoder is {PARTS['text_encoder'][1]} ({ENCODER_TYPE!r})")
    if vae.get("_class_name") != VAE_CLASS:
        raise CardError(f"{path}/vae/config.json has _class_name {vae.get('_class_name')!r}; a Qwen-Image pipeline's "
                        f"vae is {VAE_CLASS}")
    z = int(vae.get("z_dim", 16))
    if any(len(vae.get(k, [0] * z)) != z for k in ("latents_mean", "latents_std")):
        raise CardError(f"{path}/vae/config.json: latents_mean and latents_std need one value per latent channel ({z})")
    if transformer.get("patch_size", 2) != 2 or transformer.get("in_channels", 64) != 4 * z or \
            transformer.get("out_channels", 16) != z:
        raise CardError(f"{path}/transformer/config.json: expected patch_size 2, in_channels {4 * z} and out_channels "
                        f"{z} (the VAE's {z} channels packed 2x2), got {transformer.get('patch_size')}, "
                        f"{transformer.get('in_channels')} and {transformer.get('out_channels')}")
    variants = [k for k in OTHER_VARIANTS if transformer.get(k) and not (setup and k in EDIT_VARIANTS)]
    if variants:
        runs = setup.pipeline if setup else "QwenImagePipeline"
        raise CardError(f"{path}/transformer/config.json sets {', '.join(variants)}: a transformer of another "
                        f"Qwen-Image pipeline (edit, layered), which {runs} does not run")
    width = encoder.get("text_config", {}).get("hidden_size", encoder.get("hidden_size"))
    if width is not None and transformer.get("joint_attention_dim", 3584) != width:
        raise CardError(f"{path}: the text encoder's hidden size {width} is not the transformer's joint_attention_dim "
                        f"{transformer.get('joint_attention_dim', 3584)}")


def _check_processor(path: Path, setup: EditSetup) -> None:
    """An edit directory's processor/: Qwen2.5-VL's image processor config and its tokenizer's."""
    folder = path / "processor"
    for file in ("preprocessor_config.json", "tokenizer_config.json"):
        if not (folder / file).is_file():
            raise CardError(f"{path} is a {EDIT_PIPELINES[setup.pipeline]} pipeline ({setup.pipeline}) without "
                            f"processor/{file} (the Qwen2.5-VL processor that reads its reference image): expected "
                            f"{folder / file}")
    kind = read_json(folder / "preprocessor_config.json").get("image_processor_type")
    if kind not in IMAGE_PROCESSORS:
        raise CardError(f"{folder}/preprocessor_config.json has image_processor_type {kind!r}; a "
                        f"{EDIT_PIPELINES[setup.pipeline]} pipeline's processor is Qwen2.5-VL's (Qwen2VLImageProcessor)")
