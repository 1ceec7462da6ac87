"""The model card of a flux pipeline directory (torch-free)."""

from __future__ import annotations

from pathlib import Path


def card(name: str, path: Path, transformer: dict, vae: dict | None, index: dict, scheduler: dict):
    from workers.cards import CardError

    raise CardError(f"{path}: flux pipelines are not supported yet")
