"""Breakable CUDA graphs at power-of-two buckets, an aligned static-buffer arena and the splitter.

torch and the standard library only: graph code receives a callable and tensors, never a model class.
Decision logic (buckets, splitting, arena offsets) is CUDA-free and tested on a CPU.
"Pitfall N" in this package refers to the numbered list in docs/graph-pitfalls.md.
"""

from .arena import Arena, ArenaLayout, TensorSpec
from .breakable import BreakableCUDAGraph, eager_on_graph
from .runner import GraphRunner
from .splitter import GraphKey, bucket_sizes, group_by_key, split_batch

__all__ = [
    "Arena",
    "ArenaLayout",
    "BreakableCUDAGraph",
    "GraphKey",
    "GraphRunner",
    "TensorSpec",
    "bucket_sizes",
    "eager_on_graph",
    "group_by_key",
    "split_batch",
]
