"""Sana (Xie et al. 2024, "SANA: Efficient High-Resolution Image Synthesis with Linear Diffusion Transformers";
diffusers' ``SanaPipeline``) and Sana Sprint (Chen et al. 2025, "SANA-Sprint: One-Step Diffusion with Continuous-Time
Consistency Distillation"; ``SanaSprintPipeline``), torch-free: the model card of a pipeline directory, read from its
JSON files, and the built-in architectures (``sana-1600m-1024``, ``sana-sprint-1600m-1024``: random weights,
``builtin``). The model runs in ``runtime`` (Sana Sprint's step in ``sprint``).

The layout is ``Efficient-Large-Model/Sana_1600M_1024px_diffusers``'s (and the 512 px, 2K and 4K ones'):
``transformer/`` (SanaTransformer2DModel, sharded safetensors), ``vae/`` (AutoencoderDC: the deep-compression
autoencoder, 32x, 32 channels), ``text_encoder/`` (Gemma2Model: Gemma-2-2B's decoder, sharded) with
``tokenizer/`` (GemmaTokenizer), ``scheduler/`` (DPMSolverMultistepScheduler on flow sigmas: use_flow_sigmas,
flow_shift, prediction_type "flow_prediction"; or FlowMatchEulerDiscreteScheduler, which diffusers' conversion
script writes for ``--scheduler_type flow-euler``). A missing part is a CardError naming it, and so is a text
encoder that is not Gemma-2. The 2K and 4K directories differ only in their configs: the transformer's
``sample_size`` (64, 128) and ``interpolation_scale`` (1.0, 2.0: a sin-cos positional embedding; the 512 and
1024 px models have none) and the 4K scheduler's ``flow_shift`` (6.0; 3.0 elsewhere), all read from the files.

Sana Sprint (``Efficient-Large-Model/Sana_Sprint_1.6B_1024px_diffusers``, ``..._0.6B_...``): the same parts, its
model_index.json naming ``SanaSprintPipeline``, its transformer embedding the guidance scale (``guidance_embeds``,
scaled by ``guidance_embeds_scale``; QK-normalised) and its scheduler ``SCMScheduler`` (prediction_type "trigflow",
``sigma_data``). The three go together: a guidance-embedding transformer under SanaPipeline (which feeds it no
guidance), SanaSprintPipeline over a transformer without it or with another scheduler, and a sigma_data that is not
positive are CardErrors.

Sampling. SanaPipeline's defaults: 20 steps of its scheduler at guidance 4.5 with the negative prompt "". On a
DPMSolverMultistepScheduler flow config the default sampler is ``flow_dpmpp_2m`` (DPM-Solver++(2M) on the flow
sigmas, ``samplers.plans``); ``flow_euler`` is also offered, as FlowMatchEulerDiscreteScheduler(shift=flow_shift)
swapped in. Guidance is classifier-free against the negative prompt; at a scale of 1 or less the pipeline runs
without it (the prompt's prediction alone), and so does each such row of a batch. Sana Sprint samples with ``scm``
(SCMScheduler's TrigFlow steps, the only sampler its "trigflow" schedule takes) in SanaSprintPipeline's default
2 steps (1 to 4 are what it was distilled for; any count up to 1000 runs, as the pipeline's), at its default
embedded guidance 4.5: a network input, one forward per image, no negative prompt (``guidance_mode`` "embedded").
The scheduler config's own ``max_timesteps`` / ``intermediate_timesteps``, where written, play no part: the pipeline
passes its own (1.5708 and, at 2 steps, 1.3).

Sizes. The latents are 32 x H/32 x W/32 (patch size 1). The native size is the transformer's ``sample_size``
times 32 (1024 for Sana_1600M_1024px; ``dit_serve.image_size`` in model_index.json overrides). SanaPipeline
snaps every request to its aspect-ratio bins (``bins``: PixArt's 512, 1024 and 2048 tables, its own 4096 one,
by ``sample_size``; SanaSprintPipeline's, the 1024 one), so the card lists the bins and makes only those, as
PixArt's; ``dit_serve.sizes`` replaces them (tiny models, whose sample size has no bins).

Text. Prompts are lower-cased and stripped (the pipeline's ``_text_preprocessing`` without ``clean_caption``),
prefixed with the pipeline's complex human instruction (``COMPLEX_HUMAN_INSTRUCTION``, Sana Sprint's the same;
``dit_serve.complex_human_instruction`` replaces it, [] turns it off) and encoded by Gemma-2 to ``max_tokens``
(300) embeddings with their mask; the runtime's docstring has the recipe.
"""

from __future__ import annotations

from pathlib import Path

from samplers.rules import prediction_type
from workers.families.base import Builtin, CardError, Family, ModelCard, listed_sizes, read_json
from workers.families.sana.bins import sana_bins

DEFAULTS = {"sampler": "flow_dpmpp_2m", "steps": 20, "guidance": 4.5}  # SanaPipeline.__call__'s, its scheduler's
EULER_DEFAULTS = {**DEFAULTS, "sampler": "flow_euler"}  # a directory saved with FlowMatchEulerDiscreteScheduler
SPRINT_DEFAULTS = {"sampler": "scm", "steps": 2, "guidance": 4.5}  # SanaSprintPipeline.__call__'s
SPRINT_PIPELINE = "SanaSprintPipeline"
MAX_SEQUENCE_LENGTH = 300  # SanaPipeline's max_sequence_length
# SanaPipeline.__call__'s default complex_human_instruction (joined with "\n", then the prompt appended)
COMPLEX_HUMAN_INSTRUCTION = (
    ("Given a user prompt, generate an 'Enhanced prompt' that provides detailed visual descriptions suitable for "
     "image generation. Evaluate the level of detail in the user prompt:"),
    ("- If the prompt is simple, focus on adding specifics about colors, shapes, sizes, textures, and spatial "
     "relationships to create vivid and concrete scenes."),
    ("- If the prompt is already detailed, refine and enhance the existing details slightly without "
     "overcomplicating."),
    "Here are examples of how to transform or refine prompts:",
    ("- User Prompt: A cat sleeping -> Enhanced: A small, fluffy white cat curled up in a round shape, sleeping "
     "peacefully on a warm sunny windowsill, surrounded by pots of blooming red flowers."),
    ("- User Prompt: A busy city street -> Enhanced: A bustling city street scene at dusk, featuring glowing street "
     "lamps, a diverse crowd of people in colorful clothing, and a double-decker bus passing by towering glass "
     "skyscrapers."),
    ("Please generate only the enhanced description for the prompt below and avoid including any additional "
     "commentary or evaluations:"),
    "User Prompt: ",
)
# part -> (the file that must be there, what it holds: the message's words)
PARTS = {"vae": ("vae/config.json", "the DC-AE autoencoder (AutoencoderDC)"),
         "text_encoder": ("text_encoder/config.json", "the Gemma-2 text encoder (Gemma2Model)"),
         "tokenizer": ("tokenizer", "the Gemma tokenizer"),
         "scheduler": ("scheduler/scheduler_config.json", "the scheduler's config")}
GEMMA2 = "gemma2"  # text_encoder/config.json's model_type
# scheduler/scheduler_config.json of Sana_1600M_1024px_diffusers (diffusers' conversion script: flow_shift 3.0,
# 6.0 at 4K); the built-in's
SANA_SCHEDULER = {"_class_name": "DPMSolverMultistepScheduler", "algorithm_type": "dpmsolver++", "beta_end": 0.02,
                  "beta_schedule": "linear", "beta_start": 0.0001, "euler_at_final": False, "final_sigmas_type": "zero",
                  "flow_shift": 3.0, "lower_order_final": True, "num_train_timesteps": 1000,
                  "prediction_type": "flow_prediction", "solver_order": 2, "solver_type": "midpoint",
                  "steps_offset": 0, "timestep_spacing": "linspace", "use_flow_sigmas": True}
# scheduler/scheduler_config.json of Sana_Sprint_1.6B_1024px_diffusers (diffusers' conversion script); the built-in's.
# Its max_timesteps and intermediate_timesteps play no part (the module docstring says why)
SPRINT_SCHEDULER = {"_class_name": "SCMScheduler", "intermediate_timesteps": 1.3, "max_timesteps": 1.5708,
                    "num_train_timesteps": 1000, "prediction_type": "trigflow", "sigma_data": 0.5}
# Sana_1600M_1024px: transformer + DC-AE f32c32 (encoder and decoder, as the loader loads it); Gemma-2-2B's
# decoder (Gemma2Model), counted on the meta device. Sana Sprint 1.6B's transformer adds the guidance embedder
# (5,595,520) and the QK norms (179,200)
SANA_1600M_PARAMS, GEMMA2_2B_PARAMS = 1_604_462_752 + 312_250_275, 2_614_341_888
SANA_SPRINT_1600M_PARAMS = 1_610_237_472 + 312_250_275
# built-in -> its scheduler config, defaults and guidance mode (Sana's, Sana Sprint's: as its directory's card)
BUILTIN_SAMPLING = {"sana-1600m-1024": (SANA_SCHEDULER, DEFAULTS, "cfg"),
                    "sana-sprint-1600m-1024": (SPRINT_SCHEDULER, SPRINT_DEFAULTS, "embedded")}


class Sana(Family):
    name = "sana"
    pipelines = ("SanaPipeline", SPRINT_PIPELINE)
    transformers = ("SanaTransformer2DModel",)
    builtins = {"sana-1600m-1024": Builtin(1024, SANA_1600M_PARAMS, GEMMA2_2B_PARAMS),
                "sana-sprint-1600m-1024": Builtin(1024, SANA_SPRINT_1600M_PARAMS, GEMMA2_2B_PARAMS)}
    runtime = "workers.families.sana.runtime:SanaRuntime"
    # image-to-image and inpainting (workers.edits) by StableDiffusion3Img2ImgPipeline's and
    # StableDiffusion3InpaintPipeline's rule (diffusers has none for Sana), the DC-AE's latent; Sana Sprint's
    # image-to-image is SanaSprintImg2ImgPipeline's (scm's levels), its inpainting that with the same blend
    takes_image = True
    takes_mask = True
    # Inductor's dynamic-batch code for Sana on CUDA ends far from eager (the tiny transformer alone: 0.39 of the
    # largest value), where the same forward compiled for a static batch equals eager (within 3e-7, every module
    # compiled alone too; a CPU compile is within 1e-6 either way): on CUDA each bucket compiles its own graph
    static_batch_on = {"cuda": "Inductor's dynamic-batch code for Sana's step differs from eager on CUDA"}
    rate_reference = "pixart-sigma-512"  # none of its own measured: PixArt-Σ's, its predecessor

    def read_card(self, name: str, path: Path, transformer: dict, vae: dict | None, index: dict,
                  scheduler: dict) -> ModelCard:
        return card(name, path, transformer, vae, index, scheduler)

    def builtin_card(self, name: str) -> ModelCard:
        """sana-1600m-1024: Sana 1600M (SanaPipeline); sana-sprint-1600m-1024: Sana Sprint 1.6B
        (SanaSprintPipeline: scm, 2 steps, the guidance embedded). Both snap to the 1024 px bins."""
        size = self.builtins[name].image_size
        scheduler, defaults, guidance_mode = BUILTIN_SAMPLING[name]
        return ModelCard(name, "sana", "text", builtin=name, image_size=size, latent_channels=32,
                         latent_size=size // 32, scheduler=dict(scheduler), defaults=dict(defaults),
                         max_tokens=MAX_SEQUENCE_LENGTH, sizes=tuple(sana_bins(size // 32)), size_multiple=32,
                         lowercase_prompts=True, guidance_mode=guidance_mode)


def card(name: str, path: Path, transformer: dict, vae: dict | None, index: dict, scheduler: dict) -> ModelCard:
    _check_layout(path, transformer, vae, index, scheduler)
    extra = index.get("dit_serve", {})
    factor = 2 ** (len(vae["encoder_block_out_channels"]) - 1)  # SanaPipeline's vae_scale_factor: 32
    multiple = factor * int(transformer.get("patch_size", 1))
    sample_size = int(transformer.get("sample_size", 32))
    size = int(extra.get("image_size", sample_size * factor))
    if size % multiple:
        raise CardError(f"{path}/model_index.json: dit_serve.image_size {size} is not a multiple of {multiple} pixels")
    tokens = int(extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH))
    if tokens < 1:
        raise CardError(f"{path}/model_index.json: dit_serve.max_sequence_length must be at least 1, got {tokens}")
    sprint = index.get("_class_name") == SPRINT_PIPELINE
    euler = scheduler.get("_class_name") == "FlowMatchEulerDiscreteScheduler"
    defaults = SPRINT_DEFAULTS if sprint else EULER_DEFAULTS if euler else DEFAULTS
    tokenizer_json = path / "tokenizer" / "tokenizer.json"
    return ModelCard(
        name, "sana", "text", path=str(path), image_size=size, latent_channels=int(transformer.get("in_channels", 32)),
        latent_size=size // factor, dtype=extra.get("dtype", "bfloat16"), scheduler=scheduler,
        defaults={**defaults, **extra.get("defaults", {})}, max_tokens=tokens,
        sizes=tuple(listed_sizes(path, extra, multiple) or sana_bins(sample_size)), size_multiple=multiple,
        lowercase_prompts=True, tokenizer_file=str(tokenizer_json) if tokenizer_json.is_file() else "",
        guidance_mode="embedded" if sprint else "cfg")


def is_sprint(card: ModelCard) -> bool:
    """Whether ``card`` is a Sana Sprint model's: its guidance is embedded, which the layout check allows only for
    SanaSprintPipeline over a guidance-embedding transformer and SCMScheduler."""
    return card.guidance_mode == "embedded"


def _check_layout(path: Path, transformer: dict, vae: dict | None, index: dict, scheduler: dict) -> None:
    """CardError for what SanaPipeline's (or SanaSprintPipeline's) layout lacks or holds in another kind."""
    if not index:
        raise CardError(f"{path} is a bare SanaTransformer2DModel: Sana runs from its whole pipeline directory "
                        "(Efficient-Large-Model/Sana_1600M_1024px_diffusers's layout, with model_index.json)")
    for part, (file, what) in PARTS.items():
        if not (path / file).exists():
            raise CardError(f"{path} is a Sana pipeline without {part}/ ({what}): expected {path / file}")
    if vae.get("_class_name", "AutoencoderDC") != "AutoencoderDC":
        raise CardError(f"{path}/vae/config.json is a {vae.get('_class_name')}; a Sana pipeline's vae is "
                        f"{PARTS['vae'][1]}")
    text_encoder = read_json(path / "text_encoder" / "config.json")
    found = text_encoder.get("model_type")
    if found != GEMMA2:
        raise CardError(f"{path}/text_encoder/config.json has model_type {found!r}; a Sana pipeline's text_encoder is "
                        f"{PARTS['text_encoder'][1]} ({GEMMA2!r})")
    sprint = index.get("_class_name") == SPRINT_PIPELINE
    _check_guidance(path, transformer, sprint)
    width, caption = text_encoder.get("hidden_size"), transformer.get("caption_channels", 2304)
    if width != caption:
        raise CardError(f"{path}: the text encoder's hidden_size {width} is not the transformer's caption_channels "
                        f"{caption}")
    if transformer.get("in_channels", 32) != vae.get("latent_channels", 32):
        raise CardError(f"{path}: the transformer's in_channels {transformer.get('in_channels')} are not the VAE's "
                        f"latent_channels {vae.get('latent_channels')}")
    if sprint:
        _check_scm(path, scheduler)
        return
    kind = scheduler.get("_class_name")
    flow_dpm = kind == "DPMSolverMultistepScheduler" and scheduler.get("use_flow_sigmas") and \
        scheduler.get("prediction_type") == "flow_prediction"
    if not (flow_dpm or kind == "FlowMatchEulerDiscreteScheduler"):
        raise CardError(f"{path}/scheduler/scheduler_config.json is a {kind} ({scheduler.get('prediction_type')!r}); "
                        "a Sana pipeline samples with DPMSolverMultistepScheduler on flow sigmas (use_flow_sigmas, "
                        "prediction_type 'flow_prediction') or FlowMatchEulerDiscreteScheduler (SCMScheduler: Sana "
                        f"Sprint's, whose model_index.json names {SPRINT_PIPELINE})")


def _check_guidance(path: Path, transformer: dict, sprint: bool) -> None:
    """The transformer embeds the guidance scale exactly when the pipeline is SanaSprintPipeline: SanaPipeline feeds
    it none, and SanaSprintPipeline feeds one to every transformer."""
    embeds = bool(transformer.get("guidance_embeds"))
    if embeds and not sprint:
        raise CardError(f"{path}/transformer/config.json embeds the guidance scale (guidance_embeds: Sana Sprint's "
                        f"transformer), which SanaPipeline does not feed: a Sana Sprint directory's model_index.json "
                        f"names {SPRINT_PIPELINE}")
    if sprint and not embeds:
        raise CardError(f"{path}/transformer/config.json has no guidance_embeds: {SPRINT_PIPELINE} feeds the "
                        "guidance scale to its transformer, which this one does not take (a SanaPipeline model's)")


def _check_scm(path: Path, scheduler: dict) -> None:
    """Sana Sprint's scheduler: SCMScheduler on TrigFlow (``samplers.plans.scm``) with a positive sigma_data."""
    kind, predicts = scheduler.get("_class_name"), prediction_type(scheduler)
    if kind != "SCMScheduler" or predicts != "trigflow":
        raise CardError(f"{path}/scheduler/scheduler_config.json is a {kind} ({predicts!r}); a Sana Sprint pipeline "
                        "samples with SCMScheduler (prediction_type 'trigflow')")
    sigma_data = scheduler.get("sigma_data", 0.5)
    if isinstance(sigma_data, bool) or not isinstance(sigma_data, (int, float)) or not sigma_data > 0:
        raise CardError(f"{path}/scheduler/scheduler_config.json: sigma_data must be a positive number, got "
                        f"{sigma_data!r}")
