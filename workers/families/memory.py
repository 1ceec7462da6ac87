"""How much device memory a model's weights take, before loading it: a worker that lists several models
checks they fit the GPU it got, and otherwise fails to start with what each one needs.

A model directory's size is read from its safetensors headers (tensor shapes and dtypes, no weights
read); a built-in architecture's from the parameter count its family states (``Family.builtins``, counted
on the meta device). Both are converted to the dtype the model runs in.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from workers.families.encoders import fingerprint
from workers.families import FAMILIES
from workers.request.cards import ModelCard, read_card

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


def components(card: ModelCard) -> dict[str, tuple[int, str]]:
    """Parameters per component the worker loads for ``card``, with an identity for text encoders (the
    weights' fingerprint: identical encoders are loaded once per process, workers.families.encoders)."""
    if card.builtin:  # the family's count (workers.families.base.Builtin)
        builtin = FAMILIES[card.family].builtins[card.builtin]
        core, encoders = builtin.params, builtin.encoder_params
        return {"model": (core, ""), **({"text_encoders": (encoders, f"{card.name}:encoders")} if encoders else {})}
    path = Path(card.path)
    folders = [path / d for d in WEIGHT_DIRS if (path / d).is_dir()] or [path]
    return {f.name: (sum(safetensors_params(w) for w in sorted(f.glob("*.safetensors"))),
                     fingerprint(f) if f.name.startswith("text_encoder") else "") for f in folders}


def weight_params(card: ModelCard, encoders: bool = True) -> int:
    """Parameters of everything the worker loads for ``card`` (transformer, VAE, and text encoders unless
    ``encoders`` is False: they run elsewhere)."""
    return sum(n for name, (n, ident) in components(card).items() if encoders or not ident)


def weight_bytes(card: ModelCard, dtype: str, encoders: bool = True) -> int:
    return weight_params(card, encoders) * DTYPE_BYTES.get(dtype, 4)


def check_fits(specs: list[str], dtypes: list[str], free_bytes: int, device: str, headroom: float = 0.85,
               encoders_here: bool = True) -> None:
    """MemoryError naming each model's need when their weights take more than ``headroom`` of what is free
    (the rest is for activations, graph pools and the VAE). Text encoders count once per distinct weights
    (they are shared), and not at all when they run elsewhere (``encoders_here`` False)."""
    needs, seen = [], set()
    for spec, dtype in zip(specs, dtypes):
        card = read_card(spec)
        n = 0
        for name, (params, ident) in components(card).items():
            if ident and (not encoders_here or ident in seen):
                continue
            seen.add(ident)
            n += params
        needs.append((card.name, n * DTYPE_BYTES.get(dtype, 4)))
    total = sum(b for _, b in needs)
    if total > headroom * free_bytes:
        each = ", ".join(f"{name} {b / 2**30:.1f} GiB" for name, b in needs)
        raise MemoryError(f"the models of this worker need {total / 2**30:.1f} GiB of weights ({each}); {device} has "
                          f"{free_bytes / 2**30:.1f} GiB free, and {100 - 100 * headroom:.0f}% of it is kept for "
                          "activations and graphs: list fewer models per worker ([workers] models), or run the "
                          "text encoders elsewhere ([workers] text_encoder_device)")
