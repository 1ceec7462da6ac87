"""FLUX.1, torch-free: the model card of a pipeline directory (``black-forest-labs/FLUX.1-dev``, ``-schnell``;
diffusers' ``FluxPipeline``), read from its JSON files, and the built-in architectures (``flux-dev-512`` /
``-1024``: random weights, ``builtin``). The model runs in ``runtime``.

The layout: ``transformer/`` (FluxTransformer2DModel, sharded safetensors), ``vae/`` (a 16-channel
AutoencoderKL), ``text_encoder/`` (CLIPTextModel: its pooled output) with ``tokenizer/`` (CLIPTokenizer),
``text_encoder_2/`` (T5EncoderModel: the token embeddings) with ``tokenizer_2/`` (T5TokenizerFast), and
``scheduler/`` (FlowMatchEulerDiscreteScheduler). A missing part is a CardError naming it.

Guidance. FLUX.1-dev is guidance-distilled: the scale is an input of the network (``guidance_embeds`` in
the transformer's config), one forward per image, no classifier-free guidance and no negative prompt;
FLUX.1-schnell is timestep-distilled and has no guidance input: the scale is ignored (default 0). Which
of the two a directory holds is read from ``guidance_embeds``, never from its name; the card says which
(``guidance_mode`` "embedded" or "none"), and the API refuses a negative prompt for either.

Schedule. FluxPipeline passes its own sigmas, np.linspace(1, 1/steps, steps), to the scheduler, dev and
schnell alike (then shifted by ``mu`` for dev's dynamic shifting, statically for schnell): the card's
scheduler config says so with ``flow_grid: "flux"`` (a samplers.NoiseSchedule key, not a diffusers one).

Kontext. FLUX.1 Kontext (``FluxKontextPipeline``, ``black-forest-labs/FLUX.1-Kontext-dev``) has FLUX.1-dev's
layout. Its card's ``edit`` is "reference": a request's image is the reference the prompt edits (no strength, no
mask), its latent tokens joined to the image sequence (``runtime``); without an image it runs as text-to-image, as
its pipeline does with ``image=None``. The reference is resized as the pipeline does (``reference_size``): its
sides rounded down to 16 px, then, with ``_auto_resize`` (the pipeline's default), to the preferred Kontext
resolution of the nearest aspect ratio (``PREFERRED_KONTEXT_RESOLUTIONS``, the card's ``reference_sizes``);
``dit_serve.kontext_auto_resize: false`` in model_index.json keeps its own size (small test models).

Sizes. The latents are 16 x H/8 x W/8, packed 2x2 into (H/16)(W/16) tokens of 64, so each side is a
multiple of 16 px. FLUX has no native size in its configs; 1024 is the real models' (``dit_serve.image_size``
overrides). Each (width, height) size is one captured graph shape, so a card lists a few: the native
square and the common ratios 4:3, 3:2, 16:9 and 21:9 both ways, each at about the native pixel count
(width = native * sqrt(ratio), height = native / sqrt(ratio), each rounded to the nearest multiple of 16:
at 1024, 1184x880, 1248x832, 1360x768, 1568x672 and their transposes). ``dit_serve.sizes`` replaces them.
Those are the sizes it lists; like FluxPipeline it makes any other multiple of 16 as asked (the engine
captures a new size on first use), from 16 px to twice the native side per side (``size_range``: FluxPipeline
sets no bound; FLUX.1 is trained up to about 2 MP), and rounds a side off the multiple down to one, as
FluxPipeline does.
"""

from __future__ import annotations

from pathlib import Path

from workers.families.base import Builtin, CardError, Family, ModelCard, listed_sizes, read_json
from workers.families.previews import FLUX_VAE
from workers.request.sizes import ratio_sizes

NATIVE_SIZE = 1024
MAX_SEQUENCE_LENGTH = 512  # FluxPipeline refuses more T5 tokens
DEV = {"defaults": {"sampler": "flow_euler", "steps": 28, "guidance": 3.5}, "max_tokens": 512}
SCHNELL = {"defaults": {"sampler": "flow_euler", "steps": 4, "guidance": 0.0}, "max_tokens": 256}
# edit pipelines with FluxPipeline's layout: what they are (an instruction edit: the image is a reference)
EDIT_PIPELINES = {"FluxKontextPipeline": "FLUX.1 Kontext"}
# FluxKontextPipeline's PREFERRED_KONTEXT_RESOLUTIONS, (width, height) as its _auto_resize reads them
PREFERRED_KONTEXT_RESOLUTIONS = ((672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248),
                                 (880, 1184), (944, 1104), (1024, 1024), (1104, 944), (1184, 880), (1248, 832),
                                 (1328, 800), (1392, 752), (1456, 720), (1504, 688), (1568, 672))
# part -> (the file that must be there, what it holds: the message's words)
PARTS = {"vae": ("vae/config.json", "the VAE (AutoencoderKL)"),
         "text_encoder": ("text_encoder/config.json", "the CLIP text encoder (CLIPTextModel)"),
         "text_encoder_2": ("text_encoder_2/config.json", "the T5 text encoder (T5EncoderModel)"),
         "tokenizer": ("tokenizer", "the CLIP tokenizer"), "tokenizer_2": ("tokenizer_2", "the T5 tokenizer"),
         "scheduler": ("scheduler/scheduler_config.json", "the scheduler's config")}
ENCODER_TYPES = {"text_encoder": "clip_text_model", "text_encoder_2": "t5"}  # config.json's model_type
# FLUX.1-dev: transformer + VAE; CLIP-L's text tower, T5-XXL's encoder (counted on the meta device)
DEV_PARAMS, DEV_ENCODER_PARAMS = 11_901_408_320 + 83_819_683, 123_060_480 + 4_762_310_656
# FluxPipeline's scheduler_config.json, on its sigma grid: the built-ins'
DEV_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
                 "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
                 "use_dynamic_shifting": True, "flow_grid": "flux"}



class Flux(Family):
    name = "flux"
    pipelines = ("FluxPipeline", *EDIT_PIPELINES)
    transformers = ("FluxTransformer2DModel",)
    builtins = {"flux-dev-512": Builtin(512, DEV_PARAMS, DEV_ENCODER_PARAMS),
                "flux-dev-1024": Builtin(1024, DEV_PARAMS, DEV_ENCODER_PARAMS)}
    previews = {16: FLUX_VAE}
    runtime = "workers.families.flux.runtime:FluxRuntime"
    joint_attention = True  # its joint attention by the kernel per shape (workers.speed.routing), not a break
    compile_scope = "blocks"  # FLUX.1-dev 1024: 19 s cold instead of 107 s, its step 0-2.4% slower
    fp8_attention = True
    # image-to-image and inpainting (workers.edits), as FluxImg2ImgPipeline and FluxInpaintPipeline
    takes_image = True
    takes_mask = True
    rate_reference = "flux-dev-1024"  # its measured rate (workers.families.rates)

    def read_card(self, name: str, path: Path, transformer: dict, vae: dict | None, index: dict,
                  scheduler: dict) -> ModelCard:
        return card(name, path, transformer, vae, index, scheduler)

    def builtin_card(self, name: str) -> ModelCard:
        size = self.builtins[name].image_size
        return ModelCard(name, "flux", "text", builtin=name, image_size=size, latent_channels=16,
                         latent_size=size // 8, scheduler=dict(DEV_SCHEDULER), defaults=dict(DEV["defaults"]),
                         max_tokens=DEV["max_tokens"], sizes=tuple(ratio_sizes(size, 16)), size_multiple=16,
                         size_range=(16, 2 * size), rounds_down=True, guidance_mode="embedded")


def card(name: str, path: Path, transformer: dict, vae: dict | None, index: dict, scheduler: dict) -> ModelCard:
    _check_layout(path, transformer, vae)
    extra = index.get("dit_serve", {})
    distilled = bool(transformer.get("guidance_embeds", False))  # dev: True; schnell: False
    base = DEV if distilled else SCHNELL
    factor = 2 ** (len(vae["block_out_channels"]) - 1)
    multiple = factor * 2  # the pipeline packs 2x2 latent cells into one token
    size = int(extra.get("image_size", NATIVE_SIZE))
    if size % multiple:
        raise CardError(f"{path}/model_index.json: dit_serve.image_size {size} is not a multiple of {multiple} pixels")
    max_tokens = int(extra.get("max_sequence_length", base["max_tokens"]))
    if not 0 < max_tokens <= MAX_SEQUENCE_LENGTH:
        raise CardError(f"{path}/model_index.json: dit_serve.max_sequence_length must be 1 to "
                        f"{MAX_SEQUENCE_LENGTH} (FluxPipeline's limit), got {max_tokens}")
    tokenizer_json = path / "tokenizer_2" / "tokenizer.json"
    pipeline = index.get("_class_name", "")
    kontext = pipeline in EDIT_PIPELINES
    auto_resize = extra.get("kontext_auto_resize", True)
    if not isinstance(auto_resize, bool):
        raise CardError(f"{path}/model_index.json: dit_serve.kontext_auto_resize must be true or false")
    return ModelCard(
        name, "flux", "text", path=str(path), image_size=size, latent_channels=int(vae["latent_channels"]),
        latent_size=size // factor, dtype=extra.get("dtype", "bfloat16"), scheduler={**scheduler, "flow_grid": "flux"},
        defaults={**base["defaults"], **extra.get("defaults", {})}, max_tokens=max_tokens,
        sizes=tuple(listed_sizes(path, extra, multiple) or ratio_sizes(size, multiple)), size_multiple=multiple,
        size_range=(multiple, 2 * size), rounds_down=True,
        guidance_mode="embedded" if distilled else "none", edit="reference" if kontext else "",
        reference_sizes=PREFERRED_KONTEXT_RESOLUTIONS if kontext and auto_resize else (),
        tokenizer_file=str(tokenizer_json) if tokenizer_json.is_file() else "")


def reference_size(card: ModelCard, width: int, height: int) -> tuple[int, int]:
    """The (width, height) FluxKontextPipeline resizes a width x height reference image to: each side rounded down
    to the card's multiple (its image processor's ``get_default_height_width``), then the card's reference size
    of the nearest aspect ratio (``_auto_resize``: the first of the smallest (|ratio - w/h|, w, h)), each side
    rounded down to the multiple again. ValueError for an image under one patch per side."""
    m = card.size_multiple
    w, h = width - width % m, height - height % m
    if not (w and h):
        raise ValueError(f"image: {width}x{height} is too small for a reference image: model {card.name!r} needs "
                         f"at least {m} px per side")
    if card.reference_sizes:
        ratio = w / h
        _, w, h = min((abs(ratio - rw / rh), rw, rh) for rw, rh in card.reference_sizes)
    return w // m * m, h // m * m


def _check_layout(path: Path, transformer: dict, vae: dict | None) -> None:
    for part, (file, what) in PARTS.items():
        if not (path / file).exists():
            raise CardError(f"{path} is a FLUX pipeline without {part}/ ({what}): expected {path / file}")
    for part, model_type in ENCODER_TYPES.items():
        found = read_json(path / part / "config.json").get("model_type")
        if found != model_type:
            raise CardError(f"{path}/{part}/config.json has model_type {found!r}; a FLUX pipeline's {part} is "
                            f"{PARTS[part][1]} ({model_type!r})")
    if transformer.get("patch_size", 1) != 1 or transformer.get("in_channels", 64) != 4 * vae["latent_channels"]:
        raise CardError(f"{path}/transformer/config.json: expected patch_size 1 and in_channels "
                        f"{4 * vae['latent_channels']} (the VAE's {vae['latent_channels']} channels packed 2x2), "
                        f"got {transformer.get('patch_size')} and {transformer.get('in_channels')}")
