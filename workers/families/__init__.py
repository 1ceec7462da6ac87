"""Model families: what differs between kinds of DiT, behind one typed interface (``base.Family``: its
hooks and their defaults are documented there), so the engine, the splitter and ``graphs/`` never know
which family they run.

The registry below is one line per family: its torch-free part, which reads its model directories'
cards (``workers.request.cards.read_card`` dispatches here). ``family_named`` and ``family_of`` give a family's
torch part, the object the engine calls hooks on. Adding a family is one folder
(``workers/families/<name>/``) and one line here; ``register`` adds one at run time (docs/design.md,
"Adding a family").
"""

from __future__ import annotations

from workers.families.base import Family, ModelCard, runtime_of
from workers.families.dit import DiT
from workers.families.flux import Flux
from workers.families.flux2 import Flux2
from workers.families.pixart import PixArt
from workers.families.qwenimage import QwenImage
from workers.families.sana import Sana
from workers.families.sd3 import SD3
from workers.families.zimage import ZImage
from workers.families.previews import PreviewMap

FAMILIES: dict[str, Family] = {}
DEFAULT_FAMILY = "dit"  # reads a directory no family claims (and names what it needs), runs a model without a card


def register(family: Family) -> Family | None:
    """Serve ``family`` under its name from now on; the family it replaces, if any."""
    previous = FAMILIES.get(family.name)
    FAMILIES[family.name] = family
    return previous


register(DiT())
register(PixArt())
register(SD3())
register(Flux())
register(Flux2())
register(QwenImage())
register(ZImage())
register(Sana())


def family_named(name: str) -> Family:
    """The torch part of the registered family ``name`` (imported on first use)."""
    return runtime_of(FAMILIES[name])


def family_of(model) -> Family:
    """The family that runs a loaded model (its card's)."""
    return family_named(model.card.family if model.card is not None else DEFAULT_FAMILY)


def compile_regions(model) -> list:
    """What a blocks-scope compile compiles for ``model``: its family's choice (its repeated blocks unless it
    says otherwise); empty (the family said None, or none were found): the whole step."""
    return list(family_of(model).compile_regions(model) or ())


def family_for(pipeline: str | None, transformer: str | None) -> Family:
    """The family that reads a directory: the one listing its model_index.json ``_class_name`` (``pipeline``),
    else the one listing its transformer config's (``transformer``), else ``DEFAULT_FAMILY``."""
    for family in FAMILIES.values():
        if pipeline and pipeline in family.pipelines:
            return family
    for family in FAMILIES.values():
        if transformer and transformer in family.transformers:
            return family
    return FAMILIES[DEFAULT_FAMILY]


def builtin_family(name: str) -> Family | None:
    """The family with a built-in architecture called ``name``; None when no family has one."""
    return next((f for f in FAMILIES.values() if name in f.builtins), None)


def builtin_names() -> list[str]:
    """Every family's built-in architectures, in registry order."""
    return [name for f in FAMILIES.values() for name in f.builtins]


def preview_map_of(card: ModelCard) -> PreviewMap | None:
    """The map of a card's latents to RGB (its family's ``preview_map``); None when they have none."""
    return FAMILIES[card.family].preview_map(card)

