"""The family interface: what a model family reads (its ``ModelCard``) and the hooks the engine calls.

A family is one folder, ``workers/families/<name>/``, in two parts:

- ``__init__.py``, torch-free: a ``Family`` subclass that reads the model directories it accepts into a
  ``ModelCard`` (``pipelines``, ``transformers``, ``read_card``), names its built-in architectures
  (``builtins``, ``builtin_card``) and their memory, and maps its latents to preview RGB (``previews``).
  The API process imports only this part (it runs without torch).
- the torch part (``runtime``, "module:Class"): a subclass of the first that loads the model and runs it
  (``load``, ``cond_specs``, ``encode``, ``make_step`` and the optional hooks below).

``runtime_of`` is the one place a family's torch part is imported, lazily, once: the registry
(``workers.families``) holds the torch-free part, so reading cards never imports torch. A family defined
in one torch module (a test's toy) leaves ``runtime`` empty: it is its own torch part.

Hooks, all called with the loaded model (``workers.loading.LoadedModel``) as their first argument:

    required
    load(card, device, dtype) -> LoadedModel     build the model the card describes
    cond_specs(model) -> {name: TensorSpec}      the per-sample conditioning inputs of the captured step
    encode(model, specs) -> [{name: Tensor}]     each request's conditioning, on the host, outside capture
                                                 (class labels -> ids; prompts -> text encoder, batched)
    make_step(model, shape, variant="") -> step(x, t, guidance, coeffs, hist, noise, **cond) -> {"x_next",
                                                 "hist_next"}: one whole denoising step: CFG, transformer,
                                                 sampler update (``variant``: one of ``step_variants``)

    optional (default)
    break_attention (False)                      the graph backends patch its self-attention (an eager
                                                 break under breakable; fused q, k, v and the kernel per shape)
    joint_attention (False)                      the graph backends route its joint attention through the
                                                 kernel per shape (SD3's and FLUX.1's processors)
    encoder_graphs (False)                       the graph backends replay its text encoder from CUDA graphs
                                                 (``model.text_graphs``, which its encode uses)
    needs_breaks(model) (False)                  the step has eager breaks: backend "graphs" captures it
                                                 breakable, else whole (full)
    step_variants(model) (("",))                 the steps it captures per shape: "" (the step), and e.g.
                                                 NO_CFG, the step of the rows whose guidance means no classifier-
                                                 free guidance (one forward per image instead of two)
    variant_of(model, spec) ("")                 the variant a request's rows run (its guidance decides; FLUX.1
                                                 Kontext's: its reference image's token grid)
    variant_specs(model, shape, variant) ({})    the variant's own per-sample inputs, beside cond_specs' (FLUX.1
                                                 Kontext's reference tokens, whose count the variant fixes); its
                                                 encode returns them for the variant's requests
    plan_kwargs(model, shape) ({})               extra arguments of make_plan for latents of this shape
                                                 (FLUX.1-dev's resolution-dependent shift ``mu``)
    compile_regions(model) (repeated blocks)     what a blocks-scope compile compiles; None: the whole step
    uncompiled_on ({})                           device type -> why the family's step runs uncompiled there
                                                 even where its speed compiles (a compiled step not yet shown
                                                 to equal eager on that device); the reason is in the stats
    static_batch_on ({})                         device type -> why its step compiles per batch size there
                                                 (``graphs.compiled``: a static compile; its dynamic-batch
                                                 code differs from eager on that device)
    table_specs(model) ({})                      per-step inputs known at admission (SD3's and FLUX.1's
                                                 modulation tables), per sample; where not empty:
    step_tables(model, plans, specs, conds)      each request's tables at every step of its plan, and
    table_inputs(model, inputs)                  the tables' inputs of a step's rows (benchmarks)
    set_cross_attention(model, mode) (no-op)     the engine's cross_attention setting (PixArt)
    attention_kernel(model) (None)               the attention kernel its steps run, for the engine's report
    takes_image, takes_mask (False)             it runs image-to-image / inpainting requests (``workers.edits``);
                                                 the cards say so (``ModelCard.takes_image``, ``takes_mask``)
    encode_image(model, pixels, generators)      (B, 3, H, W) in [-1, 1] -> (B, C, h, w) latents in the engine's
        (the VAE's posterior, then              layout, the inverse of its decode; the posterior sampled with each
        (z - shift) * scale; pixel models:      row's generator as its pipelines sample it, or its mode where they
        the pixels)                             take the mode (``generators`` None)
    mask_latents(model, mask, shape) (nearest)   a binary mask (B, 1, H, W) on the latent grid (B, 1, h, w), as the
                                                 family's inpaint pipeline downsamples it
    reference_pipeline(model) (none)            the family's diffusers pipeline over the loaded model's modules
                                                 and its card's scheduler: the baseline benchmarks compare with
    reference_call(model, specs) ({})            the keyword arguments of that pipeline's call making ``specs``
                                                 (one size, one sampler setting): prompts or labels, size, steps,
                                                 guidance, as the card's defaults mean them
    speed_rewrites(model, stage, config, graphs) (nothing; 0)
                                                 the family's own fast paths (FLUX.1's blocks), made by the
                                                 speed layer's ``apply`` at each of ``SPEED_STAGES`` in its
                                                 order (below); returns how many modules it rewrote

The speed layer (``workers.speed.apply``) reads the flags and calls the hooks above; it imports no family.
A family's own fast paths live in its folder (``workers/families/flux/fast.py``) and reach the generic
rewrites in two ways: ``speed_rewrites`` at the points below, and the speed layer's registries (a routed
joint attention processor registers itself with ``workers.speed.routing.routes``).

    speed_rewrites stage  when ``apply`` calls it (after the generic rewrite of that point)
    "precision"           its linears are FP8 now (``to_precision``), before any other rewrite; every backend
    "epilogues"           the GELU epilogues are in (graph backends, ``SpeedConfig.gelu_epilogue``)
    "norms"               the FP8 blocks' norms are fused (graph backends, ``attention_patch``, a family with
                          ``break_attention`` or ``joint_attention``)
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from samplers.rules import prediction_type
from workers.families.previews import IDENTITY, PreviewMap
from workers.request.labels import resolve_label
from workers.request.sizes import nearest_bin, parse_size

DIT_SCHEDULER = {"num_train_timesteps": 1000, "beta_start": 0.0001, "beta_end": 0.02,
                 "beta_schedule": "linear", "prediction_type": "epsilon", "clip_sample": False}
FALLBACK_DEFAULTS = {"guidance": 4.0, "sampler": "ddim", "steps": 50}
NO_CFG = "no-cfg"  # a step variant: the rows whose guidance turns classifier-free guidance off, as the reference
                  # pipeline skips the unconditional forward for them (Family.step_variants)
SPEED_STAGES = ("precision", "epilogues", "norms")  # where workers.speed.apply calls speed_rewrites, in order


class CardError(ValueError):
    """A model name or directory that cannot be served; the message says what to fix."""


@dataclass(frozen=True)
class ModelCard:
    """A model as the service sees it. ``dtype`` is what it runs in on a GPU (on a CPU, float32)."""

    name: str
    family: str                      # the registered family that runs it (workers.families): dit | pixart | ...
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
    sizes: tuple[tuple[int, int], ...] = ()  # (width, height) it lists (and snaps to, without size_range);
                                             # the native square when empty
    size_multiple: int = 1           # pixels per transformer patch (VAE factor x patch size)
    size_range: tuple[int, int] = (0, 0)  # (min, max) px per side of the sizes it also makes unlisted: every
                                     # multiple of size_multiple in it, as the reference pipeline (FLUX.1, SD3);
                                     # (0, 0): only ``sizes`` (PixArt's pipelines snap to their bins)
    rounds_down: bool = False        # with size_range: a side off the multiple is rounded down to one, as
                                     # FluxPipeline does; else refused, as StableDiffusion3Pipeline does
    tokenizer_file: str = ""         # text models: tokenizer.json, when the directory has one (token counts)
    guidance_mode: str = "cfg"       # what `guidance` means: "cfg" (classifier-free, against the negative
                                     # prompt or null class) | "embedded" (a network input: FLUX.1-dev) |
                                     # "none" (ignored: FLUX.1-schnell)
    lowercase_prompts: bool = False  # the family lower-cases prompts before tokenising (PixArt's pipelines do)
    warnings: tuple[str, ...] = ()   # what a user should know of how it is served (an edit model served as
                                     # text-to-image): GET /v1/models shows them, each job repeats them
    takes_image: bool = False        # it runs image-to-image (an input image and a strength): its family's
    takes_mask: bool = False         # and inpainting (an image and a mask); set by read_card from the family
    edit: str = ""                   # what an input image means: "" (none taken), "image-to-image" (varied at a
                                     # strength; inpainted with a mask: workers.edits), "reference" (an
                                     # instruction edit: the image is a reference the prompt edits, FLUX.1
                                     # Kontext, Qwen-Image-Edit; no strength, no mask)
    reference_sizes: tuple[tuple[int, int], ...] = ()  # "reference": the (width, height) a reference image is
                                     # resized to, the one of the nearest aspect ratio (FLUX.1 Kontext's preferred
                                     # resolutions); empty: the family's rule (Kontext: its own size, sides rounded
                                     # down to size_multiple)
    needs_image: bool = False        # "reference": a request without an image is refused, as the model's pipeline
                                     # needs one (Qwen-Image-Edit); False: it runs as text-to-image (FLUX.1 Kontext)
    max_images: int = 1              # "reference": the most reference images a request may send (Qwen-Image-Edit-
                                     # Plus reads several: "the person of image 1 in the scene of image 2")

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
        """The (width, height) sizes it lists, the native size first (``makes`` also takes unlisted ones)."""
        return [self.native_size, *(s for s in self.sizes if s != self.native_size)]

    def makes(self, width: int, height: int) -> bool:
        """Whether it generates width x height as it is: a size it lists, or one inside ``size_range``. The one
        test of a size (the API, the engine's admission and warm-up)."""
        return (width, height) in self.made_sizes() or self.in_range(width, height)

    def in_range(self, width: int, height: int) -> bool:
        """Whether it makes width x height without listing it: sides multiples of its patch in ``size_range``."""
        lo, hi = self.size_range
        m = self.size_multiple
        return bool(hi) and lo <= width <= hi and lo <= height <= hi and not width % m and not height % m

    def size_for(self, width: int | None, height: int | None) -> tuple[int, int]:
        """The (width, height) it generates for a request (``resolve_size``)."""
        return self.resolve_size(width, height)[0]

    def resolve_size(self, width: int | None, height: int | None) -> tuple[tuple[int, int], str]:
        """The (width, height) it generates for a request, and a note when that is not the size asked. The
        native size when neither is given (a missing one is the native side); the size itself when it makes
        it; as the reference pipeline otherwise: a side off the patch multiple rounded down (FLUX.1), or the
        aspect-ratio bin nearest the asked ratio (PixArt). ValueError when the reference would refuse it."""
        w, h = width or self.image_size, height or self.image_size
        sizes = self.made_sizes()
        if (w, h) in sizes or self.in_range(w, h):  # as ``makes``, on the list made once here
            return (w, h), ""
        lo, hi = self.size_range
        if hi:
            m = self.size_multiple
            down = (w // m * m, h // m * m)
            if self.rounds_down and self.in_range(*down):
                return down, (f"{w}x{h} is not a multiple of {m} px per side: model {self.name!r} makes "
                              f"{down[0]}x{down[1]} (rounded down, as its reference pipeline does)")
            raise ValueError(f"model {self.name!r} makes sides that are multiples of {m} px from {lo} to {hi}; "
                             f"{w}x{h} is not such a size")
        if len(sizes) == 1:
            raise ValueError(f"model {self.name!r} makes {self.image_size}x{self.image_size} images only; "
                             f"{w}x{h} is not one of its sizes (leave width and height out)")
        bw, bh = nearest_bin(w, h, sizes)
        return (bw, bh), (f"model {self.name!r} makes {bw}x{bh} for {w}x{h}: its size of the nearest aspect "
                          "ratio, as its reference pipeline snaps")

    def latent_shape(self, width: int, height: int) -> tuple[int, int, int]:
        """(C, H, W) of the latents for an image it makes at width x height."""
        factor = self.image_size // self.latent_size
        return self.latent_channels, height // factor, width // factor

    def label_id(self, label: int | str) -> int:
        """A class index from a number or a name in id2label; ValueError with a message otherwise."""
        return resolve_label(label, self.num_classes, self.id2label, self.name)

    def class_names(self) -> list[str]:
        return [self.id2label.get(i, "") for i in range(self.num_classes)] if self.id2label else []


@dataclass(frozen=True)
class Builtin:
    """A built-in architecture (random weights, for benchmarks): its native size and its parameters,
    counted on the meta device (the worker's memory check reads them before loading)."""

    image_size: int
    params: int                      # transformer + VAE (and buffers the loader materialises)
    encoder_params: int = 0          # text encoders


class Family:
    """A model family: the hooks in the module docstring, each optional one with its default here."""

    name: ClassVar[str] = ""
    pipelines: ClassVar[tuple[str, ...]] = ()     # model_index.json ``_class_name``s it reads
    transformers: ClassVar[tuple[str, ...]] = ()  # transformer/config.json ``_class_name``s it reads
    builtins: ClassVar[dict[str, Builtin]] = {}   # built-in architectures by name
    previews: ClassVar[dict[int, PreviewMap]] = {}  # latent channels -> RGB map (workers.families.previews)
    runtime: ClassVar[str] = ""                   # "module:Class" of the torch part; "": this class

    break_attention: ClassVar[bool] = False
    joint_attention: ClassVar[bool] = False
    encoder_graphs: ClassVar[bool] = False
    compile_scope: ClassVar[str] = "step"         # what the `fast` speed compiles: the scope measured best for
                                                  # the family ("step": the whole step; "blocks": its blocks)
    uncompiled_on: ClassVar[dict[str, str]] = {}  # device type -> why its step is not compiled there
    static_batch_on: ClassVar[dict[str, str]] = {}  # device type -> why it compiles per batch size there
    fp8_attention: ClassVar[bool] = False         # `fastest` runs its attention in FP8 too (cuDNN, Hopper)
    takes_image: ClassVar[bool] = False           # image-to-image: requests with an input image (workers.edits)
    takes_mask: ClassVar[bool] = False            # inpainting: requests with an image and a mask
    rate_reference: ClassVar[str] = ""            # the built-in whose measured step rate estimates its models'
                                                  # until workers measure them (workers.families.rates): its own,
                                                  # or a kin family's where it has none measured; "": no estimate

    # -- the torch-free part: cards, built-ins, previews -----------------------------------------------
    def read_card(self, name: str, path: Path, transformer: dict, vae: dict | None, index: dict,
                  scheduler: dict) -> ModelCard:
        """The card of a model directory (its JSON files, read by ``workers.request.cards``); CardError when a
        part it needs is missing. ``transformer``: transformer/config.json (config.json of a bare directory)."""
        raise CardError(f"{path}: family {self.name!r} reads no model directories")

    def builtin_card(self, name: str) -> ModelCard:
        """The card of one of ``builtins``."""
        raise NotImplementedError(f"family {self.name!r} has no built-in {name!r}")

    def preview_map(self, card: ModelCard) -> PreviewMap | None:
        """The map of ``card``'s latents to RGB; the estimate itself for 1- or 3-channel pixel models."""
        if card.pixel_space:
            return IDENTITY if card.latent_channels in (1, 3) else None
        return self.previews.get(card.latent_channels)

    # -- the torch part: required ----------------------------------------------------------------------
    def load(self, card: ModelCard, device, dtype):
        raise NotImplementedError(f"family {self.name!r} does not load models")

    def cond_specs(self, model) -> dict:
        raise NotImplementedError

    def encode(self, model, specs) -> list[dict]:
        raise NotImplementedError

    def make_step(self, model, shape=None, variant: str = ""):
        raise NotImplementedError

    # -- the torch part: optional ----------------------------------------------------------------------
    def needs_breaks(self, model) -> bool:
        return False

    def step_variants(self, model) -> tuple[str, ...]:
        return ("",)

    def variant_of(self, model, spec) -> str:
        return ""

    def variant_specs(self, model, shape: tuple[int, int, int], variant: str) -> dict:
        return {}

    def plan_kwargs(self, model, shape: tuple[int, int, int]) -> dict:
        return {}

    def compile_regions(self, model) -> list | None:
        return repeated_blocks(model.transformer)

    def table_specs(self, model) -> dict:
        return {}

    def step_tables(self, model, plans, specs, conds) -> list[dict]:
        raise NotImplementedError(f"family {self.name!r} declares no step tables")

    def table_inputs(self, model, inputs: dict) -> dict:
        raise NotImplementedError(f"family {self.name!r} declares no step tables")

    def set_cross_attention(self, model, mode: str) -> None:
        return None

    def attention_kernel(self, model) -> str | None:
        return None

    def encode_image(self, model, pixels, generators=None):
        """Pixels (B, 3, H, W) in [-1, 1] on the model's device -> latents (B, C, h, w), float32, in the engine's
        layout (what its decode takes back to pixels). ``generators``: one CPU generator per row, to draw the VAE
        posterior's sample from, as the family's pipelines do (``retrieve_latents`` with a generator); a family
        whose pipelines take the mode ignores them. Default: an AutoencoderKL's sample, ``(z - shift) * scale``
        (``workers.edits.vae_encode``; a pixel-space model's pixels)."""
        from workers.edits import vae_encode  # torch: the worker's

        return vae_encode(model, pixels, generators)

    def mask_latents(self, model, mask, shape):
        """A binary mask (B, 1, H, W) at the generation size -> (B, 1, h, w) on the latent grid of ``shape``, as the
        family's inpaint pipeline makes it (default: nearest, ``interpolate``'s default, as the pipelines'
        ``prepare_mask_latents``)."""
        from workers.edits import nearest_mask

        return nearest_mask(mask, shape)

    def reference_pipeline(self, model):
        """The family's diffusers pipeline over ``model``'s modules, with its card's scheduler (benchmarks)."""
        raise NotImplementedError(f"family {self.name!r} names no diffusers pipeline")

    def reference_call(self, model, specs) -> dict:
        """The keyword arguments of ``reference_pipeline``'s call that makes ``specs`` (one size, one sampler
        setting; the caller adds output_type and a generator)."""
        raise NotImplementedError(f"family {self.name!r} names no diffusers pipeline")

    def speed_rewrites(self, model, stage: str, config, graphs: bool) -> int:
        """The family's own rewrites of ``model`` at ``stage`` (one of ``SPEED_STAGES``) of the speed layer's
        ``apply``, as ``config`` (a ``workers.speed.SpeedConfig``) says; ``graphs``: its steps run under a graph
        backend. Returns how many modules it rewrote; applying again changes nothing done already."""
        return 0


def repeated_blocks(transformer) -> list:
    """The blocks of ``transformer``'s stacks: each ``ModuleList`` attribute of it whose modules are all of one
    class (``transformer_blocks``, FLUX's ``single_transformer_blocks``), in order."""
    import torch  # the worker's: this module is imported by the API process too, without torch

    out = []
    for child in transformer.children():
        if isinstance(child, torch.nn.ModuleList) and len(child) and len({type(m) for m in child}) == 1:
            out += list(child)
    return out


_RUNTIMES: dict[Family, Family] = {}


def runtime_of(family: Family) -> Family:
    """``family``'s torch part (an instance of its ``runtime`` class), imported on first use and kept. The
    one place a family's torch part is imported: the registry holds the torch-free part, so the API
    process reads cards without torch."""
    if not family.runtime:
        return family
    if family not in _RUNTIMES:
        module, cls = family.runtime.split(":")
        _RUNTIMES[family] = getattr(importlib.import_module(module), cls)()
    return _RUNTIMES[family]


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CardError(f"missing {path}") from None
    except json.JSONDecodeError as e:
        raise CardError(f"{path} is not valid JSON: {e}") from None
    except OSError as e:
        raise CardError(f"cannot read {path}: {e}") from None


def listed_sizes(path: Path, extra: dict, multiple: int) -> list[tuple[int, int]]:
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
