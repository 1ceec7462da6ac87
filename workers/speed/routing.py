"""Joint attention processors swapped for their routed copies (``workers.speed.joint_attention``), with or
without FP8 attention.

Which processor class is routed by which is a registry that the families fill from their own folders
(``routes``): SD3's ``JointAttnProcessor2_0`` by ``workers.families.sd3.fast.RoutedJointAttention``, FLUX.1's
``FluxAttnProcessor`` by ``workers.families.flux.attention.RoutedFluxAttention``; a family's torch part
imports its routed processor, so the registry holds it once that family runs. The swap itself is generic.
"""

from __future__ import annotations

import torch

from workers.kernels import fp8_attention
from workers.speed.joint_attention import fp8_scales

ROUTED: dict[type, type] = {}  # diffusers' processor class -> its routed copy


def routes(plain: type):
    """Class decorator: the decorated processor class is the routed copy of ``plain`` (a diffusers attention
    processor class) from now on."""
    def register(routed: type) -> type:
        ROUTED[plain] = routed
        return routed
    return register


def route_joint_attention(transformer: torch.nn.Module, fp8: bool = False) -> int:
    """Swap every attention processor of ``transformer`` that has a routed copy (``ROUTED``) for that copy
    (FP8 attention where ``fp8``, for heads a multiple of 16 as the kernel wants: FLUX.1's 128, SD3's 64);
    returns how many. A routed processor is made again, with or without FP8 as asked."""
    kinds = {**ROUTED, **{routed: routed for routed in ROUTED.values()}}
    n = 0
    for module in transformer.modules():
        routed = kinds.get(type(getattr(module, "processor", None)))
        if routed is not None:
            processor = routed()
            if fp8 and (module.inner_dim // module.heads) % fp8_attention.ALIGN == 0:
                processor.fp8 = fp8_scales(module)
            module.set_processor(processor)
            n += 1
    return n


def restore_joint_attention(transformer: torch.nn.Module) -> None:
    """Undo ``route_joint_attention``: diffusers' own processors again."""
    back = {routed: plain for plain, routed in ROUTED.items()}
    for module in transformer.modules():
        plain = back.get(type(getattr(module, "processor", None)))
        if plain is not None:
            module.set_processor(plain())
