"""FLUX.2, torch-free: the model card of a pipeline directory, FLUX.2 [klein]
(``black-forest-labs/FLUX.2-klein-4B``, ``-9B``, their ``-base-`` variants; diffusers' ``Flux2KleinPipeline``) or
FLUX.2 [dev] (``black-forest-labs/FLUX.2-dev``; ``Flux2Pipeline``), read from its JSON files, and the built-in
architectures (``flux2-klein-1024``, ``flux2-dev-1024``: random weights, ``builtin``). The model runs in ``runtime``.

The layout, both: ``transformer/`` (Flux2Transformer2DModel, sharded safetensors), ``vae/`` (AutoencoderKLFlux2:
32 latent channels at /8, and the batch-norm statistics of its 2x2-patchified latents), ``text_encoder/`` with
``tokenizer/``, and ``scheduler/`` (FlowMatchEulerDiscreteScheduler). [klein]'s text encoder is Qwen3
(Qwen3ForCausalLM, Qwen2TokenizerFast with its chat template); [dev]'s is Mistral Small 3.x
(Mistral3ForConditionalGeneration, its PixtralProcessor in ``tokenizer/``). A missing part, or an encoder of
another type, is a CardError naming it.

Guidance, as each pipeline does it. [klein] has no guidance embedding (``Flux2KleinPipeline`` passes none):
a step-distilled [klein] (``is_distilled`` true in model_index.json: FLUX.2-klein-4B, -9B) ignores the scale
(``guidance_mode`` "none"; 4 steps, as its model card says); a [klein] base model runs classifier-free
guidance against a negative prompt ("" by default, as the pipeline's), for rows whose scale is above 1
(``guidance_mode`` "cfg"; 50 steps at 4.0, the pipeline's defaults). [dev] is guidance-distilled: the scale
is an input of the network when its transformer has ``guidance_embeds`` (``guidance_mode`` "embedded"; 50
steps at 4.0, ``Flux2Pipeline``'s defaults), and is ignored otherwise.

Latents. The engine's latents are the pipeline's own before packing, ``(128, H/16, W/16)``: the VAE's 32
channels patchified 2x2 and normalised by the VAE's batch-norm running statistics (``Flux2KleinPipeline.
prepare_latents`` draws them in this shape; ``_pack_latents`` flattens the cells into tokens of 128). So the
card's ``latent_channels`` is 128 and its ``latent_size`` the native side over 16; the runtime's decode
undoes the normalisation and the patchify before the VAE.

Schedule. Both pipelines pass their own sigmas, np.linspace(1, 1/steps, steps) (``flow_grid`` "flux"), shifted
by a ``mu`` of their own, ``compute_empirical_mu(image_seq_len, num_steps)``, which depends on the step count
as well as the size (the runtime's ``plan_kwargs``).

Sizes. Each side a multiple of 16 (the VAE's 8 times the 2x2 patch). FLUX.2 has no native size in its
configs; 1024 is the pipelines' default (``default_sample_size`` 128 latent cells; ``dit_serve.image_size``
overrides). The card lists the native square and the common ratios at about the native pixel count
(``workers.request.sizes.ratio_sizes``, as FLUX.1's; ``dit_serve.sizes`` replaces them), and makes any other
multiple of 16 from 16 px to twice the native side (the pipelines set no bound), rounding a side off the
multiple down, as ``prepare_latents`` does.

Prompts are read as given, ``max_sequence_length`` 512 tokens after the chat template (the pipelines'
default; ``dit_serve.max_sequence_length`` overrides), padded to it: every text shape is fixed per model.
"""

from __future__ import annotations

from pathlib import Path

from workers.families.base import Builtin, CardError, Family, ModelCard, listed_sizes, read_json
from workers.families.previews import PreviewMap
from workers.request.sizes import ratio_sizes

NATIVE_SIZE = 1024
MAX_SEQUENCE_LENGTH = 512  # both pipelines' default
MAX_TOKENS_LIMIT = 4096    # dit_serve.max_sequence_length at most (the pipelines set none; the encoders read far more)
KLEIN, DEV = "Flux2KleinPipeline", "Flux2Pipeline"
KLEIN_DISTILLED = {"defaults": {"sampler": "flow_euler", "steps": 4, "guidance": 1.0}, "guidance_mode": "none"}
KLEIN_BASE = {"defaults": {"sampler": "flow_euler", "steps": 50, "guidance": 4.0}, "guidance_mode": "cfg"}
DEV_DEFAULTS = {"sampler": "flow_euler", "steps": 50, "guidance": 4.0}
# part -> (the file that must be there, what it holds: the message's words), per pipeline
PARTS = {
    KLEIN: {"vae": ("vae/config.json", "the VAE (AutoencoderKLFlux2)"),
            "text_encoder": ("text_encoder/config.json", "the Qwen3 text encoder (Qwen3ForCausalLM)"),
            "tokenizer": ("tokenizer", "the Qwen tokenizer"),
            "scheduler": ("scheduler/scheduler_config.json", "the scheduler's config")},
    DEV: {"vae": ("vae/config.json", "the VAE (AutoencoderKLFlux2)"),
          "text_encoder": ("text_encoder/config.json",
                           "the Mistral Small 3 text encoder (Mistral3ForConditionalGeneration)"),
          "tokenizer": ("tokenizer", "the Mistral tokenizer (PixtralProcessor)"),
          "scheduler": ("scheduler/scheduler_config.json", "the scheduler's config")}}
ENCODER_TYPES = {KLEIN: "qwen3", DEV: "mistral3"}  # text_encoder/config.json's model_type
# the hidden states each pipeline stacks (text_encoder_out_layers: _get_qwen3_prompt_embeds,
# _get_mistral_3_small_prompt_embeds): joint_attention_dim is their number times the encoder's width
ENCODER_LAYERS = {KLEIN: (9, 18, 27), DEV: (10, 20, 30)}
# the pipelines' scheduler_config.json (FLUX.1-dev's), on their sigma grid: the built-ins'
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
             "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
             "time_shift_type": "exponential", "use_dynamic_shifting": True, "flow_grid": "flux"}
# counted on the meta device (builtin.py; tests/workers/families/test_flux2.py checks them):
# FLUX.2-klein-4B: transformer 3.88B + VAE; Qwen3-4B (tied embeddings)
KLEIN_PARAMS, KLEIN_ENCODER_PARAMS = 3_875_544_576 + 84_046_115, 4_022_468_096
# FLUX.2-dev: transformer 32.2B + VAE; Mistral-Small-3.2-24B (language model, Pixtral vision tower, projector)
DEV_PARAMS, DEV_ENCODER_PARAMS = 32_223_281_152 + 84_046_115, 24_011_361_280

# ComfyUI latent_formats.Flux2: RGB of the 32 VAE channels of the normalised latents seen unpatchified
# (latent_rgb_factors_reshape); here each of a cell's 4 sub-pixels' rows at a quarter, so the map of a 128-channel
# cell is the mean of its 2x2 pixels' (previews are area-averaged anyway: workers.families.previews.to_rgb)
FLUX2_RGB = ((0.0058, 0.0113, 0.0073), (0.0495, 0.0443, 0.0836), (-0.0099, 0.0096, 0.0644), (0.2144, 0.3009, 0.3652),
             (0.0166, -0.0039, -0.0054), (0.0157, 0.0103, -0.0160), (-0.0398, 0.0902, -0.0235),
             (-0.0052, 0.0095, 0.0109), (-0.3527, -0.2712, -0.1666), (-0.0301, -0.0356, -0.0180),
             (-0.0107, 0.0078, 0.0013), (0.0746, 0.0090, -0.0941), (0.0156, 0.0169, 0.0070),
             (-0.0034, -0.0040, -0.0114), (0.0032, 0.0181, 0.0080), (-0.0939, -0.0008, 0.0186),
             (0.0018, 0.0043, 0.0104), (0.0284, 0.0056, -0.0127), (-0.0024, -0.0022, -0.0030),
             (0.1207, -0.0026, 0.0065), (0.0128, 0.0101, 0.0142), (0.0137, -0.0072, -0.0007),
             (0.0095, 0.0092, -0.0059), (0.0000, -0.0077, -0.0049), (-0.0465, -0.0204, -0.0312),
             (0.0095, 0.0012, -0.0066), (0.0290, -0.0034, 0.0025), (0.0220, 0.0169, -0.0048),
             (-0.0332, -0.0457, -0.0468), (-0.0085, 0.0389, 0.0609), (-0.0076, 0.0003, -0.0043),
             (-0.0111, -0.0460, -0.0614))
FLUX2_VAE = PreviewMap(weight=tuple(tuple(v / 4 for v in row) for row in FLUX2_RGB for _ in range(4)),
                       bias=(-0.0329, -0.0718, -0.0851))


class Flux2(Family):
    name = "flux2"
    pipelines = (KLEIN, DEV)
    transformers = ("Flux2Transformer2DModel",)
    builtins = {"flux2-klein-1024": Builtin(1024, KLEIN_PARAMS, KLEIN_ENCODER_PARAMS),
                "flux2-dev-1024": Builtin(1024, DEV_PARAMS, DEV_ENCODER_PARAMS)}
    previews = {128: FLUX2_VAE}
    runtime = "workers.families.flux2.runtime:Flux2Runtime"
    # image-to-image and inpainting (workers.edits) by FluxImg2ImgPipeline's and FluxInpaintPipeline's rule
    # (diffusers has no FLUX.2 img2img pipeline, and its inpaint pipeline adds the image as reference tokens),
    # the VAE's mode as FLUX.2's pipelines encode, the mask bilinear as Flux2KleinInpaintPipeline's
    takes_image = True
    takes_mask = True
    rate_reference = "flux-dev-1024"  # none of its own measured: FLUX.1-dev's, its predecessor

    def read_card(self, name: str, path: Path, transformer: dict, vae: dict | None, index: dict,
                  scheduler: dict) -> ModelCard:
        return card(name, path, transformer, vae, index, scheduler)

    def builtin_card(self, name: str) -> ModelCard:
        """flux2-klein-1024: FLUX.2-klein-4B (step-distilled); flux2-dev-1024: FLUX.2-dev."""
        size = self.builtins[name].image_size
        klein = "klein" in name
        return ModelCard(name, "flux2", "text", builtin=name, image_size=size, latent_channels=128,
                         latent_size=size // 16, scheduler=dict(SCHEDULER),
                         defaults=dict(KLEIN_DISTILLED["defaults"] if klein else DEV_DEFAULTS),
                         max_tokens=MAX_SEQUENCE_LENGTH, sizes=tuple(ratio_sizes(size, 16)), size_multiple=16,
                         size_range=(16, 2 * size), rounds_down=True,
                         guidance_mode=KLEIN_DISTILLED["guidance_mode"] if klein else "embedded")


def card(name: str, path: Path, transformer: dict, vae: dict | None, index: dict, scheduler: dict) -> ModelCard:
    pipeline = index.get("_class_name")
    if pipeline not in PARTS:  # a bare Flux2Transformer2DModel directory: no text encoder to read prompts with
        raise CardError(f"{path} is a FLUX.2 transformer without its pipeline: FLUX.2 is served from a "
                        f"{KLEIN} or {DEV} directory (model_index.json, text_encoder/, tokenizer/, vae/, scheduler/)")
    _check_layout(path, pipeline, transformer, vae)
    extra = index.get("dit_serve", {})
    factor = 2 ** (len(vae["block_out_channels"]) - 1)
    multiple = factor * 2  # the pipeline patchifies 2x2 latent cells into one token
    size = int(extra.get("image_size", NATIVE_SIZE))
    if size % multiple:
        raise CardError(f"{path}/model_index.json: dit_serve.image_size {size} is not a multiple of {multiple} pixels")
    max_tokens = extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 0 < max_tokens <= MAX_TOKENS_LIMIT:
        raise CardError(f"{path}/model_index.json: dit_serve.max_sequence_length must be a whole number from 1 to "
                        f"{MAX_TOKENS_LIMIT}, got {max_tokens!r}")
    if pipeline == KLEIN:
        base = KLEIN_DISTILLED if index.get("is_distilled", False) else KLEIN_BASE  # the pipeline's config
        defaults, mode = base["defaults"], base["guidance_mode"]
    else:
        defaults, mode = DEV_DEFAULTS, "embedded" if transformer.get("guidance_embeds", True) else "none"
    tokenizer_json = path / "tokenizer" / "tokenizer.json"
    return ModelCard(
        name, "flux2", "text", path=str(path), image_size=size, latent_channels=4 * int(vae["latent_channels"]),
        latent_size=size // multiple, dtype=extra.get("dtype", "bfloat16"),
        scheduler={**scheduler, "flow_grid": "flux"}, defaults={**defaults, **extra.get("defaults", {})},
        max_tokens=max_tokens, sizes=tuple(listed_sizes(path, extra, multiple) or ratio_sizes(size, multiple)),
        size_multiple=multiple, size_range=(multiple, 2 * size), rounds_down=True, guidance_mode=mode,
        tokenizer_file=str(tokenizer_json) if tokenizer_json.is_file() else "")


def _check_layout(path: Path, pipeline: str, transformer: dict, vae: dict | None) -> None:
    for part, (file, what) in PARTS[pipeline].items():
        if not (path / file).exists():
            raise CardError(f"{path} is a {pipeline} directory without {part}/ ({what}): expected {path / file}")
    found = read_json(path / "text_encoder" / "config.json").get("model_type")
    if found != ENCODER_TYPES[pipeline]:
        raise CardError(f"{path}/text_encoder/config.json has model_type {found!r}; a {pipeline}'s text_encoder is "
                        f"{PARTS[pipeline]['text_encoder'][1]} ({ENCODER_TYPES[pipeline]!r})")
    channels = 4 * int(vae.get("latent_channels", 32))
    if transformer.get("patch_size", 1) != 1 or transformer.get("in_channels", 128) != channels:
        raise CardError(f"{path}/transformer/config.json: expected patch_size 1 and in_channels {channels} (the "
                        f"VAE's {channels // 4} channels patchified 2x2), got {transformer.get('patch_size')} and "
                        f"{transformer.get('in_channels')}")
