"""Model cards of the pipeline layouts that have a module of their own (torch-free, like workers.cards):
a function per transformer class that reads a pipeline directory's JSON files into a ModelCard."""

from __future__ import annotations

from workers.layouts import flux, sd3

LAYOUTS = {"SD3Transformer2DModel": sd3.card, "FluxTransformer2DModel": flux.card}
