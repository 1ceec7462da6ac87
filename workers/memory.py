"""How much device memory a model's weights take, before loading it: a worker that lists several models
checks they fit the GPU it got, and otherwise fails to start with what each one needs.

A model directory's size is read from its safetensors headers (tensor shapes and dtypes, no weights
read); a built-in architecture's from its parameter count on the meta device. Both are converted to
the dtype the model runs in.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from workers.cards import ModelCard, read_card

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}
WEIGHT_DIRS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")


def safetensors_params(path: Path) -> int:
    """Elements of every tensor in one .safetensors file, from its header only."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    total = 0
    for name, entry in header.items():
        if name != "__metadata__":
            count = 1
            for d in entry["shape"]:
                count *= d
            total += count
    return total


def weight_params(card: ModelCard) -> int:
    """Parameters of everything the worker loads for ``card`` (transformer, VAE, text encoders)."""
    if card.builtin:
        return _builtin_params(card)
    path = Path(card.path)
    folders = [path / d for d in WEIGHT_DIRS if (path / d).is_dir()] or [path]
    return sum(safetensors_params(f) for folder in folders for f in sorted(folder.glob("*.safetensors")))


# parameters of the built-in architectures (transformer + VAE + text encoders), counted on the meta device
BUILTIN_PARAMS = {
    "dit-xl-2-256": 749_826_464 + 83_653_863, "dit-xl-2-512": 749_826_464 + 83_653_863,
    "pixart-sigma-512": 610_856_096 + 4_762_310_656 + 83_653_863,
    "pixart-sigma-1024": 610_856_096 + 4_762_310_656 + 83_653_863,
    "sd35-medium-1024": 7_907_612_003 + 226_492_416,  # + the positional-embedding table (a buffer)
    "flux-dev-512": 16_870_599_139, "flux-dev-1024": 16_870_599_139,
}


def _builtin_params(card: ModelCard) -> int:
    return BUILTIN_PARAMS[card.builtin]


def weight_bytes(card: ModelCard, dtype: str) -> int:
    return weight_params(card) * DTYPE_BYTES.get(dtype, 4)


def check_fits(specs: list[str], dtypes: list[str], free_bytes: int, device: str, headroom: float = 0.85) -> None:
    """MemoryError naming each model's need when their weights take more than ``headroom`` of what is free
    (the rest is for activations, graph pools and the VAE)."""
    needs = [(read_card(s).name, weight_bytes(read_card(s), d)) for s, d in zip(specs, dtypes)]
    total = sum(b for _, b in needs)
    if total > headroom * free_bytes:
        each = ", ".join(f"{name} {b / 2**30:.1f} GiB" for name, b in needs)
        raise MemoryError(f"the models of this worker need {total / 2**30:.1f} GiB of weights ({each}); {device} has "
                          f"{free_bytes / 2**30:.1f} GiB free, and {100 - 100 * headroom:.0f}% of it is kept for "
                          "activations and graphs: list fewer models per worker ([workers] models)")
