"""Load a model the family its card names builds (``Family.load``), from a local diffusers-format
directory or a built-in architecture, and what every family's loader shares: safetensors-only weights
(pickle-based ones, ``.bin``, ``.pt``, ``.pth``, ``.ckpt``, are refused: unpickling runs code), building
without random initialisation, casting and freezing, the VAE, and the ``LoadedModel`` they return.

The directory layouts each family accepts are in its folder (``workers.families.<name>``), read by
``workers.request.cards.read_card``: the same reader the API uses.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from samplers import NoiseSchedule
from workers.families.encoders import encoders_on, load_text_encoder
from workers.families import family_named
from workers.families.base import DIT_SCHEDULER, FALLBACK_DEFAULTS, CardError, ModelCard, read_json
from workers.request.cards import read_card
from workers.request.labels import resolve_label
from workers.speed.apply import unsupported_reason
from workers.speed.config import PRECISIONS

log = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


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
    card: ModelCard | None = None  # what it was loaded from (workers.request.cards)
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
    (``workers.request.cards.read_card``, the same reader the API uses) describes, built by its family's
    ``load``. Text encoders load on ``encoder_device`` when given (offload: "cpu", another GPU), once per
    distinct weights.
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
    return family_named(card.family).load(card, device, dtype)


def assemble(card: ModelCard, transformer, vae) -> LoadedModel:
    c, size = card.latent_channels, card.latent_size
    return LoadedModel(
        name=card.name, transformer=transformer, vae=vae,
        schedule=NoiseSchedule.from_config(card.scheduler or DIT_SCHEDULER),
        num_classes=card.num_classes, latent_shape=(c, size, size), image_size=card.image_size,
        learned_sigma=getattr(transformer.config, "out_channels", c) == 2 * c,  # none named (Z-Image): out = in
        vae_scale=float(getattr(vae.config, "scaling_factor", 0.18215)) if vae is not None else 1.0,
        vae_shift=float(getattr(vae.config, "shift_factor", None) or 0.0) if vae is not None else 0.0,
        id2label=card.id2label, defaults=card.defaults, card=card)


def load_vae(path: Path, device, dtype) -> torch.nn.Module:
    from diffusers import AutoencoderKL

    return cast(load_component(AutoencoderKL, path), device, dtype)


def load_component(cls, path: Path) -> torch.nn.Module:
    """``cls`` from a component folder (its config.json and *.safetensors): refused before anything is
    built when it has no safetensors, and built without random initialisation (``_no_init``), since every
    parameter and persistent buffer then comes from the file (a missing one is a ModelError)."""
    refuse_without_safetensors(path)
    with _no_init():
        model = instantiate(cls, read_config(path / "config.json"))
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


def cast(model: torch.nn.Module, device, dtype: torch.dtype) -> torch.nn.Module:
    """Move, cast and freeze for inference. nn.Module.to, not diffusers' override: the override logs a
    warning on every dtype cast (its keep-in-float32 check) even for models with nothing to keep."""
    return torch.nn.Module.to(model, device=device, dtype=dtype).eval().requires_grad_(False)


def instantiate(cls, cfg: dict) -> torch.nn.Module:
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


def read_config(path: Path) -> dict:
    """The card reader's JSON reading (``workers.families.base.read_json``: same messages), as ModelError."""
    try:
        return read_json(path)
    except CardError as e:
        raise ModelError(str(e)) from None


def weight_files(path: Path, stem: str) -> list[Path]:
    """The safetensors files of a component: the shards its ``<stem>.safetensors.index.json`` names (each
    must be there), else ``<stem>.safetensors``. ModelError for pickles only, a missing shard, or none."""
    index = path / f"{stem}.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ModelError(f"{index} is not a safetensors index (a weight_map of tensor -> shard): {e}") from None
        absent = [s for s in shards if not (path / s).is_file()]
        if absent:
            raise ModelError(f"{path} lacks shards its index names: {', '.join(absent)}")
        return [path / s for s in shards]
    if (path / f"{stem}.safetensors").is_file():
        return [path / f"{stem}.safetensors"]
    refuse_without_safetensors(path, f"{stem}.safetensors (or shards with {stem}.safetensors.index.json)")
    raise ModelError(f"{path} has no {stem}.safetensors (nor shards with {stem}.safetensors.index.json)")


def load_sharded(cls, path: Path, device, dtype, stem: str = "diffusion_pytorch_model") -> torch.nn.Module:
    """``cls`` (a diffusers model) from a component folder of sharded or single safetensors (``weight_files``):
    built on the meta device and given the checkpoint's tensors (``assign``), so a large model is neither
    randomly initialised nor held twice on the host. ModelError when the weights do not match its config."""
    from safetensors.torch import load_file

    files = weight_files(path, stem)
    with torch.device("meta"):
        model = instantiate(cls, read_config(path / "config.json"))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f), device=str(torch.device(device))))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ModelError(f"weights in {path} do not match its config.json: {len(missing)} missing "
                         f"(e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]})")
    return cast(model, device, dtype)


def load_checked_encoder(cls, path: Path, device, dtype) -> torch.nn.Module:
    """A transformers text encoder ``cls`` from ``path`` (``workers.families.encoders.load_text_encoder``: local files,
    shared for identical weights), after our own checks of its files: pickles refused, every shard there."""
    weight_files(path, "model")
    return load_text_encoder(cls, path, device, dtype)
