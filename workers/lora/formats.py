"""Adapter files in the formats people publish, read into one form: ``{module: LoraWeights(a, b, scale)}``.

What is read
------------
Safetensors files only (``safetensors.safe_open``): nothing is ever unpickled. A file that is a pickle (what
``torch.save`` writes: a zip archive, or a bare pickle) is refused with that reason, before any parsing.

Formats, told apart by their keys:

* **diffusers / PEFT**: ``transformer.<module>.lora_A.weight`` (r, in) and ``.lora_B.weight`` (out, r) (PEFT's own
  ``base_model.model.`` prefix, or none, also read). The scale of a module is ``alpha / r`` (``alpha / sqrt(r)``
  under rsLoRA), with alpha from, in order: a ``<module>.alpha`` tensor; the adapter config diffusers writes in the
  file's metadata (``lora_adapter_metadata``: ``lora_alpha``, ``alpha_pattern``, ``use_rslora``, with or without
  the ``transformer.`` prefix a pipeline's ``save_lora_weights`` gives its keys); else r (scale 1), as diffusers'
  ``get_peft_kwargs`` assumes for a file without alphas.
* **kohya / "A1111" for FLUX.1** (``lora_unet_double_blocks_...``, ``lora_unet_single_blocks_...``,
  ``.lora_down.weight``, ``.lora_up.weight``, ``.alpha``): converted by diffusers' own
  ``_convert_kohya_flux_lora_to_diffusers``, which folds ``alpha / r`` into the weights (scale 1). One part is
  split here first: a single block's ``linear1`` (q, k, v and the MLP's input in one product), for which the
  converter hard-codes FLUX.1-dev's widths (3072 x 3 + 12288); here the widths come from the file (the product
  is 3 D + 4 D rows, diffusers' ``FluxSingleTransformerBlock`` has ``mlp_ratio`` 4), so a FLUX.1 of any width
  reads, with the same split as the converter's (``split_fused``, checked against it at FLUX.1-dev's widths).
* **kohya for SD3 / SD3.5** (``lora_unet_joint_blocks_<i>_{x,context}_block_...``): diffusers converts no such
  adapter, so the names map here (``SD3_BLOCK``, ``SD3_TOP``), following diffusers' own converter of SD3's original
  checkpoints (``convert_sd3_transformer_checkpoint_to_diffusers``: a fused ``qkv`` split into thirds, ``proj`` ->
  ``to_out.0`` / ``to_add_out``, ``mlp.fc1`` / ``fc2`` -> ``ff.net.0.proj`` / ``ff.net.2``, the last block's context
  modulation and the final layer's with shift and scale swapped). The tests hold the two to each other.

Text-encoder parts (``lora_te*``, ``text_encoder.``), DoRA, biases on ``lora_B`` and convolutions are refused with
the key that carries them: the engine applies adapters to the transformer's linears only, and leaving a part out
would make other images than the adapter's author's.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from workers.request.weights import HEAD, is_pickle


class LoraError(ValueError):
    """An adapter that cannot be served: the message names the first key, module or shape at fault."""


class LoraWeights(NamedTuple):
    """One linear's adapter: ``W x + scale * b @ (a @ x)``."""

    a: torch.Tensor   # (r, in): lora_A, lora_down
    b: torch.Tensor   # (out, r): lora_B, lora_up
    scale: float      # alpha / r (1 where a format folded it into the weights)

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class Adapter:
    """An adapter in the engine's form: the transformer's module paths (``transformer_blocks.0.attn.to_q``) and
    their weights, and the format it was read from."""

    weights: dict[str, LoraWeights]
    format: str  # "peft" | "kohya-flux" | "kohya-sd3"

    @property
    def rank(self) -> int:
        return max((w.rank for w in self.weights.values()), default=0)


METADATA_KEY = "lora_adapter_metadata"  # diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY


def read_adapter(path: str | Path, max_bytes: int | None = None) -> Adapter:
    """The adapter in the safetensors file at ``path`` (``max_bytes``: refused when larger); LoraError otherwise."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(HEAD)
    except OSError as e:
        raise LoraError(f"cannot read {path.name}: {e.strerror or e}") from None
    if max_bytes is not None and size > max_bytes:
        raise LoraError(f"{path.name} is {size} bytes; adapters are limited to {max_bytes}")
    if is_pickle(head, size):
        raise LoraError(f"{path.name} is a pickle (torch.save) file: only safetensors adapters are read, "
                        "nothing is unpickled")
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            state = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as e:  # safetensors raises its own error types for a malformed header
        raise LoraError(f"{path.name} is not a readable safetensors file: {e}") from None
    return from_state_dict(state, metadata)


def from_state_dict(state: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Adapter:
    """An adapter from a file's tensors and metadata (``read_adapter``; the formats in the module docstring)."""
    if not state:
        raise LoraError("the file holds no tensors")
    if any(k.startswith("lora_unet_joint_blocks_") for k in state):
        return Adapter(_kohya_sd3(state), "kohya-sd3")
    if any(".lora_down.weight" in k for k in state):
        return Adapter(_kohya_flux(state), "kohya-flux")
    return Adapter(_peft(state, metadata or {}), "peft")


# -- diffusers / PEFT --------------------------------------------------------------------------------------
PEFT_PREFIXES = ("transformer.", "base_model.model.")
PEFT_PARTS = re.compile(r"(?P<module>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|alpha)")


def _peft(state: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, LoraWeights]:
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        name = next((key[len(p):] for p in PEFT_PREFIXES if key.startswith(p)), key)
        match = PEFT_PARTS.fullmatch(name)
        if match is None or name.startswith(("text_encoder", "unet.")):
            raise LoraError(f"key {key!r} is not a LoRA weight of the transformer (lora_A / lora_B / alpha); "
                            "text-encoder parts, DoRA and lora_B biases are not served")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    config = _adapter_config(metadata)
    out = {}
    for module, p in parts.items():
        if "lora_A.weight" not in p or "lora_B.weight" not in p:
            missing = "lora_A" if "lora_A.weight" not in p else "lora_B"
            raise LoraError(f"module {module!r} has no {missing} weight")
        a, b = p["lora_A.weight"], p["lora_B.weight"]
        _check_pair(module, a, b)
        alpha = float(p["alpha"]) if "alpha" in p else _config_alpha(config, module, a.shape[0])
        rank = a.shape[0]
        out[module] = LoraWeights(a, b, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank))
    return out


def _adapter_config(metadata: dict[str, str]) -> dict:
    """The LoraConfig diffusers stores in the metadata, its keys without a pipeline's ``transformer.`` prefix."""
    raw = metadata.get(METADATA_KEY)
    if not raw:
        return {}
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise LoraError(f"the file's {METADATA_KEY} is not JSON: {e}") from None
    if any(k.startswith("transformer.") for k in config):
        config = {k.removeprefix("transformer."): v for k, v in config.items() if k.startswith("transformer.")}
    return config


def _config_alpha(config: dict, module: str, rank: int) -> float:
    """A module's alpha under the adapter config: its ``alpha_pattern`` entry (PEFT's match: the pattern is the
    name's last dotted parts, as a regular expression), else ``lora_alpha``, else its rank (scale 1)."""
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?(?:{pattern})", module):
            return float(alpha)
    return float(config["lora_alpha"]) if config.get("lora_alpha") is not None else float(rank)


def _check_pair(module: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.ndim != 2 or b.ndim != 2:
        raise LoraError(f"module {module!r}: lora weights of shapes {tuple(a.shape)} and {tuple(b.shape)} are not "
                        "a linear layer's (convolutions are not served)")
    if a.shape[0] != b.shape[1]:
        raise LoraError(f"module {module!r}: lora_A has rank {a.shape[0]} and lora_B rank {b.shape[1]}")


# -- kohya: the split of a fused product, shared by FLUX.1 and SD3 -----------------------------------------
def split_fused(down: torch.Tensor, up: torch.Tensor, dims: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A LoRA of one product whose output is several linears' side by side (``dims`` rows each) -> one (a, b) per
    linear, as diffusers' ``_convert_to_ai_toolkit_cat``: the down weight shared and the up weight split by rows;
    or, where the up weight is block-diagonal (rank r = k * len(dims) and each linear's rows use only its own k
    ranks, as a LoRA trained on the linears apart and saved fused is), each linear its own k ranks."""
    n, rank = len(dims), down.shape[0]
    if sum(dims) != up.shape[0]:
        raise LoraError(f"a fused product of {up.shape[0]} rows does not split into {dims}")
    ups = list(up.split(dims, dim=0))
    if rank % n == 0:
        k = rank // n
        own = [u[:, j * k:(j + 1) * k] for j, u in enumerate(ups)]
        if all(torch.count_nonzero(u).item() == torch.count_nonzero(o).item() for u, o in zip(ups, own)):
            return [(d.contiguous(), o.contiguous()) for d, o in zip(down.chunk(n, dim=0), own)]
    return [(down, u.contiguous()) for u in ups]


def _kohya_parts(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """kohya names -> {"down", "up", "alpha"}; LoraError for a key of another kind."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        name, _, part = key.partition(".")
        if not name.startswith("lora_unet_") or part not in ("lora_down.weight", "lora_up.weight", "alpha"):
            raise LoraError(f"key {key!r} is not a LoRA weight of the transformer (lora_down / lora_up / alpha); "
                            "text-encoder parts (lora_te*) and DoRA are not served")
        parts.setdefault(name, {})[part.split(".")[0].removeprefix("lora_")] = tensor
    for name, p in parts.items():
        if "down" not in p or "up" not in p:
            raise LoraError(f"{name!r} has no lora_{'down' if 'down' not in p else 'up'} weight")
        _check_pair(name, p["down"], p["up"])
    return parts


def _kohya_scale(p: dict[str, torch.Tensor]) -> float:
    rank = p["down"].shape[0]
    return float(p["alpha"]) / rank if "alpha" in p else 1.0


# -- kohya FLUX.1 ------------------------------------------------------------------------------------------
SINGLE_LINEAR1 = re.compile(r"lora_unet_single_blocks_(\d+)_linear1")
SINGLE_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")


def _kohya_flux(state: dict[str, torch.Tensor]) -> dict[str, LoraWeights]:
    parts = _kohya_parts(state)
    out: dict[str, LoraWeights] = {}
    rest = {}
    for name, p in parts.items():
        match = SINGLE_LINEAR1.fullmatch(name)
        if match is None:
            rest.update({f"{name}.lora_{k}.weight" if k != "alpha" else f"{name}.alpha": v for k, v in p.items()})
            continue
        width = p["up"].shape[0] // 7  # 3 D (q, k, v) + 4 D (the MLP's input)
        if width * 7 != p["up"].shape[0]:
            raise LoraError(f"{name!r}: lora_up of {p['up'].shape[0]} rows is not a single block's q, k, v and MLP "
                            "(3 D + 4 D)")
        block = f"single_transformer_blocks.{match[1]}"
        for target, (a, b) in zip(SINGLE_TARGETS, split_fused(p["down"], p["up"], [width] * 3 + [4 * width])):
            out[f"{block}.{target}"] = LoraWeights(a, b, _kohya_scale(p))
    if rest:
        from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

        try:
            converted = _convert_kohya_flux_lora_to_diffusers(dict(rest))
        except (ValueError, AssertionError) as e:
            raise LoraError(f"not a FLUX.1 kohya adapter diffusers converts: {e}") from None
        out.update(_peft_pairs(converted))
    return out


def _peft_pairs(converted: dict[str, torch.Tensor]) -> dict[str, LoraWeights]:
    """diffusers' converted keys (``[transformer.]<module>.lora_A.weight`` ...; alphas folded in) -> weights."""
    modules = {}
    for key, tensor in converted.items():
        module, _, part = key.removeprefix("transformer.").rpartition(".lora_")
        modules.setdefault(module, {})[part] = tensor
    return {m: LoraWeights(p["A.weight"], p["B.weight"], 1.0) for m, p in modules.items()}


# -- kohya SD3 / SD3.5 -------------------------------------------------------------------------------------
# kohya's name for a part of joint block i (its original module path with "." -> "_") -> the diffusers modules it
# feeds, as diffusers' convert_sd3_transformer_checkpoint_to_diffusers maps the original weights
SD3_BLOCK = {
    "x_block_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "x_block_attn_proj": ("attn.to_out.0",),
    "x_block_attn2_qkv": ("attn2.to_q", "attn2.to_k", "attn2.to_v"),
    "x_block_attn2_proj": ("attn2.to_out.0",),
    "x_block_mlp_fc1": ("ff.net.0.proj",),
    "x_block_mlp_fc2": ("ff.net.2",),
    "x_block_adaLN_modulation_1": ("norm1.linear",),
    "context_block_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "context_block_attn_proj": ("attn.to_add_out",),
    "context_block_mlp_fc1": ("ff_context.net.0.proj",),
    "context_block_mlp_fc2": ("ff_context.net.2",),
    "context_block_adaLN_modulation_1": ("norm1_context.linear",),
}
SD3_TOP = {
    "context_embedder": "context_embedder",
    "t_embedder_mlp_0": "time_text_embed.timestep_embedder.linear_1",
    "t_embedder_mlp_2": "time_text_embed.timestep_embedder.linear_2",
    "y_embedder_mlp_0": "time_text_embed.text_embedder.linear_1",
    "y_embedder_mlp_2": "time_text_embed.text_embedder.linear_2",
    "final_layer_linear": "proj_out",
    "final_layer_adaLN_modulation_1": "norm_out.linear",
}
SD3_JOINT = re.compile(r"lora_unet_joint_blocks_(\d+)_(.+)")


def _swap_halves(b: torch.Tensor) -> torch.Tensor:
    """Rows (shift, scale) -> (scale, shift): diffusers' ``swap_scale_shift`` of the original checkpoints' final
    modulations, whose AdaLayerNormContinuous reads scale first."""
    shift, scale = b.chunk(2, dim=0)
    return torch.cat([scale, shift], dim=0)


def _kohya_sd3(state: dict[str, torch.Tensor]) -> dict[str, LoraWeights]:
    out: dict[str, LoraWeights] = {}
    for name, p in _kohya_parts(state).items():
        down, up, scale = p["down"], p["up"], _kohya_scale(p)
        top = SD3_TOP.get(name.removeprefix("lora_unet_"))
        if top is not None:
            out[top] = LoraWeights(down, _swap_halves(up) if name.endswith("final_layer_adaLN_modulation_1") else up,
                                   scale)
            continue
        match = SD3_JOINT.fullmatch(name)
        targets = SD3_BLOCK.get(match[2]) if match else None
        if targets is None:
            raise LoraError(f"{name!r} is not a linear of SD3's transformer that adapters reach")
        block = f"transformer_blocks.{match[1]}"
        if match[2] == "context_block_adaLN_modulation_1" and up.shape[0] == 2 * down.shape[1]:
            up = _swap_halves(up)  # the last block's context modulation: shift and scale only (context_pre_only)
        pairs = split_fused(down, up, [up.shape[0] // 3] * 3) if len(targets) == 3 else [(down, up)]
        for target, (a, b) in zip(targets, pairs):
            out[f"{block}.{target}"] = LoraWeights(a, b, scale)
    return out
