"""Load class-conditional DiT models from local diffusers-format directories (safetensors only).

Accepted layouts, never fetched from a hub:
- a pipeline directory: ``model_index.json`` with ``transformer/``, optional ``vae/`` and
  ``scheduler/scheduler_config.json`` (the layout of ``facebook/DiT-XL-2-256`` and ``-512``,
  whose ``id2label`` lets users name classes), or
- a bare transformer directory: ``config.json`` plus ``*.safetensors``.

Built-in names: ``digits``, ``digits-flow`` and ``digits-text`` (the shipped models), ``dit-xl-2-256`` /
``dit-xl-2-512`` (the DiT-XL/2 architecture with the sd-vae-ft-ema VAE) and ``pixart-sigma-512`` /
``pixart-sigma-1024`` (PixArt-Σ-XL/2, a T5-XXL-sized encoder, the SDXL VAE), randomly initialised on
the device, for benchmarks.
Pickle-based weights (``.bin``, ``.pt``, ``.pth``, ``.ckpt``) are refused: unpickling runs code.
"""

from __future__ import annotations

import inspect
import logging
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from samplers import NoiseSchedule
from workers.speed.apply import unsupported_reason
from workers.speed.config import PRECISIONS
from workers.cards import DIT_SCHEDULER, FALLBACK_DEFAULTS, CardError, ModelCard, read_card, read_json
from workers.encoders import encoders_on, load_text_encoder, place_encoder
from workers.labels import resolve_label

log = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
DIT_XL_2 = dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8,
                num_layers=28, patch_size=2, num_embeds_ada_norm=1000, norm_type="ada_norm_zero")
SD_VAE_FT_EMA = dict(
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=[128, 256, 512, 512],
    down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
    layers_per_block=2, norm_num_groups=32, act_fn="silu", scaling_factor=0.18215)


class ModelError(CardError):
    """A model name or directory that cannot be served; the message says what to fix."""


@dataclass
class LoadedModel:
    """A transformer (and VAE for latent models) ready to serve, with what the service needs to know."""

    name: str
    transformer: torch.nn.Module
    vae: torch.nn.Module | None
    schedule: NoiseSchedule
    num_classes: int
    latent_shape: tuple[int, int, int]  # (C, H, W) the sampler works on
    image_size: int                     # pixels per side of the decoded image
    learned_sigma: bool                 # out_channels == 2 * in_channels: keep the first half
    vae_scale: float = 1.0
    vae_shift: float = 0.0              # SD3/FLUX VAEs: latents are decoded as latents / scale + shift
    id2label: dict[int, str] = field(default_factory=dict)
    defaults: dict = field(default_factory=lambda: dict(FALLBACK_DEFAULTS))
    card: ModelCard | None = None  # what it was loaded from (workers.cards)
    precision: str = "bf16"        # what it runs in (workers.speed.apply makes it so): "fp8": its blocks' linears as FP8
                                   # matrix products (workers.speed.fp8); "fp8+attention": and its joint attention
    fp8_linears: int = 0           # how many linears are FP8 now
    text_encoder: torch.nn.Module | None = None  # text models: the prompt encoder and its tokenizer
    tokenizer: object = None
    cache: OrderedDict = field(default_factory=OrderedDict)  # the family's encodings, by text (LRU)
    text_graphs: object = None  # the text encoder's CUDA-graph replays, when an engine made them (EncoderGraphs)

    @property
    def null_class(self) -> int:
        """The label embedding's extra row, used for the unconditional half of CFG."""
        return self.num_classes

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.transformer.parameters()).dtype

    def label_id(self, label: int | str) -> int:
        """A class index from a number or a name in id2label; ModelError when it is not a class."""
        try:
            return resolve_label(label, self.num_classes, self.id2label, self.name)
        except ValueError as e:
            raise ModelError(str(e)) from None


def run_dtype(card: ModelCard, device: str | torch.device) -> torch.dtype:
    """The dtype a model runs in: its card's on CUDA (bfloat16 unless it asks for float32), float32 elsewhere."""
    return getattr(torch, card.dtype) if torch.device(device).type == "cuda" else torch.float32


def load_model(spec: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, encoder_device: str | None = None,
               precision: str = "bf16") -> LoadedModel:
    """Load ``digits``, a built-in architecture name, or a local model directory: the model its card
    (``workers.cards.read_card``, the same reader the API uses) describes. Text encoders load on
    ``encoder_device`` when given (offload: "cpu", another GPU), once per distinct weights.
    ``precision``: what the model is to run in (``workers.speed.config.PRECISIONS``), made so by the speed
    layer (``workers.speed.apply``: "fp8", its blocks' linears as FP8 matrix products; "fp8+attention", those
    and SD3's and FLUX.1's joint attention in FP8 under the graph backends). A device without what the
    precision needs is refused here (ModelError), before anything loads."""
    if precision not in PRECISIONS:
        raise ModelError(f"unknown precision {precision!r}: 'bf16' (the model's dtype), 'fp8' (FP8 linears) "
                         "or 'fp8+attention' (FP8 linears and attention)")
    if (why := unsupported_reason(precision, device)) is not None:
        raise ModelError(f"cannot run {spec} in {precision}: {why}")
    with encoders_on(encoder_device):
        model = _load_model(spec, device, dtype)
    model.precision = precision
    return model


def _load_model(spec, device, dtype) -> LoadedModel:
    try:
        card = read_card(spec)
    except CardError as e:
        raise ModelError(str(e)) from None
    if card.family not in ("dit", "pixart"):  # families that load themselves (workers.families.<name>.load)
        from workers.families import FAMILIES

        return FAMILIES[card.family].load(card, device, dtype)
    if card.builtin:
        return (_builtin_pixart if card.family == "pixart" else _builtin_dit_xl)(card, device, dtype)
    path = Path(card.path)
    if not (path / "model_index.json").exists():
        return _assemble(card, _load_transformer(path, device, dtype), None)
    vae = _load_vae(path / "vae", device, dtype) if (path / "vae" / "config.json").is_file() else None
    if card.family == "pixart":
        return _load_pixart(card, path, vae, device, dtype)
    return _assemble(card, _load_transformer(path / "transformer", device, dtype), vae)


def _load_pixart(card: ModelCard, path: Path, vae, device, dtype) -> LoadedModel:
    """PixArtTransformer2DModel, the T5 encoder (transformers) and its tokenizer, from local files only."""
    from diffusers import PixArtTransformer2DModel
    from transformers import AutoTokenizer, T5EncoderModel

    transformer = load_component(PixArtTransformer2DModel, path / "transformer")
    refuse_without_safetensors(path / "text_encoder", "model.safetensors")
    # transformers' loader: sharded checkpoints and tied embeddings; use_safetensors refuses pickles; one
    # copy per process for identical weights (workers.encoders)
    encoder = load_text_encoder(T5EncoderModel, path / "text_encoder", device, dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True)
    model = _assemble(card, _cast(transformer, device, dtype), vae)
    model.text_encoder, model.tokenizer = encoder, tokenizer
    return model


def _assemble(card: ModelCard, transformer, vae) -> LoadedModel:
    c, size = card.latent_channels, card.latent_size
    return LoadedModel(
        name=card.name, transformer=transformer, vae=vae,
        schedule=NoiseSchedule.from_config(card.scheduler or DIT_SCHEDULER),
        num_classes=card.num_classes, latent_shape=(c, size, size), image_size=card.image_size,
        learned_sigma=transformer.config.out_channels == 2 * c,
        vae_scale=float(getattr(vae.config, "scaling_factor", 0.18215)) if vae is not None else 1.0,
        vae_shift=float(getattr(vae.config, "shift_factor", None) or 0.0) if vae is not None else 0.0,
        id2label=card.id2label, defaults=card.defaults, card=card)


def _load_transformer(path: Path, device, dtype) -> torch.nn.Module:
    from diffusers import DiTTransformer2DModel

    return _cast(load_component(DiTTransformer2DModel, path), device, dtype)  # the card checked it is a DiT


def _load_vae(path: Path, device, dtype) -> torch.nn.Module:
    from diffusers import AutoencoderKL

    return _cast(load_component(AutoencoderKL, path), device, dtype)


def load_component(cls, path: Path) -> torch.nn.Module:
    """``cls`` from a component folder (its config.json and *.safetensors): refused before anything is
    built when it has no safetensors, and built without random initialisation (``_no_init``), since every
    parameter and persistent buffer then comes from the file (a missing one is a ModelError)."""
    refuse_without_safetensors(path)
    with _no_init():
        model = _instantiate(cls, _read_json(path / "config.json"))
    _load_weights(model, path)
    return model


# torch.nn.init's in-place initialisers, which the layers' reset_parameters call while being built
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                 "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                 "sparse_")


@contextmanager
def _no_init():
    """Layers built inside keep their allocated, uninitialised memory: a random initialisation that the
    checkpoint overwrites (seconds for DiT-XL/2 on a CPU, minutes for larger models) is skipped. Only
    torch.nn.init's initialisers are skipped; buffers a module computes (position tables) are made as usual."""
    saved = {name: getattr(torch.nn.init, name) for name in _INITIALISERS if hasattr(torch.nn.init, name)}
    try:
        for name in saved:
            setattr(torch.nn.init, name, lambda tensor, *a, **k: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _cast(model: torch.nn.Module, device, dtype: torch.dtype) -> torch.nn.Module:
    """Move, cast and freeze for inference. nn.Module.to, not diffusers' override: the override logs a
    warning on every dtype cast (its keep-in-float32 check) even for models with nothing to keep."""
    return torch.nn.Module.to(model, device=device, dtype=dtype).eval().requires_grad_(False)


def _instantiate(cls, cfg: dict) -> torch.nn.Module:
    """Build ``cls`` from a config, keeping only the keys its constructor takes (Transformer2DModel
    configs carry keys DiTTransformer2DModel does not need)."""
    params = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in cfg.items() if k in params})


def refuse_without_safetensors(path: Path, expected: str = "diffusion_pytorch_model.safetensors") -> None:
    """ModelError when a component folder has no .safetensors: pickle files are named and refused
    (loading them runs code), otherwise the file that was expected is named."""
    if any(path.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES) if path.is_dir() else []
    if pickles:
        raise ModelError(f"{path} has only pickle weights ({', '.join(pickles)}); they are refused because "
                         "loading them runs arbitrary code. Convert them to .safetensors.")
    raise ModelError(f"{path} has no weights: expected {expected}")


def _load_weights(model: torch.nn.Module, path: Path) -> None:
    from safetensors.torch import load_file

    refuse_without_safetensors(path)
    files = sorted(path.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ModelError(f"weights in {path} do not match its config.json: {len(missing)} missing "
                         f"(e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]})")


def _builtin_dit_xl(card: ModelCard, device, dtype) -> LoadedModel:
    """DiT-XL/2 with random weights (a seeded init), built directly on the device."""
    from diffusers import AutoencoderKL, DiTTransformer2DModel

    torch.manual_seed(0)
    with torch.device(device):
        transformer = DiTTransformer2DModel(**DIT_XL_2, sample_size=card.latent_size)
        vae = AutoencoderKL(**SD_VAE_FT_EMA, sample_size=card.image_size)
    return _assemble(card, _cast(transformer, device, dtype), _cast(vae, device, dtype))


def _builtin_pixart(card: ModelCard, device, dtype) -> LoadedModel:
    """PixArt-Σ-XL/2 with a T5-XXL-sized encoder and the SDXL VAE, random weights made on the device
    (workers.builtins: never materialised on the host)."""
    from workers.builtins import build_pixart_sigma

    transformer, encoder, tokenizer, vae = build_pixart_sigma(card.image_size, device, dtype)
    model = _assemble(card, transformer, vae)
    model.text_encoder, model.tokenizer = place_encoder(encoder, device, dtype), tokenizer
    return model


def _read_json(path: Path) -> dict:
    """The card reader's JSON reading (same messages), as this module's ModelError."""
    try:
        return read_json(path)
    except CardError as e:
        raise ModelError(str(e)) from None
