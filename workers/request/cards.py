"""Model cards: what the service needs to know about a model, read from the model directory's own
files (model_index.json, the component configs, the scheduler config), without torch and without
weights.

One reader serves both sides: the API's catalog validates requests against the card (conditioning
kind, classes, sizes, sampler rules, defaults) in a process that may have no GPU and no torch, and the
worker's loader builds the model the card describes. A model therefore cannot be described one way
and loaded another. The reading itself is the families' (``workers.families``: each lists the pipeline
and transformer classes it reads, and its built-in architectures); this module finds the family.

    card = read_card("digits")          # a shipped model, a built-in architecture, or a directory
    card.conditioning                   # "class" (labels) or "text" (prompts)
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from workers.families import FAMILIES, builtin_family, builtin_names as family_builtins, family_for
from workers.families.base import CardError, ModelCard, read_json

MODELS_DIR = Path(__file__).resolve().parents[1] / "models"
SHIPPED = ("digits", "digits-flow", "digits-text")  # pipeline directories under workers/models
DEFAULT_MODEL = "digits"  # what the CLI's local commands use when no model is named

__all__ = ["CardError", "DEFAULT_MODEL", "MODELS_DIR", "ModelCard", "SHIPPED", "builtin_names", "read_card"]


def builtin_names() -> list[str]:
    return [*SHIPPED, *family_builtins()]


def read_card(spec: str | Path) -> ModelCard:
    """The card of a shipped model (``digits``), a built-in architecture (``dit-xl-2-256``) or a local
    diffusers-format directory (a pipeline with model_index.json, or a bare transformer)."""
    card = _read_card(str(spec))
    family = FAMILIES.get(card.family)  # what edits it runs is its family's (workers.edits)
    if family is None:
        return card
    if card.edit == "reference":  # an instruction edit (FLUX.1 Kontext): the image is the card's, no mask
        return replace(card, takes_image=True, takes_mask=False)
    return replace(card, takes_image=family.takes_image, takes_mask=family.takes_mask and family.takes_image,
                   edit="image-to-image" if family.takes_image else "")


def _read_card(spec: str) -> ModelCard:
    family = builtin_family(spec)
    if family is not None:
        return family.builtin_card(spec)
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
        cfg = read_json(path / "config.json")
        return family_for(None, cfg.get("_class_name")).read_card(name, path, cfg, vae=None, index={}, scheduler={})
    raise CardError(f"{path} holds neither model_index.json (a pipeline) nor config.json (a transformer)")


def supported_pipelines() -> list[str]:
    """The model_index.json ``_class_name``s the registered families read, in registry order."""
    return [p for family in FAMILIES.values() for p in family.pipelines]


def _pipeline_card(path: Path, name: str) -> ModelCard:
    index = read_json(path / "model_index.json")
    pipeline = index.get("_class_name")
    if pipeline and pipeline not in supported_pipelines():  # before the transformer: its message would mislead
        raise CardError(f"{pipeline} is not supported; supported: {', '.join(supported_pipelines())} "
                        f"({path}/model_index.json)")
    if not (path / "transformer" / "config.json").is_file():
        raise CardError(f"{path}/model_index.json has no transformer/config.json beside it")
    transformer = read_json(path / "transformer" / "config.json")
    vae = read_json(path / "vae" / "config.json") if (path / "vae" / "config.json").is_file() else None
    sched_file = path / "scheduler" / "scheduler_config.json"
    scheduler = read_json(sched_file) if sched_file.is_file() else {}
    family = family_for(index.get("_class_name"), transformer.get("_class_name"))
    return family.read_card(name, path, transformer, vae, index, scheduler)
