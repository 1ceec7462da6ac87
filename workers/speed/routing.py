"""SD3's and FLUX.1's attention processors swapped for their routed copies (``workers.speed.sd3_attention``,
``workers.speed.flux_attention``), with or without FP8 attention."""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import JointAttnProcessor2_0
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

from workers.kernels import fp8_attention
from workers.speed.flux_attention import RoutedFluxAttention
from workers.speed.joint_attention import fp8_scales
from workers.speed.sd3_attention import RoutedJointAttention


ROUTED = {JointAttnProcessor2_0: RoutedJointAttention, FluxAttnProcessor: RoutedFluxAttention}


def route_joint_attention(transformer: torch.nn.Module, fp8: bool = False) -> int:
    """Swap every SD3 / FLUX.1 attention processor of ``transformer`` for its routed copy (FP8 attention where
    ``fp8``, for heads a multiple of 16 as the kernel wants: FLUX.1's 128, SD3's 64); returns how many. A
    routed processor is made again, with or without FP8 as asked."""
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
