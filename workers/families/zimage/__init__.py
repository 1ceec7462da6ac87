"""Z-Image, torch-free: the model card of a pipeline directory (``Tongyi-MAI/Z-Image-Turbo``; diffusers'
``ZImagePipeline``), read from its JSON files, and the built-in architecture (``z-image-turbo-1024``: random
weights, ``builtin``). The model runs in ``runtime``.

The layout: ``transformer/`` (ZImageTransformer2DModel, sharded safetensors), ``vae/`` (FLUX.1's 16-channel
AutoencoderKL, with its scaling and shift factors), ``text_encoder/`` (Qwen3Model, Qwen3-4B: its
second-to-last hidden states, sharded) with ``tokenizer/`` (Qwen2Tokenizer and its chat template), and
``scheduler/`` (FlowMatchEulerDiscreteScheduler). A missing part is a CardError naming it; a text encoder
of another type, or one whose width is not the transformer's ``cap_feat_dim``, is one too.

Guidance. ZImagePipeline runs classifier-free guidance against the negative prompt ("" by default) when the
scale is above 0 (not 1: its rule is ``guidance_scale > 0``), as ``pos + scale (pos - neg)``, so a scale of 0
is the prompt alone; ``guidance_mode`` is "cfg". Its two options, ``cfg_normalization`` (a factor: the
guided prediction's norm is capped at that many times the prompt's) and ``cfg_truncation`` (no guidance at
steps whose normalised time (1000 - t) / 1000 is above it), are the model's, not a request's: a directory
sets them in model_index.json (``dit_serve.cfg_normalization``, ``dit_serve.cfg_truncation``; off by default,
as the pipeline: 0 and 1.0), read by ``guidance_options``.

Defaults. Z-Image-Turbo is distilled to 8 function evaluations and used without guidance: the published
usage is ``num_inference_steps=9`` with ``guidance_scale=0.0``, which made 8 transformer forwards in the
pipeline it was written for (its last sigma was 0); ZImagePipeline in diffusers 0.42 makes one forward a
step on the grid linspace(1, 1/steps, steps), so 8 steps are the same 8 sigmas (its docstring's example
runs 8). The card's defaults are those (``TURBO_DEFAULTS``), not ``__call__``'s 50 steps at 5.0, which are
for an undistilled checkpoint: nothing in a directory tells a distilled checkpoint from an undistilled one
(the same classes and configs), and a card is never decided by a directory's name, so every ZImagePipeline
directory gets Turbo's, and ``dit_serve.defaults`` in model_index.json replaces them (an undistilled
checkpoint: ``{"steps": 50, "guidance": 4.0}``).

Schedule. ZImagePipeline passes its own sigmas, torch.linspace(1, 1/steps, steps) in float32, and mu from
``calculate_shift`` (which Turbo's static shift 3.0 ignores): the card's scheduler config says
``flow_grid: "flux"``, whose grid is np.linspace's (each sigma within one float32 rounding of torch's, equal
at 8 and 9 steps; the tests bound the difference); ``plan_kwargs`` gives mu where a config shifts dynamically.

Sizes. The latents are 16 x H/8 x W/8, patchified 2x2 by the transformer, so each side is a multiple of 16
px; ZImagePipeline refuses any other side (``rounds_down`` False) and sets no bound; the native 1024 is
Turbo's (``dit_serve.image_size`` overrides). The card lists the native square and the common ratios at the
native pixel count (``ratio_sizes``; ``dit_serve.sizes`` replaces them) and makes any other multiple of 16
from 16 px to twice the native side, each a new captured shape.

Tokens. Prompts are read through the chat template, ``<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>
assistant\\n`` (about 8 tokens around the prompt), and truncated at ``max_tokens`` with it: 512, the
pipeline's ``max_sequence_length`` (``dit_serve.max_sequence_length``: a multiple of 32, the transformer's
caption padding, up to 512).
"""

from __future__ import annotations

from numbers import Real
from pathlib import Path

from workers.families.base import Builtin, CardError, Family, ModelCard, listed_sizes, read_json
from workers.families.previews import FLUX_VAE
from workers.request.sizes import ratio_sizes

NATIVE_SIZE = 1024
MAX_SEQUENCE_LENGTH = 512  # ZImagePipeline's max_sequence_length
CAPTION_MULTIPLE = 32      # the transformer pads each caption to a multiple of this (SEQ_MULTI_OF)
TURBO_DEFAULTS = {"sampler": "flow_euler", "steps": 8, "guidance": 0.0}
GUIDANCE_OPTIONS = {"cfg_normalization": 0.0, "cfg_truncation": 1.0}  # ZImagePipeline.__call__'s: both off
# part -> (the file that must be there, what it holds: the message's words)
PARTS = {"vae": ("vae/config.json", "the VAE (AutoencoderKL)"),
         "text_encoder": ("text_encoder/config.json", "the Qwen3 text encoder (Qwen3Model)"),
         "tokenizer": ("tokenizer", "the Qwen2 tokenizer and its chat template"),
         "scheduler": ("scheduler/scheduler_config.json", "the scheduler's config")}
ENCODER_TYPE = "qwen3"  # text_encoder/config.json's model_type
# Z-Image-Turbo: transformer + VAE; Qwen3-4B's base model (counted on the meta device)
TURBO_PARAMS, TURBO_ENCODER_PARAMS = 6_154_908_736 + 83_819_683, 4_022_468_096
# Z-Image-Turbo's scheduler_config.json, on the pipeline's sigma grid: the built-in's
TURBO_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0,
                   "use_dynamic_shifting": False, "flow_grid": "flux"}



class ZImage(Family):
    name = "zimage"
    pipelines = ("ZImagePipeline",)
    transformers = ("ZImageTransformer2DModel",)
    builtins = {"z-image-turbo-1024": Builtin(1024, TURBO_PARAMS, TURBO_ENCODER_PARAMS)}
    previews = {16: FLUX_VAE}
    runtime = "workers.families.zimage.runtime:ZImageRuntime"
    # image-to-image and inpainting (workers.edits), as ZImageImg2ImgPipeline and ZImageInpaintPipeline
    takes_image = True
    takes_mask = True
    rate_reference = "flux-dev-1024"  # none of its own measured: FLUX.1-dev's, a DiT at 1024 on the same VAE

    def read_card(self, name: str, path: Path, transformer: dict, vae: dict | None, index: dict,
                  scheduler: dict) -> ModelCard:
        return card(name, path, transformer, vae, index, scheduler)

    def builtin_card(self, name: str) -> ModelCard:
        size = self.builtins[name].image_size
        return ModelCard(name, "zimage", "text", builtin=name, image_size=size, latent_channels=16,
                         latent_size=size // 8, scheduler=dict(TURBO_SCHEDULER), defaults=dict(TURBO_DEFAULTS),
                         max_tokens=MAX_SEQUENCE_LENGTH, sizes=tuple(ratio_sizes(size, 16)), size_multiple=16,
                         size_range=(16, 2 * size), guidance_mode="cfg")


def card(name: str, path: Path, transformer: dict, vae: dict | None, index: dict, scheduler: dict) -> ModelCard:
    _check_layout(path, transformer, vae)
    extra = index.get("dit_serve", {})
    guidance_options(index, path)  # refused here, not at load
    factor = 2 ** (len(vae["block_out_channels"]) - 1)
    multiple = factor * 2  # the transformer patchifies 2x2 latent cells
    size = int(extra.get("image_size", NATIVE_SIZE))
    if size % multiple:
        raise CardError(f"{path}/model_index.json: dit_serve.image_size {size} is not a multiple of {multiple} pixels")
    max_tokens = extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH)
    if (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 0 < max_tokens <= MAX_SEQUENCE_LENGTH
            or max_tokens % CAPTION_MULTIPLE):
        raise CardError(f"{path}/model_index.json: dit_serve.max_sequence_length must be a multiple of "
                        f"{CAPTION_MULTIPLE} (the transformer's caption padding) up to {MAX_SEQUENCE_LENGTH}, "
                        f"got {max_tokens!r}")
    tokenizer_json = path / "tokenizer" / "tokenizer.json"
    return ModelCard(
        name, "zimage", "text", path=str(path), image_size=size, latent_channels=int(vae["latent_channels"]),
        latent_size=size // factor, dtype=extra.get("dtype", "bfloat16"), scheduler={**scheduler, "flow_grid": "flux"},
        defaults={**TURBO_DEFAULTS, **extra.get("defaults", {})}, max_tokens=max_tokens,
        sizes=tuple(listed_sizes(path, extra, multiple) or ratio_sizes(size, multiple)), size_multiple=multiple,
        size_range=(multiple, 2 * size), rounds_down=False, guidance_mode="cfg",
        tokenizer_file=str(tokenizer_json) if tokenizer_json.is_file() else "")


def guidance_options(index: dict, path: Path | str = "") -> dict[str, float]:
    """``cfg_normalization`` and ``cfg_truncation`` of a directory (model_index.json's ``dit_serve``), the
    pipeline's defaults where it sets none; CardError for a value that is not a number >= 0."""
    extra = index.get("dit_serve", {})
    out = {}
    for key, default in GUIDANCE_OPTIONS.items():
        value = extra.get(key, default)
        if isinstance(value, bool):  # the pipeline's cfg_normalization=True is a factor of 1
            value = float(value)
        if not isinstance(value, Real) or not value >= 0:
            raise CardError(f"{path}/model_index.json: dit_serve.{key} must be a number >= 0, got {value!r}")
        out[key] = float(value)
    return out


def _check_layout(path: Path, transformer: dict, vae: dict | None) -> None:
    for part, (file, what) in PARTS.items():
        if not (path / file).exists():
            raise CardError(f"{path} is a Z-Image pipeline without {part}/ ({what}): expected {path / file}")
    encoder = read_json(path / "text_encoder" / "config.json")
    if encoder.get("model_type") != ENCODER_TYPE:
        raise CardError(f"{path}/text_encoder/config.json has model_type {encoder.get('model_type')!r}; a Z-Image "
                        f"pipeline's text_encoder is {PARTS['text_encoder'][1]} ({ENCODER_TYPE!r})")
    sizes = list(zip(transformer.get("all_patch_size", (2,)), transformer.get("all_f_patch_size", (1,))))
    if (2, 1) not in sizes or transformer.get("in_channels", 16) != vae["latent_channels"]:
        raise CardError(f"{path}/transformer/config.json: expected patch size 2 (frames 1), as ZImagePipeline calls "
                        f"it, and in_channels {vae['latent_channels']} (the VAE's latent channels); got patch sizes "
                        f"{sizes} and in_channels {transformer.get('in_channels')}")
    if transformer.get("cap_feat_dim", 2560) != encoder.get("hidden_size"):
        raise CardError(f"{path}: the text encoder's hidden_size {encoder.get('hidden_size')} is not the "
                        f"transformer's cap_feat_dim {transformer.get('cap_feat_dim', 2560)}")
