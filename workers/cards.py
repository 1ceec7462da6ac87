"""Model cards: what the service needs to know about a model, read from the model directory's own
files (model_index.json, the component configs, the scheduler config), without torch and without
weights.

One reader serves both sides: the API's catalog validates requests against the card (conditioning
kind, classes, sizes, sampler rules, defaults) in a process that may have no GPU and no torch, and the
worker's loader builds the model the card describes. A model therefore cannot be described one way
and loaded another.

    card = read_card("digits")          # a shipped model, a built-in architecture, or a directory
    card.conditioning                   # "class" (labels) or "text" (prompts)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from samplers.rules import prediction_type
from workers.labels import resolve_label
from workers.sizes import nearest_bin, parse_size, pixart_bins, ratio_sizes

MODELS_DIR = Path(__file__).resolve().parent / "models"
SHIPPED = ("digits", "digits-flow", "digits-text")  # pipeline directories under workers/models
DEFAULT_MODEL = "digits"  # what the CLI's local commands use when no model is named
DIT_SCHEDULER = {"num_train_timesteps": 1000, "beta_start": 0.0001, "beta_end": 0.02,
                 "beta_schedule": "linear", "prediction_type": "epsilon", "clip_sample": False}
FALLBACK_DEFAULTS = {"guidance": 4.0, "sampler": "ddim", "steps": 50}
DIT_CONFIG_DEFAULTS = {"sample_size": 32, "in_channels": 4}  # DiTTransformer2DModel's, for keys a config omits
BUILTINS = {"dit-xl-2-256": 256, "dit-xl-2-512": 512,  # DiT-XL/2 + sd-vae-ft-ema, random weights
            "pixart-sigma-512": 512, "pixart-sigma-1024": 1024,  # PixArt-Σ-XL/2 + T5-XXL + SDXL VAE (workers.builtins)
            "sd35-medium-1024": 1024,  # SD 3.5 medium: MMDiT-X, CLIP-L, CLIP-bigG, T5-XXL, 16-ch VAE (workers.builtins)
            "flux-dev-512": 512, "flux-dev-1024": 1024}  # FLUX.1-dev, CLIP-L, T5-XXL, 16-ch VAE (workers.builtins)
PIXART_SCHEDULER = {"num_train_timesteps": 1000, "beta_start": 0.0001, "beta_end": 0.02, "beta_schedule": "linear",
                    "prediction_type": "epsilon", "algorithm_type": "dpmsolver++", "solver_order": 2,
                    "timestep_spacing": "linspace"}  # PixArt-Σ's scheduler_config.json


class CardError(ValueError):
    """A model name or directory that cannot be served; the message says what to fix."""


@dataclass(frozen=True)
class ModelCard:
    """A model as the service sees it. ``dtype`` is what it runs in on a GPU (on a CPU, float32)."""

    name: str
    family: str                      # the workers.families module that runs it: dit | pixart | sd3 | flux
    conditioning: str                # "class" (labels) | "text" (prompts)
    path: str = ""                   # the model directory; empty for a built-in architecture
    builtin: str = ""                # a built-in architecture's name
    num_classes: int = 0
    id2label: dict[int, str] = field(default_factory=dict)
    image_size: int = 0              # pixels per side of the images it makes
    latent_channels: int = 0
    latent_size: int = 0             # latent cells per side
    pixel_space: bool = False        # no VAE: the latents are the image
    dtype: str = "bfloat16"          # on CUDA; a small model may ask for float32
    scheduler: dict = field(default_factory=dict)  # scheduler_config.json (DiT's schedule when empty)
    defaults: dict = field(default_factory=lambda: dict(FALLBACK_DEFAULTS))
    max_tokens: int = 0              # text models: prompts are encoded to exactly this many tokens
    sizes: tuple[tuple[int, int], ...] = ()  # (width, height) it makes; the native square when empty
    size_multiple: int = 1           # pixels per transformer patch (VAE factor x patch size)
    tokenizer_file: str = ""         # text models: tokenizer.json, when the directory has one (token counts)
    guidance_mode: str = "cfg"       # what `guidance` means: "cfg" (classifier-free, against the negative
                                     # prompt or null class) | "embedded" (a network input: FLUX.1-dev) |
                                     # "none" (ignored: FLUX.1-schnell)
    lowercase_prompts: bool = False  # the family lower-cases prompts before tokenising (PixArt's pipelines do)

    @property
    def prediction_type(self) -> str:
        return prediction_type(self.scheduler or DIT_SCHEDULER)

    @property
    def num_train_timesteps(self) -> int:
        return int((self.scheduler or DIT_SCHEDULER).get("num_train_timesteps", 1000))

    @property
    def native_size(self) -> tuple[int, int]:
        return self.image_size, self.image_size

    def made_sizes(self) -> list[tuple[int, int]]:
        """The (width, height) sizes it generates at, the native size first."""
        return [self.native_size, *(s for s in self.sizes if s != self.native_size)]

    def size_for(self, width: int | None, height: int | None) -> tuple[int, int]:
        """The (width, height) it generates for a request: the native size when neither is given (a missing
        one is the native side), the size itself when it makes it, else the aspect-ratio bin nearest the
        asked ratio (models with bins, as the reference pipelines snap). ValueError when it has one size."""
        w, h = width or self.image_size, height or self.image_size
        sizes = self.made_sizes()
        if (w, h) in sizes:
            return w, h
        if len(sizes) == 1:
            raise ValueError(f"model {self.name!r} makes {self.image_size}x{self.image_size} images only; "
                             f"{w}x{h} is not one of its sizes (leave width and height out)")
        return nearest_bin(w, h, sizes)

    def latent_shape(self, width: int, height: int) -> tuple[int, int, int]:
        """(C, H, W) of the latents for an image it makes at width x height."""
        factor = self.image_size // self.latent_size
        return self.latent_channels, height // factor, width // factor

    def label_id(self, label: int | str) -> int:
        """A class index from a number or a name in id2label; ValueError with a message otherwise."""
        return resolve_label(label, self.num_classes, self.id2label, self.name)

    def class_names(self) -> list[str]:
        return [self.id2label.get(i, "") for i in range(self.num_classes)] if self.id2label else []


def builtin_names() -> list[str]:
    return [*SHIPPED, *BUILTINS]


def read_card(spec: str | Path) -> ModelCard:
    """The card of a shipped model (``digits``), a built-in architecture (``dit-xl-2-256``) or a local
    diffusers-format directory (a pipeline with model_index.json, or a bare transformer)."""
    spec = str(spec)
    if spec in BUILTINS and spec.startswith("pixart-"):
        size = BUILTINS[spec]
        return ModelCard(spec, "pixart", "text", builtin=spec, image_size=size, latent_channels=4, latent_size=size // 8,
                         scheduler=dict(PIXART_SCHEDULER), max_tokens=300, sizes=tuple(pixart_bins(size // 8)),
                         size_multiple=16, defaults={"sampler": "dpmpp_2m", "steps": 20, "guidance": 4.5},
                         lowercase_prompts=True)
    if spec in BUILTINS and spec.startswith("sd35-"):
        from workers.layouts.sd3 import aspect_sizes

        size = BUILTINS[spec]  # SD3.5 medium's scheduler_config.json; its model card's 40 steps at CFG 4.5
        scheduler = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}
        return ModelCard(spec, "sd3", "text", builtin=spec, image_size=size, latent_channels=16,
                         latent_size=size // 8, scheduler=scheduler, max_tokens=256, sizes=tuple(aspect_sizes(size, 16)),
                         size_multiple=16, defaults={"sampler": "flow_euler", "steps": 40, "guidance": 4.5})
    if spec in BUILTINS and spec.startswith("flux-dev-"):
        from workers.layouts.flux import DEV

        size = BUILTINS[spec]  # FLUX.1-dev's scheduler_config.json, on FluxPipeline's sigma grid
        scheduler = {"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
                     "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
                     "use_dynamic_shifting": True, "flow_grid": "flux"}
        return ModelCard(spec, "flux", "text", builtin=spec, image_size=size, latent_channels=16,
                         latent_size=size // 8, scheduler=scheduler, defaults=dict(DEV["defaults"]),
                         max_tokens=DEV["max_tokens"], sizes=tuple(ratio_sizes(size, 16)), size_multiple=16,
                         guidance_mode="embedded")
    if spec in BUILTINS:
        size = BUILTINS[spec]
        return ModelCard(spec, "dit", "class", builtin=spec, num_classes=1000, image_size=size, latent_channels=4,
                         latent_size=size // 8, scheduler=dict(DIT_SCHEDULER))
    path = MODELS_DIR / spec if spec in SHIPPED else Path(spec).expanduser()
    if not path.exists():
        raise CardError(f"unknown model {spec!r}: not a built-in name ({', '.join(builtin_names())}) "
                        "and no such directory")
    if not path.is_dir():
        raise CardError(f"model path {spec!r} is not a directory (expected a diffusers-format model directory)")
    name = spec if spec in SHIPPED else path.name
    if (path / "model_index.json").is_file():
        return _pipeline_card(path, name)
    if (path / "config.json").is_file():
        return _dit_card(name, path, read_json(path / "config.json"), vae=None, index={}, scheduler={})
    raise CardError(f"{path} holds neither model_index.json (a pipeline) nor config.json (a transformer)")


def _pipeline_card(path: Path, name: str) -> ModelCard:
    index = read_json(path / "model_index.json")
    if not (path / "transformer" / "config.json").is_file():
        raise CardError(f"{path}/model_index.json has no transformer/config.json beside it")
    transformer = read_json(path / "transformer" / "config.json")
    vae = read_json(path / "vae" / "config.json") if (path / "vae" / "config.json").is_file() else None
    sched_file = path / "scheduler" / "scheduler_config.json"
    scheduler = read_json(sched_file) if sched_file.is_file() else {}
    if transformer.get("_class_name") == "PixArtTransformer2DModel":
        return _pixart_card(name, path, transformer, vae, index, scheduler)
    from workers.layouts import LAYOUTS

    if transformer.get("_class_name") in LAYOUTS:
        return LAYOUTS[transformer["_class_name"]](name, path, transformer, vae, index, scheduler)
    return _dit_card(name, path, transformer, vae, index, scheduler)


def _pixart_card(name: str, path: Path, cfg: dict, vae: dict | None, index: dict, scheduler: dict) -> ModelCard:
    """PixArt-α/Σ pipeline directories: PixArtTransformer2DModel, a T5 text encoder and its tokenizer."""
    for part in ("text_encoder/config.json", "tokenizer"):
        if not (path / part).exists():
            raise CardError(f"{path} is a PixArt pipeline without {part}: a text model needs its encoder and tokenizer")
    extra = index.get("dit_serve", {})
    sigma = index.get("_class_name") != "PixArtAlphaPipeline"
    factor = 2 ** (len(vae["block_out_channels"]) - 1) if vae is not None else 1
    size = int(cfg.get("sample_size", 128))
    defaults = {"sampler": "dpmpp_2m", "steps": 20, "guidance": 4.5}  # the reference pipelines' defaults
    multiple = factor * int(cfg.get("patch_size", 2))
    sizes = _listed_sizes(path, extra, multiple) or pixart_bins(size)
    return ModelCard(
        name, "pixart", "text", path=str(path), image_size=size * factor, latent_channels=int(cfg.get("in_channels", 4)),
        latent_size=size, pixel_space=vae is None, dtype=extra.get("dtype", "bfloat16"), scheduler=scheduler,
        defaults={**defaults, **extra.get("defaults", {})},
        max_tokens=int(extra.get("max_sequence_length", 300 if sigma else 120)), sizes=tuple(sizes),
        size_multiple=multiple, lowercase_prompts=True, tokenizer_file=str(path / "tokenizer" / "tokenizer.json")
        if (path / "tokenizer" / "tokenizer.json").is_file() else "")


def _listed_sizes(path: Path, extra: dict, multiple: int) -> list[tuple[int, int]]:
    """Sizes a model directory lists in model_index.json (``dit_serve.sizes``: ["WxH", ...]): for models
    without reference bins. Each side a multiple of the patch in pixels."""
    out = []
    for text in extra.get("sizes", []):
        try:
            w, h = parse_size(str(text))
        except ValueError as e:
            raise CardError(f"{path}/model_index.json: dit_serve.sizes: {e}") from None
        if w % multiple or h % multiple:
            raise CardError(f"{path}/model_index.json: dit_serve.sizes: {text!r} is not a multiple of "
                            f"{multiple} pixels (the VAE factor times the patch size)")
        out.append((w, h))
    return out


def _dit_card(name: str, path: Path, cfg: dict, vae: dict | None, index: dict, scheduler: dict) -> ModelCard:
    if cfg.get("norm_type") != "ada_norm_zero" or not cfg.get("num_embeds_ada_norm"):
        raise CardError(f"{path} is not a class-conditional DiT (needs norm_type 'ada_norm_zero' and "
                        "num_embeds_ada_norm): other transformers are not supported yet")
    extra = index.get("dit_serve", {})
    factor = 2 ** (len(vae["block_out_channels"]) - 1) if vae is not None else 1  # the VAE's downsampling
    size = int(cfg.get("sample_size", DIT_CONFIG_DEFAULTS["sample_size"]))
    return ModelCard(
        name, "dit", "class", path=str(path), num_classes=int(cfg["num_embeds_ada_norm"]),
        id2label={int(k): v for k, v in (index.get("id2label") or {}).items()}, image_size=size * factor,
        latent_channels=int(cfg.get("in_channels", DIT_CONFIG_DEFAULTS["in_channels"])), latent_size=size, pixel_space=vae is None,
        dtype=extra.get("dtype", "bfloat16"), scheduler=scheduler,
        defaults={**FALLBACK_DEFAULTS, **extra.get("defaults", {})})


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CardError(f"missing {path}") from None
    except json.JSONDecodeError as e:
        raise CardError(f"{path} is not valid JSON: {e}") from None
    except OSError as e:
        raise CardError(f"cannot read {path}: {e}") from None
