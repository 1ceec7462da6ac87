"""The path the families read varlen cross-attention from: ``workers.speed.varlen`` and
``workers.kernels.varlen``."""

from workers.kernels.varlen import kernel_name
from workers.speed.varlen import VarlenCrossAttention, restore_cross_attention, varlen_cross_attention

__all__ = ["VarlenCrossAttention", "kernel_name", "restore_cross_attention", "varlen_cross_attention"]
