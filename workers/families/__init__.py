"""Model families: what differs between kinds of DiT, behind one small interface, so the engine, the
splitter and ``graphs/`` never know which family they run.

A family is a module with:

    cond_specs(model) -> {name: TensorSpec}      the per-sample conditioning inputs of the captured step
    encode(model, specs) -> [{name: Tensor}]     each request's conditioning, on the host, outside capture
                                                 (class labels -> ids; prompts -> text encoder, batched)
    make_step(model) -> step(x, t, guidance, coeffs, hist, noise, **cond) -> {"x_next", "hist_next"}
                                                 one whole denoising step: CFG, transformer, sampler update
    BREAK_ATTENTION                              whether the graph backends patch its self-attention
                                                 (workers.patches: an eager break under breakable, fused
                                                 q, k, v and the kernel per shape under both)
    JOINT_ATTENTION                              optional: the graph backends route its joint attention
                                                 through the kernel per shape (workers.joint_attention:
                                                 SD3's and FLUX.1's processors, inside the segments)
    ENCODER_GRAPHS                               optional: the graph backends replay its text encoder from
                                                 CUDA graphs (``model.text_graphs``, which its encode uses;
                                                 workers.encoders.EncoderGraphs)
    needs_breaks(model) -> bool                  optional: whether the step has eager breaks (PixArt's varlen
                                                 cross-attention); the engine's "graphs" backend captures a
                                                 step without them whole (backend full), else breakable
    plan_kwargs(model, shape) -> dict            optional: extra arguments of make_plan for latents of
                                                 this shape (FLUX's resolution-dependent shift ``mu``)
    load(card, device, dtype) -> LoadedModel     optional: families that load themselves (not dit/pixart)
    compile_regions(model) -> [Module] | None    optional: the modules a blocks-scope compile compiles
                                                 (``graphs.compiled``, "Regions"); unset: the transformer's
                                                 repeated blocks (``repeated_blocks``); None: the whole step

The model card (``workers.cards``) names the family; ``workers.loading`` builds the model. To add a
family: write its card reader branch and its loader, then a module here with the three functions,
and register it in ``FAMILIES`` (docs/design.md walks through it).
"""

from __future__ import annotations

from types import ModuleType

import torch

from workers.families import dit, flux, pixart, sd3

FAMILIES: dict[str, ModuleType] = {"dit": dit, "pixart": pixart, "sd3": sd3, "flux": flux}


def repeated_blocks(transformer) -> list:
    """The blocks of ``transformer``'s stacks: each ``ModuleList`` attribute of it whose modules are all of one
    class (``transformer_blocks``, FLUX's ``single_transformer_blocks``), in order."""
    out = []
    for child in transformer.children():
        if isinstance(child, torch.nn.ModuleList) and len(child) and len({type(m) for m in child}) == 1:
            out += list(child)
    return out


def compile_regions(model) -> list:
    """What a blocks-scope compile compiles for ``model``: its family's choice, else its repeated blocks;
    empty (the family said None, or none were found): the whole step."""
    family = family_of(model)
    regions = family.compile_regions(model) if hasattr(family, "compile_regions") else \
        repeated_blocks(model.transformer)
    return list(regions or ())


def family_of(model) -> ModuleType:
    """The family module that runs a loaded model."""
    name = model.card.family if model.card is not None else "dit"
    return FAMILIES[name]
