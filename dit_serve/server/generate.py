"""`dit-serve generate`: run a batch of images locally and write PNGs, a grid and a manifest.

Everything the user gave is checked before anything is written; the images are written into a
hidden staging folder inside DIR and moved into place one by one, the manifest last, so an
interrupted or failed run never leaves a manifest that names missing files.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image

from dit_serve.errors import UsageError
from dit_serve.outputs import grid, publish
from dit_serve.schemas import MAX_LORA_SCALE, MAX_PROMPT, JobParams, LoraUse, Manifest, ManifestImage

if TYPE_CHECKING:  # numpy is the server extra's: grid and publish also serve the client's `fetch`
    import numpy as np

log = logging.getLogger(__name__)

MAX_STEPS = 1000


@dataclass(frozen=True)
class GenerateArgs:
    model: str | None
    labels: tuple[str, ...] = ()
    num_per_label: int = 1
    prompts: tuple[str, ...] = ()
    negative_prompt: str = ""
    num_per_prompt: int = 1
    width: int | None = None
    height: int | None = None
    exact_size: bool = False
    sampler: str | None = None
    steps: int | None = None
    guidance: float | None = None
    seed: int = 0
    eta: float = 0.0
    out: Path = Path("out")
    device: str = "auto"
    backend: str = "auto"
    precision: str = "bf16"
    image: Path | None = None  # edits: an input image (image-to-image), and a mask (inpainting)
    mask: Path | None = None
    extra_images: tuple[Path, ...] = ()  # an instruction edit's further reference images (images 2, 3, ...)
    strength: float | None = None
    loras: tuple[tuple[Path, float], ...] = ()  # adapter files applied to every image, and their scales


MAX_LORAS = 4  # a worker's default lora_per_request


def check_args(a: GenerateArgs) -> None:
    """Checks that need no model (nor torch: the samplers' rules are plain data)."""
    from samplers.rules import RULES as SAMPLERS

    if not a.labels and not a.prompts:
        raise UsageError("nothing to draw: pass --labels (class models, e.g. --labels 0,1,2) or --prompt (text models)")
    if a.num_per_label < 1 or a.num_per_prompt < 1:
        raise UsageError(f"--num-per-label and --num-per-prompt must be >= 1, got {a.num_per_label}, {a.num_per_prompt}")
    if any(not p.strip() or len(p) > MAX_PROMPT for p in a.prompts):
        raise UsageError(f"a prompt has 1 to {MAX_PROMPT} characters (not only spaces)")
    if a.steps is not None and not 1 <= a.steps <= MAX_STEPS:
        raise UsageError(f"--steps must be between 1 and {MAX_STEPS}, got {a.steps}")
    if a.sampler is not None and a.sampler not in SAMPLERS:
        raise UsageError(f"unknown sampler {a.sampler!r}; choose one of: {', '.join(sorted(SAMPLERS))}")
    if a.guidance is not None and not a.guidance >= 0:
        raise UsageError(f"--guidance must be >= 0, got {a.guidance}")
    if a.eta < 0:
        raise UsageError(f"--eta must be >= 0, got {a.eta}")
    if len(a.loras) > MAX_LORAS:
        raise UsageError(f"--lora: at most {MAX_LORAS} adapters, got {len(a.loras)}")
    for path, scale in a.loras:
        if not -MAX_LORA_SCALE <= scale <= MAX_LORA_SCALE:
            raise UsageError(f"--lora {str(path)!r}: scale {scale:g} is outside [-{MAX_LORA_SCALE:g}, "
                             f"{MAX_LORA_SCALE:g}]")


def prepare_out(out: Path) -> Path:
    """Create DIR if needed and a staging folder inside it; UsageError when DIR is not writable."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=".partial-", dir=out))
    except OSError as e:
        raise UsageError(f"output directory {str(out)!r} is not writable: {e.strerror or e}") from None


def _discard(staging: Path, out: Path, created: bool) -> None:
    """A failed run leaves nothing: its staging folder, and DIR itself when this run created it."""
    shutil.rmtree(staging, ignore_errors=True)
    if created:
        try:
            out.rmdir()  # only when empty: never another run's files
        except OSError:
            pass


def write_outputs(out: Path, staging: Path, manifest: Manifest, images: list[np.ndarray], cols: int) -> Path:
    """Write the PNGs the manifest names and the grid into staging, then publish them and the manifest into DIR."""
    from workers.actor import PNG_COMPRESS_LEVEL

    try:
        pils = [Image.fromarray(img) for img in images]
        for entry, img in zip(manifest.images, pils):
            img.save(staging / entry.file, compress_level=PNG_COMPRESS_LEVEL)  # as a worker encodes them
        grid(pils, cols).save(staging / "grid.png")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return publish(staging, out, [e.file for e in manifest.images] + ["grid.png"], manifest)


def run_generate(a: GenerateArgs, progress: bool = True) -> Path:
    """Validate, load the model, generate, write; returns the manifest path. The model's card and every
    argument are checked before torch is imported: a directory that cannot be served is refused at once."""
    from workers.request.cards import DEFAULT_MODEL, CardError, read_card

    check_args(a)
    try:
        card = read_card(a.model or DEFAULT_MODEL)
        text = _check_conditioning(card, a)
        _check_sampling(card, a)
        conds = [{"prompt": p, "negative_prompt": a.negative_prompt} for p in a.prompts for _ in range(a.num_per_prompt)] \
            if text else [{"label": card.label_id(lb)} for lb in a.labels for _ in range(a.num_per_label)]
        edit, refs, source = _edit(card, a)
        default = None
        if source is not None:  # without --width and --height, as the service: the listed size nearest its ratio
            from workers.request.sizes import nearest_bin

            default = nearest_bin(*source, card.made_sizes())
        size, size_note = _size(card, a, default)
    except (CardError, ValueError) as e:
        raise UsageError(str(e)) from None

    import torch
    from tqdm import tqdm

    from workers.loading import load_model, run_dtype
    from workers.request.spec import ItemSpec

    adapters = _read_loras(a.loras)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    try:
        model = load_model(a.model or DEFAULT_MODEL, device=device, dtype=run_dtype(card, device),
                           precision=a.precision)
    except (CardError, ValueError) as e:
        raise UsageError(str(e)) from None
    sampler = a.sampler or model.defaults["sampler"]
    steps = a.steps or model.defaults["steps"]
    guidance = model.defaults["guidance"] if a.guidance is None else a.guidance
    n = len(conds)
    max_batch = min(64, 1 << (n - 1).bit_length())
    engine, loras = _engine(model, a, max_batch, adapters)
    reqs = [ItemSpec(id=str(i), seed=a.seed + i, sampler=sampler, steps=steps, guidance=guidance, eta=a.eta,
                     loras=loras, **size, **edit, **c) for i, c in enumerate(conds)]
    created = not a.out.exists()
    staging = prepare_out(a.out)
    try:
        engine.warmup()
        with tqdm(total=n * steps, desc=f"{model.name} {sampler} x{n}", unit="step",
                  disable=not progress, leave=False) as bar:
            results = engine.generate(reqs, on_progress=lambda *_: bar.update(1), max_active=max_batch)
    except BaseException:
        _discard(staging, a.out, created)
        raise
    params = JobParams(sampler=sampler, steps=steps, guidance=guidance, eta=a.eta, negative_prompt=a.negative_prompt,
                       width=size["width"], height=size["height"], output_width=size["out_width"],
                       output_height=size["out_height"], warnings=[*card.warnings, *size_note],
                       loras=[LoraUse(name=path.name, scale=scale, sha256=sha) for path, scale, _, sha in adapters],
                       **refs)
    images = [ManifestImage(file=f"{i:05d}.png" if text else f"{i:05d}_label{r.request.label}.png", index=i,
                            label=None if text else r.request.label, prompt=r.request.prompt if text else None,
                            seed=r.request.seed) for i, r in enumerate(results)]
    manifest = Manifest(job=None, model=model.name, state="done", params=params, grid="grid.png", images=images)
    cols = a.num_per_prompt if text else a.num_per_label
    return write_outputs(a.out, staging, manifest, [r.image for r in results], cols)


def _engine(model, a: GenerateArgs, max_batch: int, adapters) -> tuple[object, tuple[tuple[str, float], ...]]:
    """The engine over ``model`` with the ``--lora`` files registered (a bank of one slot each), and the
    requests' ``loras``; UsageError naming a file the model cannot take."""
    from workers.config import WorkerConfig
    from workers.engine import Engine

    lora = dict(lora_slots=len(adapters), lora_max_rank=max(r for _, _, r, _ in adapters),
                lora_per_request=len(adapters)) if adapters else {}
    engine = Engine(model, WorkerConfig(backend=a.backend, max_batch=max_batch, **lora))
    names = _lora_names(a.loras)
    for name, (path, _) in zip(names, a.loras):
        try:
            engine.add_lora(name, path, model.name)
        except ValueError as e:
            raise UsageError(f"--lora {str(path)!r}: {e}") from None
    return engine, tuple((name, scale) for name, (_, scale) in zip(names, a.loras))


def _read_loras(loras) -> list[tuple[Path, float, int, str]]:
    """Each ``--lora`` file parsed before the model loads: (path, scale, rank, SHA-256); UsageError naming the file
    that cannot be read, is not safetensors (nothing is unpickled) or holds no LoRA weights."""
    import hashlib

    from workers.lora.formats import LoraError, read_adapter

    out = []
    for path, scale in loras:
        try:
            sha = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as e:
            raise UsageError(f"--lora: cannot read {str(path)!r}: {e.strerror or e}") from None
        try:
            out.append((path, scale, read_adapter(path).rank, sha))
        except LoraError as e:
            raise UsageError(f"--lora {str(path)!r}: {e}") from None
    return out


def _lora_names(loras) -> list[str]:
    """The engine's names of the ``--lora`` files: their order and stem (two files may share a stem)."""
    import re

    return [f"{i}.{re.sub(r'[^A-Za-z0-9._-]', '-', path.stem)}"[:64] for i, (path, _) in enumerate(loras, 1)]


def _edit(card, a: GenerateArgs) -> tuple[dict, dict, tuple[int, int] | None]:
    """An edit's ItemSpec fields (image, extra_images, mask, strength), the manifest's record of them (JobParams'
    image, extra_images, mask, strength) and the size of the image that sizes the output (the last reference, as
    the service); nothing for text-to-image. The service's checks (``workers.request.images``, the card's
    takes_image, takes_mask and max_images), as UsageErrors naming the option."""
    import hashlib

    from dit_serve.schemas import InputImage, input_name
    from workers.request import images

    if a.image is None:
        if card.needs_image:
            raise UsageError(f"--image: model {card.name!r} edits an input image by its prompt: pass --image")
        if a.mask is not None or a.strength is not None:
            raise UsageError(f"{'--mask' if a.mask is not None else '--strength'} applies to edits: pass --image too")
        return {}, {}, None
    if not card.takes_image:
        raise UsageError(f"--image: model {card.name!r} does not take an input image")
    if 1 + len(a.extra_images) > card.max_images:
        most = "one input image" if card.max_images == 1 else f"at most {card.max_images} input images"
        raise UsageError(f"--image: model {card.name!r} takes {most}; {1 + len(a.extra_images)} were given")
    if card.edit == "reference" and (a.mask is not None or a.strength is not None):
        raise UsageError(f"{'--mask' if a.mask is not None else '--strength'}: model {card.name!r} edits a reference "
                         "image by its prompt (an instruction edit): it takes no mask and no strength")
    if a.mask is not None and not card.takes_mask:
        raise UsageError(f"--mask: model {card.name!r} does not inpaint")
    if a.strength is not None:
        try:
            images.check_strength(a.strength)
        except ValueError as e:
            raise UsageError(f"--{e}") from None
    files = {name: path for name, path in (("image", a.image), ("mask", a.mask),
                                           *((input_name(i), p) for i, p in enumerate(a.extra_images, 1)))
             if path is not None}
    data, decoded = {}, {}
    for name, path in files.items():
        option = "--mask" if name == "mask" else "--image"
        try:
            data[name] = path.read_bytes()
        except OSError as e:
            raise UsageError(f"{option}: cannot read {str(path)!r}: {e.strerror or e}") from None
        try:
            decoded[name] = (images.decode_mask if name == "mask" else images.decode_image)(data[name], option)
        except images.ImageError as e:
            raise UsageError(str(e)) from None
    if "mask" in decoded:
        try:
            images.check_mask_size(decoded["image"], decoded["mask"])
        except images.ImageError as e:
            raise UsageError(f"--{e}") from None
    if card.edit == "reference":  # the images are the step's references: no strength
        names = [input_name(i) for i in range(1 + len(a.extra_images))]
        refs = [InputImage(sha256=hashlib.sha256(data[n]).hexdigest(), width=decoded[n].width,
                           height=decoded[n].height) for n in names]
        spec = {"image": data["image"], "extra_images": tuple(data[n] for n in names[1:])}
        return spec, {"image": refs[0], "extra_images": refs[1:], "strength": None}, decoded[names[-1]].size
    strength = a.strength if a.strength is not None else (1.0 if "mask" in data else 0.6)
    refs = {name: InputImage(sha256=hashlib.sha256(b).hexdigest(), width=decoded[name].width,
                             height=decoded[name].height) for name, b in data.items()}
    return {**data, "strength": strength}, {**refs, "strength": strength}, decoded["image"].size


def _size(card, a: GenerateArgs, default: tuple[int, int] | None = None) -> tuple[dict, list[str]]:
    """ItemSpec's size fields, resolved as the service resolves them (``ModelCard.resolve_size``), and the
    warning when the model makes another size than the one asked (``default``: the size asked when no width and
    height are given; else the model's own)."""
    for name, value in (("--width", a.width), ("--height", a.height)):
        if value is not None and not 8 <= value <= 4096:
            raise UsageError(f"{name} must be between 8 and 4096 pixels, got {value}")
    if default is not None and a.width is None and a.height is None:
        a = replace(a, width=default[0], height=default[1])
    (w, h), note = card.resolve_size(a.width, a.height)
    asked = (a.width or card.image_size, a.height or card.image_size)
    out = asked if a.exact_size and asked != (w, h) else (0, 0)
    if note and out != (0, 0):
        note += f", then resized to {asked[0]}x{asked[1]}"
    return {"width": w, "height": h, "out_width": out[0], "out_height": out[1]}, [note] if note else []


def _check_sampling(card, a: GenerateArgs) -> None:
    """The API's check of sampler, steps and eta (samplers.rules, as make_plan applies it), before any load."""
    from dit_serve.server.catalog import grid_of
    from samplers.rules import SettingError, check_plan

    try:
        check_plan(a.sampler or card.defaults["sampler"], a.steps or card.defaults["steps"], a.eta, grid_of(card))
    except SettingError as e:
        raise UsageError(f"--{e.param}: {e}") from None


def _check_conditioning(card, a: GenerateArgs) -> bool:
    """True for a text model; UsageError when the arguments give the other kind of conditioning."""
    text = card.conditioning == "text"
    if text and not a.prompts:
        raise UsageError(f"model {card.name!r} draws from text: pass --prompt (or --prompts-file), not --labels")
    if not text and a.prompts:
        raise UsageError(f"model {card.name!r} is class-conditional: pass --labels, not --prompt")
    return text
